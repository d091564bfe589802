"""Per-run summaries of a log directory: time to accuracy, throughput, traffic, computing-time
ratio, ASRIT — the JSON interface of ``hetps summary`` (docs/METRICS.md defines each)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hetps.metrics.records import MetricsError, write_atomic
from hetps.metrics.runs import Run, find_runs, load_run

__all__ = [
    "THRESHOLDS",
    "accuracy_curve",
    "asrit",
    "computing_time_ratios",
    "wall_time",
    "write_json",
    "load_runs",
    "summarize",
    "summarize_run",
    "format_summary",
    "slowdown_note",
]

#: Accuracy levels of ``time_to_accuracy`` (keys are ``f"{a:g}"``: "0.7", "0.8", "0.85").
THRESHOLDS = (0.7, 0.8, 0.85)


def load_runs(logdir: str | os.PathLike[str], errors: list[str] | None = None) -> list[Run]:
    """Load every run under ``logdir`` (sorted by path).

    A run that cannot be read raises, unless ``errors`` is a list: then its message is
    appended there and the run is skipped.
    """
    runs = []
    for d in find_runs(logdir):
        try:
            runs.append(load_run(d))
        except MetricsError as e:
            if errors is None:
                raise
            errors.append(str(e))
    return runs


def eval_rank(run: Run) -> int | None:
    """The rank that evaluates: 0, else the lowest rank with a log (None: no log)."""
    if 0 in run.records:
        return 0
    return run.ranks[0] if run.ranks else None


def accuracy_curve(run: Run) -> list[tuple[float, float]]:
    """``[(t, accuracy)]`` of rank 0's evaluated records (lowest rank if there is no rank 0)."""
    r = eval_rank(run)
    if r is None:
        return []
    return [
        (float(rec["t"]), float(rec["accuracy"]))
        for rec in run.records[r]
        if rec.get("accuracy") is not None
    ]


def wall_time(run: Run) -> float | None:
    """The run's wall time: the largest ``t`` of any record (None without records)."""
    return max((float(rec["t"]) for rec in run.iter_records()), default=None)


def asrit(run: Run) -> float | None:
    """Average single-round iteration time of rank 0 (docs/METRICS.md defines it)."""
    r = eval_rank(run)
    if r is None:
        return None
    recs = run.records[r]
    srit = [float(rec["srit_s"]) for rec in recs if rec.get("srit_s") is not None]
    if srit:
        return sum(srit) / len(srit)
    if len(recs) < 2:
        return None
    return (float(recs[-1]["t"]) - float(recs[0]["t"])) / (len(recs) - 1)


def computing_time_ratios(run: Run) -> dict[int, float]:
    """``{rank: sum(compute_s) / last t}`` for every worker with records (and last t > 0)."""
    return {
        rank: sum(float(rec["compute_s"]) for rec in recs) / float(recs[-1]["t"])
        for rank in run.ranks
        if (recs := run.records[rank]) and float(recs[-1]["t"]) > 0
    }


def slowdown_note(run: Run) -> str | None:
    """``"emulated heterogeneity: --slowdown 1,1,8"`` if a worker ran slowed down, else None."""
    if not run.heterogeneous:
        return None
    return "emulated heterogeneity: --slowdown " + ",".join(f"{s:g}" for s in run.slowdown)


def _div(a: float, b: float | None) -> float | None:
    return a / b if b else None


def summarize_run(run: Run, thresholds: Sequence[float] = THRESHOLDS) -> dict[str, Any]:
    """The summary dict of one run (one element of ``summarize(...)["runs"]``)."""
    curve = accuracy_curve(run)
    tta = {f"{a:g}": next((t for t, acc in curve if acc >= a), None) for a in thresholds}
    wall = wall_time(run)
    samples = sum(int(rec["samples"]) for rec in run.iter_records())
    sent = sum(int(rec["bytes_sent"]) for rec in run.iter_records())
    recv = sum(int(rec["bytes_recv"]) for rec in run.iter_records())
    throughput = _div(samples, wall)
    ratios: dict[str, float] = {}
    for rank, ratio in computing_time_ratios(run).items():
        label = run.device_label(rank)
        if label in ratios:
            label = f"{label} [rank {rank}]"
        ratios[label] = ratio
    r0 = eval_rank(run)
    r0_recs = run.records[r0] if r0 is not None else []
    comm = [float(rec["comm_s"]) for rec in r0_recs if rec.get("comm_s") is not None]
    overhead = [float(rec["overhead_s"]) for rec in r0_recs if rec.get("overhead_s") is not None]
    r0_wall = float(r0_recs[-1]["t"]) if r0_recs else None
    return {
        "mode": run.mode,
        "network": run.network,
        "workers": run.workers,
        "run_dir": str(run.run_dir),
        "time_to_accuracy": tta,
        "final_accuracy": curve[-1][1] if curve else None,
        "max_accuracy": max(acc for _, acc in curve) if curve else None,
        "throughput_samples_per_s": throughput,
        "traffic_mb_per_s": {
            "push": _div(sent / 1e6, wall),
            "pull": _div(recv / 1e6, wall),
        },
        "computing_time_ratio": ratios,
        "asrit_s": asrit(run),
        # extra fields (not part of the minimal interface, but stable)
        "servers": run.meta.get("servers"),
        "batch_size": run.meta.get("batch_size"),
        "split_by_class": run.split_by_class,
        "slowdown": run.slowdown,
        "heterogeneity_note": slowdown_note(run),
        "wall_time_s": wall,
        "samples": samples,
        "iterations": len(r0_recs),
        "speed_samples_per_min": throughput * 60 if throughput is not None else None,
        "comm_time_s": sum(comm) / len(comm) if comm else None,
        "overhead_ratio": _div(sum(overhead), r0_wall) if overhead else None,
        "scheme": run.get("scheme"),
        "slice_size": run.get("slice_size"),
        "accuracy_curve": [[t, a] for t, a in curve],
        "truncated": bool(run.truncated),
        "ended": ended_text(run.meta.get("ended")),
    }


