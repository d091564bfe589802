"""The balance wing per host: a host's workers share one row of the link model, whose rate is
the host's link read from all their transfers together; the plan functions see the caps that
give a host of K pushing workers its true time; spread probes name a worker of the host; and
without host groups every plan is what it was."""

from __future__ import annotations

import numpy as np
import pytest

from hetps.balance import Network, iteration_time
from hetps.balance.hosts import HostMap, per_host_network
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
        self.answers: list = []

    def reply(self, msg, body, arrays=None):
        self.answers.append(unpack_plan(Message(msg.cmd, body=body, arrays=arrays or [])))


def _round(p: Planner, sched: _Sched, rnd: int, link: list[float], **flags: bool) -> None:
    """Every worker pushes PART to each server and pulls it back, all at once; worker r's
    host link is ``link[r]`` bytes/s, split evenly between that host's workers and servers."""
    groups = [n.group for n in sched.nodes.values()]
    for r, node in enumerate(sched.nodes.values()):
        mates = groups.count(node.group) if node.group >= 0 else 1
        share = link[r] / (mates * S)  # each flow's rate on the host's link
        rows = []
        for s in range(S):
            t = PART / share
            rows.append([node.id, P.server_id(s), PART, 100.0, 100.0 + t, 0])
            rows.append([P.server_id(s), node.id, PART, 100.0, 100.0 + t, 0])
        body = {"round": rnd, **flags}
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
    scaled = per_host_network(net, [0, 1], hosts, hosts.counts)
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
        assert p.one_push_per_host is flag
        got[flag] = p.node_network()
        pushes = np.ones(2) if flag else hosts.counts
        want = per_host_network(net, p.servers, hosts, pushes)
        assert got[flag].up == pytest.approx(want.up) and got[flag].down == pytest.approx(want.down)
    # the 3-worker host's caps: its link's, not a third of it
    assert got[True].up[S] == pytest.approx(3 * got[False].up[S])


def test_a_spread_names_a_worker_of_the_host():
    p = Planner("aware", W, S, False, slice_elems=1024)
    p.use_hosts([0, 0, 1, 1])
    p.links.spread_targets = lambda live=None: ["in", 1, [0, 1]]  # hosts 0 and 1
    assert p.spread_targets() == ["in", 1, [0, 2]]  # their lowest worker ranks
    p.links.spread_targets = lambda live=None: ["out", 1, [0, 1]]
    assert p.spread_targets() == ["out", 2, [0, 1]]
