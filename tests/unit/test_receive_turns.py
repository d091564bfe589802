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


def test_a_message_read_before_its_connection_is_admitted_takes_its_sender_when_handed_out():
    """A node table (from the scheduler) and a worker's first requests can be read in one turn:
    the requests' connection is admitted only when the table is handled, after they were read,
    and they must not reach the handler as from no node of the job."""
    rx = Van(name="rx")
    ctx = zmq.Context()
    admitter, newcomer = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    try:
        for s, rid in ((admitter, b"sched"), (newcomer, b"new")):
            s.setsockopt(zmq.LINGER, 5000)
            s.setsockopt(zmq.ROUTING_ID, rid)
            s.connect(f"tcp://{rx.endpoint}")
        rx.admit(b"sched", 1)
        admitter.send_multipart(encode(Message("table", body={"admit": 9})))
        admitter.close()
        for k in range(3):
            newcomer.send_multipart(encode(Message("init", req=k)))
        newcomer.close()
        ctx.term()  # (every message queued at rx before it reads)
        table = rx.recv(timeout=10)
        assert table.cmd == "table" and table.sender == 1
        rx.admit(b"new", table.body["admit"])  # what handling the table does
        got = [rx.recv(timeout=10) for _ in range(3)]
        assert [(m.cmd, m.req, m.sender) for m in got] == [("init", k, 9) for k in range(3)]
        assert rx.inbox.recv_many(timeout=0.05) == []
    finally:
        for s in (admitter, newcomer):
            s.close(linger=0)
        if not ctx.closed:
            ctx.term()
        rx.close()


def test_a_turn_ends_at_a_message_from_an_unknown_connection():
    """The scheduler hands out one turn's messages together: one from a connection it does not
    know yet (a registration) ends the turn, so the messages behind it take its sender."""
    rx = Van(name="rx")
    ctx = zmq.Context()
    newcomer = ctx.socket(zmq.DEALER)
    try:
        newcomer.setsockopt(zmq.LINGER, 5000)
        newcomer.setsockopt(zmq.ROUTING_ID, b"new")
        newcomer.connect(f"tcp://{rx.endpoint}")
        for k in range(3):
            newcomer.send_multipart(encode(Message("register", req=k)))
        newcomer.close()
        ctx.term()
        first = rx.inbox.recv_many(timeout=10)
        assert [(m.req, m.sender) for m in first] == [(0, 0)]
        rx.admit(b"new", 7)  # what handling the registration does
        rest = []
        while len(rest) < 2:
            rest += rx.inbox.recv_many(timeout=10)
        assert [(m.req, m.sender) for m in rest] == [(1, 7), (2, 7)]
    finally:
        newcomer.close(linger=0)
        if not ctx.closed:
            ctx.term()
        rx.close()


def test_queued_says_whether_a_message_is_ready_or_waits_on_the_socket():
    """What the scheduler's loop asks before it holds for more of a round's reports."""
    rx = Van(name="rx")
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    try:
        s.setsockopt(zmq.ROUTING_ID, b"p0")
        s.connect(f"tcp://{rx.endpoint}")
        rx.admit(b"p0", 100)
        assert not rx.inbox.queued()
        s.send_multipart(encode(Message("report", req=1, body={"k": 1})))
        assert rx.inbox.router.poll(10000) & zmq.POLLIN  # (on the socket, not read)
        assert rx.inbox.queued()
        got = rx.inbox.recv_many(timeout=10)
        assert [m.req for m in got] == [1] and not rx.inbox.queued()
        rx.inbox.ready.append(got[0])  # (read off the socket, not handed out yet)
        assert rx.inbox.queued()
    finally:
        s.close(linger=0)
        ctx.term()
        rx.close()
