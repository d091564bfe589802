"""Kill one process of a training job at a random moment, many times: does the job survive?

    .venv/bin/python benchmarks/chaos.py [--trials 4] [--rounds 60] [--seed 1] [--json FILE]
    .venv/bin/python benchmarks/chaos.py --trials 100 --json runs/chaos.json   # the full run
    .venv/bin/python benchmarks/chaos.py --trials 0 --corrupt 5 --rounds 30  # damaged checkpoints
    .venv/bin/python benchmarks/chaos.py --trials 0 --hang-trials 9 --hb-timeout 4   # hangs
    .venv/bin/python benchmarks/chaos.py --slurm-hang 3 --test-slurm --rounds 40  # Slurm hangs
    .venv/bin/python benchmarks/chaos.py --quick     # two server deaths in a job, 4 trials
    .venv/bin/python benchmarks/chaos.py --trials 0 --multi 12   # 3 of each multi-fault kind
    .venv/bin/python benchmarks/chaos.py --hosts 3 --rounds 200   # on 2 hosts of 2 workers

The job: ``hetps train -m sync -n mlp --workers 3 --servers 2 --replicas 2 --elastic 2``
with ``--checkpoint-dir`` (every 5 rounds) and ``--max-restarts 3``, on a slice of
Fashion-MNIST, for ``--rounds`` rounds (``--replicas 1``: no copies, so a server's death
restarts the job from its checkpoint; ``--elastic 0``: a worker's death does too). First one undisturbed run (the reference). Then each trial starts the same job and,
once a worker logs a round at or past one drawn at random (between 5% and 90% of the
rounds), sends SIGKILL to one process of a random role (the roles take turns, in a shuffled
order): a worker, a server, the scheduler or the launcher itself. (A moment drawn from the
reference's run time missed the job whenever the machine was busier during the reference
than during the trial.)

Per trial it records:

* the outcome: ``completed`` (exit 0), ``failed`` (non-zero exit, or the launcher was the
  one killed: then nothing is left to finish the job) or ``hung`` (no end within the limit);
* orphans: processes of the job still alive 10 s after the launcher ended;
* whether the final model equals the reference's to float rounding (``matches``): SSGD with
  fixed seeds is deterministic up to the order in which a server adds three workers'
  gradients, so a second undisturbed run gives the rounding noise (``noise_floor``, the
  largest weight difference between the two), and a trial matches when its largest
  difference is within 10x that (at least 1e-6). One lost or doubled step of SGD moves the
  weights by about the learning rate times a gradient, far above it;
* detection: from the kill to the launcher's line naming the dead process;
* rejoin: from a worker's kill to the moment it was started again and joined the running job
  (``--elastic`` with restarts left);
* recovery: from the kill to the first round a worker logs after the job went on: after the
  restart, after a server's keys were taken over by the next one (``--replicas``), or after
  a dead worker was let go (``--elastic``); the workers log a round every few rounds, so
  this is an upper bound there;
* the test accuracy at the end, against the reference's: the mean of the last 5
  evaluations (one every 10 rounds, on 1,000 test images), since one evaluation moves by
  1-3 points from the next within a run.

``--corrupt N`` adds N corrupt-checkpoint trials after the kill trials. Each runs the job
to half its rounds, damages its newest checkpoint (cuts ``worker-K.pkl`` or ``values.npz``
short, or flips a bit in it; the kinds take turns) and resumes it with ``--resume`` to the
full rounds. Expected: the damaged file is named, the job goes on from the checkpoint before
and completes with the reference's model. In every fifth trial the two newest checkpoints are
damaged: the job must then fail at once, naming both.

A worker's death is survived with nothing restarted (the two others go on, ``--elastic 2``),
a server's too (its replica takes over); the scheduler is started again at its address and
takes the running nodes back.

With ``--multi N``, N multi-fault trials in a 3-server job (benchmarks/chaos_multi.py says
which), each compared with an undisturbed run bit for bit: every worker's weights, every
key's value on the servers and their optimizer states. ``--quick`` runs one of each.

With ``--hang-trials N``, N more trials each stop one process with SIGSTOP (a worker, a
server or the scheduler) and either never continue it (``stop``), continue it with SIGCONT
after 1.5 heartbeat timeouts, when it was declared dead (``stop+cont``), or after a quarter
of one, a stall (``pause``). Each records the outcome, orphans (a stopped process left
behind counts), whether the model matches the reference's, and ``found``: from the SIGSTOP
to the launcher's line that it stops the hung process. ``--hb-interval``/``--hb-timeout``
set every job's heartbeats (a hang is found after the timeout: a short one keeps the trials
short).

``--slurm-hang N`` runs only N hang trials under the Slurm launcher instead (a server stopped
and never continued, the job must end and everything of it: benchmarks/_chaos_slurm.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import chaos_hosts  # noqa: E402
import chaos_multi  # noqa: E402
from _chaos_slurm import add_slurm_hang_args, slurm_hang_main  # noqa: E402
from _common import git_head, median  # noqa: E402

ROLES = ("worker", "server", "scheduler", "launcher")


def job_cmd(
    logs: Path, ck: Path, rounds: int, name: str, elastic: int = 0, replicas: int = 2,
    servers: int = 2, restarts: int = 3,
) -> list[str]:  # fmt: skip
    return [
        sys.executable, "-m", "hetps.cli", "train",
        *(["--elastic", str(elastic)] if elastic else []),
        *(["--replicas", str(replicas)] if replicas > 1 else []),
        "-m", "sync", "-n", "mlp", "--workers", "3", "--servers", str(servers),
        "--train-limit", "6000", "--test-limit", "1000", "-b", "32", "-e", "10",
        "--max-rounds", str(rounds), "--slowdown", "5,5,5",
        "--checkpoint-dir", str(ck), "--checkpoint-every", "5", "--max-restarts", str(restarts),
        "-ld", str(logs), "--run-name", name, "--progress", "lines",
    ]  # fmt: skip


def tagged(tag: str) -> list[tuple[int, dict[str, str]]]:
    """The live processes of the job marked ``tag`` (in their environment), with it."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            raw = (d / "environ").read_bytes()
            state = (d / "stat").read_text().split(")")[-1].split()[0]
        except OSError:
            continue
        if f"CHAOS_TAG={tag}".encode() not in raw or state == "Z":
            continue
        env = dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)
        found.append((int(d.name), env))
    return found


