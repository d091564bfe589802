"""Property tests: every plan is a valid split and none beats the optimal plan."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetps.balance import (
    LoadModel,
    Network,
    assign,
    average_plan,
    aware_plan,
    elastic_plan,
    layout,
    lower_bound,
    optimal_plan,
)

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

rate = st.floats(min_value=0.5, max_value=200.0, allow_nan=False)


@st.composite
def scenarios(draw):
    """A network, server and worker sets (co-located or separate), with or without links."""
    n = draw(st.integers(min_value=1, max_value=5))
    up = draw(st.lists(rate, min_size=n, max_size=n))
    down = draw(st.lists(rate, min_size=n, max_size=n))
    link = None
    if draw(st.booleans()):
        link = draw(st.lists(st.lists(rate, min_size=n, max_size=n), min_size=n, max_size=n))
    net = Network.from_rates(up, down, link)
    if n >= 3 and draw(st.booleans()):
        k = draw(st.integers(min_value=1, max_value=n - 1))
        servers = list(range(k, n))
        workers = list(range(k)) if draw(st.booleans()) else list(range(n))
    else:
        servers = workers = None
    return net, servers, workers


totals = st.one_of(st.just(1.0), st.floats(min_value=1e-3, max_value=1e9))


def _check_continuous(x: np.ndarray, n_s: int, total: float) -> None:
    assert x.shape == (n_s,)
    assert (x >= 0).all()
    assert np.isclose(x.sum(), total, rtol=1e-12, atol=0)


@SETTINGS
@given(scenarios(), totals)
def test_continuous_plans_valid_and_optimal_is_best(sc, total):
    net, servers, workers = sc
    model = LoadModel.build(net, total, servers, workers)
    n_s = model.n_servers
    opt = optimal_plan(net, total, servers, workers)
    plans = {
        "average": average_plan(total, n_s),
        "aware": aware_plan(net, total, servers, workers),
        "optimal": opt,
    }
    # an elastic plan from synthetic history (linear times per server)
    hist = [[(x, 0.1 * (s + 1) + x / (s + 1)) for x in (1.0, 2.0)] for s in range(n_s)]
    plans["elastic"] = elastic_plan(hist, total)
    t_opt = model.time(opt / total)
    for name, x in plans.items():
        _check_continuous(x, n_s, total)
        assert t_opt <= model.time(x / total) * (1 + 1e-7), name
    # the optimum equals the lower bound computed from the same (true) rates
    bound = lower_bound(net.up, net.down, total, servers, workers, link=net.link)
    assert np.isclose(bound, t_opt, rtol=1e-7)


@SETTINGS
@given(scenarios(), st.integers(min_value=1, max_value=40))
def test_slice_plans_valid_and_optimal_is_best(sc, n_slices):
    net, servers, workers = sc
    model = LoadModel.build(net, 1.0, servers, workers)
    n_s = model.n_servers
    plans = {
        "average": average_plan(1.0, n_s, n_slices=n_slices),
        "aware": aware_plan(net, 1.0, servers, workers, n_slices=n_slices),
        "optimal": optimal_plan(net, 1.0, servers, workers, n_slices=n_slices),
    }
    t_opt = model.time(plans["optimal"] / n_slices)
    for name, k in plans.items():
        assert k.dtype == np.int64 and k.shape == (n_s,), name
        assert (k >= 0).all() and int(k.sum()) == n_slices, name
        assert t_opt <= model.time(k / n_slices) * (1 + 1e-9), name
    # rounding to slices costs at most one slice on each resource (docs/BALANCE.md)
    cont = model.time(optimal_plan(net, 1.0, servers, workers))
    step = (np.abs(model.A).sum(axis=1) / n_slices) * model.scale / model.cap
    assert t_opt <= cont + (step.max() if step.size else 0.0) + 1e-9


@SETTINGS
@given(
    st.lists(st.integers(min_value=0, max_value=50), min_size=1, max_size=8),
    st.integers(min_value=1, max_value=16),
    st.lists(st.integers(min_value=0, max_value=9), min_size=1, max_size=5),
    st.randoms(use_true_random=False),
)
def test_assign_gives_every_slice_a_server(sizes, x, shares, rnd):
    sl = layout(sizes, x)
    assert sum(s.length for s in sl) == sum(sizes)
    if sum(shares) == 0:
        return
    previous = [rnd.randrange(len(shares)) for _ in sl] if rnd.random() < 0.5 else None
    srv = assign(sl, np.array(shares), previous=previous)
    assert srv.shape == (len(sl),)
    assert ((srv >= 0) & (srv < len(shares))).all()
    # no slice goes to a zero-share server when not probing
    assert all(shares[s] > 0 for s in srv)
    # each server is within one (longest) slice of its target volume
    got = np.bincount(srv, weights=[s.length for s in sl], minlength=len(shares))
    target = np.array(shares) / sum(shares) * sum(sizes)
    assert (np.abs(got - target) <= x + 1e-9).all()
