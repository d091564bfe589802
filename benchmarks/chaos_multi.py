"""Multi-fault trials of benchmarks/chaos.py: more than one server dies in one job.

Each trial runs ``hetps train -m sync -n mlp --workers 3 --servers 3 --elastic 2`` with
``--checkpoint-dir`` (every 5 rounds) and, at a round drawn at random (10-30% of the
rounds), kills one server with SIGKILL, then another (the ranks drawn at random):

* ``two, restarts`` (``--replicas 2 --max-restarts 3``): the second once the first is
  back (``is_recovery=1``) and every server re-sent its copies. Expected: completed.
* ``two, no restarts`` (``--replicas 3 --max-restarts 0``): the second once the first's
  keys were taken over and the copies re-sent. Expected: completed, on the last server.
* ``two, no restarts, R=2`` (``--replicas 2 --max-restarts 0``): the same two deaths with
  one copy too few. Expected: failed, at once, the launcher naming the second server.
* ``kill during a restart`` (``--replicas 2 --max-restarts 3``): the first server's new
  process is killed as soon as it exists, before it rejoined. Expected: completed.

A completed trial's final checkpoint is compared with an undisturbed run's, bit for bit:
every worker's weights (``worker-K.pkl``), every key's value on the servers
(``values.npz``) and the servers' optimizer states (``optimizer.states``). With
``--elastic`` a server adds a round's pushes in worker order, so an undisturbed run is
deterministic: any difference is a round lost, applied twice, or read from a stale copy.
"""

from __future__ import annotations

import os
import pickle
import random
import re
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

#: name -> (replicas, max restarts, how the second kill comes, expected outcome)
SCENARIOS = {
    "two, restarts": (2, 3, "after-rejoin", "completed"),
    "two, no restarts": (3, 0, "after-takeover", "completed"),
    "two, no restarts, R=2": (2, 0, "after-takeover", "failed"),
    "kill during a restart": (2, 3, "during-restart", "completed"),
}


def compare(ck: Path, ref: Path) -> dict[str, Any]:
    """Bit-for-bit comparison of two jobs' last checkpoints: each worker's weights, each
    key's value on the servers, the servers' optimizer states."""
    import torch

    from hetps import optim

    out: dict[str, Any] = {"workers": 0, "workers_equal": 0, "values_equal": None}
    a, b = _last(ck), _last(ref)
    if a is None or b is None:
        return {**out, "bit_for_bit": False, "why": "no checkpoint"}
    different: list[str] = []
    for f in sorted(b.glob("worker-*.pkl")):
        out["workers"] += 1
        if not (a / f.name).exists():
            different.append(f"{f.name} missing")
            continue
        ma = pickle.loads((a / f.name).read_bytes())["model"]
        mb = pickle.loads(f.read_bytes())["model"]
        if set(ma) == set(mb) and all(torch.equal(ma[n], mb[n]) for n in mb):
            out["workers_equal"] += 1
        else:
            different.append(f"{f.name} weights")
    with np.load(a / "values.npz") as za, np.load(b / "values.npz") as zb:
        stale = [k for k in zb.files if k not in za.files or not np.array_equal(za[k], zb[k])]
    out["values_equal"] = not stale
    out["stale_values"] = len(stale)
    different += [f"values.npz {k}" for k in stale]
    sa = optim.load_states((a / "optimizer.states").read_bytes())
    sb = optim.load_states((b / "optimizer.states").read_bytes())
    out["states_equal"] = _same(sa, sb)
    if not out["states_equal"]:
        different.append("optimizer.states")
    out["step"] = int(a.name.split("-")[1])
    out["bit_for_bit"] = not different and a.name == b.name
    out["why"] = "; ".join(different)[:300] if different else None
    return out


def _last(ck: Path) -> Path | None:
    latest = ck / "latest"
    if not latest.exists():
        return None
    path = ck / latest.read_text().strip()
    return path if path.is_dir() else None


