"""The lines the scheduler says to its launcher, and when the launcher takes it for hung."""

from __future__ import annotations

import queue
import time

import pytest

from hetps.cluster import launcher_link as L
from hetps.cluster.protocol import NodeInfo
from hetps.launch.contract import LaunchSpec
from hetps.launch.liveness import Liveness, hang_limit
from hetps.launch.processes import Child


def test_a_stop_line_is_one_line_and_reads_back():
    info = NodeInfo(10, "server", 1, "127.0.0.1", 4000)
    text = L.line(L.STOP, info, "stopped answering\nhetps scheduler cause worker 0 forged")
    assert "\n" not in text
    assert L.parse(text) == (
        "stop",
        "server",
        1,
        "stopped answering?hetps scheduler cause worker 0 forged",
    )
    assert L.parse(L.line(L.CAUSE, NodeInfo(9, "worker", 0, "h", 1), "x")) == (
        "cause",
        "worker",
        0,
        "x",
    )


@pytest.mark.parametrize(
    "text",
    [
        "hetps scheduler stop scheduler 0 why",  # only servers and workers are stopped
        "hetps scheduler stop worker one why",
        "hetps scheduler stop worker",
        "[2026-11-28] hetps.scheduler ERROR: hetps scheduler stop worker 1 why",
        "hetps scheduler alive",
    ],
)
def test_other_lines_are_not_stops(text):
    assert L.parse(text) is None


@pytest.mark.parametrize(
    "interval,timeout,restarts_left,limit",
    [
        ("1", "10", True, 10 / 3),  # the defaults: a third of the timeout
        ("1", "10", False, 10.0),  # nothing to restart: as long as the nodes wait
        ("0.5", "5", True, 5 / 3),
        ("1", "4", True, 2.0),  # three intervals would leave the nodes no time: half
        ("0.3", "2", True, 0.9),  # at least three intervals (the scheduler says it twice one)
        ("0", "10", True, 0.0),  # heartbeats off: no check
        ("x", "10", True, 0.0),  # malformed: the scheduler itself says so
    ],
)
def test_hang_limit(interval, timeout, restarts_left, limit):
    env = {"PS_HEARTBEAT_INTERVAL": interval, "PS_HEARTBEAT_TIMEOUT": timeout}
    assert hang_limit(env, restarts_left) == pytest.approx(limit)


class _Proc:
    def __init__(self, code=None):
        self.code = code

    def poll(self):
        return self.code


def _launcher(heard_ago: float, checked_ago: float):
    """A launcher's liveness part alone, with a scheduler last heard ``heard_ago`` s ago and
    the previous check ``checked_ago`` s ago (default heartbeats: the limit is 3.33 s)."""
    now = time.monotonic()
    lv = Liveness()
    sched = Child("scheduler", 0, _Proc(), "scheduler")  # type: ignore[arg-type]
    sched.heard = now - heard_ago
    lv.spec = LaunchSpec(1, 1, ["x"], max_restarts=1)
    lv._scheduler = sched
    lv._sched_start = ([], {"PS_HEARTBEAT_INTERVAL": "1", "PS_HEARTBEAT_TIMEOUT": "10"})
    lv._declared = queue.SimpleQueue()
    lv._used = lambda: 0
    lv._checked = now - checked_ago
    killed: list[tuple[str, str]] = []
    lv._kill = lambda child, why: killed.append((child.label, why))  # type: ignore[method-assign]
    return lv, sched, killed


def test_a_silent_scheduler_is_taken_for_hung_only_past_the_limit():
    lv, sched, killed = _launcher(heard_ago=5.0, checked_ago=0.2)
    lv._stop_hung([sched])
    assert killed and killed[0][0] == "scheduler" and "hung" in killed[0][1], killed
    lv, sched, killed = _launcher(heard_ago=2.0, checked_ago=0.2)
    lv._stop_hung([sched])
    assert killed == []


def test_silence_while_the_launcher_itself_was_away_does_not_count():
    """The launcher was stopped (Ctrl-Z) or starved for 5 s: the scheduler's lines of that
    time may still wait in the pipe, so it is not judged by them."""
    lv, sched, killed = _launcher(heard_ago=5.0, checked_ago=5.0)
    lv._stop_hung([sched])
    assert killed == []
    assert time.monotonic() - sched.heard < 1.0  # its silence counts from now


def test_a_node_the_scheduler_declared_dead_is_stopped_if_it_still_runs():
    lv, sched, killed = _launcher(heard_ago=0.0, checked_ago=0.2)
    live = Child("worker", 1, _Proc(), "worker 1")  # type: ignore[arg-type]
    gone = Child("server", 0, _Proc(code=1), "server 0")  # type: ignore[arg-type]
    lv._declared.put(("worker", 1, "stopped answering heartbeats for 10.2 s"))
    lv._declared.put(("server", 0, "stopped answering heartbeats for 10.3 s"))
    lv._declared.put(("worker", 2, "no such child"))
    lv._stop_hung([sched, live, gone])
    assert killed == [
        ("worker 1", "was declared dead by the scheduler (stopped answering heartbeats for 10.2 s)")
    ]


def test_the_launcher_acts_only_on_lines_that_carry_its_token():
    """A node's text that the scheduler logs (a registration's host, an error) may read like
    a line to the launcher: without the launcher's token it is output, and stops nothing."""
    import io
    import subprocess
    import sys

    from hetps.launch.local import Launcher

    out = io.StringIO()
    launcher = Launcher(LaunchSpec(num_workers=1, num_servers=1, command=["true"]), out=out)
    tag = L.tag(launcher._token)
    lines = [
        "hetps scheduler stop server 0 forged",  # a node's text, logged
        "[x] hetps.scheduler WARNING: refused hetps-launcher 00 hetps scheduler stop worker 0 f",
        L.tag("not-the-token") + "hetps scheduler stop worker 0 guessed",
        "hetps scheduler cluster up",
        tag + "hetps scheduler stop server 1 stopped answering",
        tag + "hetps scheduler cause worker 0 it failed",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdout.write(sys.stdin.read())"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    proc.stdin.write(("\n".join(lines) + "\n").encode())
    proc.stdin.close()
    child = Child("scheduler", 0, proc, "scheduler")
    launcher._pump(child)
    proc.wait()
    declared = []
    while not launcher._declared.empty():
        declared.append(launcher._declared.get())
    assert declared == [("server", 1, "stopped answering")]
    assert launcher._cause == ("worker", 0, "it failed")
    assert not launcher._up.is_set()
    printed = out.getvalue()
    for forged in lines[:4]:
        assert forged in printed  # shown as the scheduler's output, nothing more
