"""Slices move between servers as plans change; values and optimizer state move with them."""

from __future__ import annotations

import json
import re

import pytest

from conftest import run_cluster

CODE = """
import json
kv = hetps.kv.create('dist_sync')
kv.init('w', np.arange(30000, dtype=np.float32) / 1000)
kv.init('b', np.ones(7, np.float32))
kv.set_optimizer(optim.SGD(learning_rate=0.1, momentum=0.9))
rng = np.random.default_rng(kv.rank)
epochs = set()
for step in range(8):
    plan = kv.rebalance()
    if plan is not None:
        epochs.add(plan['epoch'])
        assert abs(sum(plan['shares']) - 1) < 1e-9
    kv.push('w', rng.standard_normal(30000).astype(np.float32))
    kv.push('b', np.full(7, 0.5, np.float32))
w, b = kv.pull('w'), kv.pull('b')
print('RESULT ' + json.dumps({'w': float(w.astype(np.float64).sum()), 'w0': float(w[0]),
                              'b': b.tolist(), 'epochs': sorted(epochs)}), flush=True)
"""


def _result(out: str) -> dict:
    return json.loads(re.findall(r"RESULT (\{.*\})", out)[0])


BALANCE_ENV = {"HETPS_SLICE_ELEMS": "2000", "HETPS_PROBE_PROB": "1.0"}


@pytest.fixture(scope="module")
def unbalanced(tmp_path_factory) -> dict:
    """The result of CODE without a plan: one run for every scheme's comparison."""
    rc, base = run_cluster(tmp_path_factory.mktemp("unbalanced"), CODE, 2, 3, BALANCE_ENV)
    assert rc == 0, base
    return _result(base)


@pytest.mark.parametrize("scheme", ["average", "aware", "optimal", "elastic"])
def test_balanced_training_equals_unbalanced(cluster, unbalanced, scheme):
    env = {**BALANCE_ENV, "HETPS_BALANCE": scheme}
    rc, out = cluster(CODE, workers=2, servers=3, env=env)
    assert rc == 0, out
    a, b = unbalanced, _result(out)
    assert a["epochs"] == [] and b["b"] == a["b"]
    assert b["w0"] == a["w0"] and b["w"] == pytest.approx(a["w"], rel=1e-6)
    if scheme != "average":
        print(scheme, "plan epochs", b["epochs"])


def test_colocated_balance_moves_slices(cluster):
    rc, out = cluster(
        CODE,
        workers=3,
        servers=3,
        env={"HETPS_SLICE_ELEMS": "2000", "HETPS_BALANCE": "optimal", "HETPS_COLOCATE": "1"},
    )
    assert rc == 0, out
    assert len(set(re.findall(r"RESULT (\{.*\})", out))) == 1  # every worker agrees


SLOW_CODE = """
import json
kv = hetps.kv.create('dist_sync')
kv.init('w', np.arange(12 * 32768, dtype=np.float32) / 1e5)
kv.set_optimizer(optim.SGD(learning_rate=0.1, momentum=0.9))
rng = np.random.default_rng(kv.rank)
epochs, shares = set(), None
for step in range(10):
    plan = kv.rebalance()
    if plan is not None:
        epochs.add(plan['epoch'])
        shares = plan['shares']
    kv.push('w', rng.standard_normal(12 * 32768).astype(np.float32))
    kv.pull('w')
w = kv.pull('w')
print('RESULT ' + json.dumps({'w': float(w.astype(np.float64).sum()), 'w0': float(w[0]),
                              'epochs': sorted(epochs), 'shares': shares}), flush=True)
"""


