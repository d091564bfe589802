"""A push that sends the caller's array itself (``Message.borrowed``, no staging copy) never
lets the caller's later writes reach the wire: the van copies it as it sends (into the
ring, or ZeroMQ's own buffer, never zero-copy), and a request queued behind others takes a
copy of its own before the push call returns."""

from __future__ import annotations

import os
import threading
import time

import numpy as np

from hetps.kvstore.keys import detach
from hetps.kvstore.sender import Sender
from hetps.transport import shm
from hetps.transport.codec import Message
from hetps.transport.van import Van

MiB = 1 << 20


def _mine() -> list[str]:
    return [n for n in os.listdir(shm.SHM_DIR) if n.startswith(f"hetps-shm-{os.getpid()}-")]


def _send_then_overwrite(ring_bytes: int, n: int, rounds: int = 3) -> list[np.ndarray]:
    rx, tx = Van(name="rx", ring_bytes=ring_bytes), Van(name="tx", ring_bytes=ring_bytes)
    got = []
    try:
        rx.admit(tx.connect(1, rx.endpoint), 5)
        tx.send(1, Message("push", arrays=[np.zeros(4, np.float32)]))  # (offers a ring)
        assert rx.recv(timeout=10) is not None
        if ring_bytes:  # the ring is open once the receiver took the offer
            tx.send(1, Message("push", arrays=[np.zeros(n, np.float32)]))
            assert rx.recv(timeout=10) is not None
            assert tx.ring_open(1)
        else:
            assert not tx.ring_open(1)
        for r in range(rounds):
            a = np.full(n, r, np.float32)
            tx.send(1, Message("push", arrays=[a], borrowed=True))
            a[:] = -1.0  # the caller reuses its array as soon as the send returned
            msg = rx.recv(timeout=30)
            assert msg is not None
            got.append(np.array(msg.arrays[0]))
            rx.release(msg)
    finally:
        tx.close()
        rx.close()
    return got


def test_a_borrowed_array_over_tcp_is_copied_by_zeromq_before_send_returns():
    n = 8 * MiB  # 32 MiB: ZeroMQ's I/O thread would still be reading it, were it zero-copy
    for r, arr in enumerate(_send_then_overwrite(0, n)):
        assert (arr == r).all(), f"round {r}: the caller's later write was sent"


def test_a_borrowed_array_through_a_ring_is_in_the_ring_when_send_returns():
    n = 1 * MiB  # 4 MiB into an 8 MiB ring
    for r, arr in enumerate(_send_then_overwrite(8 * MiB, n)):
        assert (arr == r).all(), f"round {r}: the caller's later write was sent"
    assert not _mine()


def test_a_request_queued_behind_another_takes_a_copy_as_it_is_queued():
    sender = Sender()
    gate, running = threading.Event(), threading.Event()
    sent: list[np.ndarray] = []
    try:

        def first() -> None:  # sent inline: holds the sender while the second is queued
            running.set()
            gate.wait(10)

        t = threading.Thread(target=sender.submit, args=("a", 0, first))
        t.start()
        assert running.wait(10)
        caller = np.arange(1000, dtype=np.float32)
        msg = Message("push", arrays=[caller], borrowed=True)
        detached = []

        def own() -> None:
            detached.append(True)
            detach(msg)

        sender.submit("b", 0, lambda: sent.append(np.array(msg.arrays[0])), detach=own)
        assert detached == [True] and not msg.borrowed
        assert not np.shares_memory(msg.arrays[0], caller)
        caller[:] = -1  # the push call has returned: the caller writes its array
        gate.set()
        t.join(10)
        deadline = time.monotonic() + 10
        while True:  # the sender thread sends "b" and goes idle: then "c" goes at once
            with sender._cv:
                if not sender._busy and not sender._heap:
                    break
            assert time.monotonic() < deadline, "the sender never went idle"
            time.sleep(0.001)  # polls the sender's state
        sender.submit("c", 0, lambda: None, detach=lambda: detached.append(False))
        assert detached == [True]  # sent at once, from the caller: no copy
    finally:
        gate.set()
        sender.close()
    assert len(sent) == 1 and (sent[0] == np.arange(1000)).all()


class _Done:
    def __init__(self, done: bool) -> None:
        self._done = done

    def done(self) -> bool:
        return self._done


def test_chunks_that_must_wait_are_copied_into_the_keys_staging_buffer():
    from hetps.kvstore.keys import Borrowed, KeyMeta

    meta = KeyMeta((100,), np.dtype(np.float32), parts=[])
    caller = np.arange(100, dtype=np.float32)
    msgs = [Message("push", arrays=[caller[a:b]], borrowed=True) for a, b in ((0, 60), (60, 100))]
    lent = Borrowed(meta)
    lent.owner(msgs[0], 0, 60)()
    lent.owner(msgs[1], 60, 100)()
    stage = meta.stage
    assert stage is not None and not np.shares_memory(stage, caller)
    for m in msgs:
        assert not m.borrowed and np.shares_memory(m.arrays[0], stage)
    caller[:] = -1
    assert (np.concatenate([m.arrays[0] for m in msgs]) == np.arange(100)).all()
    # the next push reuses the buffer once the last one was answered, else takes a new one
    meta.pushed = [_Done(True)]
    m = Message("push", arrays=[caller[:10]], borrowed=True)
    Borrowed(meta).owner(m, 0, 10)()
    assert meta.stage is stage and np.shares_memory(m.arrays[0], stage)
    meta.pushed = [_Done(False)]
    m = Message("push", arrays=[caller[:10]], borrowed=True)
    Borrowed(meta).owner(m, 0, 10)()
    assert meta.stage is not stage and not np.shares_memory(m.arrays[0], stage)
    assert (m.arrays[0] == -1).all()
