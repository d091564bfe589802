"""Attacks on a bulk channel that is replaced: a node that rejoins as a new process, or a peer
that offers a new channel while the old one still carries a message."""

from __future__ import annotations

import numpy as np

from hetps.transport.codec import Message
from hetps.transport.van import Van

from . import test_bulk
from .test_bulk import SECRET, N, _push, _until

pair = test_bulk.pair  # (the fixture: two secured vans, tx node 1, rx node 2)


def test_attack_a_rejoined_nodes_old_channel_is_never_closed(pair):
    """Node 1 holds frames for headers not yet read on its channel (up to 512 MiB is its
    share), then dies and comes back as a new process on a new connection. Its new
    channel's hello closes only the channels opened by the *same* connection
    (``on_hello``: ``old.owner == origin``), so the dead process's channel stays open for
    good: its held frames are never freed (two such channels hold the whole 1 GiB budget,
    and then every node's early frames are refused), and its id and proof still pass the
    bulk port's handshake."""
    tx, rx = pair
    _push(tx, 0)
    assert rx.recv(timeout=10) is not None
    old = tx.bulk.out[2]
    old.put(np.full(N * 4, 1, np.uint8))  # a frame no header of the dead process names
    old.flush(lambda: None)
    old_chan = rx.bulk.rx.channels[old.cid]
    _until(lambda: old_chan.held > 0, "the headerless frame was not kept", rx)
    tx.close()  # node 1 dies ...
    new = Van(name="tx2", secret=SECRET, bulk=True)  # ... and comes back
    try:
        rx.admit(new.connect(2, rx.endpoint, bulk=True), 1)
        new.admit(rx.connect(1, new.endpoint, bulk=True), 2)
        _until(lambda: new.bulk is not None and 2 in new.bulk.offers, "no offer", new)
        sent = np.arange(N, dtype=np.float32)
        new.send(2, Message("push", req=1, arrays=[sent]))
        got = rx.recv(timeout=10)
        assert got is not None and got.req == 1
        np.testing.assert_array_equal(got.arrays[0], sent)
        assert old.cid not in rx.bulk.rx.channels, "the dead process's channel is still open"
        assert rx.bulk.rx.pending_bytes == 0, "its held frames are never freed"
    finally:
        new.close()


def test_attack_a_message_behind_a_hello_in_the_waiting_queue_is_dropped(pair):
    """rx offers node 1 a new channel (it connected again) while node 1's push waits for
    its frame. Node 1's hello for the new channel and its next push on it queue behind the
    waiting push. ``Waiting.ready`` decodes the whole queue before the van applies the hello
    (``deliver`` runs after ``ready`` returns), so the push on the new channel is decoded
    against a channel not yet open and dropped ("arrays in ring ... never opened")."""
    from .test_attack_bulk_wait import _gate

    tx, rx = pair
    edit = _gate({0})
    tx.through(edit)
    try:
        sent0 = _push(tx, 0)  # (its frame is a moment late: it waits)
        assert rx.recv(timeout=0.3) is None and rx.inbox.waiting
        old = tx.bulk.offers[2].cid
        tx.admit(rx.connect(1, tx.endpoint, bulk=True), 2)  # rx offers a new channel
        _until(lambda: tx.bulk.offers[2].cid != old, "no new offer", tx)
        sent1 = _push(tx, 1)  # hello, then the push, on the new channel
        assert rx.recv(timeout=0.3) is None
    finally:
        edit.open.set()
    got = [rx.recv(timeout=5), rx.recv(timeout=5)]
    assert got[0] is not None and got[0].req == 0
    np.testing.assert_array_equal(got[0].arrays[0], sent0)
    assert got[1] is not None, "the push on the new channel was dropped"
    np.testing.assert_array_equal(got[1].arrays[0], sent1)


def test_attack_a_new_offer_discards_the_frames_still_queued_on_the_old_channel(pair):
    """rx offers node 1 a new channel (it connected again, as after a new node table) while
    node 1's push is still leaving on the old one (its frames queued in the DEALER: a slow
    link). Node 1's next big send closes the old channel with linger 0 (``_close_out`` ->
    ``OutChannel.close()``), so ZeroMQ throws the queued frames away: the push that
    ``send`` returned for is dropped at rx ("bulk frames did not come")."""
    from .test_attack_bulk_wait import _gate

    tx, rx = pair
    edit = _gate({0})
    tx.through(edit)
    rx.bulk.rx.wait_s = 1.0
    parts = [np.full(1 << 20, k, np.float32) for k in range(6)]  # 6 frames of 4 MiB
    try:
        tx.send(2, Message("push", req=0, arrays=parts))
        assert rx.recv(timeout=0.3) is None
        old = tx.bulk.offers[2].cid
        tx.admit(rx.connect(1, tx.endpoint, bulk=True), 2)
        _until(lambda: tx.bulk.offers[2].cid != old, "no new offer", tx)
        _push(tx, 1)  # opens the new channel, closes the old one
    finally:
        edit.open.set()
    got = rx.recv(timeout=10)
    assert got is not None and got.req == 0, "the push still queued on the old channel was lost"
    for a, b in zip(got.arrays, parts, strict=True):
        np.testing.assert_array_equal(a, b)
