"""``optimal_plan`` against a brute force whose cost is written here from the model's definition.

The cost does not use :class:`hetps.balance.LoadModel` or any hetps function. From the link
model (docs/BALANCE.md §1): nodes ``0..N-1`` with send caps ``up``, receive caps ``down`` and
optional per-link caps ``link[i][j]`` (bytes/s, ``inf`` uncapped, ``0`` carries nothing). In a
round every worker pushes server ``s``'s share ``x_s`` to every server and pulls it back; a
worker and a server on the same node use no network. So node ``i`` sends node ``j != i``

    d_ij = [i worker][j server] x_j  +  [i server][j worker] x_i

and the round takes the longest of: everything ``i`` sends over ``up[i]``, everything ``j``
receives over ``down[j]``, and ``d_ij`` over ``link[i][j]``. With ``n_slices``, ``optimal``
must find the best of all whole-slice splits (enumerated); without, it must reach the
continuous optimum of that cost (an LP set up here, itself never worse than a grid of splits).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from hetps.balance import Network, optimal_plan

INF = math.inf


def _seconds(load: np.ndarray, cap: np.ndarray) -> np.ndarray:
    """``load / cap``: 0 on an uncapped resource, inf for a load on a zero cap."""
    with np.errstate(divide="ignore", invalid="ignore"):
        t = load / cap
    t = np.where(np.isinf(cap), 0.0, t)
    return np.where(cap == 0, np.where(load > 1e-12, INF, 0.0), t)


def resource_loads(shares, up, down, link, servers, workers) -> tuple[np.ndarray, np.ndarray]:
    """Bytes on every resource for each row of ``shares`` (``K x len(servers)``), and the caps.

    Resources: every node's sending, every node's receiving, every ordered link.
    """
    x = np.atleast_2d(np.asarray(shares, dtype=float))
    n = len(up)
    is_w = np.zeros(n, bool)
    is_w[list(workers)] = True
    is_s = np.zeros(n, bool)
    is_s[list(servers)] = True
    node_share = np.zeros((x.shape[0], n))
    node_share[:, list(servers)] = x
    # d[k, i, j]: bytes node i sends node j under split k
    push = (is_w[:, None] & is_s[None, :])[None] * node_share[:, None, :]
    pull = (is_s[:, None] & is_w[None, :])[None] * node_share[:, :, None]
    d = push + pull
    d[:, np.arange(n), np.arange(n)] = 0.0
    link_caps = np.full((n, n), INF) if link is None else np.array(link, dtype=float)
    np.fill_diagonal(link_caps, INF)
    loads = np.concatenate([d.sum(axis=2), d.sum(axis=1), d.reshape(x.shape[0], -1)], axis=1)
    caps = np.concatenate([np.asarray(up, float), np.asarray(down, float), link_caps.ravel()])
    return loads, caps


def round_time(shares, up, down, link, servers, workers) -> np.ndarray:
    """Round time of each row of ``shares``: the slowest resource."""
    loads, caps = resource_loads(shares, up, down, link, servers, workers)
    return _seconds(loads, caps[None, :]).max(axis=1)


def continuous_optimum(up, down, link, servers, workers) -> float:
    """The smallest round time over all real splits: ``min T`` s.t. every load <= cap * T.

    Loads are linear in the shares, so their coefficients are the loads of one unit on each
    server; an LP of this file's own (scipy's HiGHS).
    """
    from scipy.optimize import linprog

    n_s = len(servers)
    coef, caps = resource_loads(np.eye(n_s), up, down, link, servers, workers)
    coef = coef.T  # (resources, servers)
    keep = np.isfinite(caps) & coef.any(axis=1)
    coef, caps = coef[keep], caps[keep]
    res = linprog(
        np.r_[np.zeros(n_s), 1.0],
        A_ub=np.hstack([coef, -caps[:, None]]),
        b_ub=np.zeros(len(caps)),
        A_eq=np.r_[np.ones(n_s), 0.0][None, :],
        b_eq=[1.0],
        bounds=[(0, None)] * (n_s + 1),
        method="highs",
    )
    assert res.status == 0, res.message
    return float(round_time(res.x[:n_s], up, down, link, servers, workers)[0])


def all_splits(n: int, k: int) -> np.ndarray:
    """Every way to put ``n`` slices on ``k`` servers, one row each."""
    rows = []
    for cuts in itertools.combinations(range(n + k - 1), k - 1):
        edges = (-1, *cuts, n + k - 1)
        rows.append([edges[i + 1] - edges[i] - 1 for i in range(k)])
    return np.array(rows, dtype=float)


def _cases():
    """Small networks of every shape the solvers treat differently."""
    rng = np.random.default_rng(2024)
    out = []
    for trial in range(48):
        kind = trial % 6
        n = 2 + (trial // 6) % 3
        up, down = rng.uniform(1.0, 10.0, n), rng.uniform(1.0, 10.0, n)
        link = None
        servers = workers = list(range(n))
        if kind == 0:  # co-located, node caps: separable (closed form)
            pass
        elif kind == 1:  # co-located with per-link caps: coupled (LP / MILP)
            link = rng.uniform(1.0, 10.0, (n, n))
        elif kind in (2, 5):  # separate roles, node and link caps
            m = n + 2
            up, down = rng.uniform(1.0, 20.0, m), rng.uniform(1.0, 20.0, m)
            link = rng.uniform(1.0, 10.0, (m, m))
            workers, servers = [0, 1], list(range(2, m))
            if kind == 5:
                link[0, 2] = 0.0  # worker 0 cannot reach server 2: it must get nothing
        elif kind == 3:  # every node a worker, some also servers, links
            link = rng.uniform(1.0, 10.0, (n + 1, n + 1))
            up, down = rng.uniform(1.0, 10.0, n + 1), rng.uniform(1.0, 10.0, n + 1)
            workers, servers = list(range(n + 1)), list(range(1, n + 1))
        else:  # two workers that are also servers, the other nodes servers only, links
            up, down = rng.uniform(1.0, 10.0, n + 1), rng.uniform(1.0, 10.0, n + 1)
            link = rng.uniform(1.0, 10.0, (n + 1, n + 1))
            workers, servers = [0, 1], list(range(n + 1))
        out.append(pytest.param(up, down, link, servers, workers, id=f"kind{kind}-n{n}-{trial}"))
    return out


def _net(up, down, link):
    return Network(np.asarray(up, float), np.asarray(down, float), link)


@pytest.mark.parametrize(("up", "down", "link", "servers", "workers"), _cases())
def test_optimal_slices_equal_independent_brute_force(up, down, link, servers, workers):
    net = _net(up, down, link)
    for n_slices in (1, 4, 7, 12):
        k = optimal_plan(net, 1.0, servers, workers, n_slices=n_slices)
        assert k.sum() == n_slices and (k >= 0).all(), k
        splits = all_splits(n_slices, len(servers))
        times = round_time(splits / n_slices, up, down, link, servers, workers)
        best = times.min()
        assert math.isfinite(best)
        got = round_time(k / n_slices, up, down, link, servers, workers)[0]
        assert got == pytest.approx(best, rel=1e-9), (n_slices, k, splits[np.argmin(times)])


@pytest.mark.parametrize(("up", "down", "link", "servers", "workers"), _cases())
def test_optimal_continuous_equals_independent_optimum(up, down, link, servers, workers):
    net = _net(up, down, link)
    x = optimal_plan(net, 1.0, servers, workers)
    assert (x >= 0).all() and x.sum() == pytest.approx(1.0)
    t = round_time(x, up, down, link, servers, workers)[0]
    best = continuous_optimum(up, down, link, servers, workers)
    assert t == pytest.approx(best, rel=1e-7), (x, t, best)
    # the LP here is no worse than a grid of whole slices (it checks the LP, not the plan)
    grid = 24
    on_grid = round_time(all_splits(grid, len(servers)) / grid, up, down, link, servers, workers)
    assert best <= on_grid.min() * (1 + 1e-9)
