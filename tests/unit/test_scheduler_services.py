"""A service's quick part runs on the scheduler's loop while its services' thread is idle,
and every service still sees its messages in the order they came."""

from __future__ import annotations

import threading

import pytest

from hetps.cluster import protocol as P
from hetps.cluster.protocol import NodeInfo
from hetps.roles import make_scheduler, new_scheduler
from hetps.transport.codec import Message
from roles import loopback_config


@pytest.fixture
def sched():
    s = new_scheduler(loopback_config("scheduler", num_worker=1))
    s.nodes = {9: NodeInfo(9, "worker", 0, "127.0.0.1", 2)}
    s.send_to = lambda nid, msg: None
    t = s._service_thread = threading.Thread(target=s._serve_services, daemon=True)
    t.start()  # (its services' thread)
    yield s
    s._service_q.put(None)
    t.join(5)
    s.van.close()


def _report(seq: int) -> Message:
    return Message(P.METRICS_REPORT, sender=9, req=seq + 1, body={"seq": seq + 1, "t": 1.0})


def _n(m: Message) -> int:
    return m.typed.seq - 1  # (a report's seq counts from 1)


def _drained(s) -> None:
    """Until the services' thread ran every job handed to it: it is told to end after them
    and joined (the fixture's own end then finds it ended)."""
    s._service_q.put(None)
    s._service_thread.join(10)
    assert not s._service_thread.is_alive() and not s._jobs


def test_a_quick_part_runs_on_the_loop_and_only_its_rest_on_the_services_thread(sched):
    seen = []
    done = threading.Event()
    loop = threading.current_thread()  # (this thread dispatches, as the loop does)

    def rest(seq):
        seen.append(("rest", seq, threading.current_thread() is loop))
        done.set()

    def quick(s, m):
        seen.append(("quick", _n(m), threading.current_thread() is loop))
        return (lambda: rest(_n(m))) if _n(m) == 1 else None

    def handler(s, m):
        seen.append(("handler", _n(m), threading.current_thread() is loop))

    sched.register(P.METRICS_REPORT, handler, quick=quick)
    sched._dispatch(_report(0))  # nothing left: no hand-off at all
    assert seen == [("quick", 0, True)] and not sched._jobs
    sched._dispatch(_report(1))
    assert done.wait(10)
    assert seen[1:] == [("quick", 1, True), ("rest", 1, False)]


def test_while_the_services_thread_works_the_next_messages_wait_behind_it(sched):
    seen = []
    gate, started = threading.Event(), threading.Event()

    def rest():
        started.set()
        gate.wait(10)  # (a long release: the next messages come meanwhile)
        seen.append("rest 0")

    def quick(s, m):
        seen.append(f"quick {_n(m)}")
        return rest if _n(m) == 0 else None

    sched.register(P.METRICS_REPORT, lambda s, m: seen.append(f"handler {_n(m)}"),
                   quick=quick)  # fmt: skip
    sched._dispatch(_report(0))
    assert started.wait(10)
    sched._dispatch(_report(1))  # queued behind the release, not run beside it
    sched._dispatch(_report(2))
    assert seen == ["quick 0"]
    gate.set()
    _drained(sched)
    assert seen == ["quick 0", "rest 0", "handler 1", "handler 2"]
    sched._dispatch(_report(3))  # idle again: on the loop
    assert seen[-1] == "quick 3" and not sched._jobs


def test_a_service_without_a_quick_part_always_runs_on_its_thread(sched):
    where = []
    done = threading.Event()
    loop = threading.current_thread()

    def handler(s, m):
        where.append(threading.current_thread() is loop)
        done.set()

    sched.register(P.METRICS_REPORT, handler)
    sched._dispatch(_report(0))
    assert done.wait(10) and where == [False]


class _Stop(threading.Event):
    """The loop's stop event, recording each wait the loop makes on it (its gather hold)."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float] = []

    def wait(self, timeout=None):
        self.waits.append(timeout)
        return super().wait(0)  # (recorded, not waited: the test reads the turns in order)


@pytest.mark.parametrize(
    ("hold_ms", "many"), [(4.0, True), (0.0, True), (4.0, False)], ids=["held", "zero", "few"]
)
def test_the_loop_holds_only_after_a_gathering_turn_with_nothing_queued(hold_ms, many):
    """A turn whose quick part kept a message and left nothing to do (a round's report before
    its last) makes the loop wait ``HETPS_GATHER_HOLD_MS`` before its next look, so that the
    reports coming meanwhile are read in one turn; not when more is queued already, not after
    the turn whose last report released the round, not after other messages; never with 0,
    nor while the service says its messages do not come in numbers (``gathers``)."""
    s = new_scheduler(loopback_config("scheduler", num_worker=1, gather_hold_ms=hold_ms))
    s.nodes = {9: NodeInfo(9, "worker", 0, "127.0.0.1", 2)}
    s.send_to = lambda nid, msg: None
    released = threading.Event()
    s.register(
        P.METRICS_REPORT,
        lambda sc, m: None,
        quick=lambda sc, m: released.set if _n(m) == 3 else None,  # (4 reports: a round)
        gathers=lambda: many,
    )
    beat = Message(P.HEARTBEAT, sender=9, req=99)
    turns = [  # (a turn's messages, whether more is queued after them)
        ([_report(0)], False),  # -> a hold
        ([_report(1)], True),  # more queued: read at once
        ([beat], False),  # not a quick part's: no hold
        ([_report(2), _report(3)], False),  # the round released by the turn's last: no hold
    ]
    looked: list[int] = []  # the hold waits recorded when each turn was read

    def recv_many(timeout=None):
        looked.append(len(s._stop.waits))
        if not turns:
            s.stop()
            return []
        msgs, queued[0] = turns.pop(0)
        return msgs

    queued = [False]
    s._stop = _Stop()
    s.van.inbox.recv_many = recv_many
    s.van.inbox.queued = lambda: queued[0]
    t = threading.Thread(target=s.run, daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive()
    assert released.wait(5)
    if hold_ms and many:
        assert s._stop.waits == [0.004]
        assert looked == [0, 1, 1, 1, 1]  # held after the first turn only
    else:
        assert s._stop.waits == [] and looked == [0] * 5


def test_the_planner_tells_the_loop_when_its_reports_come_in_numbers():
    """A balancing scheduler's loop asks the planner (``Planner.gathers``) before it holds."""
    s = make_scheduler(loopback_config("scheduler", num_worker=2, balance="aware"))
    try:
        gathers = s._gathers.get(P.BALANCE_REPORT)
        assert gathers is not None and gathers.__self__ is s.quick_parts[P.BALANCE_REPORT].__self__
        assert gathers() is False  # (no round answered yet)
    finally:
        s.van.close()
