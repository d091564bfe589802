"""What the balance agent reads of its own requests (hetps.balance.agent): a pull's size from
its body as a Pull (count times its dtype's size), a probe's kind from its body as a Probe."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hetps.balance.agent import MEASURE_MIN_BYTES, BalanceAgent, Watch
from hetps.cluster import bodies
from hetps.cluster import protocol as P
from hetps.transport.codec import Message


def _agent() -> BalanceAgent:
    return BalanceAgent(SimpleNamespace(node=SimpleNamespace(id=9), cfg=None))


@pytest.mark.parametrize(("dtype", "measured"), [("float64", True), ("float32", False)])
def test_a_pull_is_measured_by_its_count_and_dtype(dtype, measured):
    n = MEASURE_MIN_BYTES // 8  # (64 KiB of float64, half of it of float32)
    pull = Message(P.PULL, body=bodies.chunk("w", 0, 0, n, (n,), dtype))
    watch = _agent().watch(pull, 0, 8)
    assert watch is not None and watch.measure is measured and watch.noted


@pytest.mark.parametrize(
    ("spread", "meas", "kind"),
    [(False, [1.0, 2.0, 5e5], 1), (False, [1.0, 2.0, 5e5, 1.0], 1), (True, [1.0, 2.0, 5e5], 2)]
    + [(True, [1.0, 2.0, 5e5, 1.0], 3)],
)
def test_a_probes_sample_is_of_its_kind(spread, meas, kind):
    agent = _agent()
    probe = Message(P.PROBE, body={"reply_bytes": 0, "spread": spread, "tag": 7})
    Watch(agent, probe, 0, 8, measure=True, noted=False).on_reply(
        Message(P.PROBE, req=7, reply=True, body={"meas": meas})
    )
    assert list(agent.samples) == [[9, 8, 5e5, 1.0, 2.0, kind]]
