"""The balance wing per host: a host's workers share one row of the link model, whose rate is
the host's link read from all their transfers together; the plan functions see the caps that
give a host of K pushing workers its true time; spread probes name a worker of the host; and
without host groups every plan is what it was."""

from __future__ import annotations

import numpy as np
import pytest

from hetps.balance import Network, iteration_time
from hetps.balance.hosts import HostMap, host_pushes, per_host_network, row_lookup, rows_of
from hetps.balance.reports import host_ids
from hetps.balance.service import Planner
from hetps.balance.wire import unpack_plan
from hetps.cluster import commands
from hetps.cluster import protocol as P
from hetps.cluster.protocol import NodeInfo
from hetps.transport.codec import Message

S, W = 2, 4
PART = 1 << 20  # bytes a worker pushes to each server in a round


class _Sched:
    def __init__(self, groups: list[int]) -> None:
        self.nodes = {
            P.worker_id(r): NodeInfo(P.worker_id(r), "worker", r, "h", 1, g)
            for r, g in enumerate(groups)
        }
        self.dead: set = set()
        self.finished: set = set()
        self.rejoined: dict = {}  # (node -> times taken back)
        self.answers: list = []

    def reply(self, msg, body, arrays=None):
        self.answers.append(unpack_plan(Message(msg.cmd, body=body, arrays=arrays or [])))


def _round(
    p: Planner, sched: _Sched, rnd: int, link: list[float], off: tuple = (), **flags: bool
) -> None:
    """Every live worker pushes PART to each server and pulls it back, all at once; worker
    r's host link is ``link[r]`` bytes/s, split evenly between that host's workers and
    servers; the ranks ``off`` report without ``flags``."""
    groups = [n.group for n in sched.nodes.values()]
    for r, node in enumerate(sched.nodes.values()):
        if node.id in sched.dead:
            continue
        mates = groups.count(node.group) if node.group >= 0 else 1
        share = link[r] / (mates * S)  # each flow's rate on the host's link
        rows = []
        for s in range(S):
            t = PART / share
            rows.append([node.id, P.server_id(s), PART, 100.0, 100.0 + t, 0])
            rows.append([P.server_id(s), node.id, PART, 100.0, 100.0 + t, 0])
        body = {"round": rnd, **({} if r in off else flags)}
        if rnd == 1:
            body.update(sizes=[8 * 1024], assign=[i % S for i in range(8)])
        times = np.array([[s, PART * W, 0.1] for s in range(S)])
        msg = Message(P.BALANCE_REPORT, body=body, arrays=[np.array(rows, float), times])
        msg.sender = node.id
        assert commands.decode(msg) is None
        p.handle(sched, msg)


def test_a_hosts_workers_share_its_row_and_its_link_is_read_from_all_of_them():
    p = Planner("aware", W, S, False, slice_elems=1024)
    sched = _Sched([0, 0, 1, 1])  # two hosts of two workers
    link = [80e6, 80e6, 20e6, 20e6]
    _round(p, sched, 1, link)
    assert len(sched.answers) == W and p.n_nodes == S + 2  # one row per host
    assert p.index(P.worker_id(1)) == p.index(P.worker_id(0)) == S
    assert p.index(P.worker_id(3)) == S + 1
    # each worker alone moved half its host's link; the host's row reads the whole link
    assert p.links.up[S:] == pytest.approx([80e6, 20e6])
    assert p.links.down[S:] == pytest.approx([80e6, 20e6])


def test_without_host_groups_plans_are_the_flat_ones():
    """No groups, or a host for every worker: one row per worker, the same answers."""
    answers = []
    for groups in ([-1] * W, list(range(W))):
        p = Planner("aware", W, S, False, slice_elems=1024)
        sched = _Sched(groups)
        for rnd in (1, 2, 3):
            _round(p, sched, rnd, [80e6, 40e6, 20e6, 10e6])
        assert p.n_nodes == S + W
        answers.append([{k: a[k] for k in ("assign", "shares", "epoch")} for a in sched.answers])
    assert answers[0] == answers[1]


def test_the_plan_functions_see_a_hosts_pushes():
    """A host of 3 workers each pushing the whole model: 3 x the bytes on its link; every
    server gets 4 pushes (3 + the other host's 1). The scaled caps give the model those times."""
    hosts = HostMap([0, 0, 0, 1])
    net = Network(np.array([10.0, 9.0, 30.0, 30.0]), np.array([10.0, 9.0, 30.0, 30.0]))
    scaled = per_host_network(net, [0, 1], hosts, host_pushes(hosts, {}, range(4)))  # (3, 1)
    shares = np.array([60.0, 40.0])
    total = float(shares.sum())
    want = max(3 * total / 30.0, 4 * 60.0 / 10.0, 4 * 40.0 / 9.0)  # host 0, server 0, server 1
    assert iteration_time(scaled, shares, servers=[0, 1], workers=[2, 3]) == pytest.approx(want)
    ones = per_host_network(net, [0, 1], hosts, np.ones(2))  # one push per host (aggregated)
    assert iteration_time(ones, shares, servers=[0, 1], workers=[2, 3]) == pytest.approx(
        max(total / 30.0, 2 * 60.0 / 10.0, 2 * 40.0 / 9.0)
    )


