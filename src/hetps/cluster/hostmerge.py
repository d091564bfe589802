"""A host's link samples merged per (src, dst, kind) by its leader before it sends the host's
one report (cluster/hostlead.py)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def merge_host(samples: np.ndarray, host: Sequence[int]) -> np.ndarray:
    """A host's data samples merged per (src, dst, kind) before its leader sends them, the
    host's workers named by ``host[0]`` (the planner gives them one row: their link): each
    pair's overlapping or touching transfers become one row (their bytes summed, the first
    start, the last end). Every node's bytes and busy-time union, all the planner's node
    rates read, stay exact; a pair's per-message rates (the small link matrix of reports and
    plots) become the rates of its merged transfers. Probes, spread flows and rows the
    planner drops pass unchanged, in their order."""
    t0, t1, nbytes, kind = samples[:, 3], samples[:, 4], samples[:, 2], samples[:, 5]
    with np.errstate(invalid="ignore"):
        data = (t1 > t0) & (nbytes > 0) & np.isfinite(samples).all(1) & ~np.isin(kind, (1, 2, 3))
    d = samples[data].copy()
    if not len(d) or not len(host):
        return samples
    for col in (0, 1):
        d[np.isin(d[:, col], np.asarray(host, dtype=np.float64)), col] = host[0]
    d = d[np.lexsort((d[:, 3], d[:, 5], d[:, 1], d[:, 0]))]
    first = np.r_[True, (np.diff(d[:, [0, 1, 5]], axis=0) != 0).any(1)]
    # a new transfer where a pair's start is past every earlier end of the pair: a running
    # maximum of the ends per pair, on the ranks of the times (exact; groups kept apart)
    times = np.unique(np.r_[d[:, 3], d[:, 4]])
    span = len(times) + 1
    group = np.cumsum(first) * span
    ends = np.maximum.accumulate(group + np.searchsorted(times, d[:, 4]))
    start = group + np.searchsorted(times, d[:, 3])
    new = first | (start > np.r_[-1, ends[:-1]])
    at = np.flatnonzero(new)
    out = d[at]
    out[:, 2] = np.add.reduceat(d[:, 2], at)
    out[:, 4] = np.maximum.reduceat(d[:, 4], at)
    return np.concatenate([out, samples[~data]])
