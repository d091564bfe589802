"""A scheduler killed with SIGKILL mid-job is started again at the same address (--recover):
the running nodes come back to it, a barrier that waited at the dead one is released by the
new one, and the job ends as an undisturbed run, with nothing else restarted."""

from __future__ import annotations

import io
import re
import signal
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from conftest import PRELUDE
from hetps.launch.contract import LaunchSpec
from hetps.launch.local import Launcher

# Every round: push, pull, and a barrier every third round. At round 4 worker 1 says it
# enters the barrier and waits in it at the scheduler; worker 0 says so too, then waits for
# the test to kill the scheduler before it comes to that barrier.
SCRIPT = """
import hashlib
flags, kill = os.environ["FLAGS"], os.environ["KILL"] == "1"
kv = hetps.kv.create("dist_sync")
kv.init("w", np.zeros(50, np.float32))
kv.set_optimizer(optim.SGD(learning_rate=0.1, momentum=0.9))
out = np.zeros(50, np.float32)
for r in range(10):
    rng = np.random.default_rng(100 * r + kv.rank)
    kv.push("w", rng.standard_normal(50).astype(np.float32))
    kv.pull("w", out=out)
    if r == 2 and kv.rank == int(os.environ.get("LEAVE", "-1")):
        os.kill(os.getpid(), signal.SIGKILL)   # (--elastic: let go, the job goes on)
    if r % 3 == 1:
        if kill and r == 4:
            open(os.path.join(flags, f"at-{kv.rank}"), "w").close()
            if kv.rank == 0:
                while not os.path.exists(os.path.join(flags, "killed")):
                    time.sleep(0.01)   # polls a file the test writes
        kv.barrier()
if os.environ.get("HOLD") == "1":  # the job stays up until the test lets it end
    while not os.path.exists(os.path.join(flags, "release")):
        time.sleep(0.01)   # polls a file the test writes
    kv.barrier()
print("FINAL", kv.rank, hashlib.sha256(out.tobytes()).hexdigest(), flush=True)
"""

ENV = {
    "PS_HEARTBEAT_INTERVAL": "0.5",
    "PS_HEARTBEAT_TIMEOUT": "8",
    "HETPS_CONNECT_TIMEOUT": "20",
    "HETPS_REQUEST_TIMEOUT": "60",
    "OMP_NUM_THREADS": "1",
}


def _launcher(tmp_path: Path, name: str, kill: bool, max_restarts: int, elastic: bool = False):
    """The job; with ``elastic`` a third worker (rank 2) dies at round 2 and is let go."""
    flags = tmp_path / name
    flags.mkdir()
    script = tmp_path / "sched_script.py"
    script.write_text(PRELUDE + textwrap.dedent(SCRIPT))
    out = io.StringIO()
    spec = LaunchSpec(
        num_workers=3 if elastic else 2,
        num_servers=1,
        command=[sys.executable, str(script)],
        env={**ENV, "FLAGS": str(flags), "KILL": "1" if kill else "0", "LEAVE": "2"},
        max_restarts=max_restarts,
        failure_grace=5.0,
        elastic_min=2 if elastic else 0,
    )
    return Launcher(spec, out=out), out, flags


def _finals(text: str) -> dict[int, str]:
    return {int(r): d for r, d in re.findall(r"FINAL (\d) (\w+)", text)}


def _run(tmp_path: Path, max_restarts: int, elastic: bool = False) -> tuple[int | None, str]:
    launcher, out, flags = _launcher(tmp_path, "killed", True, max_restarts, elastic)
    result: dict = {}
    runner = threading.Thread(target=lambda: result.setdefault("code", launcher.run()))
    runner.start()
    try:
        deadline = time.monotonic() + 90
        while not ((flags / "at-0").exists() and (flags / "at-1").exists()):
            assert runner.is_alive(), out.getvalue()
            assert time.monotonic() < deadline, out.getvalue()
            time.sleep(0.02)  # polls files the job writes
        sched = launcher._scheduler
        assert sched is not None
        sched.proc.send_signal(signal.SIGKILL)
        sched.proc.wait(10)
        (flags / "killed").touch()
        runner.join(120)
        assert not runner.is_alive(), "the job hung: " + out.getvalue()
    finally:
        launcher.stop_all(kill=True)
        runner.join(30)
    return result.get("code"), out.getvalue()


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory) -> dict[int, str]:
    tmp = tmp_path_factory.mktemp("sched-undisturbed")
    launcher, out, _ = _launcher(tmp, "ref", kill=False, max_restarts=0)
    try:
        code = launcher.run()
    finally:
        launcher.stop_all(kill=True)
    assert code == 0, out.getvalue()
    return _finals(out.getvalue())


def test_a_killed_scheduler_is_started_again_and_the_job_goes_on(tmp_path, undisturbed):
    code, out = _run(tmp_path, max_restarts=1)
    assert code == 0, out
    assert "starting it again at port" in out, out
    assert re.search(r"\[scheduler\].*started again, it took back 3 nodes", out), out
    assert re.search(r"\[worker 1\].*the scheduler was started again and took this node", out)
    assert "starting the job again" not in out, out
    assert _finals(out) == undisturbed, out


def test_without_restarts_a_killed_scheduler_ends_the_job(tmp_path):
    code, out = _run(tmp_path, max_restarts=0)
    assert code == 137, out
    assert "starting it again" not in out and "FINAL" not in out, out


def test_a_scheduler_started_again_ends_a_job_that_let_a_worker_go(tmp_path):
    """--elastic: worker 2 died and was let go before the scheduler was killed. The one
    started again knows it was let go: the job ends when the two others finish (it waited
    for worker 2 for ever), with their values those of the same job left undisturbed."""
    launcher, out, _ = _launcher(tmp_path, "ref", kill=False, max_restarts=0, elastic=True)
    try:
        assert launcher.run() == 0, out.getvalue()
    finally:
        launcher.stop_all(kill=True)
    ref = _finals(out.getvalue())
    assert sorted(ref) == [0, 1] and len(set(ref.values())) == 1, out.getvalue()
    code, text = _run(tmp_path, max_restarts=1, elastic=True)
    assert code == 0, text
    assert re.search(r"\[scheduler\].*started again, it took back 3 nodes", text), text
    assert _finals(text) == ref, text
