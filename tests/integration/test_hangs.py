"""Processes that hang (SIGSTOP: alive, silent) and scripts that fail with an exit code, run
through the real launcher: a hung node the scheduler declared dead is stopped, so a job that
went on without it ends 0; a hung scheduler is found by the launcher and started again like
a dead one; a worker's ``sys.exit(3)`` is the job's failure with code 3, and the launcher
names the process that failed first, not the scheduler that followed it."""

from __future__ import annotations

import io
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from conftest import PRELUDE, TEST_ENV
from hetps.launch.contract import LaunchSpec
from hetps.launch.local import Launcher

#: a hung node is declared dead after 2 s of silence
FAST = {**TEST_ENV, "PS_HEARTBEAT_INTERVAL": "0.3", "PS_HEARTBEAT_TIMEOUT": "2"}

# Rounds of push and pull; each worker says when it reached round 3 (a file) and worker 0
# waits there until the test has stopped the victim, so the victim hangs mid-job.
ROUNDS = """
import hashlib
flags = os.environ["FLAGS"]
kv = hetps.kv.create("dist_sync")
kv.init("w", np.zeros(20, np.float32))
kv.set_optimizer(optim.SGD(learning_rate=0.1))
out = np.zeros(20, np.float32)
for r in range(12):
    if r == 3:
        open(os.path.join(flags, f"at-{kv.rank}"), "w").close()
        while kv.rank == 0 and not os.path.exists(os.path.join(flags, "stopped")):
            time.sleep(0.01)   # polls a file the test writes
    kv.push("w", np.full(20, 1.0 + r, np.float32))
    kv.pull("w", out=out)
    if r % 4 == 1:
        kv.barrier()
print("FINAL", kv.rank, hashlib.sha256(out.tobytes()).hexdigest(), flush=True)
"""


def _launch(tmp_path: Path, code: str, env: dict[str, str], **spec_kw) -> tuple:
    flags = tmp_path / "flags"
    flags.mkdir()
    script = tmp_path / "script.py"
    script.write_text(PRELUDE + textwrap.dedent(code))
    out = io.StringIO()
    spec = LaunchSpec(
        command=[sys.executable, str(script)],
        env={**env, "FLAGS": str(flags)},
        failure_grace=5.0,
        **spec_kw,
    )
    return Launcher(spec, out=out), out, flags


def _run_stopping(launcher: Launcher, flags: Path, pick, workers: int) -> tuple[int | None, str]:
    """Run ``launcher`` in a thread; once every worker reached round 3, SIGSTOP the child
    ``pick(launcher)`` names and let worker 0 go on. Returns (exit code, output); the
    launcher must end on its own within the limit."""
    result: dict = {}
    runner = threading.Thread(target=lambda: result.setdefault("code", launcher.run()))
    runner.start()
    victim = None
    try:
        deadline = time.monotonic() + 90
        while not all((flags / f"at-{r}").exists() for r in range(workers)):
            assert runner.is_alive(), launcher.out.getvalue()
            assert time.monotonic() < deadline, launcher.out.getvalue()
            time.sleep(0.02)  # polls files the job writes
        victim = pick(launcher)
        victim.proc.send_signal(signal.SIGSTOP)
        (flags / "stopped").touch()
        runner.join(90)
        assert not runner.is_alive(), "the launcher never ended: " + launcher.out.getvalue()
        # the stopped process was stopped for good (SIGKILL), not left behind
        assert victim.proc.poll() == -signal.SIGKILL, launcher.out.getvalue()
    finally:
        if victim is not None and victim.proc.poll() is None:
            victim.proc.send_signal(signal.SIGCONT)
        launcher.stop_all(kill=True)
        runner.join(30)
    return result.get("code"), launcher.out.getvalue()


def _finals(text: str) -> dict[int, str]:
    return {int(r): d for r, d in re.findall(r"FINAL (\d) (\w+)", text)}


def test_a_hung_server_is_stopped_and_the_job_that_went_on_returns_0(tmp_path):
    """Server 1 hangs: the scheduler declares it dead after the heartbeat timeout, server 0
    takes its keys over (--replicas 2) and the job completes. The launcher stops the hung
    server (it would hold the job, or wake up and fail it) and returns 0."""
    launcher, out, flags = _launch(tmp_path, ROUNDS, FAST, num_workers=2, num_servers=2, replicas=2)
    server1 = lambda la: next(c for c in la.children if c.role == "server" and c.rank == 1)  # noqa: E731
    code, text = _run_stopping(launcher, flags, server1, workers=2)
    assert code == 0, text
    assert re.search(
        r"\[launcher\] server 1 was declared dead by the scheduler \(stopped answering "
        r"heartbeats .*\): stopping it \(SIGKILL\)",
        text,
    ), text
    finals = _finals(text)
    assert len(finals) == 2 and finals[0] == finals[1], text


def test_a_hung_worker_is_let_go_stopped_and_the_job_returns_0(tmp_path):
    """With --elastic 2, worker 2 hangs (it stops itself): it is let go after the heartbeat
    timeout, the others finish, the launcher stops it and returns 0."""
    code = """
kv = hetps.kv.create("dist_sync")
kv.init("w", np.zeros(10, np.float32))
for r in range(10):
    if kv.rank == 2 and r == 3:
        print("STOPPING", os.getpid(), flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    kv.push("w", np.ones(10, np.float32))
    kv.pull("w")
print("DONE", kv.rank, flush=True)
"""
    launcher, out, _ = _launch(tmp_path, code, FAST, num_workers=3, num_servers=1, elastic_min=2)
    result: dict = {}
    runner = threading.Thread(target=lambda: result.setdefault("code", launcher.run()))
    runner.start()
    runner.join(90)
    try:
        assert not runner.is_alive(), "the launcher never ended: " + out.getvalue()
    finally:
        for c in launcher.children:
            if c.proc.poll() is None:
                c.proc.send_signal(signal.SIGCONT)
        launcher.stop_all(kill=True)
        runner.join(30)
    text = out.getvalue()
    assert result.get("code") == 0, text
    assert "DONE 0" in text and "DONE 1" in text and "DONE 2" not in text, text
    assert "[launcher] worker 2 was declared dead by the scheduler" in text, text
    (worker2,) = [c for c in launcher.children if c.role == "worker" and c.rank == 2]
    assert worker2.proc.returncode == -signal.SIGKILL, text


