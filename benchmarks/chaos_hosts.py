"""Fault trials of benchmarks/chaos.py on hosts: 2 hosts of 2 workers (``--hosts N``).

    .venv/bin/python benchmarks/chaos.py --hosts 3 --rounds 200    # one of each, ~3 minutes

The job: ``hetps launch -n 4 -s 2 --nproc-per-node 2 ... -- hetps train -m sync -n mlp``
with ``--checkpoint-dir`` (every 5 rounds): workers 0, 1 are host group 0 and workers 2, 3
host group 1, each host summing its gradients through shared memory (docs/HOSTS.md). Each
trial kills (or stops) one process once a worker logged a round drawn at random (10-80%
of the rounds), the scenarios in turn:

* ``worker``: a worker drawn at random, no ``--elastic``, no restarts. Expected: the job
  fails within ``FAIL_FAST_S`` of the kill, the launcher naming that worker; no process of
  the job left, nothing new left in /dev/shm named ``hetps-host-*``. ``hostagg`` says that
  the workers had their host's segments mapped at the kill (aggregation was on).
* ``worker, elastic``: the same under ``--elastic 2``: the dead one is let go (the launcher
  naming it), its host's other worker takes its parts over (its log says so), the job
  completes; every survivor's weights and optimizer state in the last checkpoint are equal
  bit for bit.
* ``server, replicas``: a server drawn at random under ``--replicas 2 --max-restarts 3``:
  its copy takes over; the job completes with the weights of every worker, every key's value
  on the servers and their optimizer states equal bit for bit to an undisturbed run of the
  same job (the servers add a round per host in host order, so that run is deterministic).
* ``worker stopped`` and ``worker stopped, elastic``: the same two with SIGSTOP instead (a
  hung worker, never continued): the scheduler declares it dead when its heartbeats stop
  (``PS_HEARTBEAT_TIMEOUT``, 10 s), the launcher naming it; then as the kills above (the job
  fails within ``FAIL_FAST_S``, or goes on with the others).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import re
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

#: name -> (--elastic, --replicas, --max-restarts, role hit, expected outcome, signal)
SCENARIOS = {
    "worker": (0, 1, 0, "worker", "failed", signal.SIGKILL),
    "worker, elastic": (2, 1, 0, "worker", "completed", signal.SIGKILL),
    "server, replicas": (0, 2, 3, "server", "completed", signal.SIGKILL),
    "worker stopped": (0, 1, 0, "worker", "failed", signal.SIGSTOP),
    "worker stopped, elastic": (2, 1, 0, "worker", "completed", signal.SIGSTOP),
}
#: what the launcher says of the process hit: killed, or (stopped) declared dead when its
#: heartbeats stopped
CAUSE = {
    signal.SIGKILL: r"\[launcher\].*killed by signal",
    signal.SIGSTOP: r"\[launcher\].*declared dead by the scheduler",
}
FAIL_FAST_S = 30.0  # a job that fails must end this soon after the kill (heartbeats: 10 s)
SHM = Path("/dev/shm")
HELP = (
    "only N trials on 2 hosts of 2 workers (--nproc-per-node 2): a worker killed without and "
    "with --elastic, a server with --replicas 2, a worker stopped (SIGSTOP) without and with "
    "--elastic, in turn (benchmarks/chaos_hosts.py)"
)


def job_cmd(base: Path, name: str, rounds: int, elastic: int, replicas: int,
            restarts: int) -> list[str]:  # fmt: skip
    """The trial's job: 4 workers on 2 emulated hosts, 2 servers."""
    py = sys.executable
    return [
        py, "-m", "hetps.cli", "launch", "-n", "4", "-s", "2", "--nproc-per-node", "2",
        *(["--elastic", str(elastic)] if elastic else []),
        *(["--replicas", str(replicas)] if replicas > 1 else []),
        "--max-restarts", str(restarts), "--",
        py, "-m", "hetps.cli", "train", "-m", "sync", "-n", "mlp",
        "--train-limit", "6000", "--test-limit", "1000", "-b", "32", "-e", "10",
        "--max-rounds", str(rounds), "--slowdown", "5",
        "--checkpoint-dir", str(base / f"ck-{name}"), "--checkpoint-every", "5",
        "-ld", str(base), "--run-name", name, "--progress", "lines",
    ]  # fmt: skip


def host_segments() -> set[str]:
    """The names in /dev/shm of host-aggregation segments."""
    try:
        return {n for n in os.listdir(SHM) if n.startswith("hetps-host-")}
    except OSError:
        return set()


