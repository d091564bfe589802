"""``hetps trace RUN [-o FILE]``: a run's logs as a Chrome/Perfetto trace (trace-event JSON).

Open the file in https://ui.perfetto.dev or chrome://tracing: a process per node, a thread
per phase, a counter track per link, in microseconds since the run's start (docs/METRICS.md
has every track)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from hetps.metrics.records import MetricsError, RunNotFoundError, write_atomic
from hetps.metrics.runs import Run, load_run
from hetps.metrics.spans import PHASES
from hetps.metrics.traffic import load_traffic

__all__ = [
    "build_trace",
    "round_spans",
    "cmd_trace",
    "write_trace",
]

_US = 1e6


# -- building ---------------------------------------------------------------------------------
def _num(x: Any, default: float = 0.0) -> float:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else default


def round_spans(rec: dict[str, Any]) -> tuple[float, float, list[tuple[str, float, float]], bool]:
    """(start, end, [(phase, start, dur)], derived) of one record, in seconds of run time."""
    t = _num(rec.get("t"))
    eval_s = _num(rec.get("eval_s"))
    end = t - eval_s
    raw = rec.get("spans")
    spans = [
        (s[0], float(s[1]), max(0.0, float(s[2])))
        for s in (raw if isinstance(raw, list) else [])
        if isinstance(s, (list, tuple)) and len(s) == 3 and isinstance(s[0], str)
        if all(isinstance(v, (int, float)) and math.isfinite(v) for v in s[1:])
    ]
    if spans:
        start = min(s for _, s, _ in spans)
        end = max(end, max(s + d for _, s, d in spans))
        srit = rec.get("srit_s")
        if isinstance(srit, (int, float)) and math.isfinite(srit):
            start = min(start, end - float(srit))
        return start, end, spans, False
    # no spans: the phase sums end to end, ending at the round's end (order assumed)
    sums = [(p, _num(rec.get(f"{p}_s"))) for p in PHASES]
    total = sum(d for _, d in sums)
    srit = _num(rec.get("srit_s"), total)
    start = end - max(srit, total)
    pos = end - total
    for p, d in sums:
        if d > 0:
            spans.append((p, pos, d))
            pos += d
    return start, end, spans, True


def _ts(seconds: float, origin: float) -> float:
    """Seconds of run time -> trace microseconds (non-negative, 3 decimals: ns)."""
    return round((seconds - origin) * _US, 3)


def _dur(seconds: float) -> float:
    return round(max(0.0, seconds) * _US, 3)


def _round_args(rec: dict[str, Any]) -> dict[str, Any]:
    keys = ("iter", "epoch", "samples", "loss", "local_steps", "bytes_sent", "bytes_recv")
    out = {k: rec[k] for k in (*keys, "accuracy") if rec.get(k) is not None}
    return out | {f"{p}_s": rec[f"{p}_s"] for p in PHASES if f"{p}_s" in rec}


def build_trace(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The trace object of one run directory (raises :class:`RunNotFoundError` when it is
    not a run, :class:`MetricsError` when it holds no iteration or a corrupt log)."""
    run = load_run(run_dir)
    if not run.records or not any(run.records.values()):
        raise MetricsError(
            f"{run.run_dir}: no iteration was logged (no worker-<rank>.jsonl with records); "
            "fix: trace a run that ran at least one round"
        )
    traffic = load_traffic(run.run_dir)
    return _trace_of(run, traffic)


