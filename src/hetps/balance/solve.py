"""Exact min-max solvers on a :class:`~hetps.balance.network.LoadModel`.
(docs/MODULES.md, "hetps.balance.solve")"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np
from numpy.typing import ArrayLike

from .network import LoadModel, Network

__all__ = [
    "greedy_round",
    "largest_remainder",
    "lower_bound",
    "solve_continuous",
    "solve_integer",
]

_REL = 1e-12

log = logging.getLogger("hetps.balance")

#: The largest LP solved exactly: entries of its dense constraint matrix (resources x servers).
#: Co-located servers with per-link caps have N (N - 1) resources and N servers: up to N = 64
#: (HiGHS ~22 ms there on 2 shared cores, ~0.6 s at N = 256). Above it,
#: :func:`solve_continuous` takes the better of two cheap plans instead (docs/BALANCE.md §2.4).
LP_MAX_ENTRIES = 1 << 18
_told_no_lp = False  # the fallback is logged once per process


def _scipy_linprog() -> Callable:
    try:
        from scipy.optimize import linprog
    except ImportError as exc:  # pragma: no cover - scipy is a declared extra
        raise ImportError(
            "this network needs the LP solver: install scipy (pip install 'hetps[balance]')"
        ) from exc
    return linprog


def _ref_cap(model: LoadModel) -> float:
    pos = model.cap[model.cap > 0]
    return float(np.median(pos)) if pos.size else 1.0


def _closed_form(model: LoadModel) -> np.ndarray:
    """Water-filling for a separable model (each row: one server, coefficient >= 0)."""
    A, beta, cap = model.A, model.beta, model.cap
    n_s = model.n_servers
    with np.errstate(divide="ignore", invalid="ignore"):
        floor_rows = np.where(cap > 0, beta / cap, 0.0)
    tau0 = float(floor_rows.max()) if floor_rows.size else 0.0
    member = A > 0  # (R, S)
    constrained = member.any(axis=0)
    if not constrained.all():
        # a server no capped resource sees absorbs everything at no cost
        free = ~constrained
        return free / free.sum()
    with np.errstate(divide="ignore", invalid="ignore"):
        slope = np.where(member, cap[:, None] / A, np.inf)  # dx_s / dtau of each line
        icpt = np.where(member, beta[:, None] / A, np.inf)

    def ub(tau: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Largest share each server can take in time tau, and its active line."""
        with np.errstate(invalid="ignore"):
            v = np.where(member, slope * tau - icpt, np.inf)
        vmin = v.min(axis=0)
        tie = member & (v <= vmin + _REL * np.maximum(1.0, np.abs(vmin)) * 8)
        s_right = np.where(tie, slope, np.inf)
        act = s_right.argmin(axis=0)
        return vmin, act, s_right.min(axis=0)

    vmin, act, g = ub(tau0)
    if vmin.sum() >= 1.0:
        # the fixed traffic sets the time; spread the load in proportion to room left
        room = np.maximum(vmin, 0.0)
        return room / room.sum()
    tau = tau0
    for _ in range(4 * A.shape[0] + 16):
        vmin, act, g = ub(tau)
        short = 1.0 - vmin.sum()
        if short <= _REL:
            break
        gs = float(g.sum())
        if gs <= 0:
            raise ValueError("no server can take any load: every server has a zero-rate link")
        nxt = tau + short / gs
        if nxt <= tau:
            break
        tau = nxt
    # exact on the final linear piece: sum_s (slope_s tau - icpt_s) = 1
    cols = np.arange(n_s)
    sl = slope[act, cols]
    ic = icpt[act, cols]
    if sl.sum() > 0:
        tau_exact = (1.0 + ic.sum()) / sl.sum()
        if tau_exact >= tau0 and abs(tau_exact - tau) <= 1e-6 * max(tau, 1e-300) + 1e-300:
            tau = tau_exact
    f = np.maximum(ub(tau)[0], 0.0)
    return f / f.sum()


def _lp(model: LoadModel) -> np.ndarray:
    linprog = _scipy_linprog()
    n_s = model.n_servers
    cref = _ref_cap(model)
    c = np.zeros(n_s + 1)
    c[-1] = 1.0
    a_ub = np.hstack([model.A, -(model.cap / cref)[:, None]])
    res = linprog(
        c,
        A_ub=a_ub,
        b_ub=-model.beta,
        A_eq=np.hstack([np.ones(n_s), [0.0]])[None, :],
        b_eq=[1.0],
        bounds=[(0, None)] * (n_s + 1),
        method="highs",
    )
    if res.status != 0 or res.x is None:
        raise ValueError(f"min-max LP failed: {res.message}")
    f = np.maximum(res.x[:n_s], 0.0)
    return f / f.sum()