@pytest.mark.parametrize(
    "scheme",
    ["aware", pytest.param("optimal", marks=pytest.mark.slow)],  # (the same path)
)
def test_slow_server_loses_share_and_nothing_is_lost(cluster, scheme):
    """Server 2 sends at 24 Mbit/s (the in-process shaper), the others unshaped: the planner
    must learn that from the pull replies, move slices off server 2 (a migration with
    optimizer state), and the training must end exactly where the unbalanced one ends."""
    env = {"HETPS_SLICE_ELEMS": "32768"}
    slow = {("server", 2): {"HETPS_SHAPE_MBIT": "24"}}
    rc, base = cluster(SLOW_CODE, workers=2, servers=3, env=env, node_env=slow)
    assert rc == 0, base
    rc, out = cluster(
        SLOW_CODE, workers=2, servers=3, env={**env, "HETPS_BALANCE": scheme}, node_env=slow
    )
    assert rc == 0, out
    a, b = _result(base), _result(out)
    assert a["epochs"] == []
    assert max(b["epochs"]) >= 1, f"the plan never changed: {b}"
    assert b["shares"][2] < 1 / 3 - 0.1, f"server 2 kept its share: {b['shares']}"
    assert b["w0"] == a["w0"] and b["w"] == pytest.approx(a["w"], rel=1e-6)
    results = re.findall(r"RESULT (\{.*\})", out)
    assert len(results) == 2 and len(set(results)) == 1  # both workers report the same


FIRST_PLAN_CODE = """
import json
kv = hetps.kv.create('dist_sync')
kv.init('w', np.zeros(30000, np.float32))
plan = kv.rebalance()
if kv.rank == 0:  # rank 0's answers alone carry the node rates and the link matrix
    print('RESULT ' + json.dumps(plan['node_rates']), flush=True)
    print('MATRIX ' + json.dumps(plan['link_matrix']), flush=True)
else:
    print('OTHER ' + json.dumps(sorted(plan)), flush=True)
"""


def test_first_plan_rests_on_a_probe_of_every_link(cluster):
    """The first init probes a whole permutation cycle before rank 0 sends any value (a
    connection that carried the init keeps a wide congestion window, which made the probes
    into rank 0's node read ~35% low, docs/BALANCE.md §7.1): the first plan already knows
    every worker's uplink and every server's downlink from a probe."""
    env = {"HETPS_SLICE_ELEMS": "2000", "HETPS_BALANCE": "aware"}
    rc, out = cluster(FIRST_PLAN_CODE, workers=2, servers=3, env=env)
    assert rc == 0, out
    results = re.findall(r"RESULT (\{.*\})", out)
    assert len(results) == 1, out
    matrix = json.loads(re.findall(r"MATRIX (\[.*\])", out)[0])
    assert len(matrix) == 5 and all(len(row) == 5 for row in matrix)  # 2 workers + 3 servers
    assert all(matrix[i][i] is None for i in range(5))  # not finite: None, as before
    other = json.loads(re.findall(r"OTHER (\[.*\])", out)[0])
    assert "assign" in other and "shares" in other and "link_matrix" not in other
    for raw in results:
        rates = json.loads(raw)
        # a probe sets its worker's probe_up and its server's probe_down
        assert sum(1 for x in rates["probe_up"] if x) == 2, rates  # both workers probed
        assert sum(1 for x in rates["probe_down"] if x) == 3, rates  # every server was probed


NO_INIT_CODE = """
kv = hetps.kv.create('dist_sync')
try:
    kv.rebalance()
except RuntimeError as exc:
    print('REFUSED ' + str(exc), flush=True)
"""


def test_rebalance_before_any_init_is_refused_not_left_waiting(cluster):
    """Nothing to place yet: every worker gets the planner's error at once (it used to fail
    inside the scheduler and leave the workers waiting for their request timeout)."""
    env = {"HETPS_BALANCE": "aware", "HETPS_REQUEST_TIMEOUT": "60"}
    rc, out = cluster(NO_INIT_CODE, workers=2, servers=2, env=env)
    assert rc == 0, out
    refused = re.findall(r"REFUSED (.*)", out)
    assert len(refused) == 2, out
    assert all("kv.init" in r for r in refused), refused


ORDER_CODE = """
import json
sent = []
kv = hetps.kv.create('dist_sync')
kv.init('w', np.zeros(16000, np.float32))
kv.node.van.observer = lambda d, peer, cmd, n, t: d == 'send' and cmd in ('push', 'pull') and sent.append(cmd)
for step in range(3):
    h = [kv.push('w', np.ones(16000, np.float32), block=False), kv.pull('w', block=False)]
    for x in h:
        x.wait()
kv.node.van.observer = None
print('RESULT ' + json.dumps({'sent': sent, 'w': float(kv.pull('w').sum())}), flush=True)
"""


