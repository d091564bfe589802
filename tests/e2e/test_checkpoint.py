"""Checkpoints and resume through `hetps train`: a job killed outright goes on from its last
checkpoint and ends exactly where an undisturbed run ends; SIGTERM checkpoints and stops."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

DATA = Path("/usr/share/datasets/fashion-mnist")
pytestmark = pytest.mark.skipif(
    not DATA.exists(),
    reason="Fashion-MNIST not installed (scripts/setup.sh --tests installs it as root)",
)
SMALL = ["--train-limit", "2400", "--test-limit", "500", "-b", "32", "-e", "5"]
SMALL += ["--progress", "lines"]


def _cmd(logs: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "hetps.cli", "train", "-ld", str(logs), *SMALL, *args]


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _run(logs: Path, *args: str) -> subprocess.CompletedProcess:
    res = subprocess.run(_cmd(logs, *args), capture_output=True, text=True, timeout=240, env=_env())
    assert res.returncode == 0, res.stdout + res.stderr
    return res


def _model(ckpt: Path, rank: int) -> dict:
    with open(ckpt / f"worker-{rank}.pkl", "rb") as f:
        return pickle.load(f)["model"]


def _iters(log: Path) -> list[int]:
    return [json.loads(line)["iter"] for line in log.read_text().splitlines()]


def _wait_for(pred, what: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if proc.poll() is not None:
            raise AssertionError(f"the job ended before {what}: {proc.stdout.read()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout} s")
        time.sleep(0.02)  # polls a file the job writes


def _processes_with(tag: str) -> list[int]:
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if tag in (d / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(d.name))
            except OSError:
                pass
    return found


COMMON = ["--workers", "2", "-m", "sync", "-n", "mlp", "--max-rounds", "30"]
COMMON += ["--slowdown", "30,30", "--checkpoint-every", "3"]  # ~30 ms a round


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The undisturbed run's last checkpoint (round 30)."""
    logs = tmp_path_factory.mktemp("reference")
    _run(logs, *COMMON, "--checkpoint-dir", str(logs / "ck"), "--run-name", "ref")
    return logs / "ck" / "ckpt-00000030"


def _same_models(a: Path, b: Path) -> None:
    for rank in (0, 1):
        ma, mb = _model(a, rank), _model(b, rank)
        for name in ma:
            assert torch.equal(ma[name], mb[name]), (rank, name)


def _pid_of(tag: str, role: str, rank: int) -> int | None:
    for pid in _processes_with(tag):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"DMLC_ROLE={role}".encode() in env and f"HETPS_LAUNCH_RANK={rank}".encode() in env:
            return pid
    return None


def test_a_killed_job_resumes_and_ends_as_an_undisturbed_run(tmp_path, reference):
    """SSGD, 2 workers: the reference runs 30 rounds. The other run is SIGKILLed (the launcher,
    so every process dies with it) just after its first checkpoint, then resumed with
    --resume: it goes on from that round and its final models equal the reference's, round
    for round in the log (each iteration once)."""
    common = COMMON
    ck = tmp_path / "ck"
    tag = f"--run-name={tmp_path.name}-victim"
    victim = subprocess.Popen(
        _cmd(tmp_path, *common, "--checkpoint-dir", str(ck), tag),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(),
        start_new_session=True,
    )
    try:
        _wait_for(lambda: (ck / "latest").exists(), "first checkpoint", victim)
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait(30)
    finally:
        if victim.poll() is None:
            os.killpg(victim.pid, signal.SIGKILL)
            victim.wait()
    deadline = time.monotonic() + 15
    while _processes_with(tag) and time.monotonic() < deadline:
        time.sleep(0.05)  # the launcher's children die with it (parent-death signal)
    assert _processes_with(tag) == [], "a process outlived the killed launcher"
    killed_at = int((ck / "latest").read_text().split("-")[1])
    assert 3 <= killed_at < 30, killed_at
    res = _run(tmp_path, *common, "--checkpoint-dir", str(ck), "--resume", str(ck), tag)
    assert "checkpoint after round 30" in res.stdout, res.stdout
    assert f"worker 1 finished {30 - killed_at} rounds (rounds {killed_at + 1}-30)" in res.stdout
    _same_models(reference, ck / "ckpt-00000030")
    run = tmp_path / f"{tmp_path.name}-victim"
    for rank in (0, 1):
        assert _iters(run / f"worker-{rank}.jsonl") == list(range(1, 31))
    meta = json.loads((run / "run.json").read_text())
    assert meta["resumed"]["round"] == killed_at and meta["ended"]["status"] == "completed"


