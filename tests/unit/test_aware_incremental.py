"""Algorithm 1 made incremental (``aware_plan``) against the implementation it replaced, kept
here as the reference: identical plans, to the last bit, on many random networks (per-node and
per-link caps, co-located or not, ties, zero rates, whole slices or not)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import pytest

from hetps.balance import LoadModel, Network, aware_plan
from hetps.balance.plans import _as_network, _check_total, _fix_sum, average_plan

NetworkLike = Network | np.ndarray


# ---------------------------------------------------------------- the reference (old code)


def _ref_pair_step(
    model: LoadModel, f: np.ndarray, hi: int, lo: int, quantum: float | None
) -> tuple[float, float, float]:
    """Best amount to move from ``hi`` to ``lo``: minimises the larger of their predicted times.

    Every resource touching either server is a line ``p_r + q_r * d`` in the moved fraction
    ``d``; the maximum of lines is convex, so its minimum over ``[0, f_hi]`` lies at an end or
    where two lines cross. Returns (d, time after, time before).
    """
    rows = (model.A[:, hi] != 0) | (model.A[:, lo] != 0)
    c = model.cap[rows]
    p = model.scale * (model.beta[rows] + model.A[rows] @ f) / c
    q = model.scale * (model.A[rows, lo] - model.A[rows, hi]) / c
    dmax = float(f[hi])
    before = float(p.max()) if p.size else 0.0
    if p.size == 0 or dmax <= 0:
        return 0.0, before, before
    dq = q[:, None] - q[None, :]
    with np.errstate(divide="ignore", invalid="ignore"):
        cross = (p[None, :] - p[:, None]) / dq
    cand = np.concatenate([[0.0, dmax], cross[np.isfinite(cross)]])
    cand = cand[(cand >= 0) & (cand <= dmax)]
    if quantum is not None:
        # P is convex: the best whole number of slices is next to the continuous optimum
        steps = np.concatenate([np.floor(cand / quantum), np.ceil(cand / quantum)])
        cand = np.unique(np.concatenate([np.clip(steps * quantum, 0, dmax), [dmax]]))
    vals = (p[None, :] + q[None, :] * cand[:, None]).max(axis=1)
    best = vals.min()
    ok = vals <= best + _ref_tol(best)
    d = float(cand[ok].min())
    return d, float((p + q * d).max()), before


def _ref_tol(v: float) -> float:
    return 1e-12 * max(abs(v), 1e-300) + 1e-300


def reference_aware_plan(
    network: NetworkLike,
    total: float,
    servers: Sequence[int] | None = None,
    workers: Sequence[int] | None = None,
    *,
    n_slices: int | None = None,
    threshold: float | None = None,
    rel_threshold: float = 1e-3,
    max_iter: int = 10_000,
    unit_bytes: float = 1.0,
) -> np.ndarray:
    """The paper's Algorithm 1 on the link model.

    Start from equal shares. Repeat: ``hi`` = the server with the longest predicted time that
    still holds load, ``lo`` = the one with the shortest; stop when they differ by less than
    ``threshold`` seconds (default ``rel_threshold`` times the equal plan's time); otherwise move
    the amount that minimises the longer of the two times -- the amount that makes them equal
    when that is possible -- found exactly on the piecewise-linear model (whole slices with
    ``n_slices``: the better of the two neighbouring counts). A server whose time no move can
    lower is frozen (its time is set by traffic the plan cannot change).
    """
    _check_total(total, n_slices)
    if threshold is not None and not threshold >= 0:
        raise ValueError(f"threshold must be >= 0 seconds, got {threshold}")
    if not rel_threshold >= 0:
        raise ValueError(f"rel_threshold must be >= 0, got {rel_threshold}")
    net = _as_network(network)
    model = LoadModel.build(net, float(total), servers, workers, unit_bytes=unit_bytes)
    model.check_feasible()
    n_s = model.n_servers
    if n_slices is not None:
        k = average_plan(0.0, n_s, n_slices=int(n_slices))
        f = k / float(n_slices)
        quantum: float | None = 1.0 / float(n_slices)
    else:
        f = np.full(n_s, 1.0 / n_s)
        quantum = None
    if total > 0 and n_s > 1 and model.A.shape[0] > 0:
        # a zero rate is treated as a tiny one so that load on it has a finite, huge cost
        pos = model.cap[model.cap > 0]
        tiny = (pos.max() if pos.size else 1.0) * 1e-9
        shadow = dataclasses.replace(model, cap=np.where(model.cap > 0, model.cap, tiny))
        if threshold is None:
            threshold = rel_threshold * shadow.time(f)
        frozen = np.zeros(n_s, dtype=bool)
        for _ in range(max_iter):
            t = shadow.server_times(f)
            donors = (f > 0) & ~frozen
            if not donors.any():
                break
            hi = int(np.argmax(np.where(donors, t, -np.inf)))
            others = np.arange(n_s) != hi
            lo = int(np.argmin(np.where(others, t, np.inf)))
            if t[hi] - t[lo] < threshold:
                break
            d, after, before = _ref_pair_step(shadow, f, hi, lo, quantum)
            if d <= 0 or after >= before - _ref_tol(before):
                frozen[hi] = True
                continue
            f = f.copy()
            f[hi] -= d
            f[lo] += d
            if quantum is not None:
                f = np.rint(f / quantum) * quantum
            f[f < 0] = 0.0
    if n_slices is not None:
        k = np.rint(f * n_slices).astype(np.int64)
        k[int(np.argmax(k))] += int(n_slices) - int(k.sum())
        return k
    return _fix_sum(f * float(total), float(total)) if total > 0 else f * 0.0


# ---------------------------------------------------------------- random networks

LEVELS = (1.0, 0.5, 0.25, 0.1)  # few distinct rates: many ties


def _random_case(rng: np.random.Generator, kind: str, n: int):
    """A network and its roles. ``kind``: ``node`` (per-node caps, separate roles),
    ``node-coloc`` (every node both), ``link`` (per-link caps, separate roles: more than a
    few lines per server), ``link-coloc`` (per-link, co-located: coupled, the general loop),
    ``mixed`` (node and link caps, some nodes both)."""
    levels = np.array(LEVELS) * 1e8
    draw = (
        (lambda size: rng.choice(levels, size=size))
        if rng.random() < 0.7
        else (lambda size: rng.uniform(1e7, 1e8, size=size))
    )
    up, down = draw(n), draw(n)
    if rng.random() < 0.2:  # a zero rate somewhere a plan can avoid (a server's receive side)
        up[0] = 0.0
    inf = np.full(n, np.inf)
    if kind in ("node", "node-coloc"):
        net = Network(up, down)
    elif kind in ("link", "link-coloc"):
        net = Network(inf, inf.copy(), draw((n, n)))
    else:
        net = Network(up, down, draw((n, n)))
    if kind in ("node-coloc", "link-coloc"):
        return net, None, None
    n_s = int(rng.integers(2, max(3, n // 2 + 1)))
    perm = [int(x) for x in rng.permutation(n)]
    servers = sorted(perm[:n_s])
    workers = sorted(perm[n_s:]) if kind != "mixed" else sorted(perm[n_s - 1 :])
    if up[0] == 0.0 and 0 in workers:  # a worker that cannot send makes any plan infeasible
        net = Network(np.where(up == 0, 1e7, up), down, net.link)
    return net, servers, workers


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("kind", ["node", "node-coloc", "link", "link-coloc", "mixed"])
def test_incremental_aware_equals_the_reference(kind):
    rng = np.random.default_rng(20 + len(kind))
    cases = 0
    for _ in range(60 if kind != "link-coloc" else 15):
        n = int(rng.integers(3, 24 if kind != "link-coloc" else 10))
        net, servers, workers = _random_case(rng, kind, n)
        total = float(rng.choice([1.0, 1e6, 123456.0]))
        opts: dict = {}
        r = rng.random()
        if r < 0.4:
            opts["n_slices"] = int(rng.integers(1, 200))
        if rng.random() < 0.3:
            opts["rel_threshold"] = float(rng.choice([0.0, 1e-6, 1e-2]))
        try:
            want = reference_aware_plan(net, total, servers, workers, **opts)
        except ValueError:
            with pytest.raises(ValueError):
                aware_plan(net, total, servers, workers, **opts)
            continue
        got = aware_plan(net, total, servers, workers, **opts)
        assert _same(got, want), (kind, n, servers, workers, opts, got, want)
        cases += 1
    assert cases >= 10


def test_incremental_aware_equals_the_reference_at_scale():
    """A planner-sized network (per-node caps, 1 in 4 nodes a server), whole slices or not."""
    rng = np.random.default_rng(7)
    for n in (64, 160):
        up = 1.25e8 * rng.choice(LEVELS, size=n, p=[0.55, 0.25, 0.15, 0.05])
        down = 1.25e8 * rng.choice(LEVELS, size=n, p=[0.55, 0.25, 0.15, 0.05])
        net = Network(up, down)
        s = n // 4
        servers, workers = list(range(s)), list(range(s, n))
        for opts in ({}, {"n_slices": 4 * s}, {"rel_threshold": 0.0}):
            want = reference_aware_plan(net, 4.0 * s * 65536, servers, workers, **opts)
            got = aware_plan(net, 4.0 * s * 65536, servers, workers, **opts)
            assert _same(got, want), (n, opts)


def test_all_equal_rates_are_ties_everywhere():
    net = Network(np.full(12, 1e8), np.full(12, 1e8))
    for opts in ({}, {"n_slices": 7}, {"n_slices": 300}):
        for roles in ((None, None), (list(range(4)), list(range(4, 12)))):
            want = reference_aware_plan(net, 1e6, *roles, **opts)
            assert _same(aware_plan(net, 1e6, *roles, **opts), want)
