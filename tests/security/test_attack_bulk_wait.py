"""Attacks on how a message waits for its bulk frames (transport/bulk_in.py Waiting,
transport/inbox.py), each from an attacker's review: a late frame after an idle spell,
replays that would keep a lost frame's message waiting, messages piled up behind a waiting
one, and a keyless frame injected to abort one."""

from __future__ import annotations

import threading
import time

import numpy as np

from hetps.transport.codec import Message

from . import test_bulk
from .test_bulk import _push
from .zmtp import frame_header

pair = test_bulk.pair  # (the fixture: two secured vans, tx node 1, rx node 2)


def _gate(hold: set[int]):
    """A relay edit that holds back the frames whose index is in ``hold`` until
    ``edit.open`` is set (the relay's thread waits there, as a slow link would)."""
    opened = threading.Event()

    def edit(i: int, body: bytes) -> list[bytes]:
        if i in hold:
            opened.wait(30)
        return [body]

    edit.open = opened
    return edit


def test_attack_first_message_after_an_idle_spell_is_dropped(pair):
    """A channel that carried nothing for longer than the frame wait (20 s: any job between
    two phases, or the first big push more than 20 s after the offer) drops the next message
    whose header overtakes its frame, at once: ``Waiting.ready`` measures the quiet from the
    channel's last frame, not from when the message began to wait. No attacker needed."""
    tx, rx = pair
    edit = _gate({1})
    tx.through(edit)
    first = _push(tx, 0)
    np.testing.assert_array_equal(rx.recv(timeout=10).arrays[0], first)
    chan = rx.bulk.rx.channels[tx.bulk.out[2].cid]
    chan.heard -= 60.0  # (the channel was idle for a minute)
    try:
        second = _push(tx, 1)  # its frame is a moment behind its header (the relay holds it)
        assert rx.recv(timeout=0.3) is None  # (the receive loop runs on: no frame yet)
    finally:
        edit.open.set()
    got = rx.recv(timeout=10)
    assert got is not None and got.req == 1, "the push was dropped at once, its frame 0.3 s late"
    np.testing.assert_array_equal(got.arrays[0], second)


def test_attack_replayed_frames_keep_a_lost_frames_message_waiting_forever(pair):
    """An on-path attacker drops one frame (push 1's) and replays an old recorded frame
    (push 0's) on the bulk connection now and then. Every refused frame still counts as
    "heard" (``_on_frame`` sets ``chan.heard`` before its checks), so push 1 never expires
    and every later message of tx (here a ping) waits behind it for ever, held in memory."""
    tx, rx = pair
    relay = tx.through(lambda i, body: [] if i == 1 else [body])
    rx.bulk.rx.wait_s = 0.5
    _push(tx, 0)
    assert rx.recv(timeout=10).req == 0
    _push(tx, 1)  # (its frame is dropped on the wire)
    tx.send(2, Message("ping", req=2))
    srv = relay.socks[2]  # (the relay's connection to rx's bulk port)
    replay = frame_header(len(relay.frames[0])) + relay.frames[0]
    got = None
    deadline = time.monotonic() + 3.0  # six times the frame wait
    while got is None and time.monotonic() < deadline:
        srv.sendall(replay)
        got = rx.recv(timeout=0.1)
    assert rx.bulk.rx.refusals.total >= 1  # the replays were refused...
    assert got is not None and got.req == 2, "...but tx's connection is wedged behind push 1"


def test_attack_messages_behind_a_waiting_one_are_held_without_bound(pair):
    """A node of the job (or an on-path attacker that drops one bulk frame while a node
    streams) gets the receiver to read and hold every later message of that connection in
    Python memory: ``Waiting`` has no bound, and ZeroMQ's high-water mark no longer pushes
    back, since the receive thread reads the ROUTER on. Here 40 MiB stay held behind one
    push whose frame never comes; with the replay above, they are never let go."""
    tx, rx = pair
    tx.through(lambda i, body: [] if i == 0 else [body])
    rx.bulk.rx.wait_s = 3600.0
    _push(tx, 0)  # (its frame is lost)
    del tx.bulk.offers[2]  # what follows crosses the CURVE connection, inline
    big = np.zeros(2 << 20, np.float32)  # 8 MiB
    for k in range(5):
        tx.send(2, Message("push", req=10 + k, arrays=[big]))
    while rx.recv(timeout=0.5) is None and rx._router.poll(0):
        pass
    held = sum(len(f.buffer) for q in rx.inbox.waiting.queues.values() for e in q for f in e[0])
    assert held < 16 << 20, f"{held >> 20} MiB held behind one waiting message"


def test_attack_an_injected_frame_aborts_a_waiting_message(pair):
    """SECURITY.md: "Only the channel's own sender can abort its message with a counter out
    of order: an injected frame needs the channel's key." ``place`` marks the waiting
    message failed ("skipped by its sender") on the counter alone, before the frame's tag
    is checked: a frame made up on the wire (no key) aborts the push whose genuine frame
    is a moment behind it."""
    tx, rx = pair
    edit = _gate({1})
    relay = tx.through(edit)
    first = _push(tx, 0)
    np.testing.assert_array_equal(rx.recv(timeout=10).arrays[0], first)
    try:
        second = _push(tx, 1)  # (its frame, counter 1, is held back)
        assert rx.recv(timeout=0.2) is None
        forged = (7).to_bytes(8, "big") + bytes(64)  # counter 7, no key, no valid tag
        relay.socks[2].sendall(frame_header(len(forged)) + forged)
        assert rx.recv(timeout=0.3) is None
    finally:
        edit.open.set()
    got = rx.recv(timeout=10)
    assert got is not None and got.req == 1, "a keyless injected frame aborted the push"
    np.testing.assert_array_equal(got.arrays[0], second)
