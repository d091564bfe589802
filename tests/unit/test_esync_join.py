"""A worker that joins a running ESync job again (HETPS_ELASTIC), piece by piece: the
readiness policy counts it again (``ReadinessPolicy.add``), the state service hears of it
from the scheduler's hook before the live workers go on, and the trainer of a joiner makes no
broadcast and takes the live workers' round. The processes, the kill and the join are in
tests/e2e/test_checkpoint.py (test_a_dead_esync_worker_started_again_joins_the_running_job)."""

from __future__ import annotations

import pytest

from hetps.sync.esync import ReadinessPolicy

S0, W0, W1 = 8, 9, 11


def _warm(policy: ReadinessPolicy, times: list[float], now: float = 0.0) -> None:
    """A lockstep round that gives every worker its estimate."""
    policy.start_round(now)
    for w, t in enumerate(times):
        policy.report_step(w, t, now + t)


# -- ReadinessPolicy.add ----------------------------------------------------------------------
def test_a_worker_back_counts_from_the_next_round_which_runs_in_lockstep():
    p = ReadinessPolicy(3)
    _warm(p, [0.1, 0.2, 5.0])
    p.start_round(10.0)
    p.remove(2)  # it died in round 2
    assert p.report_step(0, 0.1, 10.1) is False  # (the deadline is still worker 2's)
    assert p.is_ready(0, now=15.0) and p.report_step(1, 0.2, 15.0)
    assert p.round_complete()
    p.start_round(20.0)  # round 3: without it
    assert p.slowest() == 1 and p.round_complete() is False
    p.add(2)  # it joined during round 3: not in it
    assert p.is_ready(2)
    assert p.report_step(0, 0.1, 20.05) is False
    assert p.is_ready(0, now=20.15) and p.report_step(1, 0.2, 20.2)
    assert p.round_complete()
    p.start_round(30.0)  # round 4: with it, in lockstep (its old 5 s is forgotten)
    assert p.estimate(2) is None and p.slowest() is None
    assert p.report_step(0, 0.1, 30.1) and p.report_step(1, 0.2, 30.2)
    assert not p.round_complete()  # the round waits for it again
    assert p.report_step(2, 0.3, 30.3)
    assert p.round_complete()
    p.start_round(40.0)  # round 5: its new step time sets the deadline
    assert p.slowest() == 2 and p.deadline() == pytest.approx(40.3)
    assert p.report_step(0, 0.1, 40.1) is False


def test_a_worker_back_in_the_round_it_was_the_slowest_of_keeps_that_deadline():
    p = ReadinessPolicy(2)
    _warm(p, [1.0, 4.0])
    p.start_round(10.0)
    assert p.slowest() == 1
    p.remove(1)
    p.add(1)  # (back before the others finished the round)
    assert p.deadline() == 14.0 and p.is_ready(1)
    assert p.report_step(0, 1.0, 11.0) is False
    assert p.report_step(0, 1.0, 14.0) is True
    p.start_round(20.0)
    assert p.estimate(1) is None and p.slowest() is None


def test_adding_a_worker_checks_its_id():
    p = ReadinessPolicy(2)
    for bad in (2, -1, True, "1"):
        with pytest.raises(ValueError, match="worker must be in 0..1"):
            p.add(bad)
