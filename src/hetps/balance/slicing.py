"""Slices: laying keys out as slices, giving slices to servers, and choosing the slice size.
(docs/MODULES.md, "hetps.balance.slicing")"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from numpy.typing import ArrayLike

__all__ = [
    "Slice",
    "assign",
    "choose_slice_size",
    "fit_granularity",
    "granularity_cost",
    "layout",
]


class Slice(NamedTuple):
    """A contiguous run ``[offset, offset + length)`` of the flattened key ``key`` (an index
    into the ``key_sizes`` given to :func:`layout`)."""

    key: int
    offset: int
    length: int


def layout(key_sizes: Sequence[int], slice_elems: int) -> list[Slice]:
    """Cut every key into slices of ``slice_elems`` elements, keys in order.

    A key of ``n`` elements gives ``ceil(n / slice_elems)`` slices, the last one possibly
    shorter; an empty key gives none. Slices never cross keys.
    """
    if int(slice_elems) != slice_elems or slice_elems < 1:
        raise ValueError(f"slice_elems must be a positive integer, got {slice_elems!r}")
    x = int(slice_elems)
    out: list[Slice] = []
    for key, n in enumerate(key_sizes):
        if int(n) != n or n < 0:
            raise ValueError(f"key {key} has invalid size {n!r}; sizes are element counts >= 0")
        n = int(n)
        out.extend(Slice(key, off, min(x, n - off)) for off in range(0, n, x))
    return out


def assign(
    slices: Sequence[Slice],
    shares: ArrayLike,
    *,
    previous: Sequence[int] | None = None,
    probe_num: int = 0,
) -> np.ndarray:
    """Server index (into ``shares``) for every slice: the paper's Algorithm 2.

    ``shares`` are target amounts per server, in any unit: they are scaled to the slices'
    total length; its steps: docs/MODULES.md, "hetps.balance.slicing"."""
    sh = np.asarray(shares)
    if sh.ndim != 1 or sh.size == 0:
        raise ValueError("shares must be a non-empty 1-d array")
    if not np.isfinite(sh.astype(float)).all() or (sh < 0).any():
        raise ValueError("shares must be finite and >= 0")
    n_sl = len(slices)
    n_s = sh.size
    lengths = [int(s.length) for s in slices]
    if any(v < 0 for v in lengths):
        raise ValueError("slice lengths must be >= 0")
    if probe_num < 0:
        raise ValueError(f"probe_num must be >= 0, got {probe_num}")
    if previous is not None and len(previous) != n_sl:
        raise ValueError(f"previous has {len(previous)} entries for {n_sl} slices")
    total_len = sum(lengths)
    out = np.full(n_sl, -1, dtype=np.int64)
    if n_sl == 0:
        return out
    if sh.sum() <= 0:
        raise ValueError("shares must have a positive sum")
    # remaining share of server s, scaled by sum(shares): exact integers when shares are ints
    if np.issubdtype(sh.dtype, np.integer):
        ssum = int(sh.sum())
        rem: list[float | int] = [int(v) * total_len for v in sh]
    else:
        ssum = 1
        shf = sh.astype(float)
        rem = list(shf / shf.sum() * total_len)

    def give(i: int, s: int) -> None:
        out[i] = s
        rem[s] -= lengths[i] * ssum

    prev = None if previous is None else [int(p) for p in previous]
    if probe_num:
        by_len = sorted(range(n_sl), key=lambda i: (lengths[i], i))
        for s in range(n_s):
            if sh[s] != 0:
                continue
            mine = [i for i in by_len if out[i] < 0 and prev is not None and prev[i] == s]
            rest = [i for i in by_len if out[i] < 0 and (prev is None or prev[i] != s)]
            for i in (mine + rest)[:probe_num]:
                give(i, s)
    if prev is not None:
        for i in sorted(range(n_sl), key=lambda i: (-lengths[i], i)):
            s = prev[i]
            if out[i] < 0 and 0 <= s < n_s and sh[s] > 0 and rem[s] >= lengths[i] * ssum:
                give(i, s)
    # step 3, in layout order: each full-length slice to the server whose own slices are
    # least far along (smallest (placed + length) / need), among those with room for it, so
    # that every server's slices are spread evenly through the layout. Every slice here costs
    # the same, and only the chosen server's key changes: a heap of (key, server) picks what
    # min() over all servers picked (ties: lower index), in O(log S) a slice
    need = [max(r, 0) for r in rem]
    placed = [0] * n_s
    left = []
    full = max(lengths[i] for i in range(n_sl) if out[i] < 0) if (out < 0).any() else 0
    cost = full * ssum
    heap = [((placed[s] + cost) / need[s], s) for s in range(n_s) if need[s] > 0 and rem[s] >= cost]
    heapq.heapify(heap)
    for i in range(n_sl):
        if out[i] >= 0:
            continue
        if lengths[i] < full or not heap:
            left.append(i)
            continue
        s = heap[0][1]
        placed[s] += cost
        give(i, s)
        if rem[s] >= cost:  # room for another one (rem only shrinks: a server leaves for good)
            heapq.heapreplace(heap, ((placed[s] + cost) / need[s], s))
        else:
            heapq.heappop(heap)
    # shorter slices and what fits nowhere whole: longest first, to the server with the
    # most room left (they fill what the full slices left, so the shares come out exact);
    # a heap of (-room, server) gives max() over (room, -server)
    most = [(-rem[s], s) for s in range(n_s)]
    heapq.heapify(most)
    for i in sorted(left, key=lambda i: (-lengths[i], i)):
        best = most[0][1]
        give(i, best)
        heapq.heapreplace(most, (-rem[best], best))
    return out


def _check_pos(name: str, v: float, allow_zero: bool = False) -> float:
    v = float(v)
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        raise ValueError(f"{name} must be a finite number {'>=' if allow_zero else '>'} 0, got {v}")
    return v


def _coefficients(
    per_slice_overhead_s: float,
    bandwidth_Bps: float,
    n_servers: int,
    n_workers: int | None,
    colocated: bool,
    stages: int,
    elem_bytes: float,
) -> tuple[float, float]:
    """(alpha, beta) of cost(q) = alpha * q + beta * ceil(P / q), q in elements."""
    h = _check_pos("per_slice_overhead_s", per_slice_overhead_s, allow_zero=True)
    bw = _check_pos("bandwidth_Bps", bandwidth_Bps)
    if n_servers < 1:
        raise ValueError(f"n_servers must be >= 1, got {n_servers}")
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}")
    nw = n_servers if n_workers is None else int(n_workers)
    if nw < 1:
        raise ValueError(f"n_workers must be >= 1, got {nw}")
    peers = nw - 1 if colocated else nw
    alpha = stages * peers * elem_bytes / bw
    return alpha, h / n_servers


def granularity_cost(
    slice_elems: int,
    per_slice_overhead_s: float,
    bandwidth_Bps: float,
    model_bytes: float,
    n_servers: int,
    *,
    n_workers: int | None = None,
    colocated: bool = True,
    stages: int = 2,
    elem_bytes: float = 4.0,
) -> float:
    """The part of one iteration's predicted time that depends on the slice size (s).

    ``stages * w * q * elem_bytes / B`` (pipeline fill/drain and rounding, ``w`` = workers
    sending to a server) plus ``h * ceil(P / q) / S`` (per-slice overhead on each server's
    pipeline), with ``P`` the model's element count; see docs/BALANCE.md.
    """
    if int(slice_elems) != slice_elems or slice_elems < 1:
        raise ValueError(f"slice_elems must be a positive integer, got {slice_elems!r}")
    alpha, beta = _coefficients(
        per_slice_overhead_s, bandwidth_Bps, n_servers, n_workers, colocated, stages, elem_bytes
    )
    p = math.ceil(_check_pos("model_bytes", model_bytes) / elem_bytes)
    return alpha * slice_elems + beta * math.ceil(p / slice_elems)


def choose_slice_size(
    per_slice_overhead_s: float,
    bandwidth_Bps: float,
    model_bytes: float,
    n_servers: int,
    *,
    n_workers: int | None = None,
    colocated: bool = True,
    stages: int = 2,
    elem_bytes: float = 4.0,
    min_elems: int = 1,
    max_elems: int | None = None,
) -> int:
    """Slice size (elements) minimising :func:`granularity_cost`.

    Continuous optimum ``q* = sqrt(h * P * B / (S * stages * w * elem_bytes))`` elements
    (``h`` overhead per slice, ``P`` model elements, ``B`` bytes/s of the bottleneck node,
    ``S`` servers, ``w`` workers sending to a server); then the best integer size near it,
    clamped to ``[min_elems, max_elems]`` (``max_elems`` defaults to the model's size).
    """
    elem_bytes = _check_pos("elem_bytes", elem_bytes)
    p = math.ceil(_check_pos("model_bytes", model_bytes) / elem_bytes)
    alpha, beta = _coefficients(
        per_slice_overhead_s, bandwidth_Bps, n_servers, n_workers, colocated, stages, elem_bytes
    )
    hi = p if max_elems is None else min(int(max_elems), p)
    lo = max(1, int(min_elems))
    if lo > hi:
        raise ValueError(f"min_elems {min_elems} exceeds max_elems/model size {hi}")
    if alpha == 0:
        return hi
    if beta == 0:
        return lo
    q_star = math.sqrt(beta * p / alpha)
    # a slice count m is best served by the smallest size giving it: ceil(P / m)
    m_star = p / q_star
    cands = {lo, hi}
    for m in range(max(1, math.floor(m_star) - 2), math.ceil(m_star) + 3):
        cands.add(math.ceil(p / m))
    cands = {min(max(q, lo), hi) for q in cands}
    return min(cands, key=lambda q: (alpha * q + beta * math.ceil(p / q), q))


def fit_granularity(
    slice_elems: ArrayLike, times: ArrayLike, model_elems: int
) -> tuple[float, float, float, float]:
    """Fit measured iteration times to ``T(q) = c + alpha * q + beta * ceil(P / q)``.

    Returns ``(c, alpha, beta, q_best)`` with ``q_best = sqrt(beta * P / alpha)`` (elements;
    nan if the fit has no interior optimum). Needs at least three distinct slice sizes. Use it
    to calibrate the per-slice overhead (``beta * n_servers``) from an ASRIT-vs-slice-size run.
    """
    q = np.asarray(slice_elems, dtype=float)
    t = np.asarray(times, dtype=float)
    if q.shape != t.shape or q.ndim != 1:
        raise ValueError("slice_elems and times must be 1-d arrays of the same length")
    if np.unique(q).size < 3:
        raise ValueError("fit_granularity needs at least three distinct slice sizes")
    if (q < 1).any():
        raise ValueError("slice sizes must be >= 1 element")
    m = np.ceil(model_elems / q)
    design = np.column_stack([np.ones_like(q), q, m])
    (c, alpha, beta), *_ = np.linalg.lstsq(design, t, rcond=None)
    qb = math.sqrt(beta * model_elems / alpha) if alpha > 0 and beta > 0 else math.nan
    return float(c), float(alpha), float(beta), qb
