"""Link-throughput measurement: forecast-then-probe samples and per-link smoothed estimates.
(docs/MODULES.md, "hetps.balance.estimate")"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable, Iterable
from typing import NamedTuple

import numpy as np

__all__ = ["EstimateTable", "ForecastMatcher", "Sample", "link_matrix", "sample_rate", "used_links"]


class Sample(NamedTuple):
    """One measured transfer: ``size_bytes`` from node ``src`` to node ``dst`` between the
    forecast's arrival ``t_start`` and the slice's arrival ``t_end`` (receiver's clock)."""

    src: int
    dst: int
    size_bytes: float
    t_start: float
    t_end: float


def sample_rate(size_bytes: float, t_start: float, t_end: float) -> float | None:
    """``size / (t_end - t_start)`` in bytes/s, or ``None`` for an unusable sample (a
    non-positive or non-finite duration, a non-positive size)."""
    try:
        size = float(size_bytes)
        dt = float(t_end) - float(t_start)
    except (TypeError, ValueError):
        return None
    if not (math.isfinite(size) and math.isfinite(dt)) or size <= 0 or dt <= 0:
        return None
    return size / dt


class EstimateTable:
    """Per-link exponentially weighted throughput estimates (bytes/s).

    ``estimate <- sample`` for a link's first sample, then
    ``estimate <- (1 - alpha) * estimate + alpha * sample``. Each link keeps how many samples
    it took and the ``t_end`` of the newest. Samples with a non-positive duration or size, and
    samples from a node to itself, are ignored.
    """

    def __init__(self, n_nodes: int, alpha: float = 0.3) -> None:
        if int(n_nodes) != n_nodes or n_nodes < 1:
            raise ValueError(f"n_nodes must be a positive integer, got {n_nodes!r}")
        if not (0 < alpha <= 1):
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        n = int(n_nodes)
        self._n = n
        self._alpha = float(alpha)
        self._est = np.full((n, n), np.nan)
        self._count = np.zeros((n, n), dtype=np.int64)
        self._last = np.full((n, n), np.nan)

    @property
    def n_nodes(self) -> int:
        """Number of nodes."""
        return self._n

    @property
    def alpha(self) -> float:
        """Weight of a new sample."""
        return self._alpha

    def _check(self, src: int, dst: int) -> tuple[int, int]:
        if not (0 <= int(src) < self._n and 0 <= int(dst) < self._n):
            raise ValueError(f"link {src}->{dst} outside nodes 0..{self._n - 1}")
        return int(src), int(dst)

    def observe(self, src: int, dst: int, size_bytes: float, t_start: float, t_end: float) -> bool:
        """Add one sample; returns whether it was used."""
        i, j = self._check(src, dst)
        rate = sample_rate(size_bytes, t_start, t_end)
        if rate is None or i == j:
            return False
        if self._count[i, j] == 0:
            self._est[i, j] = rate
        else:
            self._est[i, j] += self._alpha * (rate - self._est[i, j])
        self._count[i, j] += 1
        last = self._last[i, j]
        self._last[i, j] = float(t_end) if math.isnan(last) else max(last, float(t_end))
        return True

    def observe_rates(
        self, src: np.ndarray, dst: np.ndarray, rate: np.ndarray, t_end: np.ndarray
    ) -> int:
        """Add rate samples (bytes/s) as arrays, in their order: the same estimates as
        :meth:`observe` of each in turn (a link named twice blends twice, in order), computed
        per link in one pass. Samples outside the nodes, from a node to itself, or with a rate
        that is not finite and positive are ignored; returns how many were used."""
        src, dst = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
        rate, t_end = np.asarray(rate, dtype=float), np.asarray(t_end, dtype=float)
        n, a = self._n, self._alpha
        ok = (
            (src >= 0) & (src < n) & (dst >= 0) & (dst < n) & (src != dst)
            & np.isfinite(rate) & (rate > 0) & np.isfinite(t_end)
        )  # fmt: skip
        flat = (src * n + dst)[ok]
        order = np.argsort(flat, kind="stable")  # each link's samples, in their order
        flat, rate, t_end = flat[order], rate[ok][order], t_end[ok][order]
        if not flat.size:
            return 0
        links, start, counts = np.unique(flat, return_index=True, return_counts=True)
        pos = np.arange(flat.size) - np.repeat(start, counts)
        c = np.repeat(counts, counts)
        # after c blends of v_0..v_(c-1): (1-a)^c E + sum_k a (1-a)^(c-1-k) v_k; a link's
        # first sample ever is taken whole (weight (1-a)^(c-1), nothing of E)
        fresh = self._count.flat[links] == 0
        w = a * (1.0 - a) ** (c - 1 - pos)
        w = np.where(np.repeat(fresh, counts) & (pos == 0), (1.0 - a) ** (c - 1), w)
        blended = np.add.reduceat(w * rate, start)
        prior = np.where(fresh, 0.0, (1.0 - a) ** counts * np.nan_to_num(self._est.flat[links]))
        self._est.flat[links] = prior + blended
        self._count.flat[links] += counts
        newest = np.maximum.reduceat(t_end, start)
        self._last.flat[links] = np.fmax(self._last.flat[links], newest)
        return int(flat.size)

    def observe_medians(
        self, seq: np.ndarray, src: np.ndarray, dst: np.ndarray, rate: np.ndarray, t_end: np.ndarray
    ) -> int:
        """One sample per report (``seq``) and link: the median rate of that report's samples
        of the link, ending at their latest ``t_end``, blended in report order
        (:meth:`observe_rates`). Arrays of node indices within the table."""
        n = self._n
        key = (seq * n + src) * n + dst  # (report, link)
        order = np.argsort(key, kind="stable")
        k = key[order]
        cut = np.flatnonzero(k[1:] != k[:-1]) + 1
        lo, hi = np.r_[0, cut], np.r_[cut, order.size]
        if lo.size < order.size:  # a link with several samples in a report: by rate in it
            many = np.repeat(hi - lo > 1, hi - lo)
            sub = order[many]
            order[many] = sub[np.lexsort((rate[sub], key[sub]))]
        mid = order[lo + (hi - lo) // 2]
        last = np.maximum.reduceat(t_end[order], lo) if order.size else np.zeros(0)
        return self.observe_rates(src[mid], dst[mid], rate[mid], last)

    def estimate(self, src: int, dst: int) -> float:
        """Smoothed throughput of ``src -> dst`` in bytes/s (nan if never measured)."""
        i, j = self._check(src, dst)
        return float(self._est[i, j])

    def count(self, src: int, dst: int) -> int:
        """Number of samples taken on ``src -> dst``."""
        i, j = self._check(src, dst)
        return int(self._count[i, j])

    def last_update(self, src: int, dst: int) -> float:
        """Newest sample's ``t_end`` on ``src -> dst`` (nan if never measured)."""
        i, j = self._check(src, dst)
        return float(self._last[i, j])

    def matrix(self) -> np.ndarray:
        """Copy of the estimates: nan where unmeasured, inf on the diagonal (a node reaches
        itself for free); ready for :meth:`hetps.balance.Network.from_matrix`."""
        m = self._est.copy()
        np.fill_diagonal(m, np.inf)
        return m

    def counts(self) -> np.ndarray:
        """Copy of the per-link sample counts."""
        return self._count.copy()

    def stale_links(
        self, now: float, max_age: float, links: Iterable[tuple[int, int]] | None = None
    ) -> list[tuple[int, int]]:
        """Links (default: every ordered pair of distinct nodes) never measured or last
        measured more than ``max_age`` seconds before ``now``: the ones to probe."""
        if links is None:
            links = ((i, j) for i in range(self._n) for j in range(self._n) if i != j)
        out = []
        for src, dst in links:
            i, j = self._check(src, dst)
            last = self._last[i, j]
            if i != j and (math.isnan(last) or now - last > max_age):
                out.append((i, j))
        return out


class ForecastMatcher:
    """Receiver side of forecast-then-probe: pairs a forecast's arrival with its slice's.

    ``forecast(src, tag, t)`` when the forecast arrives, ``arrive(src, tag, size, t)`` when
    the slice has fully arrived; the latter returns a :class:`Sample` (or ``None`` without a
    matching forecast). At most ``max_pending`` forecasts wait; the oldest is dropped first.
    """

    def __init__(self, node: int, max_pending: int = 4096) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.node = int(node)
        self._max = int(max_pending)
        self._pending: OrderedDict[tuple[int, Hashable], float] = OrderedDict()

    @property
    def pending(self) -> int:
        """Forecasts waiting for their slice."""
        return len(self._pending)

    def forecast(self, src: int, tag: Hashable, t_arrival: float) -> None:
        """Record the arrival time of the forecast for slice ``tag`` from ``src``."""
        key = (int(src), tag)
        self._pending.pop(key, None)
        self._pending[key] = float(t_arrival)
        while len(self._pending) > self._max:
            self._pending.popitem(last=False)

    def arrive(self, src: int, tag: Hashable, size_bytes: float, t_arrival: float) -> Sample | None:
        """The slice ``tag`` from ``src`` arrived: the sample, if its forecast was seen."""
        t0 = self._pending.pop((int(src), tag), None)
        if t0 is None:
            return None
        return Sample(int(src), self.node, float(size_bytes), t0, float(t_arrival))


def used_links(n_nodes: int, servers: list[int], workers: list[int]) -> np.ndarray:
    """Which ordered links of ``n_nodes`` carry traffic: worker <-> server only (with
    co-located nodes that is every pair of different nodes). Read-only."""
    used = np.zeros((n_nodes, n_nodes), dtype=bool)
    srv, wrk = np.array(servers), np.array(workers)
    used[np.ix_(srv, wrk)] = True
    used[np.ix_(wrk, srv)] = True
    np.fill_diagonal(used, False)
    used.setflags(write=False)
    return used


def link_matrix(estimates: np.ndarray, used: np.ndarray) -> np.ndarray:
    """Estimated bytes/s per link from per-link ``estimates`` (NaN: not measured). Links
    that carry no traffic (not ``used``: server to server, worker to worker) are 0: they add
    no capacity to a node. Used links never measured take the median of the measured ones."""
    m = estimates.astype(float)
    known = m[used & np.isfinite(m)]
    fill = float(np.median(known)) if known.size else 1e9
    m[used & ~np.isfinite(m)] = fill
    m[~used] = 0.0
    np.fill_diagonal(m, np.inf)
    return m
