"""The worker's request sender with a push credit window (no network: sends are recorded)."""

from __future__ import annotations

import threading

from hetps.kvstore.client import _Sender


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


def test_pushes_wait_for_credit_pulls_do_not():
    s = _Sender(window=100)
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
    s = _Sender(window=10)
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

    s = _Sender(window=100)
    r = Rec()
    try:
        s.submit("a", 0, r.op("push a"), cost=90)
        s.hold(7, 90, Done())  # its future ended (an error) without a receipt
        s.submit("b", 0, r.op("push b"), cost=90)
        assert r.wait_for(2) == ["push a", "push b"]
    finally:
        s.close()


def test_no_window_means_no_credit():
    s = _Sender(window=0)
    r = Rec()
    try:
        for i in range(5):
            s.submit(i, 0, r.op(f"p{i}"), cost=10**9)
        assert r.wait_for(5) == [f"p{i}" for i in range(5)]
    finally:
        s.close()


def test_many_waiting_pushes_do_not_hold_back_pulls_of_sent_keys():
    s = _Sender(window=100)
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
    s = _Sender(window=100)
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


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_paced_pushes_wait_for_their_time_pulls_do_not():
    clock = FakeClock()
    s = _Sender(window=1 << 20, clock=clock)
    r = Rec()
    try:
        s.set_pace(1000.0)  # bytes/s
        s.submit("a", 0, r.op("push a"), cost=100)  # the first push goes at once
        s.submit("b", 0, r.op("push b"), cost=300)  # not before t = 0.1 (100 B at 1000 B/s)
        s.submit("a", 0, r.op("pull a"))  # needs no pace: passes push b
        assert r.wait_for(2) == ["push a", "pull a"]
        clock.t = 0.099  # the loop re-checks the clock at least every 0.2 s
        s.submit("c", 0, r.op("pull c"))
        assert r.wait_for(3) == ["push a", "pull a", "pull c"]
        clock.t = 0.1
        assert r.wait_for(4)[-1] == "push b"
        clock.t = 0.35  # push b moved the next push's time to 0.1 + 300/1000 = 0.4
        s.submit("d", 0, r.op("push d"), cost=10)
        s.submit("d", 0, r.op("pull d"))  # same key: stays behind push d
        s.submit("e", 0, r.op("pull e"))
        assert r.wait_for(5)[-1] == "pull e"
        clock.t = 0.4
        assert r.wait_for(7)[-2:] == ["push d", "pull d"]
        # pacing off: pushes go as credit allows, whatever the clock says
        s.set_pace(0)
        s.submit("f", 0, r.op("push f"), cost=10)
        assert r.wait_for(8)[-1] == "push f"
    finally:
        s.close()


def test_a_pace_that_is_not_a_positive_number_means_no_pacing():
    s = _Sender(window=100, clock=FakeClock())
    try:
        for bad in (-5.0, 0.0, float("inf"), float("nan")):
            s.set_pace(bad)
            assert s.pace_bps == 0.0
        s.set_pace(2.5e6)
        assert s.pace_bps == 2.5e6
    finally:
        s.close()


def test_a_new_pace_rescales_the_wait_left_and_close_sends_unpaced():
    clock = FakeClock()
    s = _Sender(window=1 << 20, clock=clock)
    r = Rec()
    try:
        s.set_pace(100.0)
        s.submit("a", 0, r.op("push a"), cost=100)  # next push not before t = 1.0
        assert r.wait_for(1) == ["push a"]
        s.set_pace(1000.0)  # 10x faster: the 1.0 s left becomes 0.1 s
        s.submit("b", 0, r.op("push b"), cost=100)
        clock.t = 0.09
        s.submit("c", 0, r.op("pull c"))
        assert r.wait_for(2) == ["push a", "pull c"]
        clock.t = 0.1
        assert r.wait_for(3)[-1] == "push b"
        s.submit("d", 0, r.op("push d"), cost=100)  # due at 0.2; the clock never gets there
    finally:
        s.close()  # closing drops the pace: push d still goes
    assert r.sent[-1] == "push d"
