"""Load plans: how much of the model each server holds.
(docs/MODULES.md, "hetps.balance.plans")"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
from numpy.typing import ArrayLike

from .network import LoadModel, Network
from .solve import LP_MAX_ENTRIES, greedy_round, solve_continuous, solve_integer

__all__ = [
    "PLANS",
    "PLAN_NAMES",
    "Plan",
    "average_plan",
    "aware_plan",
    "elastic_plan",
    "equalise_linear",
    "fit_linear",
    "make_plan",
    "optimal_plan",
    "plan",
    "plan_of",
]

NetworkLike = Network | ArrayLike


@dataclasses.dataclass(frozen=True)
class Plan:
    """A load plan by name. ``needs`` is what ``solve`` is given (each also takes ``n_slices=``):
    ``"nothing"`` (``solve(total, n_servers)``: equal shares, which the planner holds without
    probe slices or hysteresis), a per-server ``"history"`` of (share, seconds) samples
    (``solve(history, total)``) or the ``"network"`` the workers' probes measure
    (``solve(network, total, servers, workers)``)."""

    name: str
    solve: Callable[..., np.ndarray]
    needs: Literal["nothing", "history", "network"]  # network: probed, surprises judged


PLANS: dict[str, Plan] = {}  # every plan by name, in registration order
PLAN_NAMES = PLANS.keys()  # (a live view)


def plan(name: str, *, needs: Literal["nothing", "history", "network"]) -> Callable:
    """Register the decorated function as the plan ``name`` (see :class:`Plan`)."""
    if name in PLANS or name == "none" or needs not in ("nothing", "history", "network"):
        raise ValueError(f"plan {name!r} (needs {needs!r}): the name is taken or needs unknown")
    return lambda solve: PLANS.setdefault(name, Plan(name, solve, needs)).solve


def plan_of(name: str) -> Plan:
    """The plan called ``name``; a ValueError lists the valid names."""
    if name not in PLANS:
        raise ValueError(f"unknown plan {name!r}; valid names: {', '.join(PLANS)}")
    return PLANS[name]


def _check_total(total: float, n_slices: int | None) -> None:
    if not (isinstance(total, int | float | np.integer | np.floating) and math.isfinite(total)):
        raise ValueError(f"total must be a finite number, got {total!r}")
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    if n_slices is not None and (int(n_slices) != n_slices or n_slices < 1):
        raise ValueError(f"n_slices must be a positive integer, got {n_slices!r}")


def _as_network(network: NetworkLike) -> Network:
    if isinstance(network, Network):
        return network
    return Network.from_matrix(network)


def _fix_sum(x: np.ndarray, total: float) -> np.ndarray:
    """Make float shares sum to ``total`` by putting the rounding residue on the largest."""
    x = np.maximum(x, 0.0)
    s = x.sum()
    if s > 0:
        x = x * (total / s)
    else:
        x = np.full(x.size, total / x.size)
    x[int(np.argmax(x))] += total - x.sum()
    return x


@plan("average", needs="nothing")
def average_plan(total: float, n_servers: int, *, n_slices: int | None = None) -> np.ndarray:
    """Equal shares; with ``n_slices`` the remainder goes one slice each to the first servers."""
    _check_total(total, n_slices)
    if n_servers < 1:
        raise ValueError(f"n_servers must be >= 1, got {n_servers}")
    if n_slices is not None:
        q, r = divmod(int(n_slices), n_servers)
        return np.array([q + (1 if s < r else 0) for s in range(n_servers)], dtype=np.int64)
    return _fix_sum(np.full(n_servers, total / n_servers), float(total))


# --------------------------------------------------------------------------- elastic


def fit_linear(samples: Sequence[tuple[float, float]]) -> tuple[float, float] | None:
    """Least-squares ``t = a + b x`` from ``(x, t)`` samples; ``None`` if nothing to fit.

    With a single distinct ``x > 0`` the line goes through the origin (``a = 0``,
    ``b = mean(t) / x``): a history taken under one fixed plan still gives a per-unit cost.
    """
    pts = np.asarray(list(samples), dtype=float).reshape(-1, 2)
    pts = pts[np.isfinite(pts).all(axis=1)]
    if pts.shape[0] == 0:
        return None
    x, t = pts[:, 0], pts[:, 1]
    if np.ptp(x) > 0:
        xm, tm = x.mean(), t.mean()
        b = float(((x - xm) * (t - tm)).sum() / ((x - xm) ** 2).sum())
        return float(tm - b * xm), b
    if x[0] > 0:
        return 0.0, float(t.mean() / x[0])
    return None


def equalise_linear(a: ArrayLike, b: ArrayLike, total: float) -> np.ndarray:
    """Shares ``x >= 0`` summing to ``total`` minimising ``max_s a_s + b_s x_s`` (``b_s > 0``).

    Closed form: with active set ``K`` (the servers with ``a_s < T``),
    ``T = (total + sum_K a_s/b_s) / sum_K 1/b_s`` and ``x_s = (T - a_s) / b_s``; servers whose
    intercept alone reaches ``T`` get 0.
    """
    a = np.asarray(a, dtype=float)
    b = np.asarray(b, dtype=float)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise ValueError("a and b must be non-empty 1-d arrays of the same length")
    if not (np.isfinite(a).all() and np.isfinite(b).all() and (b > 0).all()):
        raise ValueError("every slope b must be finite and > 0 and every intercept finite")
    order = np.argsort(a, kind="stable")
    inv_b = 1.0 / b
    for k in range(a.size, 0, -1):
        act = order[:k]
        t = (total + (a[act] * inv_b[act]).sum()) / inv_b[act].sum()
        if a[order[k - 1]] <= t:
            break
    x = np.zeros(a.size)
    x[act] = np.maximum((t - a[act]) * inv_b[act], 0.0)
    return _fix_sum(x, float(total)) if total > 0 else x


@plan("elastic", needs="history")
def elastic_plan(
    history: Sequence[Sequence[tuple[float, float]]],
    total: float,
    *,
    n_slices: int | None = None,
) -> np.ndarray:
    """The elastic scheme: fit ``t = a_s + b_s x`` per server from ``history[s]`` (pairs of
    share in units of ``total`` and measured transfer time in s) and equalise predicted times.

    A server whose fit is missing or has a slope ``<= 0`` gets the median model of the others;
    at least one server needs a usable fit.
    """
    _check_total(total, n_slices)
    if len(history) == 0:
        raise ValueError("elastic needs a history per server; got no servers")
    fits = [fit_linear(h) for h in history]
    ok = [m for m in fits if m is not None and m[1] > 0 and all(map(math.isfinite, m))]
    if not ok:
        raise ValueError(
            "elastic needs at least one server with samples at a positive share; "
            "run an 'average' iteration first"
        )
    med = (float(np.median([m[0] for m in ok])), float(np.median([m[1] for m in ok])))
    models = [m if m in ok else med for m in fits]
    a = np.array([m[0] for m in models])
    b = np.array([m[1] for m in models])
    if n_slices is None:
        return equalise_linear(a, b, float(total))
    n = int(n_slices)
    if total == 0:
        return average_plan(0.0, len(history), n_slices=n)
    x = equalise_linear(a, b, float(total))
    unit = float(total) / n
    return greedy_round(x, n, lambda k: a + b * k * unit)


# --------------------------------------------------------------------------- aware


def _pair_step(
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
    return _best_move(p, q, float(f[hi]), quantum)


def _best_move(
    p: np.ndarray, q: np.ndarray, dmax: float, quantum: float | None
) -> tuple[float, float, float]:
    """The step of :func:`_pair_step` on the lines ``p + q d`` (numpy, any number of lines)."""
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
    ok = vals <= best + _tol(best)
    d = float(cand[ok].min())
    return d, float((p + q * d).max()), before


_FEW_LINES = 8  # up to this many lines, :func:`_best_move_few` (plain floats) is faster


def _best_move_few(
    p: list[float], q: list[float], dmax: float, quantum: float | None
) -> tuple[float, float, float]:
    """:func:`_best_move` on a few lines, in plain floats: the same candidates and the same
    arithmetic, so the same result to the last bit (tests/unit/test_aware_incremental.py).
    (Lines ``i`` and ``j`` cross at the same ``d`` as ``j`` and ``i``: IEEE negation is exact,
    so each pair is computed once; repeated candidates change no minimum.)"""
    before = max(p) if p else 0.0
    if not p or dmax <= 0:
        return 0.0, before, before
    n = len(p)
    cand = [0.0, dmax]
    for i in range(n):
        pi, qi = p[i], q[i]
        for j in range(i + 1, n):
            dq = qi - q[j]
            if dq != 0.0:
                x = (p[j] - pi) / dq
                if 0.0 <= x <= dmax:  # (also drops inf and nan, as np.isfinite did)
                    cand.append(x)
    if quantum is not None:
        steps = [float(math.floor(x / quantum)) for x in cand]
        steps += [float(math.ceil(x / quantum)) for x in cand]
        cand = [min(max(s * quantum, 0.0), dmax) for s in steps]
        cand.append(dmax)
    p0, q0 = p[0], q[0]
    rest = list(zip(p[1:], q[1:], strict=True))
    vals = []
    for x in cand:
        v = p0 + q0 * x
        for pk, qk in rest:
            w = pk + qk * x
            if w > v:
                v = w
        vals.append(v)
    lim = min(vals)
    lim = lim + _tol(lim)
    d = min(x for x, v in zip(cand, vals, strict=True) if v <= lim)
    after = p0 + q0 * d
    for pk, qk in rest:
        w = pk + qk * d
        if w > after:
            after = w
    return d, after, before


def _tol(v: float) -> float:
    return 1e-12 * max(abs(v), 1e-300) + 1e-300


def _aware_steps(
    model: LoadModel, f: np.ndarray, quantum: float | None, threshold: float, max_iter: int
) -> np.ndarray:
    """Algorithm 1's loop on any model: every step evaluates every server's time
    (O(resources x servers) per step)."""
    n_s = model.n_servers
    frozen = np.zeros(n_s, dtype=bool)
    for _ in range(max_iter):
        t = model.server_times(f)
        donors = (f > 0) & ~frozen
        if not donors.any():
            break
        hi = int(np.argmax(np.where(donors, t, -np.inf)))
        others = np.arange(n_s) != hi
        lo = int(np.argmin(np.where(others, t, np.inf)))
        if t[hi] - t[lo] < threshold:
            break
        d, after, before = _pair_step(model, f, hi, lo, quantum)
        if d <= 0 or after >= before - _tol(before):
            frozen[hi] = True
            continue
        f = f.copy()
        f[hi] -= d
        f[lo] += d
        if quantum is not None:
            f = np.rint(f / quantum) * quantum
        f[f < 0] = 0.0
    return f


def _aware_steps_separate(
    model: LoadModel, f: np.ndarray, quantum: float | None, threshold: float, max_iter: int
) -> np.ndarray:
    """Algorithm 1's loop when every resource carries at most one server's share (per-node
    caps, or per-link caps without co-location): a step changes two shares, and so only the
    times of those two servers. Each server's resources are listed once; a step then costs
    its two servers' resources plus one vectorised pass for the argmax/argmin, instead of
    every resource against every server. The same arithmetic as :func:`_aware_steps`, so the
    same plan to the last bit (tests/unit/test_aware_incremental.py)."""
    n_s = model.n_servers
    A, beta, cap, scale = model.A, model.beta, model.cap, model.scale
    touch = A != 0
    carried = touch.any(axis=1)
    owner = np.where(carried, touch.argmax(axis=1), n_s)  # n_s: no server's share
    order = np.argsort(owner, kind="stable")  # rows by server, in row order within one
    bounds = np.searchsorted(owner[order], np.arange(n_s + 1))
    rows_of = [order[bounds[s] : bounds[s + 1]] for s in range(n_s)]
    # per server, its resources as plain floats: (beta_r, A_rs, cap_r), and the slope of each
    # one's time when the server gives load (hi) and when it takes load (lo)
    lines = [
        [(float(beta[r]), float(A[r, s]), float(cap[r])) for r in rows_of[s]] for s in range(n_s)
    ]
    q_give = [[scale * (0.0 - a) / c for _, a, c in ln] for ln in lines]
    q_take = [[scale * (a - 0.0) / c for _, a, c in ln] for ln in lines]

    def own_time(s: int, fs: float) -> float:
        # LoadModel.server_times on one server: max over its rows of scale*(beta+a f)/cap, >= 0
        ts = [scale * (b + a * fs) / c for b, a, c in lines[s]]
        return max(max(ts), 0.0) if ts else 0.0

    t = model.server_times(f)
    f = f.copy()
    frozen = [False] * n_s
    # t of the servers that may give load (hold some, not frozen), -inf elsewhere: hi's argmax
    give = np.where(f > 0, t, -np.inf)
    for _ in range(max_iter):
        hi = int(np.argmax(give))
        if give[hi] == -np.inf:  # no server holds load that it may give
            break
        t_hi = t[hi]
        t[hi] = np.inf  # lo: the argmin over the other servers (the first of ties, as before)
        lo = int(np.argmin(t))
        t[hi] = t_hi
        if t_hi - t[lo] < threshold:
            break
        # the lines of _pair_step (their order changes no result: only max and min of them)
        fh, fl = float(f[hi]), float(f[lo])
        p = [scale * (b + a * fh) / c for b, a, c in lines[hi]]
        p += [scale * (b + a * fl) / c for b, a, c in lines[lo]]
        q = q_give[hi] + q_take[lo]
        if len(p) <= _FEW_LINES:
            d, after, before = _best_move_few(p, q, fh, quantum)
        else:
            d, after, before = _best_move(np.array(p), np.array(q), fh, quantum)
        if d <= 0 or after >= before - _tol(before):
            frozen[hi] = True
            give[hi] = -np.inf
            continue
        if quantum is not None:
            old = f.copy()
            f[hi] -= d
            f[lo] += d
            f = np.rint(f / quantum) * quantum
            f[f < 0] = 0.0
            changed = [int(s) for s in np.flatnonzero(f != old)]  # all, after the first
        else:
            f[hi] -= d
            f[lo] += d
            changed = [hi, lo]
            for s in changed:
                if f[s] < 0:
                    f[s] = 0.0
        for s in changed:
            fs = float(f[s])
            t[s] = own_time(s, fs)
            give[s] = t[s] if fs > 0 and not frozen[s] else -np.inf
    return f


@plan("aware", needs="network")
def aware_plan(
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
    """The paper's Algorithm 1 on the link model. (docs/MODULES.md, "hetps.balance.plans")"""
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
        if ((shadow.A != 0).sum(axis=1) <= 1).all():
            f = _aware_steps_separate(shadow, f, quantum, threshold, max_iter)
        else:
            f = _aware_steps(shadow, f, quantum, threshold, max_iter)
    if n_slices is not None:
        k = np.rint(f * n_slices).astype(np.int64)
        k[int(np.argmax(k))] += int(n_slices) - int(k.sum())
        return k
    return _fix_sum(f * float(total), float(total)) if total > 0 else f * 0.0