def _same(a: Any, b: Any) -> bool:
    if isinstance(b, dict):
        return isinstance(a, dict) and set(a) == set(b) and all(_same(a[k], b[k]) for k in b)
    if isinstance(b, (list, tuple)):
        return (
            isinstance(a, (list, tuple))
            and len(a) == len(b)
            and all(_same(x, y) for x, y in zip(a, b, strict=True))
        )
    if isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if hasattr(b, "numpy") and hasattr(b, "dtype"):  # a torch tensor
        return hasattr(a, "numpy") and bool((a == b).all())
    return a == b


def _server_pid(chaos: Any, tag: str, rank: int, not_pid: int | None = None) -> int | None:
    for pid, env in chaos.tagged(tag):
        if (
            env.get("DMLC_ROLE") == "server"
            and env.get("HETPS_LAUNCH_RANK") == str(rank)
            and pid != not_pid
        ):
            return pid
    return None


def _wait_line(job: Any, pattern: str, after: float, limit: float) -> float | None:
    """The arrival time of the first line matching ``pattern`` after ``after``."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        t = job.first(pattern, after)
        if t is not None:
            return t
        if job.proc.poll() is not None:
            return job.first(pattern, after)
        time.sleep(0.02)  # polls the job's output
    return None


def multi_trial(
    chaos: Any, i: int, scenario: str, rng: random.Random, base: Path, rounds: int,
    limit_s: float, ref_ck: Path, elastic: int,
) -> dict[str, Any]:  # fmt: skip
    """One job, two server deaths as ``scenario`` says; what came of it."""
    replicas, restarts, how, expected = SCENARIOS[scenario]
    name = f"multi{i}"
    ck = base / f"ck-{name}"
    tag = uuid.uuid4().hex
    cmd = chaos.job_cmd(base, ck, rounds, name, elastic, replicas, servers=3, restarts=restarts)
    job = chaos.Job(cmd, tag)
    at_round = rng.randint(max(1, rounds // 10), max(1, rounds * 3 // 10))
    first, second = rng.sample(range(3), 2)
    kills: list[float] = []
    note = None
    while job.proc.poll() is None and not job.reached(at_round):
        time.sleep(0.02)  # until the chosen round (or the job's end)
    pid = _server_pid(chaos, tag, first)
    if job.proc.poll() is None and pid is not None:
        os.kill(pid, signal.SIGKILL)
        kills.append(time.monotonic())
        if how == "after-rejoin":
            back = _wait_line(
                job, rf"server rank {first} .*is back \(is_recovery=1\)", kills[0], 60
            )
            ready = back and _wait_line(job, r"holds a copy of each of the", back, 30)
            victim = second if ready else None
        elif how == "after-takeover":
            over = _wait_line(job, rf"server rank {first} .*takes over its keys", kills[0], 60)
            ready = over and _wait_line(job, r"holds a copy of each of the", over, 30)
            victim = second if ready else None
        else:  # during-restart: the new process of the first, before it rejoined
            started = _wait_line(job, rf"starting server {first} again", kills[0], 60)
            victim = None
            end = time.monotonic() + 30
            while started and victim is None and time.monotonic() < end:
                new = _server_pid(chaos, tag, first, not_pid=pid)
                if new is not None:
                    os.kill(new, signal.SIGKILL)
                    kills.append(time.monotonic())
                    note = (
                        "rejoined first" if job.first(r"is back \(is_recovery", started) else None
                    )
                    break
                time.sleep(0.005)  # polls /proc for the new process
        if how != "during-restart":
            pid2 = _server_pid(chaos, tag, victim) if victim is not None else None
            if pid2 is not None and job.proc.poll() is None:
                os.kill(pid2, signal.SIGKILL)
                kills.append(time.monotonic())
    outcome, orphans = chaos._wait_job(job, tag, limit_s)
    lines = [x for _, x in job.lines]
    end_t = job.lines[-1][0] if job.lines else time.monotonic()
    row: dict[str, Any] = {
        "trial": i,
        "scenario": scenario,
        "replicas": replicas,
        "max_restarts": restarts,
        "kill_round": at_round,
        "killed": [first, second if how != "during-restart" else first][: len(kills)],
        "kills": len(kills),
        "outcome": outcome,
        "expected": expected,
        "exit_code": job.proc.returncode,
        "orphans": orphans,
        "note": note,
        "end_after_last_kill_s": round(end_t - kills[-1], 2) if kills else None,
        "cause": next(
            (x for x in reversed(lines) if re.search(r"\[launcher\].*(stopping|fails)", x)), None
        ),
        "output": "\n".join(lines),
    }
    row["refused_copies"] = sum("served here, not a copy" in x for x in lines)
    if outcome == "completed":
        row.update(compare(ck, ref_ck))
    named = expected != "failed" or (
        row["cause"] is not None and f"server {second}" in (row["cause"] or "")
    )
    row["as_expected"] = (
        len(kills) == 2
        and outcome == expected
        and orphans == 0
        and named
        and (expected != "completed" or bool(row.get("bit_for_bit")))
    )
    return row


def run_multi(chaos: Any, args: Any, rng: random.Random, base: Path) -> list[dict[str, Any]]:
    """``--multi N`` trials (the scenarios in turn) against an undisturbed 3-server run."""
    if not args.multi:
        return []
    ref_ck = base / "ck-multiref"
    t0 = time.monotonic()
    ref = chaos.Job(
        chaos.job_cmd(base, ref_ck, args.rounds, "multiref", args.elastic, 2, servers=3),
        uuid.uuid4().hex,
    )
    if ref.proc.wait(timeout=900) != 0:
        ref.reader.join(5)
        print("\n".join(x for _, x in ref.lines[-30:]))
        raise SystemExit("chaos: the undisturbed 3-server reference run failed")
    ref.reader.join(5)
    limit = max(180.0, 6 * (time.monotonic() - t0))
    names = list(SCENARIOS)
    rows = []
    for i in range(args.multi):
        scenario = names[i % len(names)]
        row = multi_trial(chaos, i, scenario, rng, base, args.rounds, limit, ref_ck, args.elastic)
        output = row.pop("output")
        if args.keep:
            Path(args.keep).mkdir(parents=True, exist_ok=True)
            Path(args.keep, f"multi{i}.log").write_text(output + "\n")
        rows.append(row)
        print(
            f"multi {i:3d} {scenario:22s}: {row['outcome']:9s} (expected {row['expected']}) "
            f"kills {row['kills']} orphans {row['orphans']} bit for bit "
            f"{row.get('bit_for_bit', '-')} stale values {row.get('stale_values', '-')} "
            f"end {row['end_after_last_kill_s']}s after the last kill"
            + (f"; {row['why']}" if row.get("why") else ""),
            flush=True,
        )
    return rows


def summarize_multi(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for scenario in SCENARIOS:
        rs = [r for r in rows if r["scenario"] == scenario]
        if not rs:
            continue
        out[scenario] = {
            "trials": len(rs),
            "as_expected": sum(bool(r["as_expected"]) for r in rs),
            "expected": rs[0]["expected"],
            "completed": sum(r["outcome"] == "completed" for r in rs),
            "failed": sum(r["outcome"] == "failed" for r in rs),
            "hung": sum(r["outcome"] == "hung" for r in rs),
            "orphans": sum(r["orphans"] for r in rs),
            "bit_for_bit": sum(bool(r.get("bit_for_bit")) for r in rs),
            "stale_values": sum(r.get("stale_values") or 0 for r in rs),
            "refused_copies": sum(r["refused_copies"] for r in rs),
        }
    return out


def print_multi(summary: dict[str, dict[str, Any]]) -> None:
    if not summary:
        return
    print()
    print(f"{'multi-fault':24s} {'trials':>6s} {'as expected':>11s} {'completed':>9s} "
          f"{'failed':>6s} {'hung':>4s} {'orphans':>7s} {'bit for bit':>11s} "
          f"{'stale values':>12s}")  # fmt: skip
    for name, s in summary.items():
        print(
            f"{name:24s} {s['trials']:6d} {s['as_expected']:11d} {s['completed']:9d} "
            f"{s['failed']:6d} {s['hung']:4d} {s['orphans']:7d} {s['bit_for_bit']:11d} "
            f"{s['stale_values']:12d}"
        )
