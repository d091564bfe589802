"""A worker's link samples are read once a round whatever the order of its own report and its
host's: a follower that dropped its leader sends its own report of a round whose host's report
(the leader's, merged as :meth:`HostLead._merged` merges it) carries its rows too. Every
message the scheduler takes is answered, and everything its planner keeps (caps, link
matrix, history, the detector's readings, the plans) is that of the job where each report
arrived once."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from hetps.balance.reports import times_shrink
from hetps.balance.wire import unpack_plan
from hetps.cluster import protocol as P
from hetps.cluster.hostlead import HostLead, Report
from hetps.cluster.protocol import NodeInfo
from hetps.roles import make_scheduler
from hetps.transport.codec import Message
from roles import loopback_config

S, W, ROUNDS = 2, 4, 3
PART = 1 << 20  # bytes a worker pushes to each server in a round


@pytest.fixture
def scheduler():
    """A scheduler with its planner (as ``hetps scheduler`` makes it), hosts [0, 0, 1, 1];
    what it sends is kept (node id, message)."""
    made = []

    def make(scheme: str):
        cfg = loopback_config(
            "scheduler", num_worker=W, num_server=S, balance=scheme, slice_elems=1024
        )
        s = make_scheduler(cfg)
        made.append(s)
        s.nodes = {P.server_id(i): NodeInfo(P.server_id(i), "server", i, "h", 1) for i in range(S)}
        for r in range(W):
            s.nodes[P.worker_id(r)] = NodeInfo(P.worker_id(r), "worker", r, "h", 1, r // 2)
        s.sent = []
        s.send_to = lambda nid, msg: s.sent.append((nid, msg))
        return s

    yield make
    for s in made:
        s.van.close()


def _body(rank: int, rnd: int) -> tuple[dict, np.ndarray, np.ndarray]:
    """Worker ``rank``'s report of round ``rnd``: its transfers (a host's overlap, so its
    leader merges them) and its times per server."""
    rows = []
    for s in range(S):
        t = PART / 15e6 * (1 + 0.1 * rank + 0.05 * rnd + 0.2 * s)
        start = 100.0 * rnd + 0.01 * rank
        rows += [[P.worker_id(rank), P.server_id(s), PART, start, start + t, 0]]
        rows += [[P.server_id(s), P.worker_id(rank), PART, start + t, start + 2.1 * t, 0]]
    times = np.array([[s, PART * (1 + s), 0.1 * (1 + rank) + 0.01 * rnd] for s in range(S)])
    body: dict = {"round": rnd}
    if rnd == 1:
        body.update(sizes=[8 * 1024], assign=[i % S for i in range(8)])
    return body, np.array(rows, float), times


def _sent(body: dict, arrays: list, sender: int) -> Message:
    return Message(P.BALANCE_REPORT, sender=P.worker_id(sender), body=body, arrays=arrays)


def _own(rank: int, rnd: int) -> Message:
    body, samples, times = _body(rank, rnd)
    return _sent(body, [samples, times], rank)


def _hosts(rnd: int, scheme: str) -> Message:
    """Host 0's report of round ``rnd`` for workers 0 and 1, as its leader (worker 0) makes it."""
    lead = SimpleNamespace(
        node=SimpleNamespace(cfg=SimpleNamespace(colocate=False)),
        shrink_times=times_shrink(scheme, S),
    )
    batch = {}
    for r in (0, 1):
        body, samples, times = _body(r, rnd)
        batch[P.worker_id(r)] = Report(body, samples.tobytes(), times.tobytes())
    msg = HostLead._merged(lead, rnd, sorted(batch), batch)
    return _sent(msg.body, msg.arrays, 0)


def _plain(x):
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, dict):
        return {repr(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def _run(make, scheme: str, extra: dict[int, list[tuple[int, int]]]) -> tuple[str, list]:
    """Every round: host 0's report, then workers 2 and 3's own; ``extra[at]`` inserts the own
    reports ``(rank, round)`` at that place of each round's list (3: after the round is
    answered). What the planner keeps, as text (floats exact), and each round's answers."""
    sched = make(scheme)
    p = sched.services[P.BALANCE_REPORT].__self__
    answers = []
    for rnd in range(1, ROUNDS + 1):
        msgs = [_hosts(rnd, scheme), _own(2, rnd), _own(3, rnd)]
        for at in sorted(extra, reverse=True):
            msgs[at:at] = [_own(rank, rnd) for rank, _ in extra[at]]
        for req, msg in enumerate(msgs, 1):
            msg.req = req
            sched._dispatch(msg)
            while not sched._service_q.empty():  # (the services' thread's work, run here)
                sched._service_q.get_nowait()()
        sent = [(nid, m.req) for nid, m in sched.sent]
        assert sorted(sent) == sorted((m.sender, m.req) for m in msgs)  # (each once)
        plans = [unpack_plan(Message(m.cmd, body=m.body, arrays=m.arrays)) for _, m in sched.sent]
        assert not [a["error"] for a in plans if "error" in a]
        timed = [{k: v for k, v in a.items() if k != "plan_s"} for a in plans]
        answers.append(sorted({repr(_plain(a)) for a in timed}))  # (less the planner's time)
        sched.sent.clear()
    net = p.links.node_network()
    kept = {"caps": [net.up, net.down], "links": vars(p.links), "table": vars(p.table)}
    kept.update(history=p.history, detector=vars(p.detector), one_push=sorted(p.one_push.items()))
    return repr(_plain(kept)), answers


@pytest.mark.parametrize("scheme", ["aware", "elastic"])
@pytest.mark.parametrize(
    "extra",
    [
        {0: [(1, 0)]},  # worker 1's own report before its host's
        {1: [(1, 0)]},  # after its host's, the round still waiting for workers 2 and 3
        {3: [(1, 0)]},  # after the round was answered
        {0: [(1, 0)], 2: [(1, 0)]},  # its own twice, around its host's
        {2: [(2, 0)]},  # worker 2's own report twice
    ],
    ids=["own-first", "host-first", "after-answer", "own-twice", "flat-twice"],
)
def test_a_workers_samples_are_read_once_a_round_whatever_the_order(scheduler, scheme, extra):
    once, kept = _run(scheduler, scheme, {}), _run(scheduler, scheme, extra)
    assert kept[1] == once[1]  # every round's plans (and rank 0's link matrix and rates)
    assert kept[0] == once[0]