# --------------------------------------------------------------------------- optimal


@plan("optimal", needs="network")
def optimal_plan(
    network: NetworkLike,
    total: float,
    servers: Sequence[int] | None = None,
    workers: Sequence[int] | None = None,
    *,
    n_slices: int | None = None,
    unit_bytes: float = 1.0,
    milp_time_limit: float = 0.5,
    lp_max_entries: int | None = LP_MAX_ENTRIES,
) -> np.ndarray:
    """The exact min-max plan: smallest predicted iteration time on the link model
    (``lp_max_entries`` None: the LP at any size; docs/MODULES.md, "hetps.balance.plans")."""
    _check_total(total, n_slices)
    net = _as_network(network)
    model = LoadModel.build(net, float(total), servers, workers, unit_bytes=unit_bytes)
    f, _ = solve_continuous(model, lp_max_entries=lp_max_entries)
    if n_slices is not None:
        return solve_integer(
            model, int(n_slices), f, time_limit=milp_time_limit, lp_max_entries=lp_max_entries
        )
    return _fix_sum(f * float(total), float(total)) if total > 0 else f * 0.0


# --------------------------------------------------------------------------- by name


def make_plan(
    name: str,
    total: float,
    *,
    network: NetworkLike | None = None,
    servers: Sequence[int] | None = None,
    workers: Sequence[int] | None = None,
    history: Sequence[Sequence[tuple[float, float]]] | None = None,
    n_slices: int | None = None,
    **options: Any,
) -> np.ndarray:
    """Compute the plan called ``name`` (one of :data:`PLAN_NAMES`) with what it needs.

    A plan that needs ``"nothing"`` gets the number of servers (from ``servers``,
    ``network`` or ``history``); ``"history"`` gets ``history``; ``"network"`` gets
    ``network`` (a :class:`Network` or a measured matrix). ``options`` go to the plan function.
    """
    p = plan_of(name)
    if p.needs == "nothing":
        if servers is not None:
            n_s = len(servers)
        elif network is not None:
            n_s = _as_network(network).n_nodes
        elif history is not None:
            n_s = len(history)
        else:
            raise ValueError(f"{name} needs servers, network or history to count the servers")
        return p.solve(total, n_s, n_slices=n_slices, **options)
    if p.needs == "history":
        if history is None:
            raise ValueError(f"{name} needs history: per server, (share, seconds) samples")
        return p.solve(history, total, n_slices=n_slices, **options)
    if network is None:
        raise ValueError(f"{name} needs network: a Network or a measured bandwidth matrix")
    return p.solve(network, total, servers, workers, n_slices=n_slices, **options)