def test_reports_of_aggregating_hosts_plan_one_push_per_host():
    """Workers whose host sums their gradients and pushes once (host-local aggregation) say so
    in their reports: the plan functions then see each host's link carry one push."""
    got = {}
    for flag in (False, True):
        p = Planner("aware", W, S, False, slice_elems=1024)
        _round(p, _Sched([0, 0, 0, 1]), 1, [90e6, 90e6, 90e6, 30e6], one_push=flag)
        hosts, net = p.hosts, p.links.node_network()
        assert any(p.one_push.values()) is flag
        got[flag] = p.node_network()
        pushes = np.ones(2) if flag else host_pushes(hosts, {}, range(W))
        want = per_host_network(net, p.servers, hosts, pushes)
        assert got[flag].up == pytest.approx(want.up) and got[flag].down == pytest.approx(want.down)
    # the 3-worker host's caps: its link's, not a third of it
    assert got[True].up[S] == pytest.approx(3 * got[False].up[S])


@pytest.mark.parametrize("agg", [True, False])
def test_a_host_left_with_one_worker_plans_its_pushes_per_process_again(agg):
    """Two hosts of two; worker 3 dies (elastic) and its host's other worker, alone now,
    reports that it pushes its own: that host counts one push (its live worker), the other
    host one (aggregated) or two (each its own); the flag of the host is cleared, not kept."""
    p = Planner("aware", W, S, False, slice_elems=1024)
    sched = _Sched([0, 0, 1, 1])
    link = [90e6, 90e6, 30e6, 30e6]
    _round(p, sched, 1, link, one_push=agg)
    assert p.one_push == dict.fromkeys(range(W), agg)
    sched.dead.add(P.worker_id(3))
    _round(p, sched, 2, link, off=(2,), one_push=agg)
    assert p.one_push == {0: agg, 1: agg, 2: False, 3: agg}  # (3: its last, read no more)
    net, got = p.links.node_network(), p.node_network()
    want = per_host_network(net, p.servers, p.hosts, np.array([1.0 if agg else 2.0, 1.0]))
    assert got.up == pytest.approx(want.up) and got.down == pytest.approx(want.down)
    # a host of three where one pushes its own (started again): its host's sum and its own
    once = {0: True, 1: True, 2: False, 3: False}
    assert host_pushes(HostMap([0, 0, 0, 1]), once, range(4)).tolist() == [2.0, 1.0]


@pytest.mark.parametrize("seed", range(5))
def test_rows_and_pushes_in_bulk_match_one_at_a_time(seed):
    """rows_of and host_pushes, in bulk, against the rule for one id (one rank) at a time:
    ids not whole, negative, past the table, NaN, inf or past int64 name no row; ranks out of
    range (live or in the flags) count nothing."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 60, 40)
    lookup = row_lookup(ids.tolist(), rng.integers(0, 9, 40).tolist())
    odd = [-1.0, -0.5, -0.0, 2.5, 1e300, 2.0**63, 2.0**64, -(2.0**63), np.nan, np.inf, -np.inf]
    asked = np.r_[rng.integers(-5, 70, 200).astype(float), odd]
    ok = [np.isfinite(x) and x == np.floor(x) and 0 <= x < len(lookup) for x in asked]
    want = [int(lookup[int(x)]) if good else -1 for x, good in zip(asked, ok, strict=True)]
    assert rows_of(lookup, asked).tolist() == want
    hosts = HostMap(rng.integers(-1, 5, 30).tolist())
    once = {r: bool(rng.random() < 0.5) for r in rng.permutation(np.arange(-3, 35)).tolist()}
    live = rng.choice(np.arange(-2, 34), 20, replace=False)
    count, summed = np.zeros(hosts.n_hosts), np.zeros(hosts.n_hosts)
    for r in live:
        if 0 <= r < 30:
            count[hosts.host_of_rank[r]] += 1
            summed[hosts.host_of_rank[r]] += once.get(int(r), False)
    want = np.maximum(count - summed + (summed > 0), 1)
    assert host_pushes(hosts, once, live).tolist() == want.tolist()


def _host_ids_one_by_one(nodes, sender, host, rows, arrays):
    """host_ids as it read each node and each row in turn (the oracle)."""
    if host is None:
        return [sender]
    group = getattr(nodes.get(sender), "group", -1)
    bad = [i for i in host if getattr(nodes.get(i), "group", -1) != group or group < 0]
    if bad or len(set(host)) != len(host):
        return f"balance report: a host's report names nodes {bad or list(host)} of no host {group}"
    rows = rows or []
    have = [len(a) for a in arrays[:2]]
    if (
        len(rows) != len(host)
        or len(have) != 2
        or [sum(r[0] for r in rows), sum(r[1] for r in rows)] != have
    ):
        return f"balance report: 'host_rows' {[list(r) for r in rows]} do not add up to the arrays' {have} rows"
    return list(host)


@pytest.mark.parametrize("seed", range(40))
def test_a_hosts_report_names_its_workers_as_one_by_one(seed):
    """host_ids against the rule read one node and one row at a time: workers of other
    hosts, of none, unknown or named twice, and rows that do or do not add up."""
    rng = np.random.default_rng(seed)
    nodes = {
        P.worker_id(r): NodeInfo(P.worker_id(r), "worker", r, "h", 1, r // 3 - 1) for r in range(9)
    }
    host = [P.worker_id(int(r)) for r in rng.choice(11, int(rng.integers(0, 4)))]
    if seed % 3 < 2:  # (a host's own workers in some order, or those of no host: group -1)
        mine = rng.permutation([0, 1, 2] if seed % 3 else [3, 4, 5])[: int(rng.integers(1, 4))]
        host = [P.worker_id(int(r)) for r in mine]
    rows = [
        [int(rng.integers(0, 3)), int(rng.integers(0, 2))]
        for _ in host[: len(host) - seed % 3 // 2]
    ]
    sums = [sum(r[0] for r in rows), sum(r[1] for r in rows)]
    arrays = [np.zeros((n + (seed % 5 == 0), 6 - 3 * k)) for k, n in enumerate(sums)]
    sender = host[0] if host and seed % 4 else P.worker_id(3)
    for h in (host, None):
        assert host_ids(nodes, sender, h, rows, arrays) == _host_ids_one_by_one(
            nodes, sender, h, rows, arrays
        )


def test_a_spread_names_a_worker_of_the_host():
    p = Planner("aware", W, S, False, slice_elems=1024)
    p.use_hosts([0, 0, 1, 1])
    p.links.spread_targets = lambda live=None: ["in", 1, [0, 1]]  # hosts 0 and 1
    assert p.spread_targets() == ["in", 1, [0, 2]]  # their lowest worker ranks
    p.links.spread_targets = lambda live=None: ["out", 1, [0, 1]]
    assert p.spread_targets() == ["out", 2, [0, 1]]


class _Replies(_Sched):
    """The scheduler's replies, each with the report it answers."""

    def reply(self, msg, body, arrays=None):
        super().reply(msg, body, arrays)
        self.answers[-1] = (msg, self.answers[-1])