def ended_text(ended: Any) -> str:
    """How a run ended, from ``run.json``'s ``ended`` (written by ``hetps train``'s rank 0)."""
    if not isinstance(ended, dict):
        return "unknown (no end recorded: rank 0 was killed, or the run is still going)"
    if ended.get("status") == "completed":
        return "completed"
    return f"failed: {ended.get('cause', 'no cause recorded')}"


def summarize(
    logdir: str | os.PathLike[str],
    thresholds: Sequence[float] = THRESHOLDS,
    errors: list[str] | None = None,
) -> dict[str, Any]:
    """Summarize every run under ``logdir``: ``{"runs": [summarize_run(run), …]}`` by path.

    A run that cannot be read raises :class:`MetricsError`, unless ``errors`` is a list (its
    message goes there and the run is skipped).
    """
    return {"runs": [summarize_run(r, thresholds) for r in load_runs(logdir, errors)]}


# --------------------------------------------------------------------------------------------
# Text table


def _f(v: float | None, fmt: str, none: str = "-") -> str:
    return none if v is None else format(v, fmt)


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for r in rows:
        cells = [
            c.ljust(w) if i < 2 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _curve_text(curve: list[list[float]], points: int = 8) -> str:
    if not curve:
        return "no evaluation"
    if len(curve) > points:
        step = (len(curve) - 1) / (points - 1)
        curve = [curve[round(i * step)] for i in range(points)]
    return "  ".join(f"{t:.0f}s {a:.3f}" for t, a in curve)


def format_summary(summary: dict[str, Any]) -> str:
    """A readable text rendering of :func:`summarize`'s result: one table row per run, then
    each run's computing-time ratios and accuracy curve."""
    runs = summary.get("runs", [])
    if not runs:
        return "no runs"
    levels = list(runs[0]["time_to_accuracy"])
    header = ["mode", "network", "W", "data"]
    header += [f"t@{a}" for a in levels]
    header += ["final", "max", "samples/s", "push MB/s", "pull MB/s", "ASRIT s"]
    rows = []
    for s in runs:
        row = [
            s["mode"],
            s["network"],
            str(s["workers"]),
            "non-iid" if s.get("split_by_class") else "iid",
        ]
        row += [_f(s["time_to_accuracy"].get(a), ".1f", "never") for a in levels]
        row += [
            _f(s["final_accuracy"], ".4f"),
            _f(s["max_accuracy"], ".4f"),
            _f(s["throughput_samples_per_s"], ".1f"),
            _f(s["traffic_mb_per_s"]["push"], ".3f"),
            _f(s["traffic_mb_per_s"]["pull"], ".3f"),
            _f(s["asrit_s"], ".4f"),
        ]
        rows.append(row)
    out = [_table(rows, header), ""]
    for s in runs:
        head = f"{s['mode']} / {s['network']}  ({s['run_dir']})"
        notes = [
            s.get("heterogeneity_note"),
            s.get("scheme") is not None and f"scheme {s['scheme']}",
            s.get("slice_size") is not None and f"slice size {s['slice_size']}",
            s.get("truncated") and "log ends mid-line: the run was killed",
            s.get("ended") not in (None, "", "completed") and f"ended {s['ended']}",
        ]
        if any(notes):
            head += "  [" + "; ".join(n for n in notes if n) + "]"
        out.append(head)
        wall = s.get("wall_time_s")
        out.append(
            f"  wall {_f(wall, '.1f')} s, {s.get('samples', 0)} samples, "
            f"{s.get('iterations', 0)} iterations on rank 0"
        )
        ratios = s["computing_time_ratio"]
        if ratios:
            out.append(
                "  computing-time ratio: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items())
            )
        out.append("  accuracy over time: " + _curve_text(s.get("accuracy_curve", [])))
    return "\n".join(out).rstrip() + "\n"


def write_json(summary: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write ``summary`` as indented JSON (standard JSON: no NaN) and return the path."""
    return write_atomic(path, json.dumps(summary, indent=2, allow_nan=False) + "\n")
