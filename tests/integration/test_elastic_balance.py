"""Elastic workers under a network-aware plan (HETPS_ELASTIC with HETPS_BALANCE): a worker
that dies mid-round, or while it moves slices for a new plan, is let go; the others move
its share of the slices again, and the values end bit for bit as in a run without plans
where the same worker died at the same point."""

from __future__ import annotations

import hashlib
import io
import re
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import PRELUDE, TEST_ENV
from hetps.launch.contract import LaunchSpec
from hetps.launch.local import Launcher

# Server 2 sends at 24 Mbit/s, so the aware planner moves slices off it after a few rounds.
# Worker 2 dies: "start", at the start of round DIE_AT, after its rebalance (the others'
# pushes of the round wait for the scheduler to let it go); "migration", as it starts moving
# its share of the slices for the first new plan (the test's own stand-in for its
# BalanceAgent._migrate), which is before its push of that round. (A death after its push
# would be raced by the round's end: the push counts if the round completed first.)
SCRIPT = """
import hashlib
rounds, die_at, how = int(os.environ["ROUNDS"]), int(os.environ["DIE_AT"]), os.environ["HOW"]
kv = hetps.kv.create("dist_sync")
n = 12 * 32768
kv.init("w", np.arange(n, dtype=np.float32) / 1e5)
kv.set_optimizer(optim.SGD(learning_rate=0.1, momentum=0.9))
out = np.zeros(n, np.float32)

def die():
    os.kill(os.getpid(), signal.SIGKILL)

if kv.rank == 2 and how == "migration":
    kv.agent._migrate = lambda *a, **kw: die()
changed = None
for r in range(rounds):
    if kv.balance:
        plan = kv.rebalance()
        if changed is None and plan is not None and plan["epoch"] >= 1:
            changed = r
            print(f"CHANGED {kv.rank} {r}", flush=True)
    if kv.rank == 2 and how == "start" and r == die_at:
        die()
    rng = np.random.default_rng(1000 * r + kv.rank)
    kv.push("w", rng.standard_normal(n).astype(np.float32))
    kv.pull("w", out=out)
print(f"FINAL {kv.rank} {hashlib.sha256(out.tobytes()).hexdigest()}", flush=True)
"""

ENV = {
    **TEST_ENV,
    "HETPS_SLICE_ELEMS": "32768",
    "ROUNDS": "10",
}


def _run(
    tmp: Path, name: str, how: str, die_at: int, balance: bool, replicas: int = 1
) -> tuple[int, str]:
    script = tmp / f"{name}.py"
    script.write_text(PRELUDE + textwrap.dedent(SCRIPT))
    env = {**ENV, "HOW": how, "DIE_AT": str(die_at)}
    if balance:
        env["HETPS_BALANCE"] = "aware"
    spec = LaunchSpec(
        num_workers=3,
        num_servers=3,
        command=[sys.executable, str(script)],
        env=env,
        start_timeout=30.0,
        failure_grace=5.0,
        elastic_min=2,
        replicas=replicas,
    )

    def wrap(role: str, rank: int, argv: list[str], env: dict[str, str]):
        slow = {"HETPS_SHAPE_MBIT": "24"} if (role, rank) == ("server", 2) else {}
        return argv, {**env, **slow}

    spec.wrap = wrap
    out = io.StringIO()
    launcher = Launcher(spec, out=out)
    try:
        code = launcher.run()
    finally:
        launcher.stop_all(kill=True)
    return code, out.getvalue()


def _finals(out: str) -> dict[int, str]:
    return {int(r): d for r, d in re.findall(r"FINAL (\d) (\w+)", out)}


@pytest.mark.parametrize(
    ("how", "replicas"),
    [("start", 1), ("migration", 1), pytest.param("migration", 2, marks=pytest.mark.slow)],
)
def test_a_worker_that_dies_under_a_plan_is_let_go_and_nothing_is_lost(tmp_path, how, replicas):
    """Third case: the servers keep two copies of every key too (HETPS_REPLICAS=2)."""
    code, out = _run(tmp_path, "balanced", how, 4, balance=True, replicas=replicas)
    assert code == 0, out
    assert "worker 2 was killed by signal 9" in out and "goes on without it" in out, out
    finals = _finals(out)
    assert sorted(finals) == [0, 1] and finals[0] == finals[1], out
    changed = {int(r) for r in re.findall(r"CHANGED [01] (\d+)", out)}
    assert len(changed) == 1, f"the plan never changed, or not in one round: {out}"
    if how == "migration":  # the others moved its share again
        again = re.findall(r"died moving slices; (\d+) of theirs move again here", out)
        assert sum(int(n) for n in again) >= 1, out
    # "migration": it died moving slices for the plan of round `changed`, before its push
    die_at = changed.pop() if how == "migration" else 4
    ref_code, ref = _run(tmp_path, "reference", "start", die_at, balance=False)
    assert ref_code == 0, ref
    assert _finals(ref) == finals, (hashlib.sha256(out.encode()).hexdigest(), out, ref)