def _trace_of(run: Run, traffic: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    # per rank: (record, start, end, spans, derived) of each round
    rounds = {rank: [(rec, *round_spans(rec)) for rec in run.records[rank]] for rank in run.ranks}
    times = [0.0, *(row[1] for rows in rounds.values() for row in rows)]
    times += [_num(b.get("t")) for bs in traffic.values() for b in bs]
    origin = min(times)  # traffic before the start (negative t) moves the origin back

    events: list[dict[str, Any]] = []
    pids: dict[str, int] = {}

    def add(ph: str, name: str, pid: int, tid: int, args: dict, **more: Any) -> None:
        """One event; ``more`` (cat, ts, dur) in the format's order, between name and args."""
        cat = {"cat": more.pop("cat")} if "cat" in more else {}
        events.append({"ph": ph, "name": name, **cat, "pid": pid, "tid": tid, **more, "args": args})

    def named(what: str, pid: int, tid: int, label: str) -> None:
        add("M", f"{what}_name", pid, tid, {"name": label})
        add("M", f"{what}_sort_index", pid, tid, {"sort_index": tid if what == "thread" else pid})

    def process(node: str, label: str) -> int:
        if node not in pids:
            pids[node] = len(pids) + 1
            named("process", pids[node], 0, label)
        return pids[node]

    for rank in run.ranks:
        label = run.device_label(rank)
        pid = process(f"worker{rank}", f"worker {rank}" + (f": {label}" if label else ""))
        phase_names = dict.fromkeys([*PHASES, *(n for row in rounds[rank] for n, _, _ in row[3])])
        tids = {name: i + 1 for i, name in enumerate(phase_names)}
        named("thread", pid, 0, "rounds")
        for name, tid in tids.items():
            named("thread", pid, tid, name)
        derived_arg = {"derived": True}
        for rec, start, end, spans, derived in rounds[rank]:
            extra = derived_arg if derived else {}
            add("X", f"round {rec.get('iter')}", pid, 0, {**_round_args(rec), **extra},
                cat="round", ts=_ts(start, origin), dur=_dur(end - start))  # fmt: skip
            eval_s = _num(rec.get("eval_s"))
            if eval_s > 0:
                t = _num(rec.get("t"))
                add("X", "eval", pid, 0, {"accuracy": rec.get("accuracy")}, cat="eval",
                    ts=_ts(max(end, t - eval_s), origin),
                    dur=_dur(min(eval_s, t - end) if t > end else 0.0))  # fmt: skip
            for name, s, d in spans:
                add("X", name, pid, tids[name], {"iter": rec.get("iter"), **extra},
                    cat="phase", ts=_ts(s, origin), dur=_dur(d))  # fmt: skip

    for node, buckets in traffic.items():
        pid = process(node, f"{node[:6]} {node[6:]}")  # (worker<rank> or server<rank>)
        by_peer: dict[str, list[dict[str, Any]]] = {}
        for b in buckets:
            by_peer.setdefault(str(b["peer"]), []).append(b)
        for peer, bs in by_peer.items():
            name = f"bytes {node}↔{peer}"
            bs.sort(key=lambda b: _num(b["t"]))
            for i, b in enumerate(bs):
                t0, dt = _num(b["t"]), _num(b["dt"])
                sent = {"push_bytes": int(b["push_bytes"]), "pull_bytes": int(b["pull_bytes"])}
                add("C", name, pid, 0, sent, ts=_ts(t0, origin))
                nxt = _num(bs[i + 1]["t"]) if i + 1 < len(bs) else None
                if nxt is None or nxt > t0 + dt + 1e-9:  # the bucket ends before the next
                    add("C", name, pid, 0, dict.fromkeys(sent, 0), ts=_ts(t0 + dt, origin))

    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "run": str(run.run_dir),
            "mode": run.mode,
            "network": run.network,
            "workers": run.workers,
            "started_at": run.meta.get("started_at"),
            "time_origin_s": origin,
            "note": "ts in microseconds since the run's start (+ the origin, when traffic "
            "came before it)",
            "truncated": [str(p) for p in run.truncated],
        },
    }


def write_trace(
    run_dir: str | os.PathLike[str], out: str | os.PathLike[str] | None = None
) -> tuple[Path, dict[str, Any]]:
    """Build and write the trace of ``run_dir`` (default ``RUN/trace.json``); returns
    the path and the trace object."""
    trace = build_trace(run_dir)
    text = json.dumps(trace, separators=(",", ":"), allow_nan=False)
    return write_atomic(out if out is not None else Path(run_dir) / "trace.json", text), trace


# -- the command ------------------------------------------------------------------------------
def cmd_trace(args: argparse.Namespace) -> int:
    """``hetps trace RUN [-o FILE]``."""
    run = Path(args.run)
    if not run.is_dir():
        print(f"hetps trace: {run}: no such directory; fix: give a run directory", file=sys.stderr)
        return 2
    try:
        path, trace = write_trace(run, args.out)
    except RunNotFoundError:
        below = [str(p.parent) for p in sorted(run.glob("**/run.json"))[:5]]
        hint = (
            f"it holds runs, trace one of them: hetps trace {below[0]}"
            if below
            else "give a directory written by hetps train or RoundLog (it holds run.json)"
        )
        print(
            f"hetps trace: {run} is not a run directory (no run.json); fix: {hint}", file=sys.stderr
        )
        return 2
    except MetricsError as e:
        print(f"hetps trace: {e}", file=sys.stderr)
        return 1
    n = sum(1 for ev in trace["traceEvents"] if ev.get("cat") == "round")
    for p in trace["otherData"]["truncated"]:
        print(f"hetps trace: note: {p} ended in a torn line (the run was killed); dropped it")
    print(f"wrote {path} ({n} rounds): open it in https://ui.perfetto.dev or chrome://tracing")
    return 0
