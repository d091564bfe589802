"""Slice layout, Algorithm 2 (assign) and the slice-size model."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hetps.balance import (
    Slice,
    assign,
    choose_slice_size,
    fit_granularity,
    granularity_cost,
    layout,
)


def test_layout_exact():
    assert layout([5, 0, 3], 2) == [
        Slice(0, 0, 2),
        Slice(0, 2, 2),
        Slice(0, 4, 1),
        Slice(2, 0, 2),
        Slice(2, 2, 1),
    ]
    assert layout([4], 4) == [Slice(0, 0, 4)]
    assert layout([4], 10) == [Slice(0, 0, 4)]
    assert layout([], 3) == []


def test_layout_covers_every_element_once():
    sizes = [7, 1, 0, 12, 30]
    sl = layout(sizes, 4)
    for key, n in enumerate(sizes):
        mine = [s for s in sl if s.key == key]
        assert sum(s.length for s in mine) == n
        assert [s.offset for s in mine] == list(range(0, n, 4))
        assert all(0 < s.length <= 4 for s in mine)


@pytest.mark.parametrize(
    ("sizes", "x", "match"),
    [
        ([3], 0, "slice_elems"),
        ([3], 1.5, "slice_elems"),
        ([-1], 2, "key 0"),
        ([2, 1.5], 2, "key 1"),
    ],
)
def test_layout_errors(sizes, x, match):
    with pytest.raises(ValueError, match=match):
        layout(sizes, x)


def test_assign_equal_slices_follows_counts_exactly():
    sl = layout([12], 1)  # 12 equal slices
    for counts in ([3, 5, 4], [0, 12, 0], [1, 1, 10], [6, 6, 0]):
        srv = assign(sl, np.array(counts))
        np.testing.assert_array_equal(np.bincount(srv, minlength=3), counts)


def test_assign_least_advanced_server_order():
    # 4 equal slices, shares 1 : 3 -> each slice to the server whose own slices are least
    # far along after taking it: server 1 (1/3 < 1/1), server 1 (2/3 < 1), then a tie
    # 1 vs 1 -> lower index 0, then server 1
    sl = layout([4], 1)
    np.testing.assert_array_equal(assign(sl, np.array([1, 3])), [1, 1, 0, 1])


def test_assign_spreads_every_servers_slices_through_the_layout():
    """Workers push in layout order, so a server whose slices bunch up gets them all at
    once from every worker while the others idle. Every prefix of the layout holds each
    server's share of it to within about one slice (the old largest-remaining-share order
    gave the biggest server its first 9 slices in a row and the smallest its last)."""
    rng = np.random.default_rng(3)
    sl = layout([8] * 50, 8)  # 50 equal slices
    for _ in range(20):
        shares = rng.uniform(0, 1, 6) * (rng.uniform(0, 1, 6) > 0.2)
        if shares.sum() == 0:
            continue
        srv = assign(sl, shares)
        target = shares / shares.sum()
        placed = np.zeros(6)
        for i, s in enumerate(srv):
            placed[s] += 1
            assert (np.abs(placed - target * (i + 1)) <= 1.5).all(), (shares, srv)
        np.testing.assert_allclose(placed, target * 50, atol=1)


def test_assign_unequal_slices_by_volume():
    sl = layout([10, 10, 5], 3)  # lengths 3,3,3,1,3,3,3,1,3,2 (25 elements)
    srv = assign(sl, [3.0, 5.0, 1.0])
    got = np.bincount(srv, weights=[s.length for s in sl], minlength=3)
    np.testing.assert_array_equal(got, [8, 14, 3])  # targets 8.33, 13.9, 2.78
    assert (np.abs(got - np.array([3, 5, 1]) / 9 * 25) <= 3).all()


def test_assign_probes_idle_servers_first():
    sl = [Slice(0, 0, 2), Slice(0, 2, 2), Slice(0, 4, 2), Slice(1, 0, 1)]
    srv = assign(sl, np.array([3, 0]), probe_num=1)
    assert srv[3] == 1  # the shortest slice probes the idle server
    np.testing.assert_array_equal(srv[:3], [0, 0, 0])
    # without probing the idle server gets nothing
    assert (assign(sl, np.array([3, 0])) == 0).all()


def test_assign_keeps_previous_placement_when_it_fits():
    sl = layout([6], 1)
    prev = [1, 1, 0, 0, 2, 2]
    srv = assign(sl, np.array([2, 2, 2]), previous=prev)
    np.testing.assert_array_equal(srv, prev)
    # one slice has to move off server 1, none other moves
    srv = assign(sl, np.array([3, 1, 2]), previous=prev)
    np.testing.assert_array_equal(np.bincount(srv, minlength=3), [3, 1, 2])
    assert (srv != np.array(prev)).sum() == 1


def test_assign_keeps_long_slices_first_so_none_is_stranded():
    # four short slices and a long one were on server 0, a long one on server 1; now 6 : 6.
    # Kept in layout order, the short ones would fill server 0's room, and the long one
    # would have to go back to server 0 anyway (8 : 4). Long ones first: 6 : 6.
    sl = layout([1, 1, 1, 1, 4, 4], 4)
    out = assign(sl, [6, 6], previous=[0, 0, 0, 0, 0, 1])
    loads = np.bincount(out, weights=[s.length for s in sl], minlength=2)
    assert list(loads) == [6, 6]
    assert out[4] == 0 and out[5] == 1  # the long slices stayed put


def test_assign_errors():
    sl = layout([4], 1)
    with pytest.raises(ValueError, match=">= 0"):
        assign(sl, [1.0, -1.0])
    with pytest.raises(ValueError, match="positive sum"):
        assign(sl, [0, 0])
    with pytest.raises(ValueError, match="previous"):
        assign(sl, [1, 1], previous=[0])
    with pytest.raises(ValueError, match="non-empty"):
        assign(sl, [])
    assert assign([], [1, 1]).size == 0


# ----------------------------------------------------------------------------- granularity


def test_choose_slice_size_square_root_law():
    # q* = sqrt(h P B / (S * stages * w * elem_bytes)) elements
    h, bw, model, s = 1e-3, 1e8, 4e8, 8
    q = choose_slice_size(h, bw, model, s)
    q_star = math.sqrt(h * 1e8 * bw / (s * 2 * 7 * 4))
    assert abs(q - q_star) / q_star < 1e-3
    # it really is the integer minimiser of the cost near q*
    costs = [granularity_cost(v, h, bw, model, s) for v in (q - 50, q, q + 50)]
    assert costs[1] <= min(costs)


def test_choose_slice_size_reproduces_paper_optimum():
    # ResNet-50 (25.6M float32), 12 co-located nodes, ~110 Mbit/s links: with a per-slice
    # overhead of 0.19 s (a WAN round trip), the model's optimum is the paper's 10^5.4
    q = choose_slice_size(0.189, 110e6 / 8, 25.6e6 * 4, 12)
    assert math.log10(q) == pytest.approx(5.4, abs=0.02)


def test_choose_slice_size_monotone_and_clamped():
    base = {"bandwidth_Bps": 1e7, "model_bytes": 1e8, "n_servers": 4}
    small = choose_slice_size(1e-4, **base)
    big = choose_slice_size(1e-2, **base)
    assert big > small  # costlier slices -> fewer, larger slices
    assert choose_slice_size(1e-3, 1e8, 1e8, 4) > choose_slice_size(1e-3, 1e7, 1e8, 4)
    assert choose_slice_size(0.0, **base) == 1  # free slices: as small as allowed
    assert choose_slice_size(0.0, **base, min_elems=1000) == 1000
    assert choose_slice_size(1e9, **base) == 25_000_000  # whole model
    assert choose_slice_size(1e9, **base, max_elems=5000) == 5000
    # one co-located node: nothing crosses the network, one slice per key is best
    assert choose_slice_size(1e-3, 1e7, 1e8, 1) == 25_000_000


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((-1.0, 1e7, 1e8, 4), "per_slice_overhead_s"),
        ((1e-3, 0.0, 1e8, 4), "bandwidth_Bps"),
        ((1e-3, -5.0, 1e8, 4), "bandwidth_Bps"),
        ((1e-3, 1e7, 0.0, 4), "model_bytes"),
        ((1e-3, 1e7, 1e8, 0), "n_servers"),
    ],
)
def test_choose_slice_size_errors(args, match):
    with pytest.raises(ValueError, match=match):
        choose_slice_size(*args)


def test_fit_granularity_recovers_model():
    p = 1_000_000
    q = np.array([1e3, 1e4, 3e4, 1e5, 3e5, 1e6])
    t = 2.0 + 1e-6 * q + 5e-4 * np.ceil(p / q)
    c, alpha, beta, qb = fit_granularity(q, t, p)
    assert (c, alpha, beta) == pytest.approx((2.0, 1e-6, 5e-4), rel=1e-6)
    assert qb == pytest.approx(math.sqrt(5e-4 * p / 1e-6))
    with pytest.raises(ValueError, match="three distinct"):
        fit_granularity([1, 1, 2], [1.0, 1.0, 1.0], 10)
