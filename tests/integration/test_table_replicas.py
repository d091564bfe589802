"""Embedding tables with copies (HETPS_REPLICAS=2): a server killed with SIGKILL mid-round is
taken over by the next one, and every row (and through the later rounds, the lazy optimizer
state of every row) ends bit for bit as in a run with no copies where nothing died. The
orders a failover makes possible, message by message, are in
tests/unit/test_table_replica_rounds.py."""

from __future__ import annotations

import io
import re
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from test_replicas import _kill, _wait_output

from conftest import PRELUDE, TEST_ENV
from hetps.launch.contract import LaunchSpec
from hetps.launch.local import Launcher

# Two tables: 'emb' (fixed, 40 rows, the servers' SGD with momentum) and 'hashed' (it grows:
# rows are made on first push, its own Adam). Every round each worker pushes rows of both,
# with ids repeated in a push (summed first) and rows made for the first time after the kill.
# At round KILL_AT worker 0 pushes, says so, and waits until the test killed server 0; worker
# 1 pushes that round only after the kill, so the server dies with worker 0's push in a round
# it never finished: the push goes again to the server taking over.
SCRIPT = """
import hashlib
from hetps.tables.rowsparse import Table
rounds, kill_at = int(os.environ["ROUNDS"]), int(os.environ["KILL_AT"])
flags = os.environ["FLAGS"]
kv = hetps.kv.create("dist_sync")
kv.set_optimizer(optim.SGD(learning_rate=0.1, momentum=0.9))
kv.init("emb", Table(40, 4, scale=0.5, seed=1))
kv.init("hashed", Table(None, 3, scale=0.5, seed=2, server_bytes=1 << 20,
                        optimizer=optim.Adam(learning_rate=0.05)))
pool = np.array([3, 17, 99991, 123456789, 1 << 33, 1 << 40, 5, 8], np.int64)

def wait_for(name):
    while not os.path.exists(os.path.join(flags, name)):
        time.sleep(0.01)   # polls a file the test writes

def digest(*arrays):
    return hashlib.sha256(b"".join(a.tobytes() for a in arrays)).hexdigest()[:16]

for r in range(rounds):
    if r == kill_at and kv.rank == 1:
        wait_for("killed")
    rng = np.random.default_rng(1000 * r + kv.rank)
    ids = rng.integers(0, 40, 10)
    ids[1] = ids[0]                                   # an id twice in one push
    kv.push("emb", (ids, rng.standard_normal((10, 4)).astype(np.float32)))
    hid = pool[: 3 + r // 2][rng.integers(0, 3 + r // 2, 4)]   # more ids in later rounds
    kv.push("hashed", (hid, rng.standard_normal((4, 3)).astype(np.float32)))
    if r == kill_at and kv.rank == 0:
        open(os.path.join(flags, "pushed"), "w").close()
        wait_for("killed")
    emb = kv.row_sparse_pull("emb", row_ids=np.arange(40)).data
    hashed = kv.row_sparse_pull("hashed", row_ids=pool).data
    print(f"ROUND {kv.rank} {r} {digest(emb, hashed)}", flush=True)
print(f"FINAL {kv.rank} {digest(emb, hashed)}", flush=True)
"""

ENV = {**TEST_ENV, "ROUNDS": "8"}


def _job(tmp_path: Path, name: str, replicas: int, kill_at: int, max_restarts: int = 0, servers=2):
    flags = tmp_path / name
    flags.mkdir()
    script = tmp_path / "table_replicas_script.py"
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


def _rounds(out: str) -> list[tuple[str, str, str]]:
    """Every worker's digest of both tables after each round, and at the end."""
    return sorted(re.findall(r"(ROUND \d \d+|FINAL \d) (\w+)", out))


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory) -> list:
    tmp = tmp_path_factory.mktemp("tables_undisturbed")
    launcher, out, _ = _job(tmp, "ref", replicas=1, kill_at=-1)
    try:
        code = launcher.run()
    finally:
        launcher.stop_all(kill=True)
    assert code == 0, out.getvalue()
    got = _rounds(out.getvalue())
    assert len(got) == 2 * 8 + 2, out.getvalue()
    return got


def _run_killing(
    tmp_path: Path, name: str, max_restarts: int = 0, then=None, servers: int = 2, victim=0
):
    """Run with 2 copies; when worker 0 has pushed round 4, SIGKILL server ``victim``, call
    ``then(launcher, out, runner)`` if given, and let the workers go on."""
    launcher, out, flags = _job(tmp_path, name, 2, 4, max_restarts, servers)
    result: dict = {}
    runner = threading.Thread(target=lambda: result.setdefault("code", launcher.run()))
    runner.start()
    try:
        deadline = time.monotonic() + 90
        while not (flags / "pushed").exists():
            assert runner.is_alive(), out.getvalue()
            assert time.monotonic() < deadline, "worker 0 never pushed: " + out.getvalue()
            time.sleep(0.02)  # polls a file the job writes
        _kill(launcher, victim)
        if then is not None:
            then(launcher, out, runner)
        (flags / "killed").touch()
        runner.join(120)
        assert not runner.is_alive(), "the job hung after the kill: " + out.getvalue()
    finally:
        launcher.stop_all(kill=True)
        runner.join(30)
    return result.get("code"), out.getvalue()


def test_a_killed_server_is_taken_over_and_tables_equal_an_undisturbed_run(tmp_path, undisturbed):
    code, out = _run_killing(tmp_path, "kill")
    assert code == 0, out
    assert "server 0 was killed by signal 9" in out, out
    assert "takes over its keys" in out, out
    assert re.search(r"\[worker 0\].*unanswered requests went again", out), out
    assert _rounds(out) == undisturbed, out


def test_three_servers_the_middle_one_killed(tmp_path, undisturbed):
    """Three servers: server 1's parts are taken over by server 2, which then serves two
    parts of each table (a row's value does not depend on the number of servers, so the
    reference is the same run)."""
    code, out = _run_killing(tmp_path, "three", servers=3, victim=1)
    assert code == 0, out
    assert "server 1 was killed by signal 9" in out, out
    assert re.search(r"server rank 2 \(node \d+.*takes over its keys", out), out
    assert _rounds(out) == undisturbed, out


def test_a_restarted_server_gets_the_tables_again_and_takes_over_in_turn(tmp_path, undisturbed):
    """Server 0 is killed and started again: server 1, which serves both parts now, sends it
    a copy of each of its 4 parts of the two tables (rows, rounds, Adam's t and moments, the momentum). Then server 1 is
    killed too, and server 0 serves both parts from those copies: still every round as in the
    undisturbed run."""

    def then(launcher, out, runner):
        _wait_output(
            out, r"\[server 1\].*server rank 0 .* holds a copy of each of the 0 slices and 4 "
            r"table parts", runner,
        )  # fmt: skip
        _kill(launcher, 1)

    code, out = _run_killing(tmp_path, "rejoin", max_restarts=1, then=then)
    assert code == 0, out
    assert "restart 1 of 1: starting server 0 again" in out, out
    assert re.search(r"server rank 1 .*was killed by signal 9.*server rank 0 .*takes over", out), (
        out
    )
    assert _rounds(out) == undisturbed, out