def test_a_slices_pull_does_not_wait_for_the_keys_later_pushes(cluster):
    """Requests keep their order per slice, not per key: with a one-push credit window the
    pushes of a 16-slice key go one receipt at a time, and the pull of a slice that was
    pushed goes at once (in key order every pull waited for the key's last push, so a big
    key's replies all came after its whole push)."""
    env = {"HETPS_SLICE_ELEMS": "1000", "HETPS_BALANCE": "average", "HETPS_PUSH_WINDOW": "1"}
    rc, out = cluster(ORDER_CODE, workers=1, servers=2, env=env)
    assert rc == 0, out
    res = _result(out)
    sent = res["sent"]
    assert sent.count("push") == 48 and sent.count("pull") == 48, sent
    for r in range(3):  # every round: some pull left before the round's last push
        rnd = sent[32 * r : 32 * (r + 1)]
        assert sorted(rnd) == ["pull"] * 16 + ["push"] * 16, rnd
        last_push = max(i for i, c in enumerate(rnd) if c == "push")
        assert rnd.index("pull") < last_push, rnd
    assert res["w"] == 16000.0  # every pull saw its round: 1 worker, the sum replaces


def test_link_samples_stay_bounded_without_rebalance(cluster):
    """A script that never calls rebalance() keeps only the newest MAX_SAMPLES link samples
    (set to 40 here), and the next report still works and starts a fresh buffer."""
    code = """
import hetps.balance.agent as agent
agent.MAX_SAMPLES = 40
kv = hetps.kv.create('dist_sync')
kv.init('w', np.zeros(40000, np.float32))
g = np.ones(40000, np.float32)
for _ in range(60):
    kv.push('w', g)
    kv.pull('w', out=g)
kept = len(kv.agent.samples)
assert kept == 40, kept
kv.rebalance()
assert len(kv.agent.samples) < 40, len(kv.agent.samples)
kv.barrier()
print('BOUNDED', kept, flush=True)
"""
    rc, out = cluster(code, workers=2, servers=2, env={"HETPS_BALANCE": "aware"})
    assert rc == 0, out
    assert out.count("BOUNDED 40") == 2, out
    assert "the oldest dropped" in out, out


TABLE_CODE = """
import hashlib, json
from hetps.tables.rowsparse import Table
kv = hetps.kv.create('dist_sync')
kv.init('w', np.arange(30000, dtype=np.float32) / 1000)
kv.init('emb', Table(300, 4, scale=0.1, seed=1))
kv.set_optimizer(optim.SGD(learning_rate=0.1, momentum=0.9))
rng = np.random.default_rng(kv.rank)
epochs, seen = set(), []
for step in range(6):
    plan = kv.rebalance()
    if plan is not None:
        epochs.add(plan['epoch'])
    kv.push('w', rng.standard_normal(30000).astype(np.float32))
    ids = rng.integers(0, 300, 20)
    kv.push('emb', (ids, rng.standard_normal((20, 4)).astype(np.float32)))
    emb = kv.row_sparse_pull('emb', row_ids=np.arange(300)).data
    seen.append(hashlib.sha256(emb.tobytes()).hexdigest()[:16])
w = kv.pull('w')
print('RESULT ' + json.dumps({'w': float(w.astype(np.float64).sum()), 'w0': float(w[0]),
                              'emb': seen, 'epochs': sorted(epochs)}), flush=True)
"""


def test_a_table_stays_where_its_ids_place_it_while_dense_keys_are_balanced(cluster):
    """HETPS_BALANCE with an embedding table: the planner moves the dense key's slices, the
    table's rows stay on the server their id gives (said once in the log), and every round
    the table's rows equal those of the run without balancing, bit for bit."""
    env = {"HETPS_SLICE_ELEMS": "2000", "HETPS_PROBE_PROB": "1.0"}
    rc, base = cluster(TABLE_CODE, workers=2, servers=3, env=env)
    assert rc == 0, base
    rc, out = cluster(TABLE_CODE, workers=2, servers=3, env={**env, "HETPS_BALANCE": "optimal"})
    assert rc == 0, out
    a, b = _result(base), _result(out)
    assert b["emb"] == a["emb"] and b["epochs"]  # (a plan was made)
    assert b["w0"] == a["w0"] and b["w"] == pytest.approx(a["w"], rel=1e-6)
    said = "HETPS_BALANCE plans the dense keys only; row-sparse key 'emb' stays where its row"
    assert out.count(said) == 1, out
