"""Numbered barriers: each node counts its own barriers, and the scheduler releases a node at
its barrier n once every live member reached n. A scheduler started again learns how far each
node got (its readmit), so a node left waiting by the dead one is released even though the
others went past that barrier."""

from __future__ import annotations

import pytest

from hetps.cluster import protocol as P
from hetps.cluster.protocol import NodeInfo
from hetps.cluster.scheduler import Scheduler
from hetps.roles import new_scheduler
from hetps.transport.codec import Message
from roles import loopback_config

W0, W1 = 9, 11


@pytest.fixture
def sched():
    s = new_scheduler(loopback_config("scheduler", num_worker=2))
    s.nodes = {
        8: NodeInfo(8, "server", 0, "127.0.0.1", 1),
        W0: NodeInfo(W0, "worker", 0, "127.0.0.1", 2),
        W1: NodeInfo(W1, "worker", 1, "127.0.0.1", 3),
    }
    s.released = []
    s.send_to = lambda nid, msg: (
        s.released.append((nid, msg.req)) if msg.cmd == P.BARRIER_DONE else None
    )
    yield s
    s.van.close()


def _arrive(s: Scheduler, nid: int, n: int, req: int) -> None:
    s._dispatch(Message(P.BARRIER, sender=nid, req=req, body={"group": "worker", "n": n}))


def test_everyone_at_the_same_barrier_is_released_together(sched):
    _arrive(sched, W0, 1, req=5)
    assert sched.released == []
    _arrive(sched, W1, 1, req=6)
    assert sorted(sched.released) == [(W0, 5), (W1, 6)]
    _arrive(sched, W1, 2, req=7)
    assert len(sched.released) == 2  # barrier 2 waits for worker 0


def test_a_node_left_waiting_by_a_dead_scheduler_is_released_by_the_new_one(sched):
    """The old scheduler released barrier 3 to worker 0 and died before worker 1 heard: worker 1
    asks the new one again for barrier 3 while worker 0 waits at barrier 4."""
    sched.barriers.groups["worker"].reached[W0] = 3  # from worker 0's readmit: it passed 3
    _arrive(sched, W1, 3, req=20)
    assert sched.released == [(W1, 20)]
    _arrive(sched, W0, 4, req=21)
    assert sched.released == [(W1, 20)]  # 4 waits for worker 1
    _arrive(sched, W1, 4, req=22)
    assert sorted(sched.released[1:]) == [(W0, 21), (W1, 22)]