def final_model(ck: Path) -> dict | None:
    import pickle

    latest = ck / "latest"
    if not latest.exists():
        return None
    with open(ck / latest.read_text() / "worker-0.pkl", "rb") as f:
        return pickle.load(f)["model"]


LAST_EVALS = 5  # evaluations averaged into a run's final accuracy


def final_accuracy(logs: Path, name: str) -> float | None:
    """The mean test accuracy of the last LAST_EVALS rounds evaluated (by worker 0, or by
    the first live worker after worker 0 died and the job went on without it; a round
    evaluated twice, before and after a restart, counts as its last evaluation)."""
    by_round: dict[int, float] = {}
    for log in sorted((logs / name).glob("worker-*.jsonl")):
        for line in log.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("accuracy") is not None:
                by_round[rec["iter"]] = rec["accuracy"]
    last = [by_round[r] for r in sorted(by_round)[-LAST_EVALS:]]
    return round(sum(last) / len(last), 4) if last else None


class Job:
    """One run of the job, its output read line by line with arrival times."""

    def __init__(self, cmd: list[str], tag: str, extra: dict[str, str] | None = None) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CHAOS_TAG=tag)
        env.update(extra or {})
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.lines: list[tuple[float, str]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def reached(self, rnd: int) -> bool:
        """Whether a worker logged round ``rnd`` or a later one."""
        return any(
            int(m.group(1)) >= rnd
            for _, line in list(self.lines)
            if (m := re.search(r"\[worker \d\] worker \d iter (\d+)", line))
        )

    def first(self, pattern: str, after: float) -> float | None:
        for t, line in list(self.lines):
            if t >= after and re.search(pattern, line):
                return t
        return None


def trial(i: int, role: str, rng: random.Random, base: Path, rounds: int,
          limit_s: float, elastic: int = 0,
          replicas: int = 2) -> dict:  # fmt: skip
    name = f"trial{i}"
    ck = base / f"ck-{name}"
    tag = uuid.uuid4().hex
    job = Job(job_cmd(base, ck, rounds, name, elastic, replicas), tag)
    at_round = rng.randint(max(1, rounds // 20), max(1, rounds * 9 // 10))
    killed = None
    victim = None
    while job.proc.poll() is None and not job.reached(at_round):
        time.sleep(0.02)  # until the chosen round (or the job's end)
    at = time.monotonic() - job.started
    if job.proc.poll() is None:
        if role == "launcher":
            victim = job.proc.pid
        else:
            until = time.monotonic() + 20  # (early on the role's processes may not be up yet)
            while victim is None and job.proc.poll() is None and time.monotonic() < until:
                procs = [(pid, env) for pid, env in tagged(tag) if env.get("DMLC_ROLE") == role]
                if procs:
                    victim = rng.choice(procs)[0]
                else:
                    time.sleep(0.02)
        if victim is not None:
            killed = time.monotonic()
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                killed = None
    try:
        job.proc.wait(timeout=limit_s)
        outcome = "completed" if job.proc.returncode == 0 else "failed"
    except subprocess.TimeoutExpired:
        outcome = "hung"
        os.killpg(job.proc.pid, signal.SIGKILL)
        job.proc.wait()
    job.reader.join(5)
    deadline = time.monotonic() + 10
    while tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.1)  # children die with the launcher (parent-death signal)
    orphans = [pid for pid, _ in tagged(tag)]
    for pid in orphans:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    detect = recover = None
    if killed is not None and role != "launcher":
        t = job.first(r"\[launcher\] .*(killed by signal|exited)", killed)
        detect = t - killed if t is not None else None
        t = job.first(
            r"\[worker \d\] worker \d iter \d+",
            job.first(
                r"restart 1 of|goes on without it|takes over its keys|starting it again at",
                killed,
            )
            or 1e18,
        )
        recover = t - killed if t is not None else None
        t = job.first(r"joined the running job after round", killed)
        rejoin = t - killed if t is not None else None  # a worker started again is back in
    else:
        rejoin = None
    return {
        "trial": i,
        "role": role,
        "kill_round": at_round,
        "kill_at_s": round(at, 3),
        "killed": killed is not None,
        "outcome": outcome,
        "exit_code": job.proc.returncode,
        "orphans": len(orphans),
        "detect_s": detect,
        "recover_s": recover,
        "rejoin_s": rejoin,
        "ck": str(ck),
        "name": name,
        "output": "\n".join(line for _, line in job.lines),
    }


# -- corrupt-checkpoint trials ---------------------------------------------------------------
#: (how, what): cut a file short or flip a byte in it; a worker's state or the servers' values.
#: "all": the newest and the one before it both damaged: nothing intact is left to resume from
DAMAGES = (
    ("truncate", "worker"),
    ("flip", "worker"),
    ("truncate", "values"),
    ("flip", "values"),
    ("truncate", "all"),
)


def damage_file(path: Path, how: str, rng: random.Random) -> str:
    """Cut ``path`` short (``truncate``) or flip one byte of it (``flip``); says what."""
    data = bytearray(path.read_bytes())
    if how == "truncate":
        cut = rng.randrange(len(data))
        path.write_bytes(bytes(data[:cut]))
        return f"{path.parent.name}/{path.name} cut to {cut} of {len(data)} bytes"
    at = rng.randrange(len(data))
    data[at] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))
    return f"{path.parent.name}/{path.name}: a bit of byte {at} of {len(data)} flipped"


