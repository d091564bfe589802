"""The worker's request sender with a push credit window (no network: sends are recorded)."""

from __future__ import annotations

import threading

import numpy as np

from hetps.kvstore.sender import Sender


class Rec:
    def __init__(self) -> None:
        self.sent: list[str] = []
        self.cv = threading.Condition()

    def op(self, name: str):
        def send() -> None:
            with self.cv:
                self.sent.append(name)
                self.cv.notify_all()

        return send

    def wait_for(self, n: int) -> list[str]:
        with self.cv:
            assert self.cv.wait_for(lambda: len(self.sent) >= n, timeout=5), self.sent
            return list(self.sent)


def count_notifies(monkeypatch) -> list[int]:
    """The wake-ups of the sender thread by this (the calling) thread, from now on (the
    Conditions made after this call count them)."""
    notified: list[int] = []
    me = threading.get_ident()

    class Counting(threading.Condition):
        def notify(self, n: int = 1) -> None:
            if threading.get_ident() == me:
                notified.append(n)
            super().notify(n)

        def notify_all(self) -> None:
            self.notify(len(self._waiters))

    monkeypatch.setattr(threading, "Condition", Counting)
    return notified


def test_pushes_wait_for_credit_pulls_do_not():
    s = Sender(window=100)
    r = Rec()
    try:
        s.submit("a", 0, r.op("push a"), cost=80)  # alone: goes at once
        s.hold(1, 80, None)
        s.submit("b", 0, r.op("push b"), cost=80)  # 80 + 80 > 100: waits
        s.submit("a", 0, r.op("pull a"))  # a's push went: the pull may pass push b
        s.submit("b", 0, r.op("pull b"))  # must stay behind push b (same key)
        assert r.wait_for(2) == ["push a", "pull a"]
        s.release(1)  # push a arrived
        assert r.wait_for(4) == ["push a", "pull a", "push b", "pull b"]
        s.release(1)  # idempotent
    finally:
        s.close()


def test_one_push_always_goes_even_if_larger_than_the_window():
    s = Sender(window=10)
    r = Rec()
    try:
        s.submit("k", 0, r.op("big"), cost=1000)
        assert r.wait_for(1) == ["big"]
    finally:
        s.close()


def test_credit_of_a_failed_request_is_reclaimed():
    class Done:
        def done(self) -> bool:
            return True

    s = Sender(window=100)
    r = Rec()
    try:
        s.submit("a", 0, r.op("push a"), cost=90)
        s.hold(7, 90, Done())  # its future ended (an error) without a receipt
        s.submit("b", 0, r.op("push b"), cost=90)
        assert r.wait_for(2) == ["push a", "push b"]
    finally:
        s.close()


def test_no_window_means_no_credit():
    s = Sender(window=0)
    r = Rec()
    try:
        for i in range(5):
            s.submit(i, 0, r.op(f"p{i}"), cost=10**9)
        assert r.wait_for(5) == [f"p{i}" for i in range(5)]
    finally:
        s.close()


def test_many_waiting_pushes_do_not_hold_back_pulls_of_sent_keys():
    s = Sender(window=100)
    r = Rec()
    try:
        s.submit("k0", 0, r.op("push k0"), cost=100)
        s.hold(0, 100, None)
        for i in range(1, 400):  # all wait for credit
            s.submit(f"k{i}", 0, r.op(f"push k{i}"), cost=100)
        s.submit("k0", 0, r.op("pull k0"))  # behind 399 waiting pushes, but free to go
        assert r.wait_for(2) == ["push k0", "pull k0"]
        s.submit("k5", 0, r.op("pull k5"))  # its push has not gone: it must wait
        for i in range(1, 400):
            s.release(i - 1)
            s.hold(i, 100, None)
        sent = r.wait_for(402)
        assert sent.index("pull k5") > sent.index("push k5")  # never before its push
        assert len(sent) == len(set(sent)) == 402  # 400 pushes, 2 pulls, each once
    finally:
        s.close()


def test_credit_of_a_timed_out_push_is_reclaimed():
    """A push whose caller gave up waiting (RequestTimeout) counts as failed, so its credit
    comes back and later pushes are not held forever; a late answer is dropped."""
    import pytest

    from hetps.cluster.errors import RequestTimeout
    from hetps.cluster.requests import RequestTracker

    tracker = RequestTracker()
    fut = tracker.new(3, "push of key 'a'")
    s = Sender(window=100)
    r = Rec()
    try:
        s.submit("a", 0, r.op("push a"), cost=90)
        s.hold(fut.req, 90, fut)
        s.submit("b", 0, r.op("push b"), cost=90)  # waits for push a's credit
        with pytest.raises(RequestTimeout, match="no answer from node 3"):
            fut.wait(0.01)
        assert fut.done() and tracker.resolve(fut.req, "late") is False
        assert r.wait_for(2) == ["push a", "push b"]
        with pytest.raises(RequestTimeout):  # every waiter sees the same end
            fut.wait(0)
    finally:
        s.close()


