"""The lines the scheduler says to its launcher, and when the launcher takes it for hung."""

from __future__ import annotations

import pytest

from hetps.cluster import launcher_link as L
from hetps.cluster.protocol import NodeInfo
from hetps.launch.liveness import hang_limit


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