def _wait_job(job: Job, tag: str, limit_s: float) -> tuple[str, int]:
    """Wait for ``job`` (killed when past ``limit_s``): its outcome, and its orphans (killed)."""
    try:
        job.proc.wait(timeout=limit_s)
        outcome = "completed" if job.proc.returncode == 0 else "failed"
    except subprocess.TimeoutExpired:
        outcome = "hung"
        os.killpg(job.proc.pid, signal.SIGKILL)
        job.proc.wait()
    job.reader.join(5)
    deadline = time.monotonic() + 10
    while tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.1)  # children die with the launcher (parent-death signal)
    orphans = [pid for pid, _ in tagged(tag)]
    for pid in orphans:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return outcome, len(orphans)


def corrupt_trial(i: int, how: str, what: str, rng: random.Random, base: Path, rounds: int,
                  limit_s: float, elastic: int = 0,
                  replicas: int = 2) -> dict:  # fmt: skip
    """Run the job to about half its rounds, damage its newest checkpoint (``what``: a
    worker's state, the servers' values, or ``all``: the one before it too), then
    ``--resume``. Expected: it completes from the checkpoint before the newest, the damaged
    file named in the output; with ``all`` it fails at once, every damage named."""
    name = f"corrupt{i}"
    ck = base / f"ck-{name}"
    half = max(10, rounds // 10 * 5)  # (checkpoints every 5 rounds: at least two by then)
    tag = uuid.uuid4().hex
    first = Job(job_cmd(base, ck, half, name, elastic, replicas), tag)
    outcome, orphans = _wait_job(first, tag, limit_s)
    row = {"trial": i, "damage": f"{how} {what}", "first_run": outcome, "orphans": orphans}
    folders = sorted(p for p in ck.glob("ckpt-*") if (p / "manifest.json").exists())
    if outcome != "completed" or len(folders) < 2:
        return {**row, "outcome": "setup failed", "output": "\n".join(x for _, x in first.lines)}
    newest, previous = folders[-1], folders[-2]
    workers = json.loads((newest / "manifest.json").read_text())["workers"]

    def victim(folder: Path, kind: str) -> Path:
        if kind == "values":
            return folder / "values.npz"
        return folder / f"worker-{rng.randrange(workers)}.pkl"

    damaged = [victim(newest, what if what != "all" else rng.choice(("worker", "values")))]
    if what == "all":
        damaged.append(victim(previous, rng.choice(("worker", "values"))))
    row["damaged"] = [damage_file(p, how, rng) for p in damaged]
    tag = uuid.uuid4().hex
    again = Job([*job_cmd(base, ck, rounds, name, elastic, replicas), "--resume", str(ck)], tag)
    outcome, orphans = _wait_job(again, tag, limit_s)
    out = [line for _, line in again.lines]
    named = all(
        any(f"{p.parent.name}" in x and f"{p.name}" in x and "damaged" in x for x in out)
        for p in damaged
    )
    went_on = any(f"going on from {previous}" in x for x in out)
    expected = "failed" if what == "all" else "completed"
    return {
        **row,
        "outcome": outcome,
        "exit_code": again.proc.returncode,
        "expected": expected,
        "as_expected": outcome == expected and named and (went_on or what == "all"),
        "named": named,
        "from_previous": went_on,
        "orphans": row["orphans"] + orphans,
        "output": "\n".join(out),
    }


def corrupt_trials(args: argparse.Namespace, base: Path, ref_model: dict | None,
                   tolerance: float, limit_s: float) -> list[dict]:  # fmt: skip
    """``--corrupt N`` trials, the kinds of :data:`DAMAGES` in turn; prints a line each."""
    rng = random.Random(args.seed + 7919)  # (the kill trials draw as before)
    rows = []
    for i in range(args.corrupt):
        how, what = DAMAGES[i % len(DAMAGES)]
        row = corrupt_trial(
            i, how, what, rng, base, args.rounds, limit_s, args.elastic, args.replicas
        )
        diff = None
        if row["outcome"] == "completed":
            diff = max_diff(final_model(base / f"ck-corrupt{i}"), ref_model)
        row["max_abs_diff"] = diff
        row["matches"] = diff is not None and diff <= tolerance
        output = row.pop("output")
        if args.keep:
            Path(args.keep).mkdir(parents=True, exist_ok=True)
            Path(args.keep, f"corrupt{i}-{how}-{what}.log").write_text(output + "\n")
        rows.append(row)
        print(
            f"corrupt {i:3d} {how:8s} {what:6s}: {row['outcome']:9s} "
            f"(expected {row.get('expected', '-')}) named {row.get('named')} from previous "
            f"{row.get('from_previous')} matches {row['matches']} orphans {row['orphans']}; "
            f"{'; '.join(row.get('damaged', []))}",
            flush=True,
        )
    if rows:
        ok = sum(bool(r.get("as_expected")) for r in rows)
        print(
            f"corrupt checkpoints: {ok} of {len(rows)} as expected (completed from the one "
            f"before, or failed when none was intact, the damage named); "
            f"{sum(r['outcome'] == 'hung' for r in rows)} hung, "
            f"{sum(r['orphans'] for r in rows)} orphans, "
            f"{sum(bool(r['matches']) for r in rows)} of "
            f"{sum(r['outcome'] == 'completed' for r in rows)} completed equal the reference",
            flush=True,
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=4, help="default: one kill per role")
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--elastic",
        type=int,
        default=2,
        metavar="MIN",
        help="run the job with --elastic MIN (default 2): a killed worker is let go and the "
        "others go on (its trials then end on another model, so they are not compared with "
        "the reference's); 0: its death restarts the job",
    )
    ap.add_argument(
        "--replicas",
        type=int,
        default=2,
        metavar="R",
        help="copies of every key (hetps train --replicas; 1: none, a dead server restarts "
        "the job)",
    )
    ap.add_argument(
        "--roles",
        nargs="+",
        choices=ROLES,
        default=list(ROLES),
        help="the roles to kill, in turns (default: all four)",
    )
    ap.add_argument(
        "--corrupt",
        type=int,
        default=0,
        metavar="N",
        help="after the kill trials, N corrupt-checkpoint trials: run to half the rounds, "
        "cut short or flip a byte in the newest worker-K.pkl or values.npz (or in the two "
        "newest), then --resume",
    )
    ap.add_argument(
        "--multi",
        type=int,
        default=0,
        metavar="N",
        help="N multi-fault trials (3 servers, two of them killed one after the other: with "
        "and without restarts between, and a kill during a restart; benchmarks/chaos_multi.py)",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="the small preset: one multi-fault trial of each kind, 200 rounds, no other "
        "trials (about 4 minutes on 2 cores)",
    )
    ap.add_argument("--keep", default=None, metavar="DIR", help="keep each trial's output here")
    add_hang_args(ap)
    add_slurm_hang_args(ap)
    ap.add_argument("--hosts", type=int, default=0, metavar="N", help=chaos_hosts.HELP)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.hosts:  # (2 hosts of 2 workers: benchmarks/chaos_hosts.py)
        return chaos_hosts.run(sys.modules[__name__], args)
    if args.slurm_hang:  # (hang trials under the Slurm launcher: their own section)
        return slurm_hang_main(args)
    if args.quick:
        args.trials, args.corrupt, args.hang_trials = 0, 0, 0
        args.multi, args.rounds = len(chaos_multi.SCENARIOS), 200
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="hetps-chaos-") as tmp:
        base = Path(tmp)
        if not (args.trials or args.corrupt or args.hang_trials):
            return multi_only(args, rng, base)
        t0 = time.monotonic()
        ref = Job(
            job_cmd(base, base / "ck-ref", args.rounds, "ref", args.elastic, args.replicas),
            uuid.uuid4().hex,
            heartbeat_env(args),
        )
        if ref.proc.wait(timeout=600) != 0:
            ref.reader.join(5)
            print("\n".join(x for _, x in ref.lines[-30:]))
            raise SystemExit("chaos: the undisturbed reference run failed")
        ref.reader.join(5)
        expected = time.monotonic() - t0
        ref_model = final_model(base / "ck-ref")
        ref_acc = final_accuracy(base, "ref")
        again = Job(
            job_cmd(base, base / "ck-ref2", args.rounds, "ref2", args.elastic, args.replicas),
            uuid.uuid4().hex,
            heartbeat_env(args),
        )
        if again.proc.wait(timeout=600) != 0:
            raise SystemExit("chaos: the second undisturbed run failed")
        again.reader.join(5)
        floor = max_diff(final_model(base / "ck-ref2"), ref_model)
        tolerance = max(10 * floor, 1e-6)
        print(
            f"reference: {expected:.1f} s, final accuracy {ref_acc}; two undisturbed runs "
            f"differ by at most {floor:.3g} (rounding)",
            flush=True,
        )
        order: list[str] = []
        rows = []
        for i in range(args.trials):
            if not order:
                order = list(args.roles)
                rng.shuffle(order)
            role = order.pop()
            row = trial(
                i,
                role,
                rng,
                base,
                args.rounds,
                max(180, 6 * expected),
                args.elastic,
                args.replicas,
            )
            ck = Path(row.pop("ck"))
            model = final_model(ck)
            name = row.pop("name")
            diff = max_diff(model, ref_model) if row["outcome"] == "completed" else None
            row["max_abs_diff"] = diff
            row["matches"] = diff is not None and diff <= tolerance
            if args.elastic and row["outcome"] == "completed":
                # deterministic (a round is added in worker order): every worker's weights,
                # every server value and the optimizer states, bit for bit
                row.update(same_as(ck, base / "ck-ref"))
                row["matches"] = row["bit_for_bit"]
            if args.elastic and role == "worker":
                row["matches"] = None  # fewer workers from the kill on: another model
            acc = final_accuracy(base, name) if row["outcome"] == "completed" else None
            row["accuracy"] = acc
            row["accuracy_gap"] = None if acc is None or ref_acc is None else ref_acc - acc
            rows.append(row)
            if args.keep:
                Path(args.keep).mkdir(parents=True, exist_ok=True)
                Path(args.keep, f"trial{i}-{role}.log").write_text(row.pop("output") + "\n")
            else:
                row.pop("output")
            print(
                f"trial {i:3d} kill {role:9s} at round {row['kill_round']:4d} "
                f"({row['kill_at_s']:5.1f}s): {row['outcome']:9s} "
                f"orphans {row['orphans']} matches {row['matches']} detect "
                f"{_s(row['detect_s'])} recover {_s(row['recover_s'])} rejoin "
                f"{_s(row['rejoin_s'])}",
                flush=True,
            )
        corrupt = corrupt_trials(args, base, ref_model, tolerance, max(180, 6 * expected))
        hang_rows = run_hangs(args, rng, base, expected, ref_model, tolerance)
        multi_rows = chaos_multi.run_multi(sys.modules[__name__], args, rng, base)
    summary = summarize(rows)
    print()
    print(f"{'killed':10s} {'trials':>6s} {'completed':>9s} {'failed':>6s} {'hung':>4s} "
          f"{'orphans':>7s} {'match':>5s} {'detect med':>10s} {'recover med':>11s} "
          f"{'rejoined':>8s} {'rejoin med':>10s}")  # fmt: skip
    for role, s in summary.items():
        print(
            f"{role:10s} {s['trials']:6d} {s['completed']:9d} {s['failed']:6d} {s['hung']:4d} "
            f"{s['orphans']:7d} {s['matches']:5d} {_s(s['detect_median_s']):>10s} "
            f"{_s(s['recover_median_s']):>11s} {s['rejoined']:8d} "
            f"{_s(s['rejoin_median_s']):>10s}"
        )
    print(f"reference accuracy {ref_acc} (mean of its last {LAST_EVALS} evaluations); "
          f"largest gap of a completed trial "
          f"{max(((r['accuracy_gap'] or 0.0) for r in rows), default=0.0):.4f}")  # fmt: skip
    hang_summary = summarize_hangs(hang_rows)
    print_hangs(hang_summary)
    multi_summary = chaos_multi.summarize_multi(multi_rows)
    chaos_multi.print_multi(multi_summary)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "commit": git_head(str(ROOT)),
                    "rounds": args.rounds,
                    "replicas": args.replicas,
                    "elastic": args.elastic,
                    "reference_s": expected,
                    "reference_accuracy": ref_acc,
                    "noise_floor": floor,
                    "trials": rows,
                    "summary": summary,
                    "corrupt_trials": corrupt,
                    "heartbeat": {"interval_s": args.hb_interval, "timeout_s": args.hb_timeout},
                    "hang_trials": hang_rows,
                    "hang_summary": hang_summary,
                    "multi_trials": multi_rows,
                    "multi_summary": multi_summary,
                },
                indent=2,
            )
        )
    return 0


