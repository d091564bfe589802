"""Pushes read straight out of the shared-memory ring (``Van.borrow``): the server merges a
ring-borne push from the ring's own memory, and the ring's space goes back to the sender only
once the handler is done with it; a push kept for later (the backlog) owns a copy, and the
first push of a round is never kept as ring memory."""

from __future__ import annotations

import os

import numpy as np

from hetps.kvstore.server import KVServer
from hetps.roles import new_server
from hetps.transport import shm
from hetps.transport.codec import Message
from hetps.transport.van import RING_MIN_BYTES, Van

MiB = 1 << 20
N = RING_MIN_BYTES // 4 + 16  # float32 elements: just above the ring's bound, ~2 MiB


def _mine() -> list[str]:
    return [n for n in os.listdir(shm.SHM_DIR) if n.startswith(f"hetps-shm-{os.getpid()}-")]


def _vals(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(N).astype(np.float32)


def test_a_lent_push_keeps_its_ring_space_until_released_then_owns_what_is_kept():
    rx, tx = Van(name="rx", ring_bytes=8 * MiB), Van(name="tx", ring_bytes=8 * MiB)
    rx.borrow = frozenset({"push"})
    try:
        rx.admit(tx.connect(1, rx.endpoint), 5)
        tx.send(1, Message("push", arrays=[_vals(0)]))  # inline: the ring is offered
        assert rx.recv(timeout=10).lease is None
        ring = tx._rings_out[1]
        a = _vals(1)
        tx.send(1, Message("push", arrays=[a]))
        held = rx.recv(timeout=10)
        assert held.lease is not None and held.lease.holds(held.arrays[0])  # no copy
        assert not held.arrays[0].flags.writeable
        # not released yet: the sender may not write over it, however much it sends
        sent = [_vals(i) for i in range(2, 8)]
        for s in sent:
            tx.send(1, Message("push", arrays=[s]))
        assert ring.head <= ring.size  # it stopped at the held frame: the rest went inline
        np.testing.assert_array_equal(held.arrays[0], a)
        kept = held  # as the server's backlog keeps a push for the next round
        got = [rx.recv(timeout=10) for _ in sent]  # the next recv releases it
        (inn,) = rx._rings_in.values()
        assert kept.lease is None and not inn.holds(kept.arrays[0])  # a copy of its own
        for s, m in zip(sent, got, strict=True):
            np.testing.assert_array_equal(m.arrays[0], s)
        rx.release(got[-1])
        for i in range(8, 16):  # lap the ring twice over the space the kept push had
            tx.send(1, Message("push", arrays=[_vals(i)]))
            np.testing.assert_array_equal(rx.recv(timeout=10).arrays[0], _vals(i))
        assert ring.head > 2 * ring.size
        np.testing.assert_array_equal(kept.arrays[0], a)
    finally:
        tx.close()
        rx.close()
    assert not _mine()


class _Node:
    def __init__(self) -> None:
        self.roles = {9: "worker", 11: "worker"}
        self.replies: list = []

    def role_of(self, node_id: int) -> str | None:
        return self.roles.get(node_id)

    def workers(self) -> list:
        return [n for n, r in self.roles.items() if r == "worker"]

    def reply(self, msg, body=None, arrays=None, track=False):
        self.replies.append((msg.sender, msg.req, body))


def test_a_server_merging_from_the_ring_sums_exactly_while_the_ring_laps():
    """Worker 9 pushes five rounds of a single-chunk part ahead of worker 11 (the first is
    the round's first whole-part push, the others wait in the backlog) and laps its ring
    meanwhile; every round's sum is then exact. Kept as ring memory (the first push, or a
    backlogged one), a push would have been overwritten by the later ones."""
    srv_van = Van(name="srv", ring_bytes=8 * MiB)
    srv_van.borrow = KVServer.BORROWS
    w9, w11 = Van(name="w9", ring_bytes=8 * MiB), Van(name="w11", ring_bytes=8 * MiB)
    node = _Node()
    srv = new_server(node)
    try:
        srv_van.admit(w9.connect(1, srv_van.endpoint), 9)
        srv_van.admit(w11.connect(1, srv_van.endpoint), 11)
        body = {"k": "w", "part": 0, "size": N, "shape": [N], "dtype": "float32"}
        srv.handle(Message("init", sender=9, req=1, body={**body, "off": 0, "n": N},
                           arrays=[np.zeros(N, np.float32)]))  # fmt: skip
        push = {"k": "w", "part": 0, "off": 0, "n": N, "sync": True, "ce": N}
        req = iter(range(100, 1000))

        def send(van: Van, vals: np.ndarray) -> None:
            van.send(1, Message("push", req=next(req), body=dict(push), arrays=[vals]))
            msg = srv_van.recv(timeout=10)  # (releases the message handled before)
            assert msg is not None and msg.cmd == "push"
            srv.handle(msg)

        sl = srv.slices[("w", 0)]
        send(w9, _vals(0))  # round 0: both go inline (their rings are offered)
        send(w11, _vals(100))
        np.testing.assert_array_equal(sl.value, _vals(0) + _vals(100))
        rounds = range(1, 6)
        for r in rounds:  # worker 9 runs ahead: 5 x 2 MiB laps its 8 MiB ring
            send(w9, _vals(r))
        assert w9._rings_out[1].head > w9._rings_out[1].size
        lent = 0
        for r in rounds:
            send(w11, _vals(100 + r))  # completes round r; the backlog starts round r + 1
            lent += srv_van.inbox.lent is not None
            np.testing.assert_array_equal(sl.value, _vals(r) + _vals(100 + r))
        assert lent == len(rounds)  # these pushes were read from the ring, not copied out
        assert not sl.backlog and not sl.got
        errors = [b for _, _, b in node.replies if b and "error" in b]
        assert not errors
    finally:
        w9.close()
        w11.close()
        srv_van.close()
    assert not _mine()
