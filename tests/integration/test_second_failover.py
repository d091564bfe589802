"""Replicated servers through several failures, each after the one before was repaired: with
3 servers, 2 copies and restarts, server 1 is killed, comes back as a replica, then server 0
is killed (server 1, back, takes its keys over), comes back, then server 2 is killed. Every
key must keep a working copy through it all: every worker checks, after every round, each
key's value read alone and read in one batch against every round applied once, and at the
end a checkpoint's values and the servers' optimizer states against the same reference."""

from __future__ import annotations

import io
import re
import signal
import sys
import textwrap
import threading
import time
from pathlib import Path

from conftest import PRELUDE, TEST_ENV
from hetps.launch.contract import LaunchSpec
from hetps.launch.local import Launcher

# 12 keys of a few elements, SGD with momentum on the servers. Each round pushes and pulls
# one key per call (a request of its own), then reads every key in one batch. At each gate
# round worker 0 pushes its round, says so and waits; worker 1 pushes only once the test let
# it, so each kill lands with a round half merged.
SCRIPT = """
from hetps.kvstore import checkpoint
rounds, flags = int(os.environ["ROUNDS"]), os.environ["FLAGS"]
gates = [int(g) for g in os.environ["GATES"].split(",")]
kv = hetps.kv.create("dist_sync")
keys = [f"k{i}" for i in range(12)]
sizes = [3 + i for i in range(12)]
kv.init(keys, [np.zeros(s, np.float32) for s in sizes])
kv.set_optimizer(optim.SGD(learning_rate=0.05, momentum=0.9))
ref_opt = optim.SGD(learning_rate=0.05, momentum=0.9)
ref = [np.zeros(s, np.float32) for s in sizes]
ref_states = [ref_opt.create_state(k, v) for k, v in zip(keys, ref)]

def wait_for(name):
    while not os.path.exists(os.path.join(flags, name)):
        time.sleep(0.01)   # polls a file the test writes

def same(what, r, got):
    for k, g, want in zip(keys, got, ref):
        if not np.array_equal(g, want):
            raise SystemExit(
                f"WRONG VALUE: worker {kv.rank}, round {r}, key {k!r} read {what}: off by up "
                f"to {np.abs(g - want).max():.3g} from every round applied once")

for r in range(rounds):
    if r in gates and kv.rank == 1:
        wait_for(f"go{r}")
    rng = np.random.default_rng(1000 * r + kv.rank)
    mine = [rng.standard_normal(s).astype(np.float32) for s in sizes]
    alone = [np.zeros(s, np.float32) for s in sizes]
    if r in gates and kv.rank == 0:
        kv.push(keys, mine)
        open(os.path.join(flags, f"pushed{r}"), "w").close()
        wait_for(f"go{r}")
        kv.pull(keys, out=alone)
    else:
        for k, v, o in zip(keys, mine, alone):
            kv.pushpull(k, v, out=o)
    batched = [np.zeros(s, np.float32) for s in sizes]
    kv.pull(keys, out=batched)
    draws = [np.random.default_rng(1000 * r + w) for w in range(kv.num_workers)]
    pushed = [[d.standard_normal(s).astype(np.float32) for s in sizes] for d in draws]
    for i, k in enumerate(keys):
        ref_opt.update(k, ref[i], sum(p[i] for p in pushed), ref_states[i])
    same("with its push", r, alone)
    same("in one batch", r, batched)
checkpoint.save(kv, os.path.join(flags, "ck"), rounds)
if kv.rank == 0:
    saved = checkpoint.latest(os.path.join(flags, "ck")).values()
    same("from the checkpoint's values", rounds, [saved[k] for k in keys])
    kv.save_optimizer_states(os.path.join(flags, "states.bin"))
    with open(os.path.join(flags, "states.bin"), "rb") as f:
        states = optim.load_states(f.read())
    for k, want in zip(keys, ref_states):
        got = states[(k, 0)]
        if not np.array_equal(got["mom"], want["mom"]):
            raise SystemExit(f"WRONG STATE: key {k!r}: the servers' momentum is off")
print(f"ALL EQUAL {kv.rank}", flush=True)
"""

GATES = (3, 6, 9)  # server 1 is killed at the first, server 0 at the second, server 2 last


def _kill(launcher: Launcher, rank: int) -> None:
    child = next(
        c
        for c in launcher.children
        if c.role == "server" and c.rank == rank and c.proc.poll() is None
    )
    child.proc.send_signal(signal.SIGKILL)
    child.proc.wait(10)


def _wait(out: io.StringIO, pattern: str, runner: threading.Thread, since: int = 0) -> int:
    """Wait for ``pattern`` in the output after offset ``since``; returns the offset after it."""
    deadline = time.monotonic() + 60
    while True:
        found = re.search(pattern, out.getvalue()[since:])
        if found:
            return since + found.end()
        assert runner.is_alive(), out.getvalue()
        assert time.monotonic() < deadline, f"no {pattern!r} in: " + out.getvalue()[since:]
        time.sleep(0.02)  # polls the job's output