def maps_segment(pid: int) -> bool:
    """Whether process ``pid`` has a host-aggregation segment mapped."""
    try:
        return "/dev/shm/hetps-host-" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def survivors_agree(folder: Path | None) -> dict[str, Any]:
    """The workers' states in one checkpoint folder against each other, bit for bit: the
    weights and the optimizer state of every ``worker-K.pkl`` equal worker 0's (or the first
    one's)."""
    import chaos_multi
    import torch

    if folder is None:
        return {"agree": False, "survivors": 0, "why": "no checkpoint"}
    states = {
        int(p.stem.split("-")[1]): pickle.loads(p.read_bytes())
        for p in sorted(folder.glob("worker-*.pkl"))
    }
    if not states:
        return {"agree": False, "survivors": 0, "why": "no worker state"}
    first, ref = min(states), states[min(states)]
    different = []
    for k, st in sorted(states.items()):
        ma, mb = st["model"], ref["model"]
        if set(ma) != set(mb) or not all(torch.equal(ma[n], mb[n]) for n in mb):
            different.append(f"worker-{k} weights")
        if not chaos_multi._same(st.get("optimizer"), ref.get("optimizer")):
            different.append(f"worker-{k} optimizer")
        if st.get("round") != ref.get("round"):
            different.append(f"worker-{k} round {st.get('round')} != {ref.get('round')}")
    return {
        "agree": not different,
        "survivors": len(states),
        "why": (f"differ from worker-{first}: " + "; ".join(different)) if different else None,
    }


def verdict(row: dict[str, Any]) -> bool:
    """Whether a trial went as its scenario expects (see the module's docstring)."""
    if not row["killed"] or row["outcome"] != row["expected"] or row["orphans"]:
        return False
    if row["shm_left"]:
        return False
    if row["scenario"] in ("worker", "worker stopped"):
        return (
            bool(row["named"])
            and row["end_after_kill_s"] is not None
            and row["end_after_kill_s"] <= FAIL_FAST_S
            and bool(row["hostagg"])
        )
    if row["scenario"] in ("worker, elastic", "worker stopped, elastic"):
        return bool(row["named"]) and bool(row["taken_over"]) and bool(row.get("agree"))
    return bool(row.get("bit_for_bit"))


