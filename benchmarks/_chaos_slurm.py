"""chaos.py's hang trials under the Slurm launcher (``--slurm-hang N``): each runs one batch
job (``sbatch --wait``) of ``hetps launch --launcher slurm -n 2 -s 2`` with
``HETPS_REPLICAS=2`` whose worker 0 stops server rank 1 with SIGSTOP at a round drawn at
random, and never continues it. The server is failed over and the job trains to its end;
then every process of the job must end, the stopped server with it, and the batch job too.

Per trial: the outcome (``completed``: the batch job ended with 0; ``failed``; ``hung``: no
end within the limit, the job is then cancelled), orphans (a process of the job, the
stopped server among them, alive 10 s after the batch job ended), whether every value was
right (each worker checks every value it pulls, every round, against every round applied
once, and both workers end bit for bit equal), and ``ended_s``: from the last worker's end
of training to the batch job's end (what the stopped server held it up).

    .venv/bin/python benchmarks/chaos.py --slurm-hang 3 --test-slurm   # a one-node Slurm here
    salloc -n 5 .venv/bin/python benchmarks/chaos.py --slurm-hang 3   # an allocation's Slurm
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Each round: push, pull, and a check of every pulled value against every round applied once
# (SGD with momentum); at round STOP_AT worker 0 stops server rank 1 with SIGSTOP.
JOB = """
import hashlib, os, signal, time
import numpy as np
import hetps.kv
from hetps import optim

def server_pid(rank):
    port = os.environ["DMLC_PS_ROOT_PORT"]
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            env = open(f"/proc/{name}/environ", "rb").read().split(b"\\0")
            cmd = open(f"/proc/{name}/cmdline", "rb").read().split(b"\\0")
        except OSError:
            continue
        if (b"hetps.cli" in cmd and b"server" in cmd and b"DMLC_ROLE=server" in env
                and f"HETPS_LAUNCH_RANK={rank}".encode() in env
                and f"DMLC_PS_ROOT_PORT={port}".encode() in env):
            return int(name)
    raise SystemExit(f"no server process of rank {rank}")

rounds, stop_at = int(os.environ["ROUNDS"]), int(os.environ["STOP_AT"])
kv = hetps.kv.create("dist_sync")
kv.init("w", np.linspace(-1, 1, 4096, dtype=np.float32))
kv.set_optimizer(optim.SGD(learning_rate=0.05, momentum=0.9))
ref_opt = optim.SGD(learning_rate=0.05, momentum=0.9)
ref = np.linspace(-1, 1, 4096, dtype=np.float32)
state = ref_opt.create_state("w", ref)
out = np.zeros(4096, np.float32)
print(f"PIDS {os.getpid()} {os.getppid()}", flush=True)
for r in range(rounds):
    if r == stop_at and kv.rank == 0:
        pid = server_pid(1)
        os.kill(pid, signal.SIGSTOP)
        while open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T":
            time.sleep(0.01)  # polls the kernel until the stop took
        print(f"STOPPED {pid}", flush=True)
    grad = np.random.default_rng(100 * r + kv.rank).standard_normal(4096).astype(np.float32)
    kv.push("w", grad)
    kv.pull("w", out=out)
    grads = [np.random.default_rng(100 * r + w).standard_normal(4096).astype(np.float32)
             for w in range(kv.num_workers)]
    ref_opt.update("w", ref, sum(grads), state)
    if not np.array_equal(out, ref):
        raise SystemExit(f"WRONG VALUE: worker {kv.rank}, round {r}")
print(f"FINAL {kv.rank} {hashlib.sha256(out.tobytes()).hexdigest()} {time.time()}", flush=True)
"""


def add_slurm_hang_args(ap: argparse.ArgumentParser) -> None:
    """chaos.py's options for these trials."""
    ap.add_argument(
        "--slurm-hang",
        type=int,
        default=0,
        metavar="N",
        help="run only N hang trials under the Slurm launcher: a server stopped with SIGSTOP "
        "(HETPS_REPLICAS=2), never continued; the job must end, and everything of it",
    )
    ap.add_argument(
        "--test-slurm",
        action="store_true",
        help="(--slurm-hang) bring up a one-node Slurm on this machine (root, slurm-wlm, munge)",
    )


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def slurm_hang_trial(i: int, env: dict[str, str], base: Path, rounds: int, stop_at: int,
                     limit_s: float) -> dict:  # fmt: skip
    """One trial (see the module's doc); its row."""
    folder = base / f"slurm-hang-{i}"
    folder.mkdir()
    script = folder / "job.py"
    script.write_text(JOB)
    batch = folder / "job.sbatch"
    batch.write_text(
        "#!/bin/bash\n#SBATCH --ntasks=5\n"
        f"echo BATCH $$\n{sys.executable} -m hetps.cli launch --launcher slurm -n 2 -s 2 -- "
        f"{sys.executable} {script}\n"
    )
    log = folder / "job.out"
    job_env = {**env, "HETPS_REPLICAS": "2", "ROUNDS": str(rounds), "STOP_AT": str(stop_at)}
    t0 = time.monotonic()
    proc = subprocess.Popen(
        ["sbatch", "--wait", "--parsable", "-o", str(log), str(batch)],
        env=job_env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        proc.wait(timeout=limit_s)
        outcome = "completed" if proc.returncode == 0 else "failed"
    except subprocess.TimeoutExpired:
        outcome = "hung"
    ended = time.time()
    wall = time.monotonic() - t0
    job_id = ((proc.stdout.read() if proc.poll() is not None else "") or "").strip()
    if outcome == "hung":
        subprocess.run(["scancel", "--full", "-u", str(os.getuid())], env=env, timeout=30)
        proc.kill()
        proc.wait()
    text = log.read_text(errors="replace") if log.exists() else ""
    pids = [int(p) for m in re.findall(r"PIDS (\d+) (\d+)", text) for p in m]
    pids += [int(p) for p in re.findall(r"^\[worker 0\] STOPPED (\d+)$", text, re.M)]
    pids += [int(p) for p in re.findall(r"^BATCH (\d+)$", text, re.M)]
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)  # between looks at /proc (what is waited for is the processes' end)
    orphans = [p for p in pids if _alive(p)]
    finals = re.findall(r"^\[worker (\d)\] FINAL \d (\w+) ([\d.]+)$", text, re.M)
    right = (
        "WRONG VALUE" not in text
        and len(finals) == 2
        and finals[0][1] == finals[1][1]
        and "STOPPED" in text
    )
    last = max((float(t) for *_, t in finals), default=None)
    row = {
        "trial": i,
        "job": job_id.split(";")[0],
        "stop_at": stop_at,
        "outcome": outcome,
        "orphans": len(orphans),
        "values_right": right,
        "named": "did not end with it" in text,
        "ended_s": None if last is None or outcome == "hung" else ended - last,
        "wall_s": wall,
    }
    print(
        f"  slurm hang {i}: stop at round {stop_at}: {outcome}, {len(orphans)} orphans, "
        f"values {'right' if right else 'WRONG'}, "
        f"ended {row['ended_s'] if row['ended_s'] is None else round(row['ended_s'], 1)} s "
        "after training",
        flush=True,
    )
    return row


