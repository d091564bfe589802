"""Where the exact LP is not used (docs/BALANCE.md §2.4): a coupled model over LP_MAX_ENTRIES
gets the better of two cheap plans, logged once; below it the LP; the planner never needs it."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from hetps.balance import LoadModel, Network, optimal_plan
from hetps.balance import solve as S


def _coupled(n: int, seed: int = 0) -> Network:
    """Co-located per-link caps: link i -> j carries x_i + x_j (not separable: the LP)."""
    rng = np.random.default_rng(seed)
    sp = 1e8 * rng.choice([1.0, 0.5, 0.25, 0.1], size=n)
    link = np.minimum(sp[:, None], sp[None, :]) * rng.uniform(0.9, 1.1, size=(n, n))
    return Network(np.full(n, np.inf), np.full(n, np.inf), link)


def _no_lp(*_a, **_k):
    raise AssertionError("the LP was called")


def test_a_coupled_model_over_the_limit_gets_the_fallback_logged_once(monkeypatch, caplog):
    net = _coupled(12)
    model = LoadModel.build(net, 1.0)
    assert not model.separable and model.A.size > 1000
    f_lp, t_lp = S.solve_continuous(model)  # under the default limit: the LP
    monkeypatch.setattr(S, "_scipy_linprog", _no_lp)
    monkeypatch.setattr(S, "_told_no_lp", False)
    with caplog.at_level(logging.WARNING, logger="hetps.balance"):
        f, t = S.solve_continuous(model, lp_max_entries=1000)
        shares = optimal_plan(net, 1e6, lp_max_entries=1000, n_slices=48)  # no MILP either
    assert sum("too big for the exact LP" in r.message for r in caplog.records) == 1
    assert shares.sum() == 48
    equal = np.full(12, 1 / 12)
    assert t <= model.time(equal) and t >= t_lp * (1 - 1e-9)  # never worse than equal shares
    assert t == pytest.approx(model.time(f))


def test_under_the_limit_or_without_one_the_lp_is_exact(monkeypatch):
    net = _coupled(10, seed=3)
    model = LoadModel.build(net, 1.0)
    called = []
    real = S._lp
    monkeypatch.setattr(S, "_lp", lambda m: called.append(1) or real(m))
    t_lp = S.solve_continuous(model)[1]
    assert called and S.solve_continuous(model, lp_max_entries=None)[1] == t_lp
    assert S.too_big_for_lp(model, model.A.size - 1) and not S.too_big_for_lp(model, None)
    # the default limit: co-located per-link caps get the LP up to N = 64, not from N = 65
    for n, big in ((64, False), (65, True)):
        rows, servers = n * (n - 1), n
        assert (rows * servers > S.LP_MAX_ENTRIES) is big


def test_lower_bound_is_exact_at_any_size(monkeypatch):
    net = _coupled(10, seed=5)
    monkeypatch.setattr(S, "LP_MAX_ENTRIES", 10)
    want = S.solve_continuous(LoadModel.build(net, 1e6), lp_max_entries=None)[1]
    assert S.lower_bound(net.up, net.down, 1e6, link=net.link) == pytest.approx(want)


@pytest.mark.parametrize("scheme", ["optimal", "aware"])
def test_the_planner_plans_on_separable_models_never_the_lp(monkeypatch, scheme):
    from hetps.balance.service import Planner
    from hetps.balance.slicing import layout

    monkeypatch.setattr(S, "_lp", _no_lp)
    monkeypatch.setattr(S, "_scipy_linprog", _no_lp)
    for colocate in (False, True):
        p = Planner(scheme, 3, 3, colocate=colocate, slice_elems=100, margin=0.0, patience=1)
        p.slices = layout([12000], 100)
        p.assignment = np.array([0, 1, 2] * 40, dtype=np.int64)
        for i in range(p.n_nodes):  # measured links (the fallback network before node rates)
            for j in range(p.n_nodes):
                if i != j:
                    p.table.observe(i, j, (1e6 if 2 in (i, j) else 1e7), 0.0, 1.0)
        out = p.plan()  # a planning failure would keep the old plan (epoch 0)
        assert out["epoch"] == 1 and out["shares"][2] < 0.3
        net = p.links.node_network() or Network.from_matrix(p.link_matrix())
        assert net.link is None  # per-node caps: separable, never the LP