def _scheduler(la: Launcher):
    assert la._scheduler is not None
    return la._scheduler


#: the launcher takes a scheduler silent for a third of the timeout (2 s) for hung
SLOW = {**TEST_ENV, "PS_HEARTBEAT_INTERVAL": "0.5", "PS_HEARTBEAT_TIMEOUT": "6"}


def test_a_hung_scheduler_is_stopped_and_started_again(tmp_path):
    """The scheduler hangs mid-job (SIGSTOP): the launcher sees it fall silent, stops it
    and starts it again at its port (--recover), the nodes come back to it before their
    heartbeat timeout, and the job completes with the same model on both workers."""
    launcher, out, flags = _launch(
        tmp_path, ROUNDS, SLOW, num_workers=2, num_servers=1, max_restarts=1
    )
    code, text = _run_stopping(launcher, flags, _scheduler, workers=2)
    assert code == 0, text
    assert re.search(r"\[launcher\] scheduler hung: it said nothing to the launcher", text), text
    assert "starting it again at port" in text, text
    assert re.search(r"\[scheduler\].*started again, it took back 3 nodes", text), text
    assert "starting the job again" not in text, text
    finals = _finals(text)
    assert len(finals) == 2 and finals[0] == finals[1], text


def test_a_hung_scheduler_without_restarts_fails_the_job_naming_it(tmp_path):
    launcher, out, flags = _launch(tmp_path, ROUNDS, FAST, num_workers=2, num_servers=1)
    code, text = _run_stopping(launcher, flags, _scheduler, workers=2)
    assert code == 137, text
    assert re.search(r"\[launcher\] scheduler hung: .*\(code 137\); stopping the others", text), (
        text
    )


def test_sys_exit_3_in_a_worker_fails_the_job_with_code_3(cluster):
    """A worker's ``sys.exit(3)`` mid-job is a failure, not a finished worker: the launcher
    returns 3 and names that worker, and the other worker hears why."""
    code = """
kv = hetps.kv.create('dist_sync')
kv.init('w', np.zeros(10, np.float32))
for r in range(20):
    if kv.rank == 1 and r == 5:
        sys.exit(3)
    try:
        kv.push('w', np.ones(10, np.float32))
        kv.pull('w')
    except NodeFailure as exc:
        print(f'SURVIVOR {exc}', flush=True)
        os._exit(1)
"""
    rc, out = cluster(code, workers=2, servers=1, env={"PS_HEARTBEAT_TIMEOUT": "60"})
    assert rc == 3, out
    assert "[launcher] worker 1 exited (code 3); stopping the others" in out, out
    (line,) = [x for x in out.splitlines() if "SURVIVOR" in x]
    assert "worker rank 1" in line and "exited with code 3 (sys.exit)" in line, out


def test_the_launcher_names_the_crashed_worker_not_the_scheduler(cluster):
    """A plain exception in worker 1: the scheduler ends the job and exits 1 at once, while
    the worker takes its time to end (an exit hook). The launcher names the worker, whose
    death ended the job, and returns its code."""
    code = """
import atexit
atexit.register(time.sleep, 1.0)  # runs last: a slow end (big buffers freed, files flushed)
kv = hetps.kv.create('dist_sync')
kv.init('w', np.zeros(10, np.float32))
if kv.rank == 1:
    raise RuntimeError('boom in user code')
kv.push('w', np.ones(10, np.float32))
kv.pull('w')
"""
    rc, out = cluster(code, workers=2, servers=1, env={"PS_HEARTBEAT_TIMEOUT": "60"})
    assert rc == 1, out
    assert "[launcher] worker 1 exited (code 1); stopping the others" in out, out
    assert "[launcher] scheduler exited" not in out, out


EXITS = """
import atexit, sys
from hetps.kvstore import exits
exits.watch()
atexit.register(lambda: print("FAILING", exits.failing()))
how = sys.argv[1]
if how == "caught":
    try:
        sys.exit(4)
    except SystemExit as e:
        assert e.code == 4
elif how == "code":
    sys.exit(3)
elif how == "message":
    sys.exit("no data")
elif how == "builtin":
    exit(5)
elif how == "zero":
    sys.exit(0)
"""


def test_the_exit_hook_tells_a_failing_sys_exit_from_a_caught_or_clean_one(tmp_path):
    script = tmp_path / "exits.py"
    script.write_text(EXITS)
    want = {
        "caught": (0, "FAILING None"),
        "code": (3, "FAILING the script exited with code 3 (sys.exit)"),
        "message": (1, "FAILING the script exited with an error (sys.exit): no data"),
        "builtin": (5, "FAILING the script exited with code 5 (sys.exit)"),
        "zero": (0, "FAILING None"),
        "end": (0, "FAILING None"),
    }
    for how, (rc, line) in want.items():
        res = subprocess.run(
            [sys.executable, str(script), how], capture_output=True, text=True, timeout=60
        )
        assert (res.returncode, res.stdout.strip()) == (rc, line), (how, res.stdout, res.stderr)
