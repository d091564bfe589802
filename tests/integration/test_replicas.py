"""Replicated servers (HETPS_REPLICAS): a server killed with SIGKILL mid-round is taken over by
the next one, the job goes on with nothing restarted, and every value ends as in a run where
nothing died."""

from __future__ import annotations

import io
import json
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from conftest import PRELUDE, TEST_ENV
from hetps.launch.contract import LaunchSpec
from hetps.launch.local import Launcher

# Two keys: a small one (batched with the other small requests) and a big one, cut into a
# part per server (MXNET_KVSTORE_BIGARRAY_BOUND) and each part into 10 chunks
# (HETPS_CHUNK_BYTES). SGD with momentum: the optimizer state must be on the copy too.
# At round KILL_AT worker 0 pushes, says so, and waits until the test killed server 0;
# worker 1 pushes that round only after the kill, so the server dies with worker 0's push
# merged in a round it never finished: the push must go again to the server taking over.
SCRIPT = """
import hashlib, json
rounds, kill_at = int(os.environ["ROUNDS"]), int(os.environ["KILL_AT"])
flags = os.environ["FLAGS"]
kv = hetps.kv.create("dist_sync")
keys = ["small", "big"]
kv.init(keys, [np.zeros(7, np.float32), np.linspace(-1, 1, 20000, dtype=np.float32)])
kv.set_optimizer(optim.SGD(learning_rate=0.05, momentum=0.9))
outs = [np.zeros(7, np.float32), np.zeros(20000, np.float32)]
# the values the servers must hold after each round (every round applied once), computed
# here with the same optimizer: a copy lost or applied twice fails the round it shows in
ref_opt = optim.SGD(learning_rate=0.05, momentum=0.9)
ref = [np.zeros(7, np.float32), np.linspace(-1, 1, 20000, dtype=np.float32)]
ref_states = [ref_opt.create_state(k, v) for k, v in zip(keys, ref)]

def check(r):
    draws = [np.random.default_rng(1000 * r + w) for w in range(kv.num_workers)]
    pushed = [[d.standard_normal(7).astype(np.float32),
               d.standard_normal(20000).astype(np.float32)] for d in draws]
    for i, k in enumerate(keys):
        ref_opt.update(k, ref[i], sum(p[i] for p in pushed), ref_states[i])
        if not np.array_equal(outs[i], ref[i]):
            raise SystemExit(
                f"WRONG VALUE: worker {kv.rank}, round {r}, key {k!r}: the servers' value "
                f"is off by up to {np.abs(outs[i] - ref[i]).max():.3g} from every round "
                "applied once (a copy lost or applied twice?)")

def wait_for(name):
    while not os.path.exists(os.path.join(flags, name)):
        time.sleep(0.01)   # polls a file the test writes

for r in range(rounds):
    if r == kill_at and kv.rank == 1:
        wait_for("killed")
    rng = np.random.default_rng(1000 * r + kv.rank)
    kv.push(keys, [rng.standard_normal(7).astype(np.float32),
                   rng.standard_normal(20000).astype(np.float32)])
    if r == kill_at and kv.rank == 0:
        open(os.path.join(flags, "pushed"), "w").close()
        wait_for("killed")
    kv.pull(keys, out=outs)
    check(r)
digest = hashlib.sha256(b"".join(o.tobytes() for o in outs)).hexdigest()
print(f"FINAL {kv.rank} {digest}", flush=True)
if kv.rank == 0:  # the servers' optimizer states (momentum), as save_optimizer_states has them
    path = os.path.join(flags, "states.bin")
    kv.save_optimizer_states(path)
    h = hashlib.sha256()

    def feed(x):
        if isinstance(x, np.ndarray):
            h.update(np.ascontiguousarray(x).tobytes())
        elif isinstance(x, (dict, list, tuple)):
            for k in (sorted(x, key=repr) if isinstance(x, dict) else range(len(x))):
                h.update(repr(k).encode())
                feed(x[k])
        else:
            h.update(repr(x).encode())

    with open(path, "rb") as f:
        feed(optim.load_states(f.read()))
    print(f"FINAL 9 {h.hexdigest()}", flush=True)
"""

ENV = {
    **TEST_ENV,
    "MXNET_KVSTORE_BIGARRAY_BOUND": "1000",
    "HETPS_CHUNK_BYTES": "4096",
    "ROUNDS": "12",
}


def _job(tmp_path: Path, name: str, replicas: int, kill_at: int, max_restarts: int = 0, servers=2):
    flags = tmp_path / name
    flags.mkdir()
    script = tmp_path / "replicas_script.py"
    script.write_text(PRELUDE + textwrap.dedent(SCRIPT))
    out = io.StringIO()
    spec = LaunchSpec(
        num_workers=2,
        num_servers=servers,
        command=[sys.executable, str(script)],
        env={**ENV, "KILL_AT": str(kill_at), "FLAGS": str(flags)},
        start_timeout=30.0,
        failure_grace=5.0,
        replicas=replicas,
        max_restarts=max_restarts,
    )
    return Launcher(spec, out=out), out, flags