def too_big_for_lp(model: LoadModel, lp_max_entries: int | None = LP_MAX_ENTRIES) -> bool:
    """Whether ``model`` needs the LP (not separable) and it is larger than ``lp_max_entries``
    (None: no limit)."""
    return lp_max_entries is not None and not model.separable and model.A.size > lp_max_entries


def _without_lp(model: LoadModel) -> np.ndarray:
    """Instead of the LP, on a model too big for it: the better (on the model) of equal
    shares and shares in proportion to each server's tightest resource per unit of share
    (``min_r cap_r / A_rs`` over the resources it loads: with co-located per-link caps, its
    slowest link). Neither is optimal: docs/BALANCE.md §2.4 measures how far they are."""
    global _told_no_lp
    if not _told_no_lp:
        _told_no_lp = True
        log.warning(
            "balance: a coupled link model of %d resources x %d servers is too big for the "
            "exact LP (limit %d entries, LP_MAX_ENTRIES): using the better of equal shares "
            "and shares in proportion to each server's tightest resource (not optimal; "
            "logged once)",
            model.A.shape[0],
            model.n_servers,
            LP_MAX_ENTRIES,
        )
    n_s = model.n_servers
    equal = np.full(n_s, 1.0 / n_s)
    loads = model.A > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        per_unit = np.where(loads, model.cap[:, None] / model.A, np.inf)
    g = per_unit.min(axis=0) if per_unit.size else np.full(n_s, np.inf)
    if np.isinf(g).any():  # a server nothing caps takes everything (as in the closed form)
        prop = np.isinf(g) / np.isinf(g).sum()
    elif g.sum() > 0:
        prop = g / g.sum()
    else:
        return equal
    return prop if model.time(prop) < model.time(equal) else equal


def solve_continuous(
    model: LoadModel, *, lp_max_entries: int | None = LP_MAX_ENTRIES
) -> tuple[np.ndarray, float]:
    """Share fractions (summing to 1) minimising the predicted iteration time, and that time.

    Closed form when :attr:`LoadModel.separable`, else the LP with HiGHS -- up to
    ``lp_max_entries`` entries of its constraint matrix (None: any size); above that the
    better of two cheap plans, not the optimum (:func:`too_big_for_lp`, logged once).
    """
    model.check_feasible()
    n_s = model.n_servers
    if model.A.shape[0] == 0 or model.scale == 0:
        f = np.full(n_s, 1.0 / n_s)
        return f, model.time(f)
    if model.separable:
        f = _closed_form(model)
    elif too_big_for_lp(model, lp_max_entries):
        f = _without_lp(model)
    else:
        f = _lp(model)
    return f, model.time(f)


def largest_remainder(fractions: ArrayLike, n: int) -> np.ndarray:
    """Integers summing to ``n`` within one of ``fractions * n`` (Hamilton's method; ties go to
    the lower index)."""
    f = np.asarray(fractions, dtype=float)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    tot = f.sum()
    if (f < 0).any() or not tot > 0:
        raise ValueError("fractions must be >= 0 with a positive sum")
    q = f / tot * n
    k = np.floor(q + 1e-9).astype(np.int64)
    k = np.minimum(k, np.ceil(q).astype(np.int64))
    short = n - int(k.sum())
    if short > 0:
        order = np.lexsort((np.arange(f.size), -(q - k)))
        k[order[:short]] += 1
    elif short < 0:
        order = np.lexsort((np.arange(f.size), q - k))
        for idx in order:
            if short == 0:
                break
            if k[idx] > 0:
                k[idx] -= 1
                short += 1
    return k


def greedy_round(
    fractions: ArrayLike, n: int, server_time: Callable[[np.ndarray], np.ndarray]
) -> np.ndarray:
    """Round to ``n`` whole slices: floor, then add each leftover slice where it costs least.

    ``server_time(k)`` gives each server's time with ``k`` slices. When that time depends on
    the server's own count only and does not decrease with it, the result minimises the
    maximum over all integer allocations (docs/BALANCE.md, "Rounding").
    """
    f = np.asarray(fractions, dtype=float)
    q = f / f.sum() * n
    k = np.floor(q + 1e-9).astype(np.int64)
    while k.sum() > n:  # only from float noise: take back from the most rounded-up server
        k[int(np.argmin(np.where(k > 0, q - k, np.inf)))] -= 1
    eye = np.eye(k.size, dtype=np.int64)
    while k.sum() < n:  # one slice at a time to the server whose time after it is least
        k[int(np.argmin([server_time(k + eye[s])[s] for s in range(k.size)]))] += 1
    return k


