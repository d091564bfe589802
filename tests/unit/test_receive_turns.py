"""One turn of a receive loop reads every message queued on its socket (many peers' messages
at once: a scheduler's host reports of a round), in the order each peer sent them, and no
further than a message whose arrays are lent: one read behind another is still lent when it is
handed out."""

from __future__ import annotations

import numpy as np
import zmq

from hetps.transport.codec import Message, encode
from hetps.transport.van import RING_MIN_BYTES, Van

MiB = 1 << 20


def test_a_turn_reads_what_many_peers_queued_each_in_its_order():
    rx = Van(name="rx")
    ctx = zmq.Context()
    peers, each = 40, 3
    socks = []
    try:
        for p in range(peers):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 5000)
            s.setsockopt(zmq.ROUTING_ID, b"p%d" % p)
            s.connect(f"tcp://{rx.endpoint}")
            rx.admit(b"p%d" % p, 100 + p)
            socks.append(s)
        for k in range(each):
            for p, s in enumerate(socks):
                msg = Message("report", req=k, body={"k": k}, arrays=[np.full(4, p * 10.0 + k)])
                s.send_multipart(encode(msg))
        for s in socks:
            s.close()
        ctx.term()  # (returns once every message is out of the senders' queues)
        got, turns = [], 0
        while len(got) < peers * each:
            batch = rx.inbox.recv_many(timeout=10)
            assert batch, f"only {len(got)} of {peers * each} messages came"
            got += batch
            turns += 1
        assert rx.inbox.recv_many(timeout=0.05) == []
        for p in range(peers):  # every message once, each peer's in the order it sent them
            mine = [m for m in got if m.sender == 100 + p]
            assert [m.req for m in mine] == list(range(each))
            for k, m in enumerate(mine):
                assert m.body == {"k": k}
                np.testing.assert_array_equal(m.arrays[0], np.full(4, p * 10.0 + k))
        assert turns < peers  # not a poll per message: the socket is read while it has more
    finally:
        for s in socks:
            s.close(linger=0)
        if not ctx.closed:
            ctx.term()
        rx.close()


def test_a_lent_message_read_behind_another_is_still_lent_when_handed_out():
    rx, tx = Van(name="rx", ring_bytes=8 * MiB), Van(name="tx", ring_bytes=8 * MiB)
    rx.borrow = frozenset({"push"})
    big = np.arange(RING_MIN_BYTES // 4 + 16, dtype=np.float32)
    try:
        rx.admit(tx.connect(1, rx.endpoint), 5)
        tx.send(1, Message("push", arrays=[big]))  # inline: the ring is offered
        assert rx.recv(timeout=10).lease is None
        tx.send(1, Message("note", body={"n": 1}))
        tx.send(1, Message("push", arrays=[big + 1]))  # into the ring, lent to the handler
        first, held = rx.recv(timeout=10), rx.recv(timeout=10)
        assert first.cmd == "note" and held.cmd == "push"
        assert held.lease is not None and held.lease.holds(held.arrays[0])  # not a copy
        np.testing.assert_array_equal(held.arrays[0], big + 1)
        tx.send(1, Message("note", body={"n": 2}))
        after = rx.recv(timeout=10)  # the next call gives its space back
        assert after.body == {"n": 2} and held.lease is None
        np.testing.assert_array_equal(held.arrays[0], big + 1)
    finally:
        tx.close()
        rx.close()