def test_a_busy_sender_merges_waiting_requests_to_one_server():
    """While a send is in progress, requests to the same server that queue up leave together
    as one batch (in priority order); one to another server goes alone; nothing waits for
    more to come."""
    import threading as _threading

    from hetps.transport.codec import Message as _Message

    batches: list[tuple[int, list[int]]] = []
    alone: list[str] = []
    sender = Sender(
        0, send_batch=lambda server, futs, msgs: batches.append((server, [m.req for m in msgs]))
    )
    gate, started = _threading.Event(), _threading.Event()

    def blocking_send() -> None:
        started.set()
        gate.wait(10)

    first = _threading.Thread(target=sender.submit, args=("a", 0, blocking_send))
    first.start()
    assert started.wait(10)  # the sender is busy: what comes now waits in the queue

    def req(server: int, n: int, prio: int, key: str) -> None:
        msg = _Message("push", req=n)
        sender.submit(key, prio, lambda: alone.append(key), merge=(server, [(None, msg)]))

    req(0, 1, 5, "k1")
    req(0, 2, 3, "k2")
    req(1, 3, 4, "k3")  # another server: not merged
    gate.set()
    first.join(10)
    sender.close()
    assert batches == [(0, [1, 2])], batches
    assert alone == ["k3"] and sender.merged == 1


def test_an_inline_send_does_not_wake_the_sender_thread(monkeypatch):
    """A request sent from the caller (nothing waits) must not wake the sender thread: that
    thread switch cost every small round trip about 5% (it only has queued ops to send)."""
    rec = Rec()  # (its own Condition is not counted)
    notified = count_notifies(monkeypatch)
    s = Sender()
    try:
        for i in range(50):
            s.submit(f"k{i}", 0, rec.op(f"k{i}"))
        assert rec.wait_for(50) == [f"k{i}" for i in range(50)]
        assert notified == []
    finally:
        s.close()
    assert not s._thread.is_alive()  # close still wakes it


def test_a_key_counts_its_elements_once(monkeypatch):
    """KeyMeta.size is the element count, worked out once (np.prod on every push cost about
    a tenth of a small push's time)."""
    from hetps.kvstore.keys import KeyMeta

    calls = []
    real = np.prod
    monkeypatch.setattr(np, "prod", lambda *a, **k: calls.append(1) or real(*a, **k))
    meta = KeyMeta((3, 4), np.dtype(np.float32), [])
    assert [KeyMeta(s, np.dtype(np.float32), []).size for s in [(), (0, 5), (7,)]] == [1, 0, 7]
    for _ in range(100):
        assert meta.size == 12
        meta.prefetch_into()
    assert calls == []


def test_a_caller_that_drains_sends_what_waits_in_one_message(monkeypatch):
    """Requests queued with ``later`` do not wake the sender thread; the caller's drain()
    sends them itself (a table's pull with the push before it: one message per server, no
    thread hand-off), in order, merged per server."""
    from hetps.transport.codec import Message as _Message

    notified = count_notifies(monkeypatch)
    me = threading.get_ident()
    batches: list[tuple[int, list[int], int]] = []
    sender = Sender(
        0,
        send_batch=lambda server, futs, msgs: batches.append(
            (server, [m.req for m in msgs], threading.get_ident())
        ),
    )
    try:

        def req(server: int, n: int, key: str, inline: bool) -> None:
            msg = _Message("push", req=n)
            merge = (server, [(None, msg)])
            sender.submit(key, 0, None, merge=merge, inline=inline, later=True)

        req(0, 1, "push0", inline=False)  # a deferred push: queued
        req(1, 2, "push1", inline=False)
        req(0, 3, "pull0", inline=True)  # the pulls behind them: queued too
        req(1, 4, "pull1", inline=True)
        assert batches == [] and notified == []
        sender.drain()
        assert batches == [(0, [1, 3], me), (1, [2, 4], me)], batches
        assert notified == [] and sender.merged == 2
    finally:
        sender.close()


def looks(sender: Sender, untimed: bool) -> bool:
    """Whether the sender thread went to its untimed sleep (``untimed``) or out of it within
    5 s (lock held; it is given up while waiting)."""
    for _ in range(500):
        if sender._untimed == untimed:
            return True
        sender._cv.wait(0.01)
    return False


