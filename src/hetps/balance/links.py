"""Per-node link capacities learnt from traffic and probes (pure: no messages, no clock).
(docs/MODULES.md, "hetps.balance.links")"""

from __future__ import annotations

import numpy as np

from hetps.balance.network import Network
from hetps.balance.reports import listed

NODE_MIN_BYTES = 256 * 1024  # a node's round must carry this much to measure its rate
SPREAD_NEAR = 0.85  # a node probing within this fraction of its fastest peer may be censored
SPREAD_WINDOW = 3  # spread readings kept per node and direction
#: a spread's last flow, once alone, runs at most this times its peer's estimated cap
SPREAD_TAIL_MARGIN = 1.1
#: a capacity probe under this fraction of min(sender's up cap, receiver's down cap) means
#: one of them got slower; over 1/CONTRADICT times either cap, that one got faster. Probes
#: of the rounds before CONTRADICT_FROM_ROUND read low and are not judged (docs/BALANCE.md §7.1)
CONTRADICT = 0.5
CONTRADICT_FROM_ROUND = 6
#: a probe shorter than this is not judged: its few milliseconds carry a busy machine's
#: timing noise
CONTRADICT_MIN_S = 0.02


class LinkEstimator:
    """Per-node send (up) and receive (down) caps of ``n_nodes`` nodes, in bytes/s."""

    def __init__(
        self,
        n_nodes: int,
        servers: list[int],
        workers: list[int],
        colocate: bool,
        probe_window: int,
        alpha: float = 0.5,
    ) -> None:
        self.n_nodes = n_nodes
        self.servers, self.workers = list(servers), list(workers)
        self.colocate = colocate
        self.node_alpha = alpha
        self.probe_window = max(2, probe_window)
        # busy-time rates: what a node sends (up) and receives (down) over the time it was
        # busy doing so, from every worker's samples of a round
        self.up = np.full(n_nodes, np.nan)
        self.down = np.full(n_nodes, np.nan)
        self._replace_busy = False  # the next busy-time rates replace the old, not blend
        # capacity probes: per node the rates of one permutation cycle (each peer once), each
        # a lower bound of that node's cap. Longer windows remember a slower node longer.
        self.last_probes: dict[tuple[int, int], tuple[float, int]] = {}  # (rate, round)
        self._probe_up: list[list[float]] = [[] for _ in range(n_nodes)]
        self._probe_down: list[list[float]] = [[] for _ in range(n_nodes)]
        # spread probes: the last few readings per node and direction (with the count of
        # spreads seen when each was taken), and each node's last turn
        self._last_turn: dict[tuple[str, int], int] = {}  # (way, node) -> its last spread
        self._spread_up: list[list[tuple[float, int]]] = [[] for _ in range(n_nodes)]
        self._spread_down: list[list[tuple[float, int]]] = [[] for _ in range(n_nodes)]
        self.spreads_seen = 0

    def forget_probes(self) -> None:
        """Drop the probe and spread readings (a new cycle of probes is coming because the
        network changed); the busy-time rates measured next replace the old ones."""
        for hist in (self._probe_up, self._probe_down, self._spread_up, self._spread_down):
            for h in hist:
                h.clear()
        self._replace_busy = True

    def spread_turn(self, way: str, node: int) -> None:
        """Node ``node`` has had its turn of a spread probe in direction ``way``."""
        self._last_turn[(way, node)] = self.spreads_seen

    def observe_nodes(self, samples: list[tuple[int, int, float, float, float]]) -> None:
        """:meth:`observe_arrays` of one round's samples ``(src, dst, t0, t1, bytes)``."""
        a = np.asarray(samples, dtype=float).reshape(-1, 5)
        self.observe_arrays(a[:, 0].astype(np.int64), a[:, 1].astype(np.int64), *a[:, 2:].T)

    def observe_arrays(
        self,
        src: np.ndarray,
        dst: np.ndarray,
        t0: np.ndarray,
        t1: np.ndarray,
        nbytes: np.ndarray,
    ) -> None:
        """Update the per-node rates from one round's samples, as arrays (rows of nodes
        ``0..n_nodes-1``; a host's workers share its row, so its rate is its link's).
        (docs/MODULES.md, "hetps.balance.links")"""
        n = self.n_nodes
        for est, ends in ((self.up, src), (self.down, dst)):
            total = np.bincount(ends, weights=nbytes, minlength=n)[:n]
            busy = union_lengths(ends, t0, t1, n)
            k = np.flatnonzero((total >= NODE_MIN_BYTES) & (busy > 0))
            rate = total[k] / busy[k]
            old = est[k]
            fresh = np.isnan(old) | self._replace_busy
            est[k] = np.where(fresh, rate, old + self.node_alpha * (rate - old))
        if len(src):
            self._replace_busy = False

    def observe_probe(self, src: int, dst: int, rate: float, rnd: int = -1) -> None:
        """A capacity probe from ``src`` to ``dst`` went at ``rate`` bytes/s: one more lower
        bound of ``src``'s uplink and ``dst``'s downlink, in each one's window of one
        permutation cycle. (A probe clearly slower than its peer's probes with third nodes
        does not reset this end's window: probes that share their links with data read low
        often enough that this threw away good estimates, and the one-cycle window already
        forgets a node's old speed within a cycle.)"""
        if rnd > max((n for _, n in self.last_probes.values()), default=-1):
            self.last_probes.clear()  # only the latest probing round's (reports stay small)
        self.last_probes[(src, dst)] = (rate, rnd)
        for hist, k in ((self._probe_up, src), (self._probe_down, dst)):
            hist[k].append(rate)
            del hist[k][: -self.probe_window]

    def observe_spread(self, flows: list[tuple], done: bool = False) -> None:
        """One spread probe's flows ``(src, dst, t0, t1, bytes, late)``: the node that sent
        (or received) two or more of them is read at their total bytes over the time they
        spanned together, min(its cap, the sum of its peers' caps). If the earliest flow's
        forecast was stamped late (its receive thread was busy), the span would be short and
        the reading high: that node gets no reading. ``done``: the workers reported making a
        spread (it counts as a turn even when no flow came back)."""
        if not flows and not done:
            return
        self.spreads_seen += 1
        caps = self.capacity() if flows else None
        for col, hist in ((0, self._spread_up), (1, self._spread_down)):
            for k in {f[col] for f in flows}:
                mine = [f for f in flows if f[col] == k]
                if len(mine) < 2:
                    continue
                first = min(mine, key=lambda f: f[2])
                span = max(f[3] for f in mine) - first[2]
                if span > 0 and not first[5]:
                    assert caps is not None
                    # the peers' caps: receivers' for a node that sent, senders' otherwise
                    rate = spread_rate(mine, caps[1] if col == 0 else caps[0], 1 - col)
                    hist[k].append((rate, self.spreads_seen))
                    del hist[k][:-SPREAD_WINDOW]

    def _spread_best(self, hist: list[list[tuple[float, int]]], turns: int) -> np.ndarray:
        """Per node, the best spread reading taken within the last ``turns`` spreads."""
        out = np.full(len(hist), np.nan)
        for k in [k for k, h in enumerate(hist) if h]:  # (most nodes have none)
            out[k] = max(
                (v for v, at in hist[k] if self.spreads_seen - at <= turns), default=np.nan
            )
        return out

    def _spread_turns(self, cen: np.ndarray) -> int:
        """Spreads in which every censored node of one direction has had its turn (both
        directions alternate), plus one: readings older than that are stale."""
        return 2 * max(1, int(cen.sum())) + 1

    @property
    def spread_up(self) -> np.ndarray:
        """Per node, the best recent spread reading of its sending cap (NaN: none)."""
        return self._spread_best(self._spread_up, self._spread_turns(self.censored()[0]))

    @property
    def spread_down(self) -> np.ndarray:
        """Per node, the best recent spread reading of its receiving cap (NaN: none)."""
        return self._spread_best(self._spread_down, self._spread_turns(self.censored()[1]))

    def single(self) -> tuple[np.ndarray, np.ndarray]:
        """Per node, the fastest single-flow probe of its window (NaN: none yet)."""
        return tuple(
            np.array([max(h) if h else np.nan for h in hist])
            for hist in (self._probe_up, self._probe_down)
        )  # type: ignore[return-value]

    def censored(self, single: tuple | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Which nodes' sending (receiving) cap the single-flow probes may not show in full:
        those whose fastest probe comes within 15% of the fastest peer at the other end,
        so that every reading of them may have been the peer's limit, not theirs.
        ``single``: :meth:`single`, when the caller has it."""
        up, down = self.single() if single is None else single
        out = []
        for mine, other, ends in ((up, down, self.servers), (down, up, self.workers)):
            # per node k, the fastest finite peer j != k: the fastest end, or for that end
            # itself the second fastest (vectorised: this runs several times per report)
            idx = np.asarray(ends, dtype=np.int64)
            vals = other[idx] if idx.size else np.zeros(0)
            fin = np.isfinite(vals)
            idx, vals = idx[fin], vals[fin]
            best = np.full(self.n_nodes, np.nan)
            if vals.size:
                order = np.argsort(-vals, kind="stable")
                best[:] = vals[order[0]]
                best[idx[order[0]]] = vals[order[1]] if vals.size > 1 else np.nan
            with np.errstate(invalid="ignore"):
                flags = np.isfinite(mine) & np.isfinite(best) & (mine >= SPREAD_NEAR * best)
            out.append(flags)
        return out[0], out[1]

    def spread_targets(self, live: set[int] | None = None) -> list | None:
        """The next spread probe (see the client's ``_spread_probe``): ``["out", worker rank,
        [server ranks]]``, that worker probes those servers at once, or ``["in", server rank,
        [worker ranks]]``, those workers probe that server at once. Directions alternate;
        within one, the censored node (:meth:`censored`) whose last spread is the oldest goes. The peers are the
        fastest ones at the other end, as few as together have twice the node's current
        estimate (at least two): flows to peers of alike speed end together, where a slow
        peer's flow would stretch the span the spread is timed over and read the node low.
        None when no node is censored or no node has two peers.
        ``live``: matrix indices of the workers still running (default: all)."""
        k = self.spreads_seen
        cen_up, cen_down = self.censored()
        up, down = self.capacity()
        alive = set(self.workers) if live is None else set(live)
        workers = [w for w in self.workers if w in alive]
        ways = [
            ("out", [w for w in workers if cen_up[w]], self.workers, self.servers, up, down),
            ("in", [s for s in self.servers if cen_down[s]], self.servers, workers, down, up),
        ]
        for way, cands, ends, others, mine, theirs in (ways[k % 2], ways[1 - k % 2]):
            if not cands:
                continue
            # the censored node whose turn is longest ago (or never came): a fixed rotation
            # over a set that changes from one turn to the next could skip a node for good
            node = min(cands, key=lambda c: (self._last_turn.get((way, c), -1), c))
            peers = [j for j in others if not (self.colocate and j == node)]
            ends_of = self.workers if way == "in" else self.servers  # rank order of the peers
            if len(peers) < 2:
                continue
            fill = float(np.nanmedian(theirs)) if np.isfinite(theirs).any() else 1.0
            rate = {j: float(theirs[j]) if np.isfinite(theirs[j]) else fill for j in peers}
            peers.sort(key=lambda j: -rate[j])
            want = 2.0 * (float(mine[node]) if np.isfinite(mine[node]) else fill)
            pick: list[int] = []
            for j in peers:
                pick.append(j)
                if len(pick) >= 2 and sum(rate[x] for x in pick) >= want:
                    break
            return [way, ends.index(node), sorted(ends_of.index(j) for j in pick)]
        return None

    def capacity(self) -> tuple[np.ndarray, np.ndarray]:
        """Per-node send and receive caps: the larger of what the data traffic showed
        (busy-time rate) and the fastest recent probe. Both under-estimate a cap (a node never
        (docs/MODULES.md, "hetps.balance.links")"""
        caps = []
        single = self.single()
        censored = self.censored(single)  # (read once: each is a pass over every node)
        spreads = (
            self._spread_best(self._spread_up, self._spread_turns(censored[0])),
            self._spread_best(self._spread_down, self._spread_turns(censored[1])),
        )
        for busy, probe, spread, cen in zip(
            (self.up, self.down), single, spreads, censored, strict=True
        ):
            # a spread reading counts while the node is still censored: once its single-flow
            # probes read clearly below its peers, they are its cap (it got slower)
            caps.append(np.fmax(np.fmax(busy, probe), np.where(cen, spread, np.nan)))
        return caps[0], caps[1]

    def node_rates(self) -> dict:
        """The per-node caps and what they come from (single-flow probes, fresh spreads, the
        data's busy time), JSON-ready, with the latest probes, for reports and plots."""
        up, down = self.capacity()
        single = self.single()
        return {
            "up": listed(up),
            "down": listed(down),
            "probe_up": listed(single[0]),
            "probe_down": listed(single[1]),
            "spread_up": listed(self.spread_up),
            "spread_down": listed(self.spread_down),
            "busy_up": listed(self.up),
            "busy_down": listed(self.down),
            "last_probes": [[i, j, r, n] for (i, j), (r, n) in sorted(self.last_probes.items())],
        }

    def node_network(self) -> Network | None:
        """The network of per-node caps measured so far (unmeasured nodes take the median
        of the measured ones), or None before any node was measured."""
        up, down = self.capacity()
        known = np.concatenate([up[np.isfinite(up)], down[np.isfinite(down)]])
        if known.size == 0:
            return None
        fill = float(np.median(known))
        up = np.where(np.isfinite(up), up, fill)
        down = np.where(np.isfinite(down), down, fill)
        return Network(up, down)

    def contradicts(self, src: int, dst: int, rate: float) -> bool:
        """Whether a capacity probe from ``src`` to ``dst`` at ``rate`` says the network
        changed: it reads far below the smaller of the two caps it measures (one of the
        nodes got slower), or far above either of them (that node got faster: a probe never
        reads above its sender's up or its receiver's down). A rise alone would raise that
        one cap at once, but a network that changed usually changed in more places than
        this round's probes show."""
        up, down = self.capacity()
        cu, cd = float(up[src]), float(down[dst])
        expected = float(np.fmin(cu, cd))  # (an unknown cap is no limit)
        if np.isfinite(expected) and rate < CONTRADICT * expected:
            return True
        return any(np.isfinite(c) and rate * CONTRADICT > c for c in (cu, cd))


def spread_rate(flows: list[tuple], peer_caps: np.ndarray, peer_col: int) -> float:
    """A node's rate from one spread's flows ``(src, dst, t0, t1, bytes, late)`` (all of
    them sent, or all received, by that node; ``peer_col`` is the tuple index of the peer).
    (docs/MODULES.md, "hetps.balance.links")"""
    t_start = min(f[2] for f in flows)
    ends = sorted(f[3] for f in flows)
    total = float(sum(f[4] for f in flows))
    rate = total / (ends[-1] - t_start)
    last = max(flows, key=lambda f: f[3])
    peer = last[peer_col]
    cap = float(peer_caps[peer]) if 0 <= peer < len(peer_caps) else float("nan")
    t2 = ends[-2]
    if np.isfinite(cap) and cap > 0 and t2 > t_start:
        rest = total - SPREAD_TAIL_MARGIN * cap * (ends[-1] - t2)
        rate = max(rate, rest / (t2 - t_start))
    return rate


def union_lengths(group: np.ndarray, t0: np.ndarray, t1: np.ndarray, n: int) -> np.ndarray:
    """Per group ``0..n-1``, the total length its intervals ``[t0, t1)`` cover (overlaps
    counted once), all groups at once: the intervals sorted by group (a stable sort of 16-bit
    keys is a radix sort), one row per group (groups of like sizes together: rows of one size
    one after another are the sorted order itself, others are padded by empty intervals at
    +inf), each row sorted by start (ties in their order: :func:`_by_start`), a running
    maximum of the ends along it, and its covered pieces summed in order (pads add 0.0)."""
    out = np.zeros(n)
    m = len(group)
    if not m:
        return out
    keys = group
    if n <= 1 << 16 and group.min() >= 0 and group.max() < n:
        keys = group.astype(np.uint16)
    order = np.argsort(keys, kind="stable")
    g = keys[order]
    first = np.concatenate(([0], np.flatnonzero(g[1:] != g[:-1]) + 1))
    sizes = np.diff(first, append=m)
    bucket = np.frexp(sizes - 1)[1]  # (a row at most twice its length)
    padded = None
    for k in np.unique(bucket).tolist():
        pick = np.flatnonzero(bucket == k)
        size, start, width = sizes[pick], first[pick], int(sizes[pick].max())
        lo, hi = t0, t1
        if size.min() == width and start[-1] - start[0] == width * (len(pick) - 1):
            idx = order[start[0] : start[0] + width * len(pick)].reshape(-1, width)
        else:
            if padded is None:
                padded = np.append(order, m), np.append(t0, np.inf), np.append(t1, -np.inf)
            col = np.arange(width)
            idx = padded[0][np.where(col < size[:, None], start[:, None] + col, m)]
            lo, hi = padded[1], padded[2]
        lo, hi = _by_start(lo[idx], hi[idx])
        seg = np.empty_like(hi)  # (each piece: in place, one array of the row's size)
        seg[:, 0] = -np.inf
        np.maximum.accumulate(hi[:, :-1], axis=1, out=seg[:, 1:])
        np.maximum(np.subtract(hi, np.maximum(lo, seg, out=seg), out=seg), 0.0, out=seg)
        out[g[start]] = np.add.accumulate(seg, axis=1, out=seg)[:, -1]
    return out


def _by_start(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rows of ``(lo, hi)`` sorted by start in place, ties in their order (as a stable sort):
    rows in order stay, the others take the quick sort, and the stable one where two of one
    start and different ends may have changed places."""
    with np.errstate(invalid="ignore"):
        todo = np.flatnonzero(~(lo[:, 1:] >= lo[:, :-1]).all(axis=1))
    if not len(todo):
        return lo, hi
    x, y = lo[todo], hi[todo]
    order = np.argsort(x, axis=1)
    s_lo, s_hi = np.take_along_axis(x, order, axis=1), np.take_along_axis(y, order, axis=1)
    ties = ((s_lo[:, 1:] == s_lo[:, :-1]) & (s_hi[:, 1:] != s_hi[:, :-1])).any(axis=1)
    ties |= np.isnan(s_lo[:, -1])  # (NaN starts: equal to nothing, sorted last)
    if ties.any():
        order = np.argsort(x[ties], axis=1, kind="stable")
        s_lo[ties] = np.take_along_axis(x[ties], order, axis=1)
        s_hi[ties] = np.take_along_axis(y[ties], order, axis=1)
    lo[todo], hi[todo] = s_lo, s_hi
    return lo, hi