def multi_only(args: argparse.Namespace, rng: random.Random, base: Path) -> int:
    """Only the multi-fault trials (``--quick``, or ``--trials 0 --multi N``)."""
    rows = chaos_multi.run_multi(sys.modules[__name__], args, rng, base)
    summary = chaos_multi.summarize_multi(rows)
    chaos_multi.print_multi(summary)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "commit": git_head(str(ROOT)),
                    "rounds": args.rounds,
                    "elastic": args.elastic,
                    "multi_trials": rows,
                    "multi_summary": summary,
                },
                indent=2,
            )
        )
    return 0 if all(r["as_expected"] for r in rows) else 1


def same_as(ck: Path, ref: Path) -> dict:
    """A trial's last checkpoint against the reference's, bit for bit (chaos_multi.compare):
    ``bit_for_bit``, ``workers_equal`` of ``workers``, ``stale_values``, ``states_equal``."""
    cmp = chaos_multi.compare(ck, ref)
    keep = ("bit_for_bit", "workers", "workers_equal", "stale_values", "states_equal", "why")
    return {k: cmp.get(k) for k in keep}


def max_diff(a: dict | None, b: dict | None) -> float:
    """The largest absolute weight difference between two models (inf if one is missing)."""
    if a is None or b is None:
        return float("inf")
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in b)


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}s"


