"""Replicated servers under a network-aware plan (HETPS_REPLICAS with HETPS_BALANCE): a plan
that moves a slice moves its copies, its optimizer state and its round count with it, so
the server the slice moved to can die and the one after it takes over with nothing lost."""

from __future__ import annotations

import io
import json
import re
import signal
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from conftest import PRELUDE, TEST_ENV
from hetps.launch.contract import LaunchSpec
from hetps.launch.local import Launcher

# Server 0 sends at 24 Mbit/s (the in-process shaper): the aware planner moves slices off
# it to servers 1 and 2, with their momentum. One round after the first plan change, worker 0
# pushes, writes which of servers 1 and 2 got the larger share, and waits; the test kills
# that server; worker 1 pushes that round only after the kill. Both workers see the plan
# change in the same round (a migration ends in a barrier), so both know the round.
SCRIPT = """
import hashlib, json
rounds, flags = int(os.environ["ROUNDS"]), os.environ["FLAGS"]
kill = os.environ["KILL"] == "1"
kv = hetps.kv.create("dist_sync")
kv.init("w", np.arange(12 * 32768, dtype=np.float32) / 1e5)
kv.set_optimizer(optim.SGD(learning_rate=0.1, momentum=0.9))
out = np.zeros(12 * 32768, np.float32)
# the value the servers must hold after each round (every round applied once), computed here
# with the same optimizer: a copy lost or applied twice fails the round it shows in
ref_opt = optim.SGD(learning_rate=0.1, momentum=0.9)
ref = np.arange(12 * 32768, dtype=np.float32) / 1e5
ref_state = ref_opt.create_state("w", ref)

def check(r):
    pushed = [np.random.default_rng(1000 * r + w).standard_normal(12 * 32768).astype(np.float32)
              for w in range(kv.num_workers)]
    ref_opt.update("w", ref, sum(pushed), ref_state)
    if not np.array_equal(out, ref):
        raise SystemExit(
            f"WRONG VALUE: worker {kv.rank}, round {r}: the servers' value is off by up to "
            f"{np.abs(out - ref).max():.3g} from every round applied once (a copy lost or "
            "applied twice?)")
epochs, kill_at, shares, victim, kill_shares = set(), None, None, None, None

def wait_for(name):
    while not os.path.exists(os.path.join(flags, name)):
        time.sleep(0.01)   # polls a file the test writes

for r in range(rounds):
    plan = kv.rebalance()
    if plan is not None:
        epochs.add(plan["epoch"])
        shares = plan["shares"]
        if kill_at is None and kill and plan["epoch"] >= 1:
            kill_at = r + 1
            victim = 1 if shares[1] >= shares[2] else 2
            kill_shares = list(shares)
    if r == kill_at and kv.rank == 1:
        wait_for("killed")
    rng = np.random.default_rng(1000 * r + kv.rank)
    kv.push("w", rng.standard_normal(12 * 32768).astype(np.float32))
    if r == kill_at and kv.rank == 0:
        with open(os.path.join(flags, "pushed.tmp"), "w") as f:
            f.write(str(victim))
        os.rename(os.path.join(flags, "pushed.tmp"), os.path.join(flags, "pushed"))
        wait_for("killed")
    kv.pull("w", out=out)
    check(r)
if kv.rank == 0 and (kill_at is None or kill_at >= rounds):
    open(os.path.join(flags, "nokill"), "w").close()
print(f"FINAL {kv.rank} {hashlib.sha256(out.tobytes()).hexdigest()}", flush=True)
print("PLAN " + json.dumps({"epochs": sorted(epochs), "shares": kill_shares, "kill_at": kill_at}),
      flush=True)
"""

ENV = {
    **TEST_ENV,
    "HETPS_SLICE_ELEMS": "32768",
    "ROUNDS": "12",
}


def _launcher(tmp: Path, balance: bool) -> tuple[Launcher, io.StringIO, Path]:
    flags = tmp / "flags"
    flags.mkdir()
    script = tmp / "script.py"
    script.write_text(PRELUDE + textwrap.dedent(SCRIPT))
    env = {**ENV, "FLAGS": str(flags), "KILL": "1" if balance else "0"}
    if balance:
        env["HETPS_BALANCE"] = "aware"
    spec = LaunchSpec(
        num_workers=2,
        num_servers=3,
        command=[sys.executable, str(script)],
        env=env,
        start_timeout=30.0,
        failure_grace=5.0,
        replicas=2 if balance else 1,
    )

    def wrap(role: str, rank: int, argv: list[str], env: dict[str, str]):
        slow = {"HETPS_SHAPE_MBIT": "24"} if (role, rank) == ("server", 0) else {}
        return argv, {**env, **slow}

    spec.wrap = wrap
    out = io.StringIO()
    return Launcher(spec, out=out), out, flags


def _finals(out: str) -> dict[int, str]:
    return {int(r): d for r, d in re.findall(r"FINAL (\d) (\w+)", out)}


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory) -> dict[int, str]:
    """Each worker's final values with no plan, no copies and nothing killed."""
    launcher, out, _ = _launcher(tmp_path_factory.mktemp("ref"), balance=False)
    try:
        code = launcher.run()
    finally:
        launcher.stop_all(kill=True)
    assert code == 0, out.getvalue()
    finals = _finals(out.getvalue())
    assert len(finals) == 2 and finals[0] == finals[1], out.getvalue()
    return finals


def test_a_server_that_slices_moved_to_dies_and_nothing_is_lost(tmp_path, undisturbed):
    """Server 0's replica is server 1, whose replica is server 2, whose replica is server 0.
    Slices moved 0 -> 1 had their copy on server 1, which serves them now: server 2 gets
    value, momentum and round count (victim 1). Slices moved 0 -> 2 keep their copy on
    server 0, which served them until then and must neither serve them nor drop them
    (victim 2). tests/unit/test_replica_rounds.py plays each case message by message."""
    launcher, out, flags = _launcher(tmp_path, balance=True)
    result: dict = {}
    runner = threading.Thread(target=lambda: result.setdefault("code", launcher.run()))
    runner.start()
    try:
        deadline = time.monotonic() + 120
        while not (flags / "pushed").exists():
            assert not (flags / "nokill").exists(), "the plan never moved a slice: " + (
                out.getvalue()
            )
            assert runner.is_alive(), out.getvalue()
            assert time.monotonic() < deadline, "no round to kill in: " + out.getvalue()
            time.sleep(0.02)  # polls a file the job writes
        victim = int((flags / "pushed").read_text())
        child = next(
            c
            for c in launcher.children
            if c.role == "server" and c.rank == victim and c.proc.poll() is None
        )
        child.proc.send_signal(signal.SIGKILL)
        child.proc.wait(10)
        (flags / "killed").touch()
        runner.join(120)
        assert not runner.is_alive(), "the job hung after the kill: " + out.getvalue()
    finally:
        launcher.stop_all(kill=True)
        runner.join(30)
    text = out.getvalue()
    assert result.get("code") == 0, text
    assert f"server {victim} was killed by signal 9" in text, text
    assert "takes over its keys" in text, text
    plans = [json.loads(p) for p in re.findall(r"PLAN (\{.*\})", text)]
    assert len(plans) == 2 and plans[0] == plans[1], text
    assert max(plans[0]["epochs"]) >= 1 and plans[0]["shares"][0] < 1 / 3 - 0.1, plans
    assert plans[0]["shares"][victim] > 1 / 3, plans  # slices moved to the server killed
    assert _finals(text) == undisturbed, text