def _finals(out: str) -> dict[int, str]:
    """Each worker's digest of its values (and as "9", the servers' optimizer states)."""
    return {int(r): d for r, d in re.findall(r"FINAL (\d) (\w+)", out)}


def _kill(launcher: Launcher, rank: int) -> None:
    """SIGKILL the running server ``rank`` and reap it."""
    child = next(
        c
        for c in launcher.children
        if c.role == "server" and c.rank == rank and c.proc.poll() is None
    )
    child.proc.send_signal(signal.SIGKILL)
    child.proc.wait(10)


def _wait_output(out: io.StringIO, pattern: str, runner: threading.Thread) -> None:
    deadline = time.monotonic() + 60
    while not re.search(pattern, out.getvalue()):
        assert runner.is_alive(), out.getvalue()
        assert time.monotonic() < deadline, f"no {pattern!r} in: " + out.getvalue()
        time.sleep(0.02)  # polls the job's output


def _run_killing(
    tmp_path: Path,
    name: str,
    victims: list[int],
    max_restarts: int = 0,
    then=None,
    at: int = 5,
    servers: int = 2,
):
    """Run the job; when worker 0 has pushed round ``at``, SIGKILL the servers ``victims``
    (each reaped before the next), call ``then(launcher, out, runner)`` if given, and let the
    workers go on. Returns (code, output)."""
    launcher, out, flags = _job(tmp_path, name, 2, at, max_restarts, servers)
    result: dict = {}
    runner = threading.Thread(target=lambda: result.setdefault("code", launcher.run()))
    runner.start()
    try:
        deadline = time.monotonic() + 90
        while not (flags / "pushed").exists():
            assert runner.is_alive(), out.getvalue()
            assert time.monotonic() < deadline, "worker 0 never reached the round: " + (
                out.getvalue()
            )
            time.sleep(0.02)  # polls a file the job writes
        for rank in victims:
            _kill(launcher, rank)
        if then is not None:
            then(launcher, out, runner)
        (flags / "killed").touch()
        runner.join(120)
        assert not runner.is_alive(), "the job hung after the kill: " + out.getvalue()
    finally:
        launcher.stop_all(kill=True)
        runner.join(30)
    return result.get("code"), out.getvalue()


def _undisturbed(tmp_path_factory, servers: int) -> dict[int, str]:
    tmp = tmp_path_factory.mktemp(f"undisturbed{servers}")
    launcher, out, _ = _job(tmp, "ref", replicas=1, kill_at=-1, servers=servers)
    try:
        code = launcher.run()
    finally:
        launcher.stop_all(kill=True)
    assert code == 0, out.getvalue()
    finals = _finals(out.getvalue())
    assert len(finals) == 3 and finals[0] == finals[1], out.getvalue()
    return finals


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory) -> dict[int, str]:
    """What each worker ends with, and the servers' optimizer states, when nothing dies
    (2 servers, no copies)."""
    return _undisturbed(tmp_path_factory, 2)


def test_three_servers_a_rejoin_leaves_no_stale_copy_in_what_is_read_back(tmp_path_factory):
    """3 servers, 2 copies: server 2 dies and server 0 takes over its keys; server 1's copies
    move to server 0, then back to server 2 when it rejoins. Server 0 still holds the old
    copies of server 1's keys: the optimizer states read back (save_optimizer_states) must be
    server 1's own, each server asked once, and the values as if nothing died."""
    reference = _undisturbed(tmp_path_factory, 3)

    def then(launcher, out, runner):
        _wait_output(out, r"\[server 1\].*server rank 2 .* holds a copy of each of the", runner)

    tmp = tmp_path_factory.mktemp("three")
    code, out = _run_killing(tmp, "three", victims=[2], max_restarts=1, then=then, servers=3)
    assert code == 0, out
    assert "server rank 0 (node 8" in out and "takes over its keys" in out, out
    assert _finals(out) == reference, out


def test_a_killed_server_is_taken_over_and_values_equal_an_undisturbed_run(tmp_path, undisturbed):
    code, out = _run_killing(tmp_path, "one", victims=[0])
    assert code == 0, out
    assert "server 0 was killed by signal 9" in out, out
    assert "server rank 1 (node 10" in out and "takes over its keys" in out, out
    assert re.search(r"\[worker 0\].*unanswered requests went again", out), out
    assert "restart" not in out, out
    assert _finals(out) == undisturbed, out


def test_losing_every_copy_fails_the_job_with_the_cause(tmp_path):
    """Two copies, both servers killed: nothing can take over the second; every process
    ends, non-zero, and the workers say which server died."""
    code, out = _run_killing(tmp_path, "both", victims=[0, 1])
    assert code not in (0, None), out
    assert "takes over its keys" in out, out
    assert re.search(r"\[worker \d\].*server rank 1 .*the job cannot continue", out), out
    assert "FINAL" not in out, out


