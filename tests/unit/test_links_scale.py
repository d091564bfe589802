"""LinkEstimator's per-node passes, rewritten to scale (benchmarks/scale_sim.py), give what the
plain per-node loops gave."""

from __future__ import annotations

import numpy as np
import pytest

from hetps.balance.links import (
    NODE_MIN_BYTES,
    SPREAD_NEAR,
    LinkEstimator,
    union_lengths,
)


def _union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by ``intervals`` (overlaps counted once), one at a time."""
    total, end = 0.0, -float("inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _censored_reference(est: LinkEstimator) -> tuple[np.ndarray, np.ndarray]:
    up, down = est.single()
    out = []
    for mine, other, ends in ((up, down, est.servers), (down, up, est.workers)):
        flags = np.zeros(est.n_nodes, dtype=bool)
        for k in range(est.n_nodes):
            peers = [other[j] for j in ends if j != k and np.isfinite(other[j])]
            if np.isfinite(mine[k]) and peers and mine[k] >= SPREAD_NEAR * max(peers):
                flags[k] = True
        out.append(flags)
    return out[0], out[1]


def _nodes_reference(samples, n: int) -> tuple[np.ndarray, np.ndarray]:
    up, down = np.full(n, np.nan), np.full(n, np.nan)
    for k in range(n):
        for est, col in ((up, 0), (down, 1)):
            mine = [x for x in samples if x[col] == k]
            total = sum(x[4] for x in mine)
            busy = _union_length([(x[2], x[3]) for x in mine])
            if total >= NODE_MIN_BYTES and busy > 0:
                est[k] = total / busy
    return up, down


def _estimator(seed: int, colocate: bool) -> LinkEstimator:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 12))
    if colocate:
        servers = workers = list(range(n))
    else:
        s = int(rng.integers(1, n))
        servers, workers = list(range(s)), list(range(s, n))
    est = LinkEstimator(n, servers, workers, colocate, probe_window=4)
    levels = [1e6, 2e6, 3e6, 3.2e6, 5e6]
    for _ in range(int(rng.integers(0, 3 * n))):  # some nodes never probed (NaN)
        w, s = int(rng.choice(workers)), int(rng.choice(servers))
        if w != s:
            est.observe_probe(*((w, s) if rng.random() < 0.5 else (s, w)), rng.choice(levels))
    return est


@pytest.mark.parametrize("seed", range(60))
@pytest.mark.parametrize("colocate", [False, True])
def test_censored_matches_the_per_node_loop(seed, colocate):
    est = _estimator(seed, colocate)
    for got, want in zip(est.censored(), _censored_reference(est), strict=True):
        assert got.tolist() == want.tolist()


@pytest.mark.parametrize("seed", range(20))
def test_observe_nodes_matches_the_per_node_filter(seed):
    rng = np.random.default_rng(seed)
    n = 6
    samples = []
    for _ in range(40):
        src, dst = (int(x) for x in rng.choice(n, 2, replace=False))
        t0 = float(rng.uniform(0, 1))
        samples.append(
            (src, dst, t0, t0 + float(rng.uniform(0.01, 0.3)), float(rng.integers(1, 9) * 64e3))
        )
    est = LinkEstimator(n, [0, 1], [2, 3, 4, 5], False, probe_window=4)
    est.observe_nodes(samples)
    up, down = _nodes_reference(samples, n)
    np.testing.assert_array_equal(est.up, up)
    np.testing.assert_array_equal(est.down, down)


@pytest.mark.parametrize("seed", range(3))
def test_union_lengths_of_many_groups_match_the_interval_loop(seed):
    # more groups than a byte counts (the groups are sorted as 16-bit keys), in no order
    rng = np.random.default_rng(seed)
    n = 700
    group = rng.integers(0, n - 1, 5000)  # (the last group has no interval: 0)
    t0 = 1.7e9 + rng.uniform(0, 5, group.size)
    t1 = t0 + rng.uniform(1e-4, 0.5, group.size)
    got = union_lengths(group, t0, t1, n)
    want = [_union_length(list(zip(t0[group == k], t1[group == k], strict=True))) for k in range(n)]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("alike", [False, True])
def test_union_lengths_keep_equal_starts_in_their_order(seed, alike):
    # starts from a few values (ties of different ends, summed in the order they came, as a
    # stable sort by start orders them: near 0 their sums round by order), rows already in
    # order, and intervals repeated; ``alike``: groups of one size (no padding)
    rng = np.random.default_rng(seed)
    n = 300
    group = rng.permutation(np.repeat(np.arange(n), 20)) if alike else rng.integers(0, n, 6000)
    t0 = rng.choice([0.0, 0.1, 0.25], group.size)
    t1 = t0 + rng.uniform(1e-4, 0.5, group.size)
    lined = group < 20  # (these groups' intervals come in order of start)
    t0[lined] = np.arange(lined.sum()) * 1e-3
    t1[lined] = t0[lined] + 0.5
    twice = np.flatnonzero(group >= n - 20)
    group, t0, t1 = (np.r_[v, v[twice]] for v in (group, t0, t1))
    got = union_lengths(group, t0, t1, n)
    want = []
    for k in range(n):
        total, end = 0.0, -np.inf
        for a, b in sorted(zip(t0[group == k], t1[group == k], strict=True), key=lambda iv: iv[0]):
            total += max(b - max(a, end), 0.0)
            end = max(end, b)
        want.append(total)
    np.testing.assert_array_equal(got, want)
