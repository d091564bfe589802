"""Plans with exact vectors, brute force, convergence of Algorithm 1, elastic fits, errors."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from hetps.balance import (
    PLAN_NAMES,
    LoadModel,
    Network,
    average_plan,
    aware_plan,
    elastic_plan,
    equalise_linear,
    fit_linear,
    greedy_round,
    iteration_time,
    largest_remainder,
    make_plan,
    optimal_plan,
    server_times,
    solve_integer,
)

INF = math.inf


def compositions(n: int, k: int):
    """All k-tuples of non-negative ints summing to n."""
    for cuts in itertools.combinations(range(n + k - 1), k - 1):
        prev = -1
        out = []
        for c in (*cuts, n + k - 1):
            out.append(c - prev - 1)
            prev = c
        yield tuple(out)


def brute_force(model: LoadModel, n: int) -> float:
    return min(model.time(np.array(k) / n) for k in compositions(n, model.n_servers))


def links_only(link) -> Network:
    link = np.asarray(link, dtype=float)
    n = link.shape[0]
    return Network(np.full(n, INF), np.full(n, INF), link)


# ----------------------------------------------------------------------------- average


def test_average_continuous_and_slices():
    np.testing.assert_allclose(average_plan(10.0, 4), [2.5] * 4)
    assert average_plan(10.0, 3).sum() == pytest.approx(10.0)
    k = average_plan(10.0, 3, n_slices=10)
    assert k.dtype == np.int64
    np.testing.assert_array_equal(k, [4, 3, 3])
    np.testing.assert_array_equal(average_plan(1.0, 4, n_slices=6), [2, 2, 1, 1])
    np.testing.assert_array_equal(average_plan(1.0, 4, n_slices=2), [1, 1, 0, 0])


# ----------------------------------------------------------------------------- optimal


def test_optimal_colocated_node_caps_exact():
    # (15 + x_i) / c_i = T for c = 4, 5, 6: T = 4, x = 1, 5, 9
    net = Network.from_rates([4.0, 5.0, 6.0])
    x = optimal_plan(net, 15.0)
    np.testing.assert_allclose(x, [1.0, 5.0, 9.0])
    assert iteration_time(net, x) == pytest.approx(4.0)
    assert iteration_time(net, average_plan(15.0, 3)) == pytest.approx(5.0)
    np.testing.assert_array_equal(optimal_plan(net, 15.0, n_slices=15), [1, 5, 9])
    # 5 slices of 3: floor (0, 1, 3), the fifth slice is cheapest on node 1 -> T = 21/5
    np.testing.assert_array_equal(optimal_plan(net, 15.0, n_slices=5), [0, 2, 3])


def test_optimal_gives_slow_nodes_zero_share():
    # nodes 0 and 1 need 6 s just for their own workers' push of M = 6 at 1 B/s; any share
    # on them adds to that, so node 2 takes everything and T = 6 (average: 8)
    net = Network.from_rates([1.0, 1.0, 4.0])
    np.testing.assert_allclose(optimal_plan(net, 6.0), [0.0, 0.0, 6.0])
    np.testing.assert_array_equal(optimal_plan(net, 6.0, n_slices=3), [0, 0, 3])
    assert iteration_time(net, [0.0, 0.0, 6.0]) == pytest.approx(6.0)
    assert iteration_time(net, average_plan(6.0, 3)) == pytest.approx(8.0)


def test_optimal_separate_servers_receive_caps():
    # workers 0, 1; servers 2, 3 each receive x_s from both workers: t_s = 2 x_s / c_s
    net = Network.from_rates([10.0, 10.0, 1.0, 3.0])
    np.testing.assert_allclose(optimal_plan(net, 8.0, [2, 3], [0, 1]), [2.0, 6.0])
    np.testing.assert_array_equal(optimal_plan(net, 8.0, [2, 3], [0, 1], n_slices=4), [1, 3])


def test_optimal_per_link_caps_separate_roles():
    # workers 0, 1; servers 2, 3; t_2 = max(x/1, x/4, x/2, x/4) = x, t_3 = x / 2
    link = np.full((4, 4), INF)
    link[0, 2], link[1, 2], link[2, 0], link[2, 1] = 1.0, 4.0, 2.0, 4.0
    link[0, 3] = link[1, 3] = link[3, 0] = link[3, 1] = 2.0
    net = links_only(link)
    x = optimal_plan(net, 6.0, [2, 3], [0, 1])
    np.testing.assert_allclose(x, [2.0, 4.0])
    np.testing.assert_allclose(server_times(net, x, [2, 3], [0, 1]), [2.0, 2.0])


def test_optimal_zero_rate_link_gets_zero_share():
    link = np.full((4, 4), 2.0)
    link[0, 3] = 0.0  # worker 0 cannot reach server 3
    net = links_only(link)
    x = optimal_plan(net, 6.0, [2, 3], [0, 1])
    np.testing.assert_allclose(x, [6.0, 0.0])
    np.testing.assert_array_equal(aware_plan(net, 6.0, [2, 3], [0, 1], n_slices=4), [4, 0])


def test_optimal_colocated_links_lp():
    # x_i + x_j <= c_ij T with c_01 = 1, c_02 = c_12 = 2: all three tight at x = (2, 2, 6), T = 4
    net = links_only([[INF, 1, 2], [1, INF, 2], [2, 2, INF]])
    x = optimal_plan(net, 10.0)
    np.testing.assert_allclose(x, [2.0, 2.0, 6.0], atol=1e-9)
    assert iteration_time(net, x) == pytest.approx(4.0)
    np.testing.assert_array_equal(optimal_plan(net, 10.0, n_slices=10), [2, 2, 6])
    assert iteration_time(net, aware_plan(net, 10.0)) >= 4.0 - 1e-9


def test_optimal_single_server_and_zero_total():
    net = Network.from_rates([1.0, 2.0])
    np.testing.assert_allclose(optimal_plan(net, 5.0, servers=[1]), [5.0])
    np.testing.assert_allclose(optimal_plan(net, 0.0), [0.0, 0.0])
    np.testing.assert_array_equal(optimal_plan(net, 0.0, n_slices=3).sum(), 3)


def test_optimal_uncapped_network_is_equal():
    net = Network.from_rates([INF, INF, INF])
    np.testing.assert_allclose(optimal_plan(net, 9.0), [3.0, 3.0, 3.0])


def _random_networks():
    rng = np.random.default_rng(1234)
    cases = []
    for trial in range(30):
        n = int(rng.integers(2, 5))
        rates = rng.uniform(1.0, 10.0, size=n)
        kind = trial % 3
        if kind == 0:  # co-located, node caps (separable)
            cases.append((Network.from_rates(rates, rng.uniform(1.0, 10.0, n)), None, None))
        elif kind == 1:  # co-located with per-link caps (coupled: MILP)
            link = rng.uniform(1.0, 10.0, size=(n, n))
            cases.append((Network(rates, rates * 2, link), None, None))
        else:  # separate roles, per-link caps and node caps (separable)
            m = n + 2
            link = rng.uniform(1.0, 10.0, size=(m, m))
            net = Network(rng.uniform(1.0, 20.0, m), rng.uniform(1.0, 20.0, m), link)
            cases.append((net, list(range(2, m)), [0, 1]))
    return cases


@pytest.mark.parametrize(("net", "servers", "workers"), _random_networks())
@pytest.mark.parametrize("n_slices", [1, 5, 12])
def test_optimal_integer_matches_brute_force(net, servers, workers, n_slices):
    model = LoadModel.build(net, 1.0, servers, workers)
    k = optimal_plan(net, 1.0, servers, workers, n_slices=n_slices)
    assert k.sum() == n_slices and (k >= 0).all()
    assert model.time(k / n_slices) == pytest.approx(brute_force(model, n_slices), rel=1e-9)
    # the continuous optimum is a lower bound of the brute force
    x = optimal_plan(net, 1.0, servers, workers)
    assert model.time(x) <= brute_force(model, n_slices) * (1 + 1e-9)


def test_greedy_round_is_optimal_from_any_floor():
    net = Network.from_rates([3.0, 7.0, 11.0, 2.0])
    model = LoadModel.build(net, 1.0)
    for n in range(1, 13):
        k = greedy_round(optimal_plan(net, 1.0), n, lambda kk, n=n: model.server_times(kk / n))
        assert model.time(k / n) == pytest.approx(brute_force(model, n), rel=1e-12)


def test_solve_integer_rejects_zero_slices():
    model = LoadModel.build(Network.from_rates([1.0, 2.0]), 1.0)
    with pytest.raises(ValueError, match="n_slices"):
        solve_integer(model, 0)


def test_largest_remainder():
    np.testing.assert_array_equal(largest_remainder([1, 1, 1], 10), [4, 3, 3])
    np.testing.assert_array_equal(largest_remainder([0.2, 0.5, 0.3], 7), [1, 4, 2])
    np.testing.assert_array_equal(largest_remainder([1, 0], 3), [3, 0])
    with pytest.raises(ValueError):
        largest_remainder([0, 0], 3)


# ----------------------------------------------------------------------------- aware


def test_aware_exact_vectors():
    net = Network.from_rates([4.0, 5.0, 6.0])
    # one step: equalising (20 - d)/4 and (20 + d)/6 moves d = 4 from node 0 to node 2
    np.testing.assert_array_equal(aware_plan(net, 15.0, n_slices=15), [1, 5, 9])
    np.testing.assert_allclose(aware_plan(net, 15.0, threshold=1e-9), [1.0, 5.0, 9.0])
    # slow nodes end with nothing, like the optimum
    slow = Network.from_rates([1.0, 1.0, 4.0])
    np.testing.assert_allclose(aware_plan(slow, 6.0), [0.0, 0.0, 6.0])
    np.testing.assert_array_equal(aware_plan(slow, 6.0, n_slices=6), [0, 0, 6])


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("threshold", [1e-2, 1e-6])
@pytest.mark.parametrize("spread", [1.2, 100.0])
def test_aware_converges_within_threshold(seed, threshold, spread):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(3, 9))
    net = Network.from_rates(rng.uniform(10.0, 10 * spread, n), rng.uniform(10.0, 10 * spread, n))
    x = aware_plan(net, 100.0, threshold=threshold)
    t = server_times(net, x)
    holders = x > 0
    # the longest time among servers holding load is within threshold of the shortest
    assert t[holders].max() - t.min() < threshold
    # and so the plan is within threshold of the optimum (docs/BALANCE.md)
    assert iteration_time(net, x) <= iteration_time(net, optimal_plan(net, 100.0)) + threshold


def test_aware_default_threshold_is_relative():
    rng = np.random.default_rng(7)
    net = Network.from_rates(rng.uniform(1.0, 100.0, 6))
    x = aware_plan(net, 1.0)
    t_eq = iteration_time(net, average_plan(1.0, 6))
    assert iteration_time(net, x) <= iteration_time(net, optimal_plan(net, 1.0)) + 1e-3 * t_eq


def test_aware_slices_never_worse_than_average():
    rng = np.random.default_rng(3)
    for _ in range(20):
        n = int(rng.integers(2, 7))
        net = Network.from_rates(rng.uniform(1.0, 50.0, n), rng.uniform(1.0, 50.0, n))
        k = aware_plan(net, 1.0, n_slices=40)
        assert k.sum() == 40
        t_avg = iteration_time(net, average_plan(1.0, n, n_slices=40))
        assert iteration_time(net, k) <= t_avg * (1 + 1e-12)


# ----------------------------------------------------------------------------- elastic


def test_fit_linear_recovers_noiseless_models():
    a, b = fit_linear([(x, 0.5 + 0.25 * x) for x in (1.0, 2.0, 8.0, 3.0)])
    assert a == pytest.approx(0.5) and b == pytest.approx(0.25)
    assert fit_linear([(4.0, 2.0), (4.0, 3.0)]) == pytest.approx((0.0, 0.625))  # one x
    assert fit_linear([]) is None
    assert fit_linear([(0.0, 1.0)]) is None


def test_equalise_linear_exact():
    # T = (10 + 1/1 + 0 + 2/0.25) / (1 + 2 + 4) = 19/7
    x = equalise_linear([1.0, 0.0, 2.0], [1.0, 0.5, 0.25], 10.0)
    np.testing.assert_allclose(x, [12 / 7, 38 / 7, 20 / 7])
    # intercept 100 >= T = 5: that server gets nothing
    np.testing.assert_allclose(equalise_linear([0.0, 0.0, 100.0], [1.0, 1.0, 1.0], 10.0), [5, 5, 0])
    with pytest.raises(ValueError, match="slope"):
        equalise_linear([0.0, 0.0], [1.0, 0.0], 1.0)


def test_elastic_recovers_models_and_equalises():
    a = [1.0, 0.0, 2.0]
    b = [1.0, 0.5, 0.25]
    history = [[(x, a[s] + b[s] * x) for x in (1.0, 3.0, 4.0)] for s in range(3)]
    np.testing.assert_allclose(elastic_plan(history, 10.0), [12 / 7, 38 / 7, 20 / 7])
    k = elastic_plan(history, 10.0, n_slices=10)
    assert k.sum() == 10
    t = np.array(a) + np.array(b) * k
    brute = min(max(a[s] + b[s] * c[s] for s in range(3)) for c in compositions(10, 3))
    assert t.max() == pytest.approx(brute)


def test_elastic_zero_share_and_fallbacks():
    history = [[(1.0, 1.0), (2.0, 2.0)], [(1.0, 1.0), (3.0, 3.0)], [(1.0, 101.0), (2.0, 102.0)]]
    np.testing.assert_allclose(elastic_plan(history, 10.0), [5.0, 5.0, 0.0])
    # one share size only: lines through the origin, b = 1 and 2; server 2 has no samples
    # and gets the median model (a, b) = (0, 1.5): x proportional to 1/b = 1, 1/2, 2/3
    history = [[(2.0, 2.0)], [(2.0, 4.0)], []]
    np.testing.assert_allclose(elastic_plan(history, 8.0), [48 / 13, 24 / 13, 32 / 13])
    with pytest.raises(ValueError, match="at least one server"):
        elastic_plan([[], [(0.0, 1.0)]], 1.0)


# ----------------------------------------------------------------------------- make_plan


def test_make_plan_dispatch():
    net = Network.from_rates([4.0, 5.0, 6.0])
    np.testing.assert_array_equal(make_plan("average", 15.0, network=net, n_slices=4), [2, 1, 1])
    np.testing.assert_allclose(make_plan("optimal", 15.0, network=net), [1, 5, 9])
    np.testing.assert_array_equal(make_plan("aware", 15.0, network=net, n_slices=15), [1, 5, 9])
    hist = [[(1.0, 1.0)], [(1.0, 1.0)]]
    np.testing.assert_allclose(make_plan("elastic", 2.0, history=hist), [1.0, 1.0])
    # a raw measured matrix is accepted as the network
    bw = [[INF, 4.0, 4.0], [4.0, INF, 5.0], [4.0, 5.0, INF]]  # isolated rates min(c_i, c_j)
    expect = optimal_plan(Network.from_matrix(bw), 15.0)
    np.testing.assert_allclose(make_plan("optimal", 15.0, network=bw), expect)
    assert set(PLAN_NAMES) == {"average", "elastic", "aware", "optimal"}


@pytest.mark.parametrize(
    ("name", "kwargs", "match"),
    [
        ("fastest", {}, "unknown plan 'fastest'; valid names: average, elastic, aware, optimal"),
        ("elastic", {}, "elastic needs history"),
        ("aware", {}, "aware needs network"),
        ("optimal", {}, "optimal needs network"),
        ("average", {}, "average needs"),
        ("average", {"servers": []}, "n_servers"),
        ("optimal", {"network": Network.from_rates([1.0]), "servers": []}, "servers is empty"),
        ("optimal", {"network": [[INF, -1.0], [1.0, INF]]}, "negative bandwidth"),
        ("average", {"servers": [0], "n_slices": 0}, "n_slices"),
        ("average", {"servers": [0], "n_slices": 1.5}, "n_slices"),
    ],
)
def test_make_plan_errors(name, kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_plan(name, 1.0, **kwargs)


@pytest.mark.parametrize("total", [-1.0, math.inf, math.nan])
def test_plans_reject_bad_total(total):
    with pytest.raises(ValueError, match="total"):
        average_plan(total, 2)
    with pytest.raises(ValueError, match="total"):
        optimal_plan(Network.from_rates([1.0, 1.0]), total)


def test_aware_rejects_negative_threshold():
    net = Network.from_rates([1.0, 2.0])
    with pytest.raises(ValueError, match="threshold"):
        aware_plan(net, 1.0, threshold=-1.0)
    with pytest.raises(ValueError, match="rel_threshold"):
        aware_plan(net, 1.0, rel_threshold=-1.0)


def test_worker_with_zero_send_rate_is_reported():
    with pytest.raises(ValueError, match="'send 1' has rate 0"):
        optimal_plan(Network.from_rates([1.0, 0.0, 1.0]), 1.0)
    with pytest.raises(ValueError, match="rate 0"):
        aware_plan(Network.from_rates([1.0, 0.0, 1.0]), 1.0)