@pytest.mark.slow  # (default run: integration/test_launcher.py)
def test_max_restarts_brings_a_job_through_a_killed_worker(tmp_path, reference):
    """--max-restarts 1: worker 1 is SIGKILLed after the first checkpoint; the launcher starts
    the job again at once, it goes on from the checkpoint and ends with the reference's
    models, exit code 0."""
    code, out, ck, _ = _kill_one_and_go_on(tmp_path, "restart", "worker", 1, "--max-restarts", "1")
    assert code == 0, out
    assert "restart 1 of 1" in out and "going on from the last checkpoint" in out, out
    assert "was killed by signal 9 (code 137)" in out, out
    _same_models(reference, ck / "ckpt-00000030")


def _pid_with_env(marker: str, role: str, rank: int | None) -> int | None:
    """The process of ``role`` ``rank`` (None: any) whose environment holds ``marker``."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            marker.encode() in env
            and f"DMLC_ROLE={role}".encode() in env
            and (rank is None or f"HETPS_LAUNCH_RANK={rank}".encode() in env)
        ):
            return int(d.name)
    return None


def _kill_one_and_go_on(tmp_path: Path, name: str, role: str, rank: int | None, *args: str):
    """Run the COMMON job with ``args`` and checkpoints, SIGKILL ``role`` ``rank`` once the
    first checkpoint is in, and let it end. Returns (exit code, output, checkpoint dir, run)."""
    ck = tmp_path / "ck"
    marker = f"HETPS_TEST_JOB={tmp_path.name}"
    proc = subprocess.Popen(
        _cmd(
            tmp_path,
            *COMMON,
            *args,
            "--checkpoint-dir",
            str(ck),
            f"--run-name={tmp_path.name}-{name}",
        ),  # fmt: skip
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**_env(), "HETPS_TEST_JOB": tmp_path.name},
        start_new_session=True,
    )
    try:
        _wait_for(lambda: (ck / "latest").exists(), "first checkpoint", proc)
        victim = _pid_with_env(marker, role, rank)
        assert victim is not None, f"no {role} process"
        os.kill(victim, signal.SIGKILL)
        out = proc.communicate(timeout=180)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, out, ck, tmp_path / f"{tmp_path.name}-{name}"


@pytest.mark.slow  # (default run: integration/test_replicas.py)
def test_replicas_carry_training_through_a_killed_server(tmp_path, reference):
    """--servers 2 --replicas 2: server 0 is SIGKILLed after the first checkpoint. Server 1
    takes over its keys, nothing restarts (each iteration is logged once), the job exits 0
    and its models equal the reference's (one server, nothing killed) bit for bit."""
    code, out, ck, run = _kill_one_and_go_on(
        tmp_path, "replicas", "server", 0, "--servers", "2", "--replicas", "2"
    )
    assert code == 0, out
    assert "server 0 was killed by signal 9" in out and "takes over its keys" in out, out
    assert "restart" not in out and "resum" not in out, out
    assert out.index("takes over its keys") < out.index("checkpoint after round 30"), out
    _same_models(reference, ck / "ckpt-00000030")
    for rank in (0, 1):
        assert _iters(run / f"worker-{rank}.jsonl") == list(range(1, 31))


@pytest.mark.slow  # (default run: integration/test_scheduler_restart.py)
def test_a_killed_scheduler_is_started_again_and_training_goes_on(tmp_path, reference):
    """--max-restarts 1: the scheduler is SIGKILLed after the first checkpoint. The launcher
    starts it again at the same port with --recover; the workers and the server come back to
    it, nothing else restarts (each iteration is logged once), checkpoints go on (they meet at
    barriers) and the models equal the reference's."""
    code, out, ck, run = _kill_one_and_go_on(
        tmp_path, "sched", "scheduler", None, "--max-restarts", "1"
    )
    assert code == 0, out
    assert "starting it again at port" in out and "took back 3 nodes" in out, out
    assert "starting the job again" not in out and "resum" not in out, out
    assert out.index("took back 3 nodes") < out.index("checkpoint after round 30"), out
    _same_models(reference, ck / "ckpt-00000030")
    for rank in (0, 1):
        assert _iters(run / f"worker-{rank}.jsonl") == list(range(1, 31))