def test_a_restarted_server_rejoins_as_a_replica_and_takes_over_in_turn(tmp_path, undisturbed):
    """--max-restarts 1: server 0 is killed, server 1 takes over its keys, and the launcher
    starts server 0 again. It is admitted with its old rank (is_recovery=1) and server 1 sends
    it a copy of everything it serves. Then server 1 is killed too: server 0 takes over every
    key, and the values still end as in the undisturbed run."""

    def then(launcher, out, runner):
        _wait_output(out, r"\[server 1\].*server rank 0 .* holds a copy of each of the", runner)
        _kill(launcher, 1)

    code, out = _run_killing(tmp_path, "rejoin", victims=[0], max_restarts=1, then=then)
    assert code == 0, out
    assert "restart 1 of 1: starting server 0 again" in out, out
    assert re.search(r"\[scheduler\].*role=server.*is_recovery=1", out), out
    assert re.search(r"server rank 1 .*was killed by signal 9.*server rank 0 .*takes over", out), (
        out
    )
    assert _finals(out) == undisturbed, out


def test_a_server_started_again_after_the_job_ended_does_not_fail_it(tmp_path, undisturbed):
    """Server 1 dies in the last round with --max-restarts 1: its copy takes over, the job
    ends before the server started again could join, and that server is stopped: exit 0."""
    code, out = _run_killing(tmp_path, "late", victims=[1], max_restarts=1, at=11)
    assert code == 0, out
    assert "starting server 1 again" in out, out
    assert _finals(out) == undisturbed, out


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["-n", "1", "-s", "1", "--replicas", "2"], "--replicas 2 must be between 1 and"),
        (["-n", "1", "-s", "2", "--replicas", "2", "--launcher", "ray"], "--replicas works"),
    ],
)
def test_replicas_that_cannot_work_are_one_line(args, says):
    res = subprocess.run(
        [sys.executable, "-m", "hetps.cli", "launch", *args, "--", sys.executable, "-c", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode != 0 and says in res.stderr, res.stderr
    assert "Traceback" not in res.stderr, res.stderr


def test_dist_async_with_replicas_fails_at_create(cluster):
    code = """
try:
    hetps.kv.create('dist_async')
except Exception as exc:
    print('REFUSED', type(exc).__name__, exc, flush=True)
    sys.exit(4)
"""
    rc, out = cluster(code, workers=1, servers=2, env={"HETPS_REPLICAS": "2"})
    assert rc != 0, out
    assert "REFUSED ConfigError dist_async with HETPS_REPLICAS=2" in out, out
    assert "[server 0]" in out and "exited with an error: dist_async with" in out, out


def test_replica_cost_benchmark_runs_both_settings(tmp_path):
    """benchmarks/replica_cost.py at a tiny size: both settings run and every size gets a
    ratio in the JSON. No timing is asserted."""
    out = tmp_path / "cost.json"
    root = Path(__file__).resolve().parents[2]
    res = subprocess.run(
        [
            sys.executable,
            str(root / "benchmarks" / "replica_cost.py"),
            "--repeats",
            "1",
            "--rounds",
            "2",
            "--json",
            str(out),
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads(out.read_text())
    assert [r["size"] for r in data["rows"]] == ["4KiB", "1MiB", "16MiB"]
    assert all(r["none_s"] > 0 and r["replicas2_s"] > 0 for r in data["rows"])


def test_a_server_dead_before_the_start_completed_restarts_the_job(tmp_path):
    """Before every node registered there is nothing to take over: a server that dies then
    fails the start, and --max-restarts starts the whole job again (not that server alone)."""
    script = tmp_path / "w.py"
    script.write_text(
        PRELUDE
        + textwrap.dedent("""
        kv = hetps.kv.create("dist_sync")
        kv.init("a", np.zeros(3, np.float32))
        kv.push("a", np.ones(3, np.float32))
        print("VALUE", kv.pull("a").tolist(), flush=True)
        """)
    )
    starts = []

    def wrap(role, rank, argv, env):
        if role == "server" and rank == 1:
            starts.append(argv)
            if len(starts) == 1:  # its first start dies at once, before registering
                return [sys.executable, "-c", "import sys; sys.exit(3)"], env
        return argv, env

    out = io.StringIO()
    spec = LaunchSpec(
        num_workers=2,
        num_servers=2,
        command=[sys.executable, str(script)],
        env={k: v for k, v in ENV.items() if k.startswith(("PS_", "HETPS_", "OMP"))},
        replicas=2,
        max_restarts=1,
        wrap=wrap,
    )
    launcher = Launcher(spec, out=out)
    try:
        code = launcher.run()
    finally:
        launcher.stop_all(kill=True)
    text = out.getvalue()
    assert code == 0, text
    assert "restart 1 of 1: starting the job again" in text, text
    assert "starting server 1 again" not in text and "job goes on" not in text, text
    assert text.count("VALUE [2.0, 2.0, 2.0]") == 2, text