def summarize(rows: list[dict]) -> dict:
    out = {}
    for role in ROLES + ("all",):
        rs = [r for r in rows if role in ("all", r["role"]) and r["killed"]]
        if not rs:
            continue
        out[role] = {
            "trials": len(rs),
            "completed": sum(r["outcome"] == "completed" for r in rs),
            "failed": sum(r["outcome"] == "failed" for r in rs),
            "hung": sum(r["outcome"] == "hung" for r in rs),
            "orphans": sum(r["orphans"] for r in rs),
            "matches": sum(bool(r["matches"]) for r in rs),
            "compared": sum(r["matches"] is not None for r in rs),
            "detect_median_s": median(r["detect_s"] for r in rs if r["detect_s"] is not None),
            "recover_median_s": median(r["recover_s"] for r in rs if r["recover_s"] is not None),
            "rejoined": sum(r.get("rejoin_s") is not None for r in rs),
            "rejoin_median_s": median(r["rejoin_s"] for r in rs if r.get("rejoin_s") is not None),
        }
    return out


# -- hang trials: SIGSTOP of one process (and SIGCONT later, or never) ------------------------

#: stop: never continued; stop+cont: continued after 1.5 heartbeat timeouts (it was declared
#: dead by then: it must not come back to fail the job); pause: continued after a quarter of
#: the timeout (a stall, not a death: nothing may be declared dead)
HANGS = ("stop", "stop+cont", "pause")
HANG_ROLES = ("worker", "server", "scheduler")