def test_sigterm_checkpoints_after_the_round_and_stops(tmp_path):
    """SIGTERM to `hetps train --workers 2` with --checkpoint-dir: the launcher passes it to
    the workers first; they agree to stop after the round, checkpoint it and exit, and the
    launcher returns 143."""
    ck = tmp_path / "ck"
    proc = subprocess.Popen(
        _cmd(tmp_path, "--workers", "2", "-m", "sync", "-n", "mlp", "--max-rounds", "100000")
        + ["--slowdown", "10,10", "--checkpoint-dir", str(ck), "--run-name", "term"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(),
        start_new_session=True,
    )
    log0 = tmp_path / "term" / "worker-0.jsonl"
    try:
        _wait_for(lambda: log0.exists() and len(_iters(log0)) >= 3, "three rounds", proc)
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 143, out
    assert "SIGTERM: checkpoint after this round" in out, out
    last = _iters(log0)[-1]
    assert _iters(tmp_path / "term" / "worker-1.jsonl")[-1] == last
    assert (ck / "latest").read_text() == f"ckpt-{last:08d}", out
    assert json.loads((tmp_path / "term" / "run.json").read_text())["ended"]["status"] == (
        "completed"
    )


def test_esync_and_local_resume_from_their_round(tmp_path):
    """ESync (2 workers) and local training: a run of 4 rounds, then --resume to 7 goes on
    from round 4 (rounds 5-7 logged once, the model of round 4 loaded)."""
    for mode, extra in (("esync", ["--workers", "2"]), ("local", [])):
        ck = tmp_path / f"{mode}-ck"
        args = [*extra, "-m", mode, "-n", "mlp", "--checkpoint-dir", str(ck)]
        args += ["--run-name", mode]
        _run(tmp_path, *args, "--max-rounds", "4")
        four = _model(ck / "ckpt-00000004", 0)
        res = _run(tmp_path, *args, "--max-rounds", "7", "--resume", str(ck))
        assert "checkpoint after round 7" in res.stdout, res.stdout
        assert _iters(tmp_path / mode / "worker-0.jsonl") == list(range(1, 8))
        seven = _model(ck / "ckpt-00000007", 0)
        assert any(not torch.equal(four[n], seven[n]) for n in four)  # it trained on


@pytest.mark.parametrize(
    "args, says",
    [
        (["-m", "async", "--workers", "2", "--checkpoint-dir", "CK"], "no round the whole"),
        (["-m", "sync", "--workers", "2", "--resume", "CK"], "no complete checkpoint there"),
        (
            ["-m", "sync", "--workers", "2", "--checkpoint-dir", "CK", "--checkpoint-every", "0"],
            "at least 1 round",
        ),
        (["-m", "async", "--workers", "2", "--elastic", "1"], "--elastic needs -m sync or esync"),
    ],
)
def test_checkpoint_flags_that_cannot_work_are_one_line(tmp_path, args, says):
    args = [str(tmp_path / "ck") if a == "CK" else a for a in args]
    res = subprocess.run(
        _cmd(tmp_path, *args), capture_output=True, text=True, timeout=60, env=_env()
    )
    assert res.returncode != 0
    assert says in res.stderr and "Traceback" not in res.stderr, res.stderr


@pytest.mark.slow  # (default run: integration/test_elastic_workers.py)
def test_elastic_goes_on_without_a_dead_worker(tmp_path):
    """--elastic 2 with 3 workers: worker 0 is SIGKILLed after the first checkpoint; the
    other two go on at once with nothing restarted: they finish every round (each logged
    once), split its data between them from the next epoch, worker 1 leads (evaluation,
    checkpoints, run.json) and the checkpoints after it hold 2 workers. With --elastic 3 the
    death of worker 2 ends the job with a clear error."""
    args = ["--workers", "3", "-m", "sync", "-n", "mlp", "--max-rounds", "40"]
    args += ["--slowdown", "30,30,30", "--checkpoint-every", "3"]
    outs = {}
    for minimum in ("2", "3"):
        ck = tmp_path / f"ck{minimum}"
        tag = f"--run-name={tmp_path.name}-elastic{minimum}"
        proc = subprocess.Popen(
            _cmd(tmp_path, *args, "--checkpoint-dir", str(ck), "--elastic", minimum, tag),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=_env(),
            start_new_session=True,
        )
        try:
            _wait_for(lambda ck=ck: (ck / "latest").exists(), "first checkpoint", proc)
            victim = _pid_of(tag, "worker", 0 if minimum == "2" else 2)
            assert victim is not None, "no worker process to kill"
            os.kill(victim, signal.SIGKILL)
            outs[minimum] = proc.communicate(timeout=180)[0]
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        outs[minimum] = (proc.returncode, outs[minimum])
    code, out = outs["2"]
    assert code == 0, out
    assert (
        "elastic: worker 0 was killed by signal 9 (code 137); the job goes on without it, "
        "with 2 workers" in out
    ), out
    assert "restart" not in out, out
    # 2,400 examples: 25 batches of 32 per worker with 3, 37 with 2; from epoch 1 on
    assert "worker 1: from epoch 1 on, data shard 0 of 2 (1200 examples)" in out, out
    assert "worker 2: from epoch 1 on, data shard 1 of 2 (1200 examples)" in out, out
    assert "[worker 1] checkpoint after round 40" in out, out
    run = tmp_path / f"{tmp_path.name}-elastic2"
    for rank in (1, 2):
        assert _iters(run / f"worker-{rank}.jsonl") == list(range(1, 41)), out
    last = json.loads((run / "worker-1.jsonl").read_text().splitlines()[-1])
    assert last["accuracy"] is not None, last  # worker 1 evaluates now
    assert json.loads((run / "run.json").read_text())["ended"]["status"] == "completed"
    final = json.loads((tmp_path / "ck2" / "ckpt-00000040" / "manifest.json").read_text())
    assert final["workers"] == 2
    assert sorted(p.name for p in (tmp_path / "ck2" / "ckpt-00000040").glob("worker-*.pkl")) == [
        "worker-0.pkl",
        "worker-1.pkl",
    ]
    code, out = outs["3"]
    assert code == 137, out
    assert "fewer than --elastic 3: the job fails" in out, out


@pytest.mark.slow  # (default run: integration/test_elastic_workers.py)
def test_a_dead_worker_started_again_joins_the_running_job(tmp_path):
    """--elastic 2 --max-restarts 1 with 3 workers: worker 2 is SIGKILLed after the first
    checkpoint; the other two go on, the launcher starts it again, and it joins at a round
    boundary with the others' model. The job completes, every later checkpoint holds 3
    workers, and the three models are equal at the end (every worker stepped with the same
    mean from the same weights). A checkpoint every round: the round the joiner comes in
    after has one too, which every live worker must finish first."""
    args = ["--workers", "3", "-m", "sync", "-n", "mlp", "--max-rounds", "60"]
    args += ["--slowdown", "30,30,30", "--checkpoint-every", "1", "--elastic", "2"]
    args += ["--max-restarts", "1"]
    ck = tmp_path / "ck"
    tag = f"--run-name={tmp_path.name}-join"
    proc = subprocess.Popen(
        _cmd(tmp_path, *args, "--checkpoint-dir", str(ck), tag),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(),
        start_new_session=True,
    )
    try:
        _wait_for(lambda: (ck / "latest").exists(), "first checkpoint", proc)
        victim = _pid_of(tag, "worker", 2)
        assert victim is not None, "no worker 2 process"
        os.kill(victim, signal.SIGKILL)
        out = proc.communicate(timeout=180)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out
    assert "starting worker 2 again (it joins the running job at a round boundary" in out, out
    joined = re.search(r"worker 2: joined the running job after round (\d+) \(is_recovery=1\)", out)
    assert joined is not None, out
    boundary = int(joined.group(1))
    assert f"worker 0: a worker joined after round {boundary}; 3 workers" in out, out
    assert f"worker 1: a worker joined after round {boundary}; 3 workers" in out, out
    # the joiner ran the rounds after the boundary, and says so (not all 60)
    assert f"worker 2 finished {60 - boundary} rounds (rounds {boundary + 1}-60)" in out, out
    assert "worker 0 finished 60 rounds (" in out, out
    final = ck / "ckpt-00000060"
    assert json.loads((final / "manifest.json").read_text())["workers"] == 3
    models = [_model(final, r) for r in range(3)]
    for m in models[1:]:
        assert all(torch.equal(models[0][k], m[k]) for k in m)
    # the joiner logs the rounds after the boundary; the others every round, once
    run = tmp_path / f"{tmp_path.name}-join"
    assert _iters(run / "worker-0.jsonl") == list(range(1, 61)), out
    assert _iters(run / "worker-2.jsonl")[-(60 - boundary) :] == list(range(boundary + 1, 61))


def test_a_dead_esync_worker_started_again_joins_the_running_job(tmp_path):
    """-m esync, --elastic 1 --max-restarts 1 with 2 workers, worker 1 three times slower
    than worker 0 (~45 and ~140 ms a step): worker 1 is SIGKILLed after the first checkpoint;
    worker 0 goes on alone, the launcher starts worker 1 again, and it joins at a round
    boundary with worker 0's model and ESync round. The state server counts it again: worker
    0 takes local steps while the slow one takes one (alone, it took one a round). The job
    completes with the two models equal bit for bit (every round both take the same global
    update from the same weights). A checkpoint every round, as in the sync test above.
    (That the round after the boundary runs in lockstep is tests/unit/test_esync_join.py's:
    here the joiner's first step is fast anyway, as --slowdown scales measured steps.)"""
    rounds = 120  # (alone, worker 0 takes ~70 ms a round: the joiner is in long before)
    args = ["--workers", "2", "-m", "esync", "-n", "mlp", "--max-rounds", str(rounds)]
    args += ["-e", "1000", "--slowdown", "20,60", "--checkpoint-every", "1"]
    args += ["--elastic", "1", "--max-restarts", "1"]
    ck = tmp_path / "ck"
    tag = f"--run-name={tmp_path.name}-esync-join"
    proc = subprocess.Popen(
        _cmd(tmp_path, *args, "--checkpoint-dir", str(ck), tag),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(),
        start_new_session=True,
    )
    try:
        _wait_for(lambda: (ck / "latest").exists(), "first checkpoint", proc)
        victim = _pid_of(tag, "worker", 1)
        assert victim is not None, "no worker 1 process"
        os.kill(victim, signal.SIGKILL)
        out = proc.communicate(timeout=180)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out
    assert "starting worker 1 again (it joins the running job at a round boundary" in out, out
    joined = re.search(r"worker 1: joined the running job after round (\d+) \(is_recovery=1\)", out)
    assert joined is not None, out
    boundary = int(joined.group(1))
    assert boundary < rounds - 2, out  # (rounds with both are left to look at)
    assert f"worker 0: a worker joined after round {boundary}; 2 workers" in out, out
    final = ck / f"ckpt-{rounds:08d}"
    assert json.loads((final / "manifest.json").read_text())["workers"] == 2
    models = [_model(final, r) for r in range(2)]
    assert all(torch.equal(models[0][k], models[1][k]) for k in models[0])
    run = tmp_path / f"{tmp_path.name}-esync-join"
    assert _iters(run / "worker-0.jsonl") == list(range(1, rounds + 1)), out
    after = list(range(boundary + 1, rounds + 1))
    assert _iters(run / "worker-1.jsonl")[-len(after) :] == after, out
    steps = {
        rec["iter"]: rec["local_steps"]
        for rec in map(json.loads, (run / "worker-0.jsonl").read_text().splitlines())
    }
    # counted again: worker 0 steps until the slow joiner's step ends (alone, it took one)
    assert max(steps[r] for r in after) >= 2, steps


def test_checkpoint_seconds_is_agreed_by_every_worker(tmp_path):
    """--checkpoint-seconds (1 ms, so due after almost every round) and no --checkpoint-every:
    rank 0's wish rides in the round's control sum, so both workers take the checkpoint after
    the same round (a wish of rank 0 alone would leave it waiting at the checkpoint's barrier,
    and the job would hang). Several are taken before the last round's; the two newest are
    kept."""
    ck = tmp_path / "ck"
    args = ["--workers", "2", "-m", "sync", "-n", "mlp", "--max-rounds", "6"]
    res = _run(tmp_path, *args, "--checkpoint-dir", str(ck), "--checkpoint-seconds", "0.001")
    rounds = [int(r) for r in re.findall(r"checkpoint after round (\d+)", res.stdout)]
    assert len(rounds) >= 3 and rounds[-1] == 6, res.stdout
    kept = sorted(p.name for p in ck.glob("ckpt-*"))
    assert kept == [f"ckpt-{r:08d}" for r in rounds[-2:]], (kept, rounds)


def _records(log: Path) -> dict[int, dict]:
    return {rec["iter"]: rec for rec in map(json.loads, log.read_text().splitlines())}


def test_a_damaged_checkpoint_is_named_and_a_worker_that_cannot_load_fails_the_job(tmp_path):
    """2 workers, 2 servers, --elastic 1. (1) The newest checkpoint's worker-1.pkl is cut
    short: --resume names the file and why, and goes on from the checkpoint before it; each
    round is logged once, t goes on from that round's (the time the job was down is not
    counted) and each worker says it ran the rounds after it. (2) worker-1.pkl is replaced by
    bytes that match their checksum but do not load: worker 1 fails before it joins, so the
    job fails (it is not let go as a dead worker and the job does not complete without it).
    (3) Every checkpoint damaged: one line that lists them, before anything starts."""
    ck = tmp_path / "ck"
    run = tmp_path / "dmg"
    args = ["--workers", "2", "--servers", "2", "-m", "sync", "-n", "mlp", "--elastic", "1"]
    args += ["--checkpoint-every", "3", "--checkpoint-dir", str(ck)]
    args += ["--run-name", "dmg"]
    _run(tmp_path, *args, "--max-rounds", "9")
    assert json.loads((run / "run.json").read_text())["servers"] == 2
    cut = ck / "ckpt-00000009" / "worker-1.pkl"
    cut.write_bytes(cut.read_bytes()[:1000])
    before = _records(run / "worker-0.jsonl")
    res = _run(tmp_path, *args, "--max-rounds", "12", "--resume", str(ck))
    out = res.stdout + res.stderr
    assert "ckpt-00000009 is damaged: worker-1.pkl: 1000 bytes, the manifest says" in out, out
    assert "going on from" in out and "ckpt-00000006, the newest intact checkpoint" in out, out
    assert "worker 1 finished 6 rounds (rounds 7-12)" in out, out
    meta = json.loads((run / "run.json").read_text())
    assert meta["resumed"]["round"] == 6 and meta["ended"]["status"] == "completed"
    after = _records(run / "worker-0.jsonl")
    assert sorted(after) == list(range(1, 13))
    assert after[6]["t"] == before[6]["t"]  # kept as it was
    # round 7 ends one round after round 6 on the run's clock: the restart is not counted
    assert after[7]["t"] - after[6]["t"] <= after[7]["srit_s"] + after[7]["eval_s"] + 0.5, after

    bad = b"not a pickle of this hetps"
    newest = ck / "ckpt-00000012"
    manifest = json.loads((newest / "manifest.json").read_text())
    manifest["files"]["worker-1.pkl"] = {
        "bytes": len(bad),
        "sha256": hashlib.sha256(bad).hexdigest(),
    }
    (newest / "worker-1.pkl").write_bytes(bad)
    (newest / "manifest.json").write_text(json.dumps(manifest))
    res = subprocess.run(
        _cmd(tmp_path, *args, "--max-rounds", "15", "--resume", str(ck)),
        capture_output=True,
        text=True,
        timeout=240,
        env=_env(),
    )
    out = res.stdout + res.stderr
    assert res.returncode != 0, out
    assert "worker 1 cannot load its state: " in out and "worker-1.pkl: cannot be loaded" in out
    assert "goes on without it" not in out, out
    ended = json.loads((run / "run.json").read_text())["ended"]
    assert ended["status"] == "failed" and "before training" in ended["cause"], (ended, out)

    (ck / "ckpt-00000009" / "values.npz").write_bytes(b"")
    (newest / "values.npz").write_bytes((newest / "values.npz").read_bytes()[:-1])
    res = subprocess.run(
        _cmd(tmp_path, *args, "--max-rounds", "15", "--resume", str(ck)),
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
    )
    assert res.returncode != 0
    assert "every checkpoint in" in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert "ckpt-00000012/values.npz: " in res.stderr and "(cut short)" in res.stderr
    assert "ckpt-00000009/values.npz: 0 bytes" in res.stderr, res.stderr