def test_a_parked_request_waits_for_a_drain_and_wakes_no_thread(monkeypatch):
    """A parked op (a table's push) does not wake the sender thread while it looks every
    PARK_S; the caller's drain sends it merged with its own request, and the sender thread,
    waking on its own meanwhile, sends nothing of it."""
    import time as _time

    from hetps.kvstore import sender as sender_mod
    from hetps.transport.codec import Message as _Message

    monkeypatch.setattr(sender_mod, "PARK_S", 5.0)  # (long: the test drains well before it)
    monkeypatch.setattr(sender_mod, "IDLE_S", 60.0)
    notified = count_notifies(monkeypatch)
    me = threading.get_ident()
    batches: list[tuple[list[int], int]] = []
    sender = Sender(
        0, lambda server, futs, msgs: batches.append(([m.req for m in msgs], threading.get_ident()))
    )
    try:
        with sender._cv:  # parks came just now: the thread looks every PARK_S, not woken
            sender._last_park = _time.monotonic()
            sender._cv.notify()
            assert looks(sender, untimed=False)
        notified.clear()
        msg = _Message("spush", req=1)
        sender.submit("t", 0, None, merge=(0, [(None, msg)]), inline=False, park=True)
        sender.submit("t2", 0, None, merge=(0, [(None, _Message("spull", req=2))]), later=True)
        assert batches == [] and notified == []
        sender.drain()
        assert batches == [([1, 2], me)] and notified == []
    finally:
        sender.close()


def test_a_parked_request_nobody_drains_leaves_within_park_s():
    """With no drain after it, the sender thread sends a parked op once PARK_S passed, also
    from its untimed sleep (the park wakes it then)."""
    from hetps.transport.codec import Message as _Message

    rec = Rec()
    sender = Sender(0, send_batch=lambda server, futs, msgs: None)
    try:
        for n in range(3):
            if n == 2:
                sender._last_park -= 10  # (long since the last park: it sleeps untimed)
                with sender._cv:
                    assert looks(sender, untimed=True)
            msg = _Message("spush", req=n)
            merge = (0, [(None, msg)])
            sender.submit(f"t{n}", 0, rec.op(f"b{n}"), merge=merge, inline=False, park=True)
            assert rec.wait_for(n + 1)[-1] == f"b{n}"
    finally:
        sender.close()


def test_a_park_after_a_pause_wakes_the_thread_which_does_not_look_through_the_pause(
    monkeypatch,
):
    """Rounds of a park and its drain with pauses between them (a training step's compute):
    the sender thread wakes a few times per round (the park's wake-up, its due time), not
    every PARK_S through the pause, and sends nothing itself (every park was drained)."""
    waits: list[int] = []

    class Counting(threading.Condition):
        def wait(self, timeout: float | None = None) -> bool:
            if threading.current_thread().name == "hetps-sender":
                waits.append(1)
            return super().wait(timeout)

    monkeypatch.setattr(threading, "Condition", Counting)
    from hetps.transport.codec import Message as _Message

    me = threading.get_ident()
    batches: list[int] = []
    sender = Sender(0, lambda server, futs, msgs: None)
    pause = threading.Event()

    def send() -> None:
        batches.append(threading.get_ident())

    try:
        for n in range(3):
            msg = _Message("spush", req=n)
            sender.submit(f"t{n}", 0, send, merge=(0, [(None, msg)]), inline=False, park=True)
            sender.drain()
            pause.wait(0.1)  # (the pause itself is what is looked at: no parks in it)
        assert batches == [me] * 3, batches
        # looking every PARK_S (2 ms) through the pauses would be about 150 wake-ups
        assert len(waits) <= 30, len(waits)
    finally:
        sender.close()


def test_parks_in_short_rounds_keep_the_thread_looking_unwoken(monkeypatch):
    """Rounds shorter than BUSY_S (parks less than BUSY_S apart, each drained): the sender
    thread looks every PARK_S instead of sleeping untimed, so a park wakes no thread; once
    parks stop for BUSY_S it sleeps untimed again (and the next park wakes it)."""
    from hetps.kvstore import sender as sender_mod
    from hetps.transport.codec import Message as _Message

    for name, seconds in (("PARK_S", 0.03), ("IDLE_S", 0.03), ("BUSY_S", 0.6)):
        monkeypatch.setattr(sender_mod, name, seconds)
    notified = count_notifies(monkeypatch)
    me = threading.get_ident()
    batches: list[tuple[list[int], int]] = []

    def record(server: int, futs: list, msgs: list) -> None:
        batches.append(([m.req for m in msgs], threading.get_ident()))

    sender = Sender(0, record)

    def round_(n: int) -> None:
        push = (0, [(None, _Message("spush", req=2 * n))])
        sender.submit(f"t{n}", 0, None, merge=push, inline=False, park=True)
        pull = (0, [(None, _Message("spull", req=2 * n + 1))])
        sender.submit(f"u{n}", 0, None, merge=pull, later=True)
        sender.drain()

    pause = threading.Event()  # (the time between rounds, longer than IDLE_S: a step's compute)
    try:
        with sender._cv:
            assert looks(sender, untimed=True)
        round_(0)  # (the first park wakes the untimed thread)
        pause.wait(0.15)
        round_(1)  # parks 0.15 s apart: under BUSY_S
        pause.wait(0.15)
        notified.clear()
        round_(2)
        assert notified == []  # looking every PARK_S: the park woke nobody
        assert batches == [([2 * n, 2 * n + 1], me) for n in range(3)]
        with sender._cv:  # no park for BUSY_S: untimed again
            assert looks(sender, untimed=True)
        round_(3)
        assert notified == [1]
    finally:
        sender.close()