def add_hang_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--hang-trials",
        type=int,
        default=0,
        metavar="N",
        help="after the kills, N trials that SIGSTOP one process (worker, server or "
        "scheduler, each hang of HANGS in turn: 9 cover every pair)",
    )
    ap.add_argument(
        "--hb-interval",
        type=float,
        default=1.0,
        metavar="S",
        help="PS_HEARTBEAT_INTERVAL of every job (default 1, hetps's)",
    )
    ap.add_argument(
        "--hb-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="PS_HEARTBEAT_TIMEOUT of every job (default 10, hetps's): how long a hang "
        "takes to be found",
    )


def heartbeat_env(args: argparse.Namespace) -> dict[str, str]:
    return {
        "PS_HEARTBEAT_INTERVAL": f"{args.hb_interval:g}",
        "PS_HEARTBEAT_TIMEOUT": f"{args.hb_timeout:g}",
    }


def _signal(pid: int, tag: str, sig: int) -> bool:
    """``sig`` to ``pid`` if it is still a process of the job (not a reused pid)."""
    if pid not in {p for p, _ in tagged(tag)}:
        return False
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


def hang_trial(i: int, role: str, hang: str, rng: random.Random, base: Path, rounds: int,
               limit_s: float, args: argparse.Namespace) -> dict:  # fmt: skip
    """One job; at a round drawn at random, SIGSTOP one process of ``role``; ``hang`` says
    whether and when it gets SIGCONT."""
    name = f"hang{i}"
    ck = base / f"ck-{name}"
    tag = uuid.uuid4().hex
    cmd = job_cmd(base, ck, rounds, name, args.elastic, args.replicas)
    job = Job(cmd, tag, heartbeat_env(args))
    at_round = rng.randint(max(1, rounds // 20), max(1, rounds * 9 // 10))
    stopped = victim = continued = None
    while job.proc.poll() is None and not job.reached(at_round):
        time.sleep(0.02)  # until the chosen round (or the job's end)
    if job.proc.poll() is None:
        until = time.monotonic() + 20
        while victim is None and job.proc.poll() is None and time.monotonic() < until:
            procs = [pid for pid, env in tagged(tag) if env.get("DMLC_ROLE") == role]
            if procs:
                victim = rng.choice(procs)
            else:
                time.sleep(0.02)
        if victim is not None and _signal(victim, tag, signal.SIGSTOP):
            stopped = time.monotonic()
    cont_after = {"stop": None, "stop+cont": 1.5, "pause": 0.25}[hang]
    end = time.monotonic() + limit_s
    while job.proc.poll() is None and time.monotonic() < end:
        if (
            stopped is not None
            and cont_after is not None
            and continued is None
            and time.monotonic() - stopped >= cont_after * args.hb_timeout
        ):
            continued = _signal(victim, tag, signal.SIGCONT)  # False: gone (stopped for good)
        time.sleep(0.05)
    if job.proc.poll() is None:
        outcome = "hung"
        os.killpg(job.proc.pid, signal.SIGKILL)
        job.proc.wait()
    else:
        outcome = "completed" if job.proc.returncode == 0 else "failed"
    job.reader.join(5)
    deadline = time.monotonic() + 10
    while tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.1)  # children die with the launcher (parent-death signal)
    orphans = [pid for pid, _ in tagged(tag)]
    for pid in orphans:
        for sig in (signal.SIGKILL, signal.SIGCONT):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    found = recover = None
    if stopped is not None:
        t = job.first(r"\[launcher\] .*(declared dead by the scheduler|scheduler hung)", stopped)
        found = t - stopped if t is not None else None
        went_on = job.first(
            r"goes on without it|takes over its keys|starting it again at|restart 1 of", stopped
        )
        t = job.first(r"\[worker \d\] worker \d iter \d+", went_on or 1e18)
        recover = t - stopped if t is not None else None
    return {
        "trial": i,
        "role": role,
        "hang": hang,
        "stop_round": at_round,
        "stopped": stopped is not None,
        "continued": continued,
        "outcome": outcome,
        "exit_code": job.proc.returncode,
        "orphans": len(orphans),
        "found_s": found,
        "recover_s": recover,
        "ck": str(ck),
        "name": name,
        "output": "\n".join(line for _, line in job.lines),
    }


def run_hangs(args: argparse.Namespace, rng: random.Random, base: Path, expected: float,
              ref_model: dict | None, tolerance: float) -> list[dict]:  # fmt: skip
    """``--hang-trials`` trials, every (role, hang) pair in turn in a shuffled order."""
    order: list[tuple[str, str]] = []
    rows = []
    for i in range(args.hang_trials):
        if not order:
            order = [(r, h) for r in HANG_ROLES for h in HANGS]
            rng.shuffle(order)
        role, hang = order.pop()
        row = hang_trial(i, role, hang, rng, base, args.rounds, max(180, 6 * expected), args)
        ck = Path(row.pop("ck"))
        model = final_model(ck)
        row.pop("name")
        diff = max_diff(model, ref_model) if row["outcome"] == "completed" else None
        row["max_abs_diff"] = diff
        row["matches"] = diff is not None and diff <= tolerance
        if args.elastic and row["outcome"] == "completed":
            row.update(same_as(ck, base / "ck-ref"))  # bit for bit (see the kill trials)
            row["matches"] = row["bit_for_bit"]
        if args.elastic and role == "worker" and hang != "pause":
            row["matches"] = None  # let go from the hang on: another model
        if args.keep:
            Path(args.keep).mkdir(parents=True, exist_ok=True)
            Path(args.keep, f"hang{i}-{role}-{hang}.log").write_text(row.pop("output") + "\n")
        else:
            row.pop("output")
        rows.append(row)
        print(
            f"hang {i:3d} {hang:9s} {role:9s} at round {row['stop_round']:4d}: "
            f"{row['outcome']:9s} exit {row['exit_code']} orphans {row['orphans']} "
            f"matches {row['matches']} found {_s(row['found_s'])} "
            f"recover {_s(row['recover_s'])}",
            flush=True,
        )
    return rows


def summarize_hangs(rows: list[dict]) -> dict:
    out = {}
    for hang in HANGS:
        for role in HANG_ROLES:
            rs = [r for r in rows if r["hang"] == hang and r["role"] == role and r["stopped"]]
            if not rs:
                continue
            out[f"{hang} {role}"] = {
                "trials": len(rs),
                "completed": sum(r["outcome"] == "completed" for r in rs),
                "failed": sum(r["outcome"] == "failed" for r in rs),
                "hung": sum(r["outcome"] == "hung" for r in rs),
                "orphans": sum(r["orphans"] for r in rs),
                "matches": sum(bool(r["matches"]) for r in rs),
                "compared": sum(r["matches"] is not None for r in rs),
                "found_median_s": median(r["found_s"] for r in rs if r["found_s"] is not None),
                "recover_median_s": median(
                    r["recover_s"] for r in rs if r["recover_s"] is not None
                ),
            }
    return out


def print_hangs(summary: dict) -> None:
    if not summary:
        return
    print()
    print(f"{'hang':20s} {'trials':>6s} {'completed':>9s} {'failed':>6s} {'hung':>4s} "
          f"{'orphans':>7s} {'match':>9s} {'found med':>9s} {'recover med':>11s}")  # fmt: skip
    for key, s in summary.items():
        print(
            f"{key:20s} {s['trials']:6d} {s['completed']:9d} {s['failed']:6d} {s['hung']:4d} "
            f"{s['orphans']:7d} {s['matches']:4d}/{s['compared']:<4d} "
            f"{_s(s['found_median_s']):>9s} {_s(s['recover_median_s']):>11s}"
        )


if __name__ == "__main__":
    sys.exit(main())
