"""Insiders at a node's bulk port: nodes of the job (they hold the secret and channels of
their own) that fill the room kept for frames ahead of their headers, take another node's
channel id, or connect again with a channel's proof."""

from __future__ import annotations

import logging

import numpy as np
import zmq

from hetps.transport import bulk_in
from hetps.transport.codec import Message
from hetps.transport.van import Van

from . import test_bulk
from .test_bulk import SECRET, N, _push, _until

pair = test_bulk.pair  # (the fixture: two secured vans, tx node 1, rx node 2)


def _insider(rx: Van, nid: int) -> Van:
    """A node of the job, ``nid``, connected both ways to rx with its channel open."""
    van = Van(name=f"insider{nid}", secret=SECRET, bulk=True)
    rx.admit(van.connect(2, rx.endpoint, bulk=True), nid)
    van.admit(rx.connect(nid, van.endpoint, bulk=True), 2)
    _until(lambda: van.bulk is not None and 2 in van.bulk.offers, "no offer", van)
    van.send(2, Message("push", req=nid, arrays=[np.ones(N, np.float32)]))
    got = rx.recv(timeout=10)
    assert got is not None and got.sender == nid
    return van


def _headerless(van: Van, frames: int) -> None:
    """Frames no header will ever name, on ``van``'s channel to node 2."""
    chan = van.bulk.out[2]
    for k in range(frames):
        chan.put(np.full(N * 4, k, np.uint8))
    chan.flush(lambda: None)


def test_two_insiders_cannot_fill_the_room_an_honest_peer_needs(pair, monkeypatch, caplog):
    """Two nodes of the job send frames far ahead of any header, as many as they can: each
    fills its own share of what rx keeps (a third of it: three peers) and is refused past
    it, logged; the honest peer's frame ahead of its header is still kept, and its pushes
    arrive exact."""
    tx, rx = pair
    caplog.set_level(logging.WARNING)
    monkeypatch.setattr(bulk_in, "PENDING_MAX", 6 << 20)  # (5 frames of N floats in all)
    monkeypatch.setattr(bulk_in, "PEER_PENDING_MIN", 1 << 20, raising=False)
    insiders = []
    try:
        sent = _push(tx, 0)  # (tx's channel opens)
        np.testing.assert_array_equal(rx.recv(timeout=10).arrays[0], sent)
        insiders = [_insider(rx, 3), _insider(rx, 4)]
        for van in insiders:
            _headerless(van, 4)
        _until(lambda: rx.bulk.rx.refusals.total >= 6, "the insiders were not refused", rx)
        held = rx.bulk.rx.peer_held
        share = (6 << 20) // 3
        assert 0 < held[3] <= share and 0 < held[4] <= share, held
        assert "of that node's share of" in caplog.text
        refused = rx.bulk.rx.refusals.total
        _headerless(tx, 1)  # the honest peer's frame, ahead of its header
        own = rx.bulk.rx.channels[tx.bulk.out[2].cid]
        _until(lambda: own.held > 0 or rx.bulk.rx.refusals.total > refused, "no frame", rx)
        assert own.held == 4 * N and rx.bulk.rx.refusals.total == refused
        for k in (1, 2):
            sent = _push(tx, k)
            got = rx.recv(timeout=10)
            assert got is not None and got.sender == 1 and got.req == k
            np.testing.assert_array_equal(got.arrays[0], sent)
    finally:
        for van in insiders:
            van.close()


def test_an_insider_that_learned_a_channel_id_cannot_take_the_channel(pair, caplog):
    """A node of the job proves its own channel at rx's bulk port but connects under the id
    of tx's channel (read off the wire), before tx's first big send. tx's channel still
    opens and its pushes arrive exact; a second connection with tx's proof (a replay) is
    refused and logged."""
    tx, rx = pair
    caplog.set_level(logging.WARNING)
    theirs = tx.bulk.offers[2]  # (what the insider learned: the id travels in the clear)
    mine = rx.bulk.offer(3)  # (rx's offer to the insider, node 3)
    ctx = zmq.Context()
    try:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.ROUTING_ID, theirs.cid)
        s.setsockopt(zmq.PLAIN_USERNAME, mine["id"])
        s.setsockopt(zmq.PLAIN_PASSWORD, bulk_in.proof_of(mine["k"], mine["id"]))
        s.connect(f"tcp://127.0.0.1:{rx.bulk.rx.port}")
        s.send(b"\x00" * 64)
        own = rx.bulk.rx.channels[mine["id"]]
        _until(lambda: own.early, "the insider's frame did not come", rx)
        for k in range(3):
            sent = _push(tx, k)
            got = rx.recv(timeout=10)
            assert got is not None and got.sender == 1 and got.req == k, "tx's push was lost"
            np.testing.assert_array_equal(got.arrays[0], sent)
        replay = ctx.socket(zmq.DEALER)
        replay.setsockopt(zmq.LINGER, 0)
        replay.setsockopt(zmq.PLAIN_USERNAME, theirs.cid)
        replay.setsockopt(zmq.PLAIN_PASSWORD, bulk_in.proof_of(theirs.key, theirs.cid))
        replay.connect(f"tcp://127.0.0.1:{rx.bulk.rx.port}")
        _until(
            lambda: "refused a second connection for node 1's bulk channel" in caplog.text,
            "the second connection was not logged",
            rx,
        )
    finally:
        ctx.destroy(linger=0)
    assert not rx.bulk.rx.channels[theirs.cid].early
