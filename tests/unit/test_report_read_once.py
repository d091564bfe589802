"""A worker's link samples are read once a round whatever the order of its own report and its
host's: a follower that dropped its leader sends its own report of a round whose host's report
(the leader's, merged as :meth:`HostLead._merged` merges it) carries its rows too. Every
message is answered, and everything the planner keeps (caps, link matrix, history, the
detector's readings, the plans) is that of the job where each report arrived once."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from hetps.balance.reports import times_shrink
from hetps.balance.service import Planner
from hetps.balance.wire import unpack_plan
from hetps.cluster import commands
from hetps.cluster import protocol as P
from hetps.cluster.hostlead import HostLead, Report
from hetps.cluster.protocol import NodeInfo
from hetps.transport.codec import Message

S, W, ROUNDS = 2, 4, 3
PART = 1 << 20  # bytes a worker pushes to each server in a round


class _Sched:
    """The scheduler's side the planner uses: a node table (hosts [0, 0, 1, 1]) and its replies."""

    def __init__(self) -> None:
        self.nodes = {
            P.worker_id(r): NodeInfo(P.worker_id(r), "worker", r, "h", 1, r // 2) for r in range(W)
        }
        self.dead: set = set()
        self.finished: set = set()
        self.answers: list = []

    def reply(self, msg, body, arrays=None):
        self.answers.append((msg, unpack_plan(Message(msg.cmd, body=body, arrays=arrays or []))))


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
    msg = Message(P.BALANCE_REPORT, body=body, arrays=arrays)
    msg.sender = P.worker_id(sender)
    assert commands.decode(msg) is None
    return msg


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


def _run(scheme: str, extra: dict[int, list[tuple[int, int]]]) -> tuple[str, list]:
    """Every round: host 0's report, then workers 2 and 3's own; ``extra[at]`` inserts the own
    reports ``(rank, round)`` at that place of each round's list (3: after the round is
    answered). What the planner keeps, as text (floats exact), and each round's answers."""
    p, sched = Planner(scheme, W, S, False, slice_elems=1024), _Sched()
    answers = []
    for rnd in range(1, ROUNDS + 1):
        msgs = [_hosts(rnd, scheme), _own(2, rnd), _own(3, rnd)]
        for at in sorted(extra, reverse=True):
            msgs[at:at] = [_own(rank, rnd) for rank, _ in extra[at]]
        sched.answers.clear()
        for msg in msgs:
            p.handle(sched, msg)
        assert sorted(id(m) for m, _ in sched.answers) == sorted(map(id, msgs))  # (each once)
        timed = [{k: v for k, v in a.items() if k != "plan_s"} for _, a in sched.answers]
        answers.append(sorted({repr(_plain(a)) for a in timed}))  # (less the planner's time)
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
def test_a_workers_samples_are_read_once_a_round_whatever_the_order(scheme, extra):
    once, kept = _run(scheme, {}), _run(scheme, extra)
    assert kept[1] == once[1]  # every round's plans (and rank 0's link matrix and rates)
    assert kept[0] == once[0]
