"""Slices move between servers as plans change; values and optimizer state move with them."""

from __future__ import annotations

import json
import re

import pytest

from hetps.transport import pacing

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


@pytest.mark.parametrize("scheme", ["average", "aware", "optimal", "elastic"])
def test_balanced_training_equals_unbalanced(cluster, scheme):
    env = {"HETPS_SLICE_ELEMS": "2000", "HETPS_PROBE_PROB": "1.0"}
    rc, base = cluster(CODE, workers=2, servers=3, env=env)
    assert rc == 0, base
    rc, out = cluster(CODE, workers=2, servers=3, env={**env, "HETPS_BALANCE": scheme})
    assert rc == 0, out
    a, b = _result(base), _result(out)
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


@pytest.mark.parametrize("scheme", ["aware", "optimal"])
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
print('RESULT ' + json.dumps(dict(plan['node_rates'], pace=plan['pace'],
                                  sender_pace=kv._sender.pace_bps)), flush=True)
"""


@pytest.mark.parametrize("pace", [None, "1.25"])
def test_first_plan_rests_on_a_probe_of_every_link(cluster, pace):
    """The first init probes a whole permutation cycle before rank 0 sends any value (a
    connection that carried the init keeps a wide congestion window, which made the probes
    into rank 0's node read ~35% low, docs/BALANCE.md §7.1): the first plan already knows
    every worker's uplink and every server's downlink from a probe."""
    env = {"HETPS_SLICE_ELEMS": "2000", "HETPS_BALANCE": "aware"}
    if pace:
        env["HETPS_PUSH_PACE"] = pace
    rc, out = cluster(FIRST_PLAN_CODE, workers=2, servers=3, env=env)
    assert rc == 0, out
    results = re.findall(r"RESULT (\{.*\})", out)
    assert len(results) == 2, out
    for raw in results:
        rates = json.loads(raw)
        # a probe sets its worker's probe_up and its server's probe_down
        assert sum(1 for x in rates["probe_up"] if x) == 2, rates  # both workers probed
        assert sum(1 for x in rates["probe_down"] if x) == 3, rates  # every server was probed
        # the plan carries the slowest pusher's pace through the model: with separate workers
        # (nodes 3 and 4) each sends the whole model, so it is the slower worker's uplink;
        # the worker paces its pushes at that times HETPS_PUSH_PACE (default: off)
        assert rates["pace"] == pytest.approx(min(rates["up"][3], rates["up"][4]), rel=1e-9)
        want = float(pace) * rates["pace"] if pace else 0.0
        assert rates["sender_pace"] == pytest.approx(want, rel=1e-9)


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


PACE_CODE = """
import json
from hetps.cluster.errors import ClusterError, RequestError
from hetps.kvstore import commands as C
from hetps.transport import pacing
from hetps.transport.codec import Message
kv = hetps.kv.create('dist_sync')
kv.init('w', np.arange(12 * 32768, dtype=np.float32) / 1e5)
kv.set_optimizer(optim.SGD(learning_rate=0.1, momentum=0.9))
rng = np.random.default_rng(kv.rank)
refused = None
for step in range(8):
    plan = kv.rebalance()
    kv.push('w', rng.standard_normal(12 * 32768).astype(np.float32))
    kv.pull('w')
    if step == 3 and kv.rank == 0:  # a bad pace is refused, and the server goes on serving
        try:
            kv._request(None, 0, 1, Message(C.PACE, body={'rate': 'fast'})).wait(30)
        except (ClusterError, RequestError) as exc:
            refused = str(exc)
w = kv.pull('w')
own = {}
if plan is not None:
    for s, peer in enumerate(kv._server_ids):
        host, port = kv.node.van._endpoints[peer].rsplit(':', 1)
        fds = pacing.connection_fds(host, int(port), exclude_local_port=kv.node.van.port)
        own[s] = [pacing.get_max_pacing_rate(fd) for fd in fds]
print('RESULT ' + json.dumps({
    'rank': kv.rank, 'w': float(w.astype(np.float64).sum()), 'w0': float(w[0]),
    'rates': plan and plan['flow_rates'], 'own': own, 'paced': kv._paced,
    'acks': kv._pace_acks, 'refused': refused}), flush=True)
"""


def test_flow_pacing_caps_each_connection_at_its_plans_rate(cluster):
    """HETPS_FLOW_PACE: each worker caps its connection to every remote server, and asks
    that server to cap its connection back, at the factor times the plan's flow rate for
    that server (its share over the predicted iteration time); its own node's server is
    not paced. The values end exactly where an unbalanced run ends, and a bad pace request
    is refused with the reason while the server goes on serving."""
    env = {"HETPS_SLICE_ELEMS": "32768", "HETPS_SHAPE_MBIT": "400", "HETPS_COLOCATE": "1"}
    rc, base = cluster(PACE_CODE, workers=3, servers=3, env=env)
    assert rc == 0, base
    paced_env = {**env, "HETPS_BALANCE": "optimal", "HETPS_FLOW_PACE": "0.9"}
    rc, out = cluster(PACE_CODE, workers=3, servers=3, env=paced_env)
    assert rc == 0, out
    a = {r["rank"]: r for r in map(json.loads, re.findall(r"RESULT (\{.*\})", base))}
    b = {r["rank"]: r for r in map(json.loads, re.findall(r"RESULT (\{.*\})", out))}
    assert sorted(a) == sorted(b) == [0, 1, 2], out
    for rank, res in b.items():
        # (three pushes are summed in arrival order: equal up to rounding)
        assert res["w0"] == pytest.approx(a[rank]["w0"], rel=1e-6)
        assert res["w"] == pytest.approx(a[rank]["w"], rel=1e-6)
        assert a[rank]["paced"] == {} and a[rank]["own"] == {}  # off unless asked for
        for s in range(3):
            if s == rank:  # co-located: no link to share, never paced
                assert res["own"][str(s)] == [pacing.UNLIMITED], res
                assert str(s) not in res["paced"], res
                continue
            want = 0.9 * res["rates"][s]
            assert res["paced"][str(s)] == pytest.approx(want, rel=0.051), res
            # a plan that sends this worker nothing to s has flow rate 0: pace 0 is "no cap"
            paced = int(res["paced"][str(s)])
            assert res["own"][str(s)] == [paced or pacing.UNLIMITED], res
            assert res["acks"][str(s)] == 1, res  # the server paced its one socket back
    assert "pace: rate must be a number" in b[0]["refused"], b[0]


BACKOFF_CODE = """
import json
kv = hetps.kv.create('dist_sync')
kv.init('w', np.zeros(24000, np.float32))
probes = []
orig = kv._probe
def probe():
    probes.append(kv._round)
    orig()
kv._probe = probe
rounds = []
for step in range(20):
    scale = (kv.plan or {}).get('probe_scale', 1)  # what this round's decision uses
    plan = kv.rebalance()
    # kv._recalibrated: this round probed a whole cycle (the planner saw a change)
    rounds.append([kv._round, scale, plan.get('probe_scale'), kv._recalibrated])
    kv.push('w', np.ones(24000, np.float32))
    kv.pull('w')
print('RESULT ' + json.dumps({'probes': probes, 'rounds': rounds}), flush=True)
"""


def test_probing_rounds_thin_out_by_the_planners_scale_on_every_worker(cluster):
    """Every answer carries the planner's ``probe_scale`` and every worker probes by it: a
    probing round (after the first two) is a round of the base schedule (every base-th,
    base = 1 / HETPS_PROBE_PROB = 2 here) at least ``base * scale`` rounds after the last
    one, with the scale of the answer the worker adopted last, so all workers probe in the
    same rounds. Through a shaped transport the probes agree with the caps and the rounds
    thin out (to every ``2 * 4``-th at most)."""
    env = {
        "HETPS_SLICE_ELEMS": "2000",
        "HETPS_BALANCE": "optimal",
        "HETPS_PROBE_PROB": "0.5",
        "HETPS_PROBE_BACKOFF": "4",
        # a shaped transport: steady probes, and long enough (~50 ms) to be judged
        "HETPS_SHAPE_MBIT": "40",
        "HETPS_PROBE_BYTES": "262144",
    }
    rc, out = cluster(BACKOFF_CODE, workers=2, servers=2, env=env)
    assert rc == 0, out
    results = [json.loads(r) for r in re.findall(r"RESULT (\{.*\})", out)]
    assert len(results) == 2, out
    assert results[0]["probes"] == results[1]["probes"], results  # the same rounds everywhere
    for res in results:
        last = 1
        for rnd, scale, _answer_scale, cycle in res["rounds"]:
            if rnd <= 2:  # the first two rounds always probe
                continue
            due = (rnd - 1) % 2 == 0 and rnd - last >= 2 * scale
            if not cycle:  # (a round that probed a whole cycle probed anyway)
                assert (rnd in res["probes"]) == due, (rnd, scale, res)
            if due:
                last = rnd
        assert all(1 <= a <= 4 for _, _, a, _ in res["rounds"]), res
        assert max(a for _, _, a, _ in res["rounds"]) >= 2, res  # quiet probes thinned them
    print("probing rounds", results[0]["probes"], "scales", [r[2] for r in results[0]["rounds"]])