def trial(chaos: Any, i: int, scenario: str, rng: random.Random, base: Path, rounds: int,
          limit_s: float, ref_ck: Path | None) -> dict[str, Any]:  # fmt: skip
    """One job, one SIGKILL or SIGSTOP as ``scenario`` says; what came of it."""
    import chaos_multi

    elastic, replicas, restarts, role, expected, sig = SCENARIOS[scenario]
    name = f"hosts{i}"
    tag = uuid.uuid4().hex
    before = host_segments()
    job = chaos.Job(job_cmd(base, name, rounds, elastic, replicas, restarts), tag)
    at_round = rng.randint(max(1, rounds // 10), max(1, rounds * 8 // 10))
    while job.proc.poll() is None and not job.reached(at_round):
        time.sleep(0.02)  # polls the job's output for the chosen round
    victim: dict[str, str] | None = None
    killed = None
    hostagg = None
    if job.proc.poll() is None:
        procs = [(p, e) for p, e in chaos.tagged(tag) if e.get("DMLC_ROLE") == role]
        workers = [p for p, e in chaos.tagged(tag) if e.get("DMLC_ROLE") == "worker"]
        hostagg = any(maps_segment(p) for p in workers)
        if procs:
            pid, env = rng.choice(procs)
            try:
                os.kill(pid, sig)
                killed = time.monotonic()
                victim = env
            except ProcessLookupError:
                pass
    outcome, orphans = chaos._wait_job(job, tag, limit_s)
    lines = [x for _, x in job.lines]
    end_t = job.lines[-1][0] if job.lines else time.monotonic()
    rank = victim.get("HETPS_LAUNCH_RANK") if victim else None
    cause = next((x for x in lines if re.search(CAUSE[sig], x)), None)
    row: dict[str, Any] = {
        "trial": i,
        "scenario": scenario,
        "kill_round": at_round,
        "killed": killed is not None,
        "victim": f"{role} {rank}" if victim else None,
        "host_group": victim.get("HETPS_HOST_GROUP") if victim and role == "worker" else None,
        "local_rank": victim.get("LOCAL_RANK") if victim and role == "worker" else None,
        "outcome": outcome,
        "expected": expected,
        "exit_code": job.proc.returncode,
        "orphans": orphans,
        "shm_left": len(host_segments() - before),
        "shm_names": sorted(host_segments() - before),  # (another job's may show here too)
        "hostagg": hostagg,
        # its host's other worker took its parts over (docs/HOSTS.md)
        "taken_over": any("were let go; the others sum their parts" in x for x in lines),
        "named": cause is not None and rank is not None and f"{role} {rank}" in cause,
        "cause": cause,
        "peer_saw_it": any(
            re.search(r"local rank \d+ \(pid \d+\) of host group", x) for x in lines
        ),
        "end_after_kill_s": round(end_t - killed, 2) if killed is not None else None,
        "output": "\n".join(lines),
    }
    ck = base / f"ck-{name}"
    if outcome == "completed" and SCENARIOS[scenario][:2] == (2, 1):
        row.update(survivors_agree(chaos_multi._last(ck)))
    if outcome == "completed" and scenario == "server, replicas" and ref_ck is not None:
        cmp = chaos_multi.compare(ck, ref_ck)
        keep = ("bit_for_bit", "workers", "workers_equal", "stale_values", "states_equal")
        row.update({k: cmp.get(k) for k in keep})
        row["why"] = cmp.get("why")
    row["as_expected"] = verdict(row)
    return row


def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per scenario: trials, as expected, outcomes, orphans, leftover segments, and the
    slowest end after the kill."""
    out = {}
    for scenario in SCENARIOS:
        rs = [r for r in rows if r["scenario"] == scenario]
        if not rs:
            continue
        ends = [r["end_after_kill_s"] for r in rs if r["end_after_kill_s"] is not None]
        out[scenario] = {
            "trials": len(rs),
            "as_expected": sum(bool(r["as_expected"]) for r in rs),
            "expected": SCENARIOS[scenario][4],
            "completed": sum(r["outcome"] == "completed" for r in rs),
            "failed": sum(r["outcome"] == "failed" for r in rs),
            "hung": sum(r["outcome"] == "hung" for r in rs),
            "orphans": sum(r["orphans"] for r in rs),
            "shm_left": sum(r["shm_left"] for r in rs),
            "values_equal": sum(bool(r.get("agree") or r.get("bit_for_bit")) for r in rs),
            "end_max_s": max(ends) if ends else None,
        }
    return out


def print_summary(summary: dict[str, dict[str, Any]]) -> None:
    """The summary as a table, a row per scenario."""
    print()
    print(f"{'2 hosts x 2 workers':20s} {'trials':>6s} {'as expected':>11s} {'expected':>9s} "
          f"{'completed':>9s} {'failed':>6s} {'hung':>4s} {'orphans':>7s} {'shm left':>8s} "
          f"{'values equal':>12s} {'end max':>8s}")  # fmt: skip
    for name, s in summary.items():
        end = "-" if s["end_max_s"] is None else f"{s['end_max_s']:.1f}s"
        print(
            f"{name:20s} {s['trials']:6d} {s['as_expected']:11d} {s['expected']:>9s} "
            f"{s['completed']:9d} {s['failed']:6d} {s['hung']:4d} {s['orphans']:7d} "
            f"{s['shm_left']:8d} {s['values_equal']:12d} {end:>8s}"
        )


def run(chaos: Any, args: argparse.Namespace) -> int:
    """``chaos.py --hosts N``: a reference run of the replicated job, then N trials (the
    scenarios in turn); 0 when every trial went as expected."""
    rng = random.Random(args.seed)
    names = list(SCENARIOS)
    rows = []
    with tempfile.TemporaryDirectory(prefix="hetps-chaos-hosts-") as tmp:
        base = Path(tmp)
        ref_ck = None
        limit = 300.0
        if any(names[i % len(names)] == "server, replicas" for i in range(args.hosts)):
            t0 = time.monotonic()
            ref = chaos.Job(job_cmd(base, "ref", args.rounds, 0, 2, 3), uuid.uuid4().hex)
            if ref.proc.wait(timeout=900) != 0:
                ref.reader.join(5)
                print("\n".join(x for _, x in ref.lines[-30:]))
                raise SystemExit("chaos: the undisturbed run on hosts failed")
            ref.reader.join(5)
            ref_ck = base / "ck-ref"
            limit = max(180.0, 6 * (time.monotonic() - t0))
            print(f"reference on hosts: {time.monotonic() - t0:.1f} s", flush=True)
        for i in range(args.hosts):
            scenario = names[i % len(names)]
            row = trial(chaos, i, scenario, rng, base, args.rounds, limit, ref_ck)
            output = row.pop("output")
            if args.keep:
                Path(args.keep).mkdir(parents=True, exist_ok=True)
                Path(args.keep, f"hosts{i}.log").write_text(output + "\n")
            rows.append(row)
            print(
                f"hosts {i:3d} {scenario:17s} kill {row['victim']} (host group "
                f"{row['host_group']}, local rank {row['local_rank']}) at round "
                f"{row['kill_round']}: {row['outcome']} (expected {row['expected']}) in "
                f"{row['end_after_kill_s']}s, orphans {row['orphans']}, shm left "
                f"{row['shm_left']}, aggregating {row['hostagg']}, as expected "
                f"{row['as_expected']}" + (f"; {row['why']}" if row.get("why") else ""),
                flush=True,
            )
    summary = summarize(rows)
    print_summary(summary)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"rounds": args.rounds, "hosts_trials": rows, "hosts_summary": summary},
                indent=2,
            )
        )
    return 0 if all(r["as_expected"] for r in rows) else 1