def _local_search(model: LoadModel, k: np.ndarray, n: int, rounds: int | None = None) -> np.ndarray:
    """Move single slices while that lowers the predicted iteration time."""
    k = k.copy()
    n_s = k.size
    A, cap = model.A, model.cap
    unit = model.scale / n
    zero = cap == 0
    tol = 1e-12 * max(model.scale, 1.0)

    def times(load: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            t = load / cap[:, None]
        return np.where(zero[:, None], np.where(load > tol, np.inf, 0.0), t)

    for _ in range(4 * n_s + 8 if rounds is None else rounds):
        base = model.scale * model.beta + unit * (A @ k)
        cur = model.time(k / n)
        best_t, move = cur, None
        for a in np.flatnonzero(k > 0):
            # loads after moving one slice from a to every b: (R, S)
            t = times(base[:, None] + unit * (A - A[:, [a]])).max(axis=0)
            t[a] = np.inf
            b = int(np.argmin(t))
            if t[b] < best_t * (1 - _REL) - 1e-300:
                best_t, move = float(t[b]), (int(a), b)
        if move is None:
            break
        k[move[0]] -= 1
        k[move[1]] += 1
    return k


def _milp(model: LoadModel, n: int, time_limit: float) -> np.ndarray | None:
    linprog = _scipy_linprog()
    n_s = model.n_servers
    cref = _ref_cap(model)
    c = np.zeros(n_s + 1)
    c[-1] = 1.0
    a_ub = np.hstack([model.A / n, -(model.cap / cref)[:, None]])
    res = linprog(
        c,
        A_ub=a_ub,
        b_ub=-model.beta,
        A_eq=np.hstack([np.ones(n_s), [0.0]])[None, :],
        b_eq=[float(n)],
        bounds=[(0, n)] * n_s + [(0, None)],
        integrality=[1] * n_s + [0],
        method="highs",
        options={"mip_rel_gap": 0.0, "time_limit": float(time_limit)},
    )
    if res.x is None:
        return None
    k = np.maximum(np.rint(res.x[:n_s]), 0).astype(np.int64)
    if k.sum() != n:
        return None
    return k


def solve_integer(
    model: LoadModel,
    n: int,
    fractions: ArrayLike | None = None,
    *,
    time_limit: float = 0.5,
    lp_max_entries: int | None = LP_MAX_ENTRIES,
) -> np.ndarray:
    """Slice counts (summing to ``n``) minimising the predicted iteration time.
    (docs/MODULES.md, "hetps.balance.solve")"""
    if n < 1:
        raise ValueError(f"n_slices must be >= 1, got {n}")
    model.check_feasible()
    if fractions is None:
        f = solve_continuous(model, lp_max_entries=lp_max_entries)[0]
    else:
        f = np.asarray(fractions, float)
    if model.A.shape[0] == 0 or model.scale == 0:
        return largest_remainder(np.ones(model.n_servers), n)
    if model.separable:
        return greedy_round(f, n, lambda k: model.server_times(k / n))
    if too_big_for_lp(model, lp_max_entries):
        return largest_remainder(f, n)
    t_cont = model.time(f)
    best = largest_remainder(f, n)
    if model.time(best / n) <= t_cont * (1 + 1e-9):
        return best
    milp = _milp(model, n, time_limit)
    if milp is not None and model.time(milp / n) <= model.time(best / n):
        best = milp
    return _local_search(model, best, n)


def lower_bound(
    up: ArrayLike,
    down: ArrayLike,
    total_bytes: float,
    servers: Sequence[int] | None = None,
    workers: Sequence[int] | None = None,
    *,
    link: ArrayLike | None = None,
) -> float:
    """Smallest possible communication time (s) of one synchronous iteration.

    ``up``/``down`` are the TRUE per-node send/receive rates (bytes/s, e.g. the tc rates),
    ``link`` optional true per-link rates. Every worker pushes its whole gradient
    (``total_bytes``) split over the servers and pulls the result back. No plan, slicing or
    schedule can beat this: it is the fluid optimum over all shares (docs/BALANCE.md).
    """
    net = Network.from_rates(up, down, link)
    model = LoadModel.build(net, float(total_bytes), servers, workers)
    return solve_continuous(model, lp_max_entries=None)[1]  # a bound: the LP at any size
