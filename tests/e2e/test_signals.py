"""The launcher's signals: SIGHUP (its terminal or ssh session closed) stops a `hetps train`
job as SIGTERM does, with a checkpoint after the round; a worker started again that had not
joined yet, stopped at the job's end, says no checkpoint wish."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

DATA = Path("/usr/share/datasets/fashion-mnist")
SMALL = ["--train-limit", "2400", "--test-limit", "500", "-b", "32", "-e", "5"]


def _iters(log: Path) -> list[int]:
    return [json.loads(line)["iter"] for line in log.read_text().splitlines()]


def _hup_when(cmd: list[str], ready, seconds: float, what: str) -> tuple[int, str]:
    """Start ``cmd`` in a session of its own, send it SIGHUP once ``ready()`` holds (within
    ``seconds``, else fail saying ``what``): its exit code and output. Killed whatever happens."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"),
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + seconds
        while not ready():
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, what
            time.sleep(0.02)  # polls a file the job writes
        proc.send_signal(signal.SIGHUP)
        out = proc.communicate(timeout=60)[0]
        return proc.returncode, out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.slow  # (about 20 s: the launcher's part is in the default run, below)
@pytest.mark.skipif(not DATA.exists(), reason="Fashion-MNIST not installed")
def test_sighup_to_the_launcher_checkpoints_after_the_round_and_stops(tmp_path):
    """SIGHUP to `hetps train --workers 2 --checkpoint-dir D`: the workers get SIGTERM first,
    agree to stop after the round and checkpoint it; run.json records the end, and the
    launcher returns 129 (128 + SIGHUP)."""
    ck = tmp_path / "ck"
    cmd = [sys.executable, "-m", "hetps.cli", "train", "-ld", str(tmp_path), *SMALL]
    cmd += ["--progress", "lines", "--workers", "2", "-m", "sync", "-n", "mlp"]
    cmd += ["--max-rounds", "100000", "--slowdown", "10,10", "--checkpoint-dir", str(ck)]
    cmd += ["--run-name", "hup"]
    log0 = tmp_path / "hup" / "worker-0.jsonl"
    code, out = _hup_when(
        cmd, lambda: log0.exists() and len(_iters(log0)) >= 3, 120, "no three rounds within 120 s"
    )
    assert code == 129, out
    assert "[launcher] SIGHUP: stopping every process (the workers first)" in out, out
    assert "SIGTERM: checkpoint after this round" in out, out
    last = _iters(log0)[-1]
    assert _iters(tmp_path / "hup" / "worker-1.jsonl")[-1] == last
    assert (ck / "latest").read_text() == f"ckpt-{last:08d}", out
    ended = json.loads((tmp_path / "hup" / "run.json").read_text())["ended"]
    assert ended["status"] == "completed", ended


# A worker that stops after its round when it gets SIGTERM, as `hetps train`'s do
ROUNDS = """
import os, signal, sys, time
import numpy as np
import hetps.kv
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
kv = hetps.kv.create("dist_sync")
kv.init("w", np.zeros(4, np.float32))
open(os.path.join(sys.argv[1], f"up{kv.rank}"), "w").close()
r = 0
while not stop:
    kv.push("w", np.ones(4, np.float32))
    kv.pull("w")
    r += 1
    time.sleep(0.01)   # a round's compute
print(f"worker {kv.rank}: SIGTERM: stopped after round {r}", flush=True)
"""


def test_sighup_to_hetps_launch_gives_the_workers_sigterm_first_and_returns_129(tmp_path):
    script = tmp_path / "rounds.py"
    script.write_text(textwrap.dedent(ROUNDS))
    cmd = [sys.executable, "-m", "hetps.cli", "launch", "-n", "1", "-s", "1", "--"]
    cmd += [sys.executable, str(script), str(tmp_path)]
    code, out = _hup_when(cmd, (tmp_path / "up0").exists, 60, "the worker never started")
    assert code == 129, out
    assert "[launcher] SIGHUP: stopping every process (the workers first)" in out, out
    assert "[worker 0] worker 0: SIGTERM: stopped after round" in out, out


# A worker's checkpointing as `hetps train` sets it up: first in a worker past its last
# round, then in one started again that has not joined the running job yet
# (kv.rejoining); the launcher's SIGTERM at the job's end to each.
LATE = """
import os, signal, types
from hetps.app.checkpointing import TrainCheckpoints
args = types.SimpleNamespace(checkpoint_dir="ck", checkpoint_every=None, checkpoint_seconds=None)
done = TrainCheckpoints(args, types.SimpleNamespace(rejoining=False, live_rank=0), 1)
done.over = True
os.kill(os.getpid(), signal.SIGTERM)
print("PAST ITS LAST ROUND, STILL HERE", done.term, flush=True)
kv = types.SimpleNamespace(rejoining=True, live_rank=-1)
TrainCheckpoints(args, kv, 2)
os.kill(os.getpid(), signal.SIGTERM)
print("NOT JOINED, STILL HERE", flush=True)
"""


def test_sigterm_after_the_last_round_or_before_joining_asks_for_no_checkpoint(tmp_path):
    """Neither says "checkpoint after this round": the first ends as it would have, the
    second, which has no round of its own, stops at once (143)."""
    script = tmp_path / "late.py"
    script.write_text(textwrap.dedent(LATE))
    res = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    out = res.stdout
    assert res.returncode == 143, out + res.stderr
    assert "worker 1: SIGTERM after its last round: it ends" in out, out
    assert "PAST ITS LAST ROUND, STILL HERE False" in out, out
    assert "worker 2: SIGTERM before it joined the running job: it stops" in out, out
    assert "NOT JOINED, STILL HERE" not in out, out
    assert "checkpoint after this round" not in out, out
