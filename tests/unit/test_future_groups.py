"""A call's futures wake their waiter once (:func:`wait_all`): when the last one ends, or at
once when one fails; a future's end is recorded once, whichever thread comes first."""

from __future__ import annotations

import threading

import pytest

from hetps.cluster.errors import RequestError, RequestTimeout
from hetps.cluster.requests import RequestTracker, wait_all


def _waiting(futs: list) -> tuple[threading.Thread, list]:
    """``wait_all(futs)`` in a thread of its own, once every future counts it as a waiter."""
    out: list = []

    def run() -> None:
        try:
            out.append(wait_all(futs, 30, "pull"))
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    ready = threading.Event()
    for _ in range(500):  # (until the call registered its group on the pending futures)
        if all(f._groups for f in futs if not f.done()):
            ready.set()
            break
        ready.wait(0.01)
    assert ready.is_set()
    return t, out


def test_wait_all_wakes_once_when_the_last_future_ends():
    tracker = RequestTracker()
    futs = [tracker.new(peer=3, what=f"pull {i}") for i in range(3)]
    thread, out = _waiting(futs)
    group = futs[0]._groups[0]
    try:
        assert all(f._groups == [group] for f in futs)
        assert tracker.resolve(futs[2].req, "c", sender=3)
        assert tracker.resolve(futs[0].req, "a", sender=3)
        assert group.gate.locked() and group.left == 1  # (two ended: the waiter still sleeps)
        assert tracker.resolve(futs[1].req, "b", sender=3)
        assert not group.gate.locked() or not thread.is_alive()
    finally:
        tracker.fail_all(RequestError("test over"))
        thread.join(5)
    assert out == [["a", "b", "c"]]
    assert all(f._groups is None for f in futs)


def test_wait_all_wakes_at_the_first_failure():
    """The first future fails while the others are still out: the call raises its error at
    once (it does not wait for the rest), and they stay pending for a later wait."""
    tracker = RequestTracker()
    futs = [tracker.new(peer=3, what=f"pull {i}") for i in range(3)]
    thread, out = _waiting(futs)
    assert tracker.resolve(futs[0].req, None, "no such row", sender=3)
    thread.join(5)
    assert not thread.is_alive()
    assert isinstance(out[0], RequestError) and "no such row" in str(out[0])
    assert futs[0].reported and not futs[1].done() and not futs[2].done()
    assert tracker.resolve(futs[1].req, "b", sender=3)
    assert futs[1].wait(0) == "b"


def test_an_end_is_recorded_once_and_every_waiter_wakes():
    """Several threads wait on one future; an answer and an error race for it: the first
    wins, the other changes nothing, and every waiter sees the same outcome."""
    tracker = RequestTracker()
    fut = tracker.new(peer=3, what="pull")
    seen: list = []

    def wait() -> None:
        try:
            seen.append(fut.wait(30))
        except RequestError as exc:
            seen.append(exc)

    waiters = [threading.Thread(target=wait, daemon=True) for _ in range(4)]
    for t in waiters:
        t.start()
    assert tracker.resolve(fut.req, "value", sender=3)
    fut.set_error(RequestError("late error"))
    for t in waiters:
        t.join(5)
    assert seen == ["value"] * 4
    assert fut.done() and fut.error is None and fut.wait(0) == "value"


def test_a_timeout_waits_for_an_answer_being_landed():
    """The caller's timeout strikes while the receive thread runs the answer's callback
    (landing its rows): the answer wins, and the caller gets it, not a half-landed result."""
    tracker = RequestTracker()
    inside, go_on = threading.Event(), threading.Event()
    landed: list = []

    def land(value: str) -> None:
        inside.set()
        assert go_on.wait(5)
        landed.append(value)

    fut = tracker.new(peer=3, what="pull", callback=land)
    t = threading.Thread(target=tracker.resolve, args=(fut.req, "rows"), daemon=True)
    t.start()
    assert inside.wait(5)
    timer = threading.Timer(0.05, go_on.set)
    timer.start()
    try:
        assert fut.wait(0.01) == "rows"  # (timed out, then let the answer finish)
    finally:
        timer.join()
        t.join(5)
    assert landed == ["rows"]


def test_a_group_that_times_out_gives_up_its_futures():
    tracker = RequestTracker()
    futs = [tracker.new(peer=3, what=f"pull {i}") for i in range(2)]
    with pytest.raises(RequestTimeout):
        wait_all(futs, 0.05, "pull")
    assert all(f.done() and f.reported for f in futs) and tracker.pending() == 0


def test_a_failure_of_a_later_future_ends_the_call_at_once():
    """The last future fails while the first is still out (a server that refused, another
    that is slow or dead): the call raises that error at once, not a timeout of the first."""
    tracker = RequestTracker()
    futs = [tracker.new(peer=3, what=f"pull {i}") for i in range(3)]
    thread, out = _waiting(futs)
    try:
        assert tracker.resolve(futs[2].req, None, "no such row", sender=3)
        thread.join(5)
        assert not thread.is_alive()
        assert isinstance(out[0], RequestError) and "no such row" in str(out[0])
        assert futs[2].reported and not futs[0].done() and not futs[1].done()
    finally:
        tracker.fail_all(RequestError("test over"))
        thread.join(5)


def test_a_request_says_what_it_is_only_when_an_error_needs_it():
    """A future may be given what makes its text (a request of the worker's pipeline: its
    command, key and server); it is made once, when an error says it, never per request."""
    from functools import partial

    from hetps.kvstore.pipeline import _what

    asked: list[int] = []

    class _Node:
        def describe(self, peer: int) -> str:
            asked.append(peer)
            return f"server {peer // 2 - 4}"

    tracker = RequestTracker()
    fut = tracker.new(10, partial(_what, "spull", "t", _Node(), 10))
    assert asked == []  # (nothing made for a request that is answered)
    with pytest.raises(RequestTimeout, match=r"^spull of key 't' on server 1: no answer from"):
        fut.wait(0.01)
    assert fut.what == "spull of key 't' on server 1" and asked == [10]  # made once
