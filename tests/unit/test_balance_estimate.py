"""Forecast-then-probe samples and the per-link smoothed estimate table."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hetps.balance import (
    EstimateTable,
    ForecastMatcher,
    Network,
    Sample,
    iteration_time,
    lower_bound,
    optimal_plan,
    sample_rate,
)


def test_sample_rate():
    assert sample_rate(1000, 1.0, 1.5) == 2000.0
    assert sample_rate(1000, 1.0, 1.0) is None
    assert sample_rate(1000, 2.0, 1.0) is None
    assert sample_rate(0, 1.0, 2.0) is None
    assert sample_rate(10, 0.0, math.nan) is None
    assert sample_rate("x", 0.0, 1.0) is None


def test_ewma_exact():
    t = EstimateTable(3, alpha=0.5)
    assert math.isnan(t.estimate(0, 1)) and t.count(0, 1) == 0
    assert t.observe(0, 1, 100, 0.0, 1.0)  # 100 B/s
    assert t.estimate(0, 1) == 100.0
    assert t.observe(0, 1, 300, 1.0, 2.0)  # 300 -> 0.5 * 100 + 0.5 * 300
    assert t.estimate(0, 1) == 200.0
    assert t.observe(0, 1, 100, 5.0, 6.0)
    assert t.estimate(0, 1) == 150.0
    assert t.count(0, 1) == 3 and t.last_update(0, 1) == 6.0
    assert math.isnan(t.estimate(1, 0))  # links are directed


def test_ignored_samples_change_nothing():
    t = EstimateTable(2, alpha=0.3)
    assert not t.observe(0, 1, 100, 2.0, 2.0)
    assert not t.observe(0, 1, 100, 3.0, 2.0)
    assert not t.observe(0, 1, -5, 0.0, 1.0)
    assert not t.observe(1, 1, 100, 0.0, 1.0)  # a node to itself
    assert t.count(0, 1) == 0 and math.isnan(t.last_update(0, 1))


def test_alpha_one_keeps_last_and_last_update_is_newest():
    t = EstimateTable(2, alpha=1.0)
    for s in [Sample(0, 1, 10, 0.0, 5.0), (0, 1, 40, 0.0, 2.0)]:
        t.observe(*s)
    assert t.estimate(0, 1) == 20.0
    assert t.last_update(0, 1) == 5.0  # an older sample does not move it back


def test_matrix_and_network():
    t = EstimateTable(3)
    t.observe(0, 1, 100, 0, 1)
    t.observe(1, 0, 200, 0, 1)
    m = t.matrix()
    assert np.isinf(np.diag(m)).all()
    assert m[0, 1] == 100 and m[1, 0] == 200 and math.isnan(m[2, 0])
    # unmeasured links get the median of the measured ones
    net = Network.from_matrix(m, node_caps="max")
    assert net.link[2, 0] == pytest.approx(150)
    np.testing.assert_array_equal(t.counts(), [[0, 1, 0], [1, 0, 0], [0, 0, 0]])


def test_stale_links():
    t = EstimateTable(3)
    t.observe(0, 1, 100, 0, 10.0)
    t.observe(0, 2, 100, 0, 2.0)
    stale = t.stale_links(now=12.0, max_age=5.0)
    assert (0, 1) not in stale and (0, 2) in stale and (2, 1) in stale
    assert len(stale) == 5
    assert t.stale_links(12.0, 5.0, links=[(0, 1), (0, 2)]) == [(0, 2)]


@pytest.mark.parametrize(("n", "alpha"), [(0, 0.5), (2, 0.0), (2, 1.5), (1.5, 0.5)])
def test_table_validation(n, alpha):
    with pytest.raises(ValueError):
        EstimateTable(n, alpha)


def test_table_rejects_unknown_nodes():
    with pytest.raises(ValueError, match="outside"):
        EstimateTable(2).observe(0, 2, 1, 0, 1)


def test_forecast_matcher():
    m = ForecastMatcher(node=3, max_pending=2)
    m.forecast(0, "k7:0", 10.0)
    assert m.arrive(0, "k7:0", 5000, 10.5) == Sample(0, 3, 5000.0, 10.0, 10.5)
    assert m.arrive(0, "k7:0", 5000, 11.0) is None  # consumed
    assert m.arrive(1, "other", 10, 1.0) is None  # no forecast seen
    m.forecast(0, "a", 1.0)
    m.forecast(0, "b", 2.0)
    m.forecast(0, "c", 3.0)  # drops the oldest ("a")
    assert m.pending == 2
    assert m.arrive(0, "a", 1, 4.0) is None
    table = EstimateTable(4)
    assert table.observe(*m.arrive(0, "b", 100, 4.0))
    assert table.estimate(0, 3) == 50.0


def _max_min_fair(up: np.ndarray, down: np.ndarray) -> np.ndarray:
    """Rates of all-to-all flows under per-node send/receive caps (progressive filling)."""
    n = up.size
    rate = np.zeros((n, n))
    ru, rd = up.astype(float).copy(), down.astype(float).copy()
    fixed = np.eye(n, dtype=bool)
    while not fixed.all():
        nu, nd = (~fixed).sum(axis=1), (~fixed).sum(axis=0)
        inc = min(
            np.where(nu > 0, ru / np.maximum(nu, 1), np.inf).min(),
            np.where(nd > 0, rd / np.maximum(nd, 1), np.inf).min(),
        )
        rate[~fixed] += inc
        ru -= inc * nu
        rd -= inc * nd
        fixed |= (ru <= 1e-9 * up)[:, None] | (rd <= 1e-9 * down)[None, :]
    np.fill_diagonal(rate, np.inf)
    return rate


def test_concurrent_measurements_plan_near_the_bound_with_sum_caps():
    # rates measured while every node sends to all others (data slices in an iteration) on a
    # network shaped per node: node_caps="sum" recovers plans close to the true optimum
    rng = np.random.default_rng(11)
    ratio = {"sum": [], "max": []}
    for _ in range(30):
        up = rng.uniform(10.0, 220.0, 6)
        down = up * rng.uniform(0.8, 1.2, 6)
        bound = lower_bound(up, down, 1.0)
        meas = _max_min_fair(up, down)
        for mode in ratio:
            x = optimal_plan(Network.from_matrix(meas, node_caps=mode), 1.0)
            ratio[mode].append(iteration_time(Network.from_rates(up, down), x) / bound)
    assert np.mean(ratio["sum"]) < 1.02
    assert np.mean(ratio["sum"]) < np.mean(ratio["max"])
