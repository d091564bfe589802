"""A worker's share of a slice migration (hetps.balance.agent.BalanceAgent._migrate) with a
store wired by hand: which requests go where. After a failover (HETPS_REPLICAS) a dead
server's keys are served by the server that took them over, so a plan that moves a slice
between the two moves nothing: an init there and a drop "from the dead one" (routed to the
same server) would drop the slice itself."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from hetps.balance.agent import BalanceAgent
from hetps.kvstore.keys import KeyMeta
from hetps.kvstore.placement import Part

S0, S1, S2 = 8, 10, 12


class _Store:
    """What _migrate reads of a store: two keys of two slices, three servers; every request
    is recorded and answered at once."""

    def __init__(self, redirect: dict[int, int]) -> None:
        self.node = SimpleNamespace(route=lambda peer: redirect.get(peer, peer))
        self.cfg = SimpleNamespace(colocate=False)
        self.rank, self.num_workers, self.num_servers, self.timeout = 0, 1, 3, 5.0
        self.server_id = [S0, S1, S2].__getitem__
        self.order = ["a", "b"]
        self.meta = {}
        for k in self.order:
            parts = [Part(0, 0, 0, 4), Part(1, 1, 4, 8)]  # (server, index, start, stop)
            self.meta[k] = KeyMeta((8,), np.dtype(np.float32), parts)
            self.meta[k].rounds = 3
        self.sent: list[tuple[int, str, dict]] = []

    def request(self, key, priority, server_rank, msg, callback=None, landing=None):
        self.sent.append((server_rank, msg.cmd, dict(msg.body)))
        arrays = [np.zeros(4, np.float32)] if msg.cmd == "pull" else [np.zeros(0, np.uint8)]
        if msg.cmd == "get_states":
            from hetps import optim

            arrays = [np.frombuffer(optim.dump_states({}), np.uint8)]
        reply = SimpleNamespace(arrays=arrays, body={})
        return SimpleNamespace(wait=lambda timeout=None: reply, done=lambda: True)


def _agent(redirect: dict[int, int]) -> tuple[BalanceAgent, _Store]:
    kv = _Store(redirect)
    return BalanceAgent(kv), kv


def test_a_move_between_a_dead_server_and_its_taker_sends_nothing():
    agent, kv = _agent({S0: S1})  # server 0 died; server 1 serves its keys
    drops = agent._migrate([0, 1, 0, 2], [1, 0, 1, 2], [0])
    assert drops == [] and kv.sent == []


def test_a_move_carries_the_slices_rounds():
    agent, kv = _agent({S0: S1})
    drops = agent._migrate([0, 1, 0, 2], [2, 1, 0, 0], [0])  # a/0: 0 -> 2 (read on 0's taker)
    inits = [(rank, body) for rank, cmd, body in kv.sent if cmd == "init"]
    assert [(r, b["k"], b["part"], b["rnd"]) for r, b in inits] == [(2, "a", 0, 3), (0, "b", 1, 3)]
    assert drops == [(0, [["a", 0, S2]]), (2, [["b", 1, S0]])]  # (each names its new server)
    assert agent._drops([0, 1, 0, 2], [2, 1, 0, 0]) == drops


def _moved(kv: _Store) -> list[tuple[str, int]]:
    return [(b["k"], b["part"]) for _, cmd, b in kv.sent if cmd == "init"]


def test_the_live_workers_move_the_share_of_one_that_died():
    """HETPS_ELASTIC: three movers deal the four moved slices round-robin (by slice index);
    worker 2 dies before it is done, and the two left move its share (slice 2) again, dealt
    over them; worker 0 (this one) redoes nothing it or worker 1 moved."""
    agent, kv = _agent({})
    old, new = [0, 0, 0, 0], [1, 1, 1, 2]
    agent._migrate(old, new, [0, 1, 2])
    assert _moved(kv) == [("a", 0), ("b", 1)]  # slices 0 and 3
    kv.sent.clear()
    agent._migrate(old, new, [0, 1], redo=([0, 1, 2], [2]))
    assert _moved(kv) == [("b", 0)]  # slice 2 (b/0), dealt over [0, 1]: 2 % 2 = 0


def test_joining_is_refused_under_a_plan():
    """A worker started again cannot join under HETPS_BALANCE (it would need the plan's
    layout): it says so before it asks the scheduler anything."""
    import pytest

    from hetps.faults.joining import Joining

    store = SimpleNamespace(balance=True, node=SimpleNamespace(recovery=1, request=None))
    with pytest.raises(RuntimeError, match="not built with HETPS_BALANCE"):
        Joining(store).join()