def run_slurm_hangs(args: argparse.Namespace) -> list[dict]:
    """``--slurm-hang N`` trials (with ``--test-slurm``, on a one-node Slurm of its own)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.update(
        PS_HEARTBEAT_INTERVAL=str(args.hb_interval), PS_HEARTBEAT_TIMEOUT=str(args.hb_timeout)
    )
    cluster = None
    if args.test_slurm:
        sys.path.insert(0, str(ROOT / "tests"))
        import slurm_cluster

        reason = slurm_cluster.why_not()
        if reason:
            raise SystemExit(f"chaos: --test-slurm: {reason}")
        cluster = slurm_cluster.start(Path(tempfile.mkdtemp(prefix="hetps-slurm-")))
        env = cluster.env(env)
    elif not env.get("SLURM_CONF") and not env.get("SLURM_JOB_ID"):
        raise SystemExit("chaos: --slurm-hang needs a Slurm: pass --test-slurm (root) or run it "
                         "where sbatch works")  # fmt: skip
    rng = random.Random(args.seed)
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="hetps-chaos-slurm-") as tmp:
            for i in range(args.slurm_hang):
                stop_at = rng.randint(max(1, args.rounds // 20), max(2, args.rounds * 9 // 10))
                rows.append(slurm_hang_trial(i, env, Path(tmp), args.rounds, stop_at, 300.0))
    finally:
        if cluster is not None:
            subprocess.run(["scancel", "--full", "-u", "root"], env=env, timeout=30)
            cluster.stop()
    return rows


def summarize_slurm_hangs(rows: list[dict]) -> dict:
    """The counts and medians of the trials' rows."""
    ended = sorted(r["ended_s"] for r in rows if r["ended_s"] is not None)
    return {
        "trials": len(rows),
        "completed": sum(r["outcome"] == "completed" for r in rows),
        "failed": sum(r["outcome"] == "failed" for r in rows),
        "hung": sum(r["outcome"] == "hung" for r in rows),
        "orphans": sum(r["orphans"] for r in rows),
        "values_right": sum(r["values_right"] for r in rows),
        "named": sum(r["named"] for r in rows),
        "ended_median_s": ended[len(ended) // 2] if ended else None,
    }


def print_slurm_hangs(summary: dict) -> None:
    """The table of these trials."""
    print()
    print("| stopped under Slurm | trials | completed | failed | hung | orphans | values right "
          "| named by the launcher | end of training → job ended (median) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    s = summary
    med = "–" if s["ended_median_s"] is None else f"{s['ended_median_s']:.1f} s"
    print(f"| server (never continued) | {s['trials']} | {s['completed']} | {s['failed']} | "
          f"{s['hung']} | {s['orphans']} | {s['values_right']} | {s['named']} | {med} |")  # fmt: skip


def slurm_hang_main(args: argparse.Namespace) -> int:
    """chaos.py with ``--slurm-hang N``: the trials, their table, and ``--json``."""
    rows = run_slurm_hangs(args)
    summary = summarize_slurm_hangs(rows)
    print_slurm_hangs(summary)
    if args.json:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from _common import git_head

        Path(args.json).write_text(
            json.dumps(
                {
                    "commit": git_head(str(ROOT)),
                    "rounds": args.rounds,
                    "heartbeat": {"interval_s": args.hb_interval, "timeout_s": args.hb_timeout},
                    "slurm_hang_trials": rows,
                    "slurm_hang_summary": summary,
                },
                indent=2,
            )
        )
    return 0 if summary["completed"] == summary["trials"] and not summary["orphans"] else 1
