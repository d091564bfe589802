"""The scheduler's side of one message per host: a host's leader arrives for its host's
workers (``host``), is answered once for them, a worker that then arrives itself (its leader
gone) is counted once, and an arrival for a worker of another host is refused; a host's link
report is read per worker, in bulk."""

from __future__ import annotations

import numpy as np
import pytest

from hetps.balance.reports import host_ids, longest_named, named, spans
from hetps.cluster import protocol as P
from hetps.cluster.protocol import NodeInfo
from hetps.roles import new_scheduler
from hetps.transport.codec import Message
from roles import loopback_config

W0, W1, W2 = 9, 11, 13  # W0 and W1 on host 0, W2 on host 1


@pytest.fixture
def sched():
    s = new_scheduler(loopback_config("scheduler", num_worker=3))
    s.nodes = {
        8: NodeInfo(8, "server", 0, "127.0.0.1", 1),
        W0: NodeInfo(W0, "worker", 0, "127.0.0.1", 2, group=0),
        W1: NodeInfo(W1, "worker", 1, "127.0.0.1", 3, group=0),
        W2: NodeInfo(W2, "worker", 2, "127.0.0.1", 4, group=1),
    }
    s.sent = []
    s.send_to = lambda nid, msg: s.sent.append((nid, msg.cmd, msg.req, msg.error))
    yield s
    s.van.close()


def _arrive(s, nid: int, n: int, req: int, host: list[int] | None = None) -> None:
    body = {"group": "worker", "n": n, **({"host": host} if host is not None else {})}
    s._dispatch(Message(P.BARRIER, sender=nid, req=req, body=body))


def test_a_hosts_arrival_is_answered_once_for_its_workers(sched):
    _arrive(sched, W0, 1, req=5, host=[W0, W1])
    assert sched.sent == []  # worker 2 is not there yet
    _arrive(sched, W2, 1, req=6)
    assert sorted(sched.sent) == [(W0, P.BARRIER_DONE, 5, None), (W2, P.BARRIER_DONE, 6, None)]


@pytest.mark.parametrize("own_first", [False, True])
def test_a_worker_that_arrives_itself_after_its_leader_counts_once(sched, own_first):
    """Its leader died, or it dropped its leader (a hand left unread), which, busy, read the
    hand all the same and arrives for its host after it: each arrival is answered."""
    if own_first:
        _arrive(sched, W1, 1, req=7)
    _arrive(sched, W0, 1, req=5, host=[W0, W1])
    if not own_first:
        _arrive(sched, W1, 1, req=7)  # its leader died: it sends its own, for the same barrier
    assert sched.sent == []  # still waiting for worker 2, not released by a double count
    _arrive(sched, W2, 1, req=6)
    assert sorted(sched.sent) == [
        (W0, P.BARRIER_DONE, 5, None),
        (W1, P.BARRIER_DONE, 7, None),
        (W2, P.BARRIER_DONE, 6, None),
    ]


def test_an_arrival_for_a_worker_of_another_host_is_refused(sched):
    _arrive(sched, W0, 1, req=5, host=[W0, W2])
    assert [(nid, req) for nid, _, req, _ in sched.sent] == [(W0, 5)]
    assert "no host 0" in sched.sent[0][3]
    assert sched.barriers.groups["worker"].reached == {}


def test_a_hosts_report_is_read_per_worker_in_bulk():
    nodes = {
        W0: NodeInfo(W0, "worker", 0, "", 0, group=0),
        W1: NodeInfo(W1, "worker", 1, "", 0, group=0),
    }
    nodes[W2] = NodeInfo(W2, "worker", 2, "", 0, group=1)
    # worker 0: two server times (0.5 s, 0.25 s), worker 1: one (0.75 s) and one naming no server
    times = np.array([[0, 1e6, 0.5], [1, 1e6, 0.25], [1, 1e6, 0.75], [9, 1e6, 3.0]])
    samples = np.zeros((5, 6))
    ids = host_ids(nodes, W0, [W0, W1], [[3, 2], [2, 2]], [samples, times])
    assert ids == [W0, W1]
    mine, worked = named(times, servers=2), spans([(times, [[3, 2], [2, 2]])], servers=2)
    assert mine.tolist() == [True, True, True, False] and worked == [0.5, 0.75]
    assert spans([(times[:2], None)], servers=2) == [0.5]  # a worker's own report: one span
    # a round's reports read together: each report's spans, in report order
    both = [(times[2:], None), (times, [[3, 2], [2, 2]]), (times[:0], None), (times[3:], None)]
    both.append((times[1:2], None))  # (an empty report, one naming no server: no span)
    assert spans(both, servers=2) == [0.75, 0.5, 0.75, 0.25]
    assert host_ids(nodes, W0, None, None, [samples, times]) == [W0]
    assert "of no host 0" in host_ids(nodes, W0, [W0, W2], [[3, 2], [2, 2]], [samples, times])
    assert "do not add up" in host_ids(nodes, W0, [W0, W1], [[3, 2], [2, 1]], [samples, times])


def test_each_workers_longest_time_gives_the_spans_of_all_its_times():
    # what a host's leader sends of its workers' server times when the plan fits no line per
    # server: the spans the planner reads are those of every time, value for value
    rng = np.random.default_rng(5)
    reports = []
    for _ in range(40):
        n = int(rng.integers(0, 6))
        times = np.c_[rng.integers(-1, 4, n), rng.uniform(0, 1e6, n), rng.uniform(-0.1, 1, n)]
        times[rng.random(n) < 0.1, 2] = np.nan  # (and ranks 3 and -1: no server of three)
        reports.append((times, None))
    short = [(longest_named(t, servers=3), None) for t, _ in reports]
    assert all(len(t) <= 1 for t, _ in short)
    assert spans(short, servers=3) == spans(reports, servers=3)
    assert len(spans(reports, servers=3)) > 20  # (most workers have a span)