def _flows(rank: int, rnd: int) -> tuple[list, np.ndarray]:
    """Worker ``rank``'s transfers of a round (its host link 60 MB/s, shared by 2 workers)."""
    rows = []
    for s in range(S):
        end = 100.0 + PART / (60e6 / (2 * S)) * (1 + 0.1 * rank)
        rows += [[P.worker_id(rank), P.server_id(s), PART, 100.0, end, 0]]
        rows += [[P.server_id(s), P.worker_id(rank), PART, 100.0, end, 0]]
    return rows, np.array([[s, PART * W, 0.1 * (1 + rank)] for s in range(S)])


def _report(ranks: list[int], rnd: int) -> Message:
    """The report of ``ranks`` (more than one: their host's leader's, for all of them)."""
    flows = [_flows(r, rnd) for r in ranks]
    body: dict = {"round": rnd}
    if len(ranks) > 1:
        body.update(host=[P.worker_id(r) for r in ranks])
        body.update(host_rows=[[len(f), len(t)] for f, t in flows])
    if rnd == 1:
        body.update(sizes=[8 * 1024], assign=[i % S for i in range(8)])
    samples = np.array([row for f, _ in flows for row in f], float)
    times = np.concatenate([t for _, t in flows])
    msg = Message(P.BALANCE_REPORT, body=body, arrays=[samples, times])
    msg.sender = P.worker_id(ranks[0])
    assert commands.decode(msg) is None
    return msg


@pytest.mark.parametrize("order", ["own-first", "host-first", "none"])
def test_a_report_sent_both_ways_is_answered_each_way_and_read_once(order):
    """Worker 1's leader (worker 0) relays the host's report of a round and worker 1, having
    dropped that leader (it did not read in time, or answered half a frame), sends its own
    too, before or after. Each message gets the round's plan (none waits for an answer that
    never comes); and the round's link readings are those of the round without the second."""
    nets = {}
    for how in dict.fromkeys(["none", order]):
        p, sched = Planner("aware", W, S, False, slice_elems=1024), _Replies([0, 0, 1, 1])
        msgs = [_report([0, 1], 1), _report([2], 1), _report([3], 1)]
        if how != "none":
            msgs.insert(0 if how == "own-first" else 3, _report([1], 1))
        for msg in msgs:
            p.handle(sched, msg)
        assert sorted(id(m) for m, _ in sched.answers) == sorted(map(id, msgs))
        assert len({a["epoch"] for _, a in sched.answers}) == 1  # (the same round's plan)
        nets[how] = p.links.node_network()
    if order == "host-first":  # (own-first: its host's report holds its flows as well)
        np.testing.assert_array_equal(nets[order].up, nets["none"].up)
        np.testing.assert_array_equal(nets[order].down, nets["none"].down)