def test_every_key_keeps_a_copy_through_three_failures_with_restarts(tmp_path: Path) -> None:
    flags = tmp_path / "flags"
    flags.mkdir()
    script = tmp_path / "job.py"
    script.write_text(PRELUDE + textwrap.dedent(SCRIPT))
    out = io.StringIO()
    spec = LaunchSpec(
        num_workers=2,
        num_servers=3,
        command=[sys.executable, str(script)],
        env={
            **TEST_ENV,
            "ROUNDS": "12",
            # (a request sent to a server that never answers it fails within seconds)
            "HETPS_REQUEST_TIMEOUT": "15",
            "FLAGS": str(flags),
            "GATES": ",".join(map(str, GATES)),
        },
        start_timeout=30.0,
        failure_grace=5.0,
        replicas=2,
        max_restarts=3,
    )
    launcher = Launcher(spec, out=out)
    result: dict = {}
    runner = threading.Thread(target=lambda: result.setdefault("code", launcher.run()))
    runner.start()
    try:
        # (the server whose copies a server started again needs, and who sends them)
        for gate, victim, sender in zip(GATES, (1, 0, 2), (0, 2, None), strict=True):
            while not (flags / f"pushed{gate}").exists():
                assert runner.is_alive(), out.getvalue()
                time.sleep(0.02)  # polls a file the job writes
            at = len(out.getvalue())
            _kill(launcher, victim)
            if sender is not None:
                back = _wait(out, rf"server rank {victim} .*is back \(is_recovery=1\)", runner, at)
                _wait(
                    out,
                    rf"\[server {sender}\].*server rank {victim} .* holds a copy of each of",
                    runner,
                    back,
                )
            (flags / f"go{gate}").touch()
        runner.join(120)
        assert not runner.is_alive(), "the job hung: " + out.getvalue()
    finally:
        launcher.stop_all(kill=True)
        runner.join(30)
    text = out.getvalue()
    assert result.get("code") == 0, text
    assert "ALL EQUAL 0" in text and "ALL EQUAL 1" in text, text
    assert "starting the job again" not in text, text  # each death was taken over live
    assert "served here, not a copy" not in text and "did not take a copy" not in text, text
    # the second failover went to the server started again, the third to server 0, back too
    assert re.search(r"server rank 0 .*killed.*server rank 1 \(node 10.*takes over", text), text
    assert re.search(r"server rank 2 .*killed.*server rank 0 \(node 8.*takes over", text), text


# A broken replica: server 1 takes rounds and inits, but refuses every whole-slice copy
BROKEN_REPLICA = """
import sys
from hetps.faults import replicas
from hetps.kvstore.slices import BadRequest

def refuse(self, msg):
    raise BadRequest("this replica refuses every slice copy (broken on purpose)")

replicas.Replication._sync_copy = refuse
from hetps.cli import main
sys.exit(main(["server"]))
"""

LOUD = """
flags = os.environ["FLAGS"]
kv = hetps.kv.create("dist_sync")
keys = ["a", "b", "c", "d"]
kv.init(keys, [np.zeros(4, np.float32)] * 4)
kv.set_optimizer(optim.SGD(learning_rate=0.1))
for r in range(40):
    if r == 3:
        if kv.rank == 0:
            open(os.path.join(flags, "at3"), "w").close()
        while not os.path.exists(os.path.join(flags, "go")):
            time.sleep(0.01)   # polls a file the test writes
    kv.push(keys, [np.ones(4, np.float32)] * 4)
    kv.pull(keys, out=[np.zeros(4, np.float32) for _ in keys])
print(f"DONE {kv.rank}", flush=True)
"""


def test_a_copy_refused_by_a_live_replica_fails_the_job_naming_the_key_and_servers(tmp_path):
    """Server 2 dies, server 0 takes its keys and sends its replica, server 1, all it serves;
    server 1 refuses the copies. Those keys have one copy left: the workers' next requests of
    them are refused with the key and both servers named, and the job fails instead of going
    on (or waiting) with keys a second death would lose."""
    flags = tmp_path / "flags"
    flags.mkdir()
    script = tmp_path / "job.py"
    script.write_text(PRELUDE + textwrap.dedent(LOUD))

    def wrap(role, rank, argv, env):
        if role == "server" and rank == 1:
            return [sys.executable, "-c", BROKEN_REPLICA], env
        return argv, env

    out = io.StringIO()
    spec = LaunchSpec(
        num_workers=2,
        num_servers=3,
        command=[sys.executable, str(script)],
        env={**TEST_ENV, "FLAGS": str(flags)},
        start_timeout=30.0,
        failure_grace=5.0,
        replicas=2,
        wrap=wrap,
    )
    launcher = Launcher(spec, out=out)
    result: dict = {}
    runner = threading.Thread(target=lambda: result.setdefault("code", launcher.run()))
    runner.start()
    try:
        while not (flags / "at3").exists():
            assert runner.is_alive(), out.getvalue()
            time.sleep(0.02)  # polls a file the job writes
        at = len(out.getvalue())
        _kill(launcher, 2)
        _wait(out, r"server rank 0 .*takes over its keys", runner, at)
        (flags / "go").touch()
        runner.join(60)
        assert not runner.is_alive(), "the job hung: " + out.getvalue()
    finally:
        launcher.stop_all(kill=True)
        runner.join(30)
    text = out.getvalue()
    assert result.get("code") not in (0, None), text
    assert "DONE" not in text, text
    said = re.search(
        r"\[worker \d\].*key '(\w)' part 0 has no working copy: server rank 0 \(node 8.* serves "
        r"it and server rank 1 \(node 10.*, its replica, refused the copy",
        text,
    )
    assert said is not None, text
