"""Marks on the bulk channels (transport/bulk.py): a timed message's arrays are led by an
empty sealed frame whose arrival starts the receiver's clock (network-aware balancing times
its links from them, docs/BALANCE.md "Measurement"). Two secured vans over real sockets, the
bulk connection through the recording relay of test_bulk."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest
import zmq

from hetps.transport import bulk_in
from hetps.transport.codec import Message

from .test_bulk import N, _until, pair  # noqa: F401 - the fixture

DELAY_S = 0.4


def _timed(tx, k: int, timed: bool = True) -> np.ndarray:
    a = np.arange(N, dtype=np.float32) + np.float32(k)
    tx.send(2, Message("push", req=k, arrays=[a], timed=timed))
    return a


def test_a_timed_message_is_clocked_from_its_mark_not_from_its_header(pair):  # noqa: F811
    """The relay holds the bulk connection's first frame (the mark) for DELAY_S, as a link
    busy with earlier bytes would: the mark's stamp comes after that wait and the span to the
    whole message leaves it out, while the header (on the CURVE connection) came at once. An
    untimed message sends no mark (one frame on the bulk connection) and gets no stamp."""
    tx, rx = pair

    def hold_first(i: int, body: bytes) -> list[bytes]:
        if i == 0:
            time.sleep(DELAY_S)  # (the relay's own thread: a slow link, not a wait for a peer)
        return [body]

    relay = tx.through(hold_first)
    t_send = time.time()
    sent = _timed(tx, 0)
    got = rx.recv(timeout=10)
    assert got is not None and got.req == 0
    np.testing.assert_array_equal(got.arrays[0], sent)
    assert got.mark is not None
    t0, late, t1 = got.mark
    assert t0 - t_send >= DELAY_S, (t0 - t_send, "the clock started before the bytes came")
    assert 0 <= t1 - t0 < DELAY_S, t1 - t0
    assert not late
    assert len(relay.frames) == 2 and len(relay.frames[0]) == bulk_in.CTR + bulk_in.TAG

    plain = _timed(tx, 1, timed=False)
    got = rx.recv(timeout=10)
    assert got is not None and got.req == 1 and got.mark is None
    np.testing.assert_array_equal(got.arrays[0], plain)
    assert len(relay.frames) == 3  # (no mark)


def test_a_replayed_mark_is_refused(pair, caplog):  # noqa: F811
    """The mark sent twice on the connection: the copy is refused as a replay, the message
    arrives exact with its stamp, and the next one too."""
    tx, rx = pair
    caplog.set_level(logging.WARNING)
    tx.through(lambda i, body: [body, body] if i == 0 else [body])
    sent = [_timed(tx, k) for k in range(2)]
    for k in range(2):
        m = rx.recv(timeout=10)
        assert m is not None and m.req == k and m.mark is not None
        np.testing.assert_array_equal(m.arrays[0], sent[k])
    assert "was used already (a replay)" in caplog.text


def test_marks_without_messages_are_bounded_and_the_channel_goes_on(pair, caplog):  # noqa: F811
    """A node of the job that sends marks and never the messages that name them: at most
    MAX_MARKS are kept (the oldest go, each logged as a refusal); its later timed message
    still arrives exact and stamped, and the marks it skipped are forgotten once taken."""
    tx, rx = pair
    caplog.set_level(logging.WARNING)
    chan = tx.bulk.out[2] if 2 in tx.bulk.out else None
    if chan is None:  # (the channel opens with the first big send)
        _timed(tx, 0, timed=False)
        assert rx.recv(timeout=10) is not None
        chan = tx.bulk.out[2]
    extra = bulk_in.MAX_MARKS + 6
    for _ in range(extra):
        chan.put_mark()
    chan.flush(lambda: None)
    sent = _timed(tx, 1)
    got = rx.recv(timeout=10)
    assert got is not None and got.req == 1 and got.mark is not None
    np.testing.assert_array_equal(got.arrays[0], sent)
    inchan = next(iter(rx.bulk.rx.channels.values()))
    assert not inchan.marks  # (all below the counters it took)
    assert "marks ahead" in caplog.text
    assert rx.bulk.rx.refusals.total >= 6


def test_a_header_naming_a_mark_that_never_came_is_delivered_untimed(pair):  # noqa: F811
    """The sender names a mark counter but never sends its frame: the message is still
    delivered, exact, with no stamp (its timing is lost, never its values)."""
    tx, rx = pair
    _timed(tx, 0, timed=False)
    assert rx.recv(timeout=10) is not None
    chan = tx.bulk.out[2]

    def skip_mark() -> int:
        pos = chan.next
        chan.next += 1  # (reserved, never queued)
        return pos

    chan.put_mark = skip_mark
    sent = _timed(tx, 1)
    got = rx.recv(timeout=10)
    assert got is not None and got.req == 1 and got.mark is None
    np.testing.assert_array_equal(got.arrays[0], sent)


def test_empty_frames_before_the_hello_count_against_the_channels_budget(
    pair,  # noqa: F811
    monkeypatch,
):
    """A connection that proved an offered channel (its node, or one who writes into that
    plain TCP connection) sends empty frames and never the hello: each frame kept for the
    hello is charged what keeping it costs (at least KEEP_COST), so the channel's budget
    bounds how many are kept. An empty frame counted by its bytes cost nothing: the list of
    frames kept for the hello grew without end."""
    tx, rx = pair
    monkeypatch.setattr(bulk_in, "CHANNEL_PENDING_MAX", 1 << 20)
    offer = rx.bulk.offer(3)  # (rx's offer to a node 3, whose hello never comes)
    chan = rx.bulk.rx.channels[offer["id"]]
    sent = 3000
    ctx = zmq.Context()
    try:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.ROUTING_ID, offer["id"])
        s.setsockopt(zmq.PLAIN_USERNAME, offer["id"])
        s.setsockopt(zmq.PLAIN_PASSWORD, bulk_in.proof_of(offer["k"], offer["id"]))
        s.connect(f"tcp://127.0.0.1:{rx.bulk.rx.port}")
        for _ in range(sent):
            s.send(b"")
        _until(
            lambda: len(chan.early) + rx.bulk.rx.refusals.total >= sent,
            "the frames did not come",
            rx,
        )
    finally:
        ctx.destroy(linger=0)
    assert len(chan.early) <= (1 << 20) // bulk_in.KEEP_COST, len(chan.early)
    assert rx.bulk.rx.refusals.total >= sent - (1 << 20) // bulk_in.KEEP_COST


def test_a_timed_message_that_cannot_be_encoded_leaves_nothing_queued(pair):  # noqa: F811
    """A timed message whose array has a dtype the wire does not carry is refused at the
    send (ValueError naming the dtype) after its mark took a counter: the mark is not left
    queued on the channel to go out with the next message's frames."""
    tx, rx = pair
    _timed(tx, 0, timed=False)  # (the channel opens with the first big send)
    assert rx.recv(timeout=10) is not None
    chan = tx.bulk.out[2]
    bad = np.zeros(N, np.complex64)
    with pytest.raises(ValueError, match="complex64"):
        tx.send(2, Message("push", req=1, arrays=[bad], timed=True))
    assert not chan._queue, chan._queue
    sent = _timed(tx, 2)
    got = rx.recv(timeout=10)
    assert got is not None and got.req == 2 and got.mark is not None
    np.testing.assert_array_equal(got.arrays[0], sent)


def test_a_mark_replayed_before_the_hello_is_refused_at_the_hello(pair, caplog):  # noqa: F811
    """The first timed message opens the channel; its mark is sent twice on the wire and
    both copies reach the bulk port before the hello is read: at the hello the copy is
    refused and counted, as a replayed array frame is, and the message arrives exact."""
    tx, rx = pair
    caplog.set_level(logging.WARNING)
    tx.through(lambda i, body: [body, body] if i == 0 else [body])
    sent = _timed(tx, 0)
    chan = rx.bulk.rx.channels[tx.bulk.out[2].cid]
    deadline = time.monotonic() + 10
    while len(chan.early) < 3:  # (the receive loop reaching the bulk port first)
        assert time.monotonic() < deadline, "the frames did not come"
        rx.bulk.rx.drain()
        rx.bulk.rx.sock.poll(10)
    got = rx.recv(timeout=10)
    assert got is not None and got.req == 0
    np.testing.assert_array_equal(got.arrays[0], sent)
    assert rx.bulk.rx.refusals.total == 1
    assert "before its hello" in caplog.text
