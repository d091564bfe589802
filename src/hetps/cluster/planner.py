"""The load planner: learns the link matrix from the nodes' measurements and decides, every
iteration, which server holds which slice (network-aware load distribution, docs/BALANCE.md).

Hosted by the scheduler (command ``balance_report``). Every worker reports at the start of an
iteration: the slice layout (key sizes, in init order), the link samples it collected
(forecast-then-probe timings of its pushes, measured by the servers, and of its pulls,
measured by itself) and, per server, bytes and seconds of the last iteration. When every
worker has reported the same round the planner computes the shares with the configured scheme
(:func:`hetps.balance.make_plan`), assigns slices (Algorithm 2, keeping slices in place where it
can), and answers every worker with the plan and its epoch.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from hetps.balance import EstimateTable, Network, assign, iteration_time, make_plan, push_pace
from hetps.balance.plans import fit_linear
from hetps.balance.slicing import Slice, layout
from hetps.cluster import protocol as P
from hetps.transport.codec import Message

log = logging.getLogger("hetps.planner")

REPORT = "balance_report"
NODE_MIN_BYTES = 256 * 1024  # a node's round must carry this much to measure its rate
SPREAD_NEAR = 0.85  # a node probing within this fraction of its fastest peer may be censored
SPREAD_WINDOW = 3  # spread readings kept per node and direction
#: a spread's last flow, once alone, runs at most this times its peer's estimated cap
SPREAD_TAIL_MARGIN = 1.1
#: a round this many times slower (against the plan's prediction) than the recent median
#: means the network changed under the plan: every worker probes a whole cycle anew
SURPRISE = 1.5
SURPRISE_HISTORY = 8  # rounds of (measured / predicted) kept for the median
SURPRISE_MIN_HISTORY = 3  # rounds needed before a round can surprise
SURPRISE_SETTLE = 2  # rounds after a plan change or a cycle that are not judged
RECAL_WAIT = 4  # rounds a requested cycle may take to come back before it counts as lost
SURPRISE_ROUNDS = 2  # surprising rounds in a row that it takes (one is a hiccup)
SURPRISE_AT_ONCE = 2.0  # ... unless one round is this much slower
SURPRISE_IN_SETTLE = 4.0  # a round right after a plan change this much slower surprises too
#: a capacity probe under this fraction of min(sender's up cap, receiver's down cap) means
#: one of them got slower; over 1/CONTRADICT times either cap, that one got faster. Measured
#: on 8 static nodes: after the first regular probing round every probe read 0.93-1.06 of
#: it; that round's, right after the first data round, down to 0.58 (hence the rounds before
#: CONTRADICT_FROM_ROUND are not judged). On 4 nodes probing every round a node's inbound
#: probe read 0.6 twice while its own outbound probe held its acks back (docs/BALANCE.md §7.1)
CONTRADICT = 0.5
CONTRADICT_FROM_ROUND = 6
#: a probe shorter than this is not judged: its few milliseconds carry the timing noise of
#: a busy machine (3 nodes at 150 Mbit/s on 2 cores, 7 ms probes: the rate-cut test asked
#: for a cycle before its cut until short probes were left out)
CONTRADICT_MIN_S = 0.02


class Planner:
    """The scheduler's planning service for one cluster."""

    def __init__(
        self,
        scheme: str,
        num_workers: int,
        num_servers: int,
        colocate: bool,
        slice_elems: int,
        probe_num: int = 1,
        alpha: float = 0.5,
        margin: float = 0.10,
        patience: int = 2,
        probe_backoff: int = 1,
    ) -> None:
        if colocate and num_workers != num_servers:
            raise ValueError("colocated servers need as many servers as workers")
        self.scheme = scheme
        self.W, self.S = num_workers, num_servers
        self.colocate = colocate
        self.slice_elems = slice_elems
        self.probe_num = probe_num
        self.margin = margin  # hysteresis: a new assignment must be predicted this much faster
        self.patience = max(1, patience)  # reports in a row that must favour a change
        self.kept = 0  # plans computed but not adopted (not enough predicted gain)
        self._streak = 0  # consecutive reports whose new plan beat the margin
        self.n_nodes = num_workers if colocate else num_workers + num_servers
        self.table = EstimateTable(self.n_nodes, alpha=alpha)
        self.slices: list[Slice] | None = None
        self.assignment: np.ndarray | None = None
        self.shares: np.ndarray | None = None
        self.epoch = 0
        self.pending: dict[int, dict[int, Message]] = {}
        # per-node rates (bytes/s): what a node sends (up) and receives (down) over the time
        # it was busy doing so, from every worker's samples of a round
        self._samples: dict[int, list[tuple[int, int, float, float, float]]] = {}
        self.node_alpha = alpha
        self.up = np.full(self.n_nodes, np.nan)
        self.down = np.full(self.n_nodes, np.nan)
        # capacity probes (one flow alone on its sender's uplink and receiver's downlink,
        # sent once every worker finished its previous round): per node the rates of one
        # permutation cycle (each peer once), each a lower bound of that node's cap. Longer
        # windows remember a node that got slower for longer.
        cycle = num_servers - 1 if colocate else max(num_workers, num_servers)
        self.probe_window = max(2, cycle)
        self.last_probes: dict[tuple[int, int], tuple[float, int]] = {}  # (rate, round)
        self._probe_up: list[list[float]] = [[] for _ in range(self.n_nodes)]
        self._probe_down: list[list[float]] = [[] for _ in range(self.n_nodes)]
        # spread probes (one worker to every server at once, or every worker to one server):
        # their flows per round, the last few readings per node and direction, and how many
        # spread probes were seen (it picks the next one)
        self._spread: dict[int, list[tuple[int, int, float, float, float, bool]]] = {}
        self._spread_done: set[int] = set()  # rounds whose reports say a spread was made
        self._last_turn: dict[tuple[str, int], int] = {}  # (way, node) -> its last spread
        # per node: (reading, spreads_seen when it was taken)
        self._spread_up: list[list[tuple[float, int]]] = [[] for _ in range(self.n_nodes)]
        self._spread_down: list[list[tuple[float, int]]] = [[] for _ in range(self.n_nodes)]
        self.spreads_seen = 0
        self.history: list[list[tuple[float, float]]] = [[] for _ in range(num_servers)]
        self.plan_seconds: list[float] = []
        # surprise detection (docs/BALANCE.md §7.3): per round, every worker's communication
        # span; the recent ratios of measured to predicted time; a pending request for a cycle
        self._spans: dict[int, list[float]] = {}
        self._ratios: list[float] = []
        self._surprises = 0  # surprising rounds in a row
        self._settle = 0
        self._before: np.ndarray | None = None  # the assignment before the last change
        self._replace_busy = False  # the next busy-time rates replace the old, not blend
        self._recal_asked: int | None = None  # the round that asked, while it is pending
        self._recal_wait = 0  # released rounds left before a pending request counts as lost
        self._rebase = False  # the first judged round after a cycle may set a new baseline
        self._released = 0  # rounds answered so far (reports, whatever HETPS_REPLAN_EVERY)
        self._calibration_rounds: set[int] = set()  # rounds whose reports bring a new cycle
        self._contradicted: set[int] = set()  # rounds with a probe far off its caps
        self.recalibrations = 0  # new probe cycles that came back
        self._trust = False  # the next plan rests on a fresh cycle: no patience (margin holds)
        self.last_surprise: float | None = None
        # with probe_backoff > 1 (HETPS_PROBE_BACKOFF; off by default: a network that got
        # faster shows only in probes) probing thins out while the network holds still:
        # each quiet probing round (its probes agreed with the caps, no plan change, no
        # surprise) doubles the interval the workers probe at, up to probe_backoff times
        # their base interval; any sign of change brings it back to the base (every answer
        # carries it: "probe_scale"; docs/BALANCE.md §7.5)
        self.probe_backoff = max(1, int(probe_backoff))
        self.probe_scale = 1
        # rounds whose reports carry a capacity probe that was checked against the caps (one
        # too short to judge, or from a calibration cycle or a settling round, says nothing)
        self._probed: set[int] = set()

    # network node index of a ps-lite id
    def index(self, node_id: int) -> int:
        """Row/column of ``node_id`` in the link matrix."""
        rank = P.rank_of(node_id)
        if P.role_of(node_id) == "server":
            return rank
        return rank if self.colocate else self.S + rank

    @property
    def servers(self) -> list[int]:
        """Matrix indices of the servers."""
        return list(range(self.S))

    @property
    def workers(self) -> list[int]:
        """Matrix indices of the workers."""
        return list(range(self.W)) if self.colocate else list(range(self.S, self.S + self.W))

    def used_links(self) -> np.ndarray:
        """Which ordered links carry traffic in this deployment: worker <-> server only (with
        co-located nodes that is every pair of different nodes)."""
        used = np.zeros((self.n_nodes, self.n_nodes), dtype=bool)
        for s in self.servers:
            for w in self.workers:
                if s != w:
                    used[s, w] = used[w, s] = True
        return used

    def link_matrix(self) -> np.ndarray:
        """Estimated bytes/s per link. Links that carry no traffic here (server to server,
        worker to worker) are 0: they add no capacity to a node. Used links that were never
        measured take the median of the measured ones."""
        m = self.table.matrix().astype(float)
        used = self.used_links()
        known = m[used & np.isfinite(m)]
        fill = float(np.median(known)) if known.size else 1e9
        m[used & ~np.isfinite(m)] = fill
        m[~used] = 0.0
        np.fill_diagonal(m, np.inf)
        return m

    def handle(self, sched: Any, msg: Message) -> None:
        """One worker's report; answer everyone once every worker reported the round."""
        b = msg.body
        rnd = b.get("round")
        if not isinstance(rnd, int):
            sched.reply(msg, {"error": "balance report without a round number"})
            return
        sizes = b.get("sizes")
        if sizes is not None:  # the layout, first time or grown by later inits
            if not isinstance(sizes, list) or not all(isinstance(x, int) and x >= 0 for x in sizes):
                sched.reply(msg, {"error": "balance report: 'sizes' must be element counts"})
                return
            slices = layout(sizes, self.slice_elems)
            where = b.get("assign")
            if not isinstance(where, list) or len(where) != len(slices):
                sched.reply(msg, {"error": "balance report: 'assign' must give a server per slice"})
                return
            if self.slices is None or len(slices) != len(self.slices):
                self.slices = slices
                self.assignment = np.array(where, dtype=np.int64)
        if self.slices is None:
            sched.reply(msg, {"error": "the first balance report must carry the key sizes"})
            return
        if b.get("calibration") is True and rnd not in self._calibration_rounds:
            # the first report of a round that re-probed a whole cycle: its readings (this
            # report's and the other workers') replace everything older
            self._calibration_rounds.add(rnd)
            self.forget_readings()
        # the link matrix (reports, plots; plans use it only before any node rate is known):
        # one sample per link per report, the median of its messages' rates. Bytes over the
        # link's busy time would be steadier, but it reads 15-30% low on short phases after
        # an idle spell (TCP's slow start), which the median ignores.
        per_link: dict[tuple[int, int], list[tuple[float, float, float]]] = {}
        for item in b.get("samples", []):
            try:
                src, dst, nbytes, t0, t1 = item[:5]
                kind = item[5] if len(item) > 5 else 0
                i, j = self.index(int(src)), self.index(int(dst))
                nbytes, t0, t1 = float(nbytes), float(t0), float(t1)
            except (TypeError, ValueError, IndexError):
                continue
            if not (0 <= i < self.n_nodes and 0 <= j < self.n_nodes and t1 > t0 and nbytes > 0):
                continue
            if i == j:  # a worker and its co-located server: never on the network
                continue
            if kind == 1:
                rate = nbytes / (t1 - t0)
                judged = (
                    self._released + 1 >= CONTRADICT_FROM_ROUND
                    and t1 - t0 >= CONTRADICT_MIN_S
                    and not b.get("calibration")
                    and self._settle == 0  # not right after a migration or a cycle
                )
                if judged:
                    self._probed.add(rnd)  # a probe checked against the caps (backoff)
                    if self.contradicts(i, j, rate):
                        self._contradicted.add(rnd)
                self.observe_probe(i, j, rate, rnd)
            elif kind in (2, 3):  # a spread's flow (3: its forecast was stamped late)
                self._spread.setdefault(rnd, []).append((i, j, t0, t1, nbytes, kind == 3))
            else:
                per_link.setdefault((i, j), []).append((t0, t1, nbytes))
        round_samples = self._samples.setdefault(rnd, [])
        for (i, j), items in per_link.items():
            round_samples += [(i, j, t0, t1, n) for t0, t1, n in items]
            rates = sorted(n / (t1 - t0) for t0, t1, n in items)
            t_end = max(t1 for _, t1, _ in items)
            self.table.observe(i, j, rates[len(rates) // 2], t_end - 1.0, t_end)  # 1 s at it
        span = 0.0
        for srank, (nbytes, secs) in (b.get("server_times") or {}).items():
            s = int(srank)
            if 0 <= s < self.S and secs > 0:
                self.history[s].append((float(nbytes), float(secs)))
                del self.history[s][:-20]
                span = max(span, float(secs))
        if span > 0:  # this worker's last round: from its first request to its last answer
            self._spans.setdefault(rnd, []).append(span)
        done = b.get("spread_done")
        if isinstance(done, list) and len(done) == 2 and isinstance(done[1], int):
            self._spread_done.add(rnd)
            way, rank = done
            ends = self.workers if way == "out" else self.servers if way == "in" else []
            if 0 <= rank < len(ends):
                self._last_turn[(way, ends[rank])] = self.spreads_seen
        self.pending.setdefault(rnd, {})[msg.sender] = msg
        self.release(sched)

    def release(self, sched: Any) -> None:
        """Answer every round that every live, unfinished worker has reported (also called
        when a worker finishes, so the others never wait for it)."""
        live = {
            nid
            for nid, n in sched.nodes.items()
            if n.role == "worker" and nid not in sched.dead and nid not in sched.finished
        }
        for rnd in sorted(self.pending):
            waiting = self.pending[rnd]
            if not live <= set(waiting):
                continue
            del self.pending[rnd]
            self.observe_nodes(self._samples.pop(rnd, []))
            done = rnd in self._spread_done
            self.observe_spread(self._spread.pop(rnd, []), done=done)
            for old in [r for r in self._samples if r < rnd]:
                del self._samples[old]
            for old in [r for r in self._spread if r < rnd]:
                del self._spread[old]
            self._released += 1
            contradicted = rnd in self._contradicted
            recal = self.surprised(rnd, self._spans.pop(rnd, []), contradicted=contradicted)
            probed = rnd in self._probed
            self._probed = {r for r in self._probed if r > rnd}
            self._contradicted = {r for r in self._contradicted if r > rnd}
            for old in [r for r in self._spans if r < rnd]:
                del self._spans[old]
            self._calibration_rounds = {r for r in self._calibration_rounds if r >= rnd}
            self._spread_done = {r for r in self._spread_done if r > rnd}
            if not self.slices:
                # every worker gets the error (``rebalance`` raises it) rather than a timeout
                answer = {
                    "error": "rebalance() before any kv.init(): there is nothing to place "
                    "yet; initialise the keys first"
                }
                for m in waiting.values():
                    sched.reply(m, answer)
                continue
            epoch = self.epoch
            answer = self.plan()
            if recal or contradicted or self._surprises or self.epoch != epoch or self._settle:
                self.probe_scale = 1  # the network may be changing: probe at the base rate
            elif probed:
                self.probe_scale = min(2 * self.probe_scale, self.probe_backoff)
            answer["probe_scale"] = self.probe_scale
            spread = self.spread_targets(live={self.index(n) for n in live})
            if recal:
                answer = {**answer, "recalibrate": True}
            elif spread is not None:
                answer = {**answer, "spread": spread}
            for m in waiting.values():
                sched.reply(m, answer)

    def forget_readings(self) -> None:
        """Drop the probe and spread readings: a new cycle of probes is arriving because the
        network changed. The busy-time rates stay (some caps show only in data, e.g. a
        server's sending without co-location), but those measured in the next round are
        replaced instead of blended. The link matrix (reports only) stays. Counts one
        re-calibration (``recalibrations``: cycles that came back, not requests)."""
        for hist in (self._probe_up, self._probe_down, self._spread_up, self._spread_down):
            for h in hist:
                h.clear()
        self._replace_busy = True
        self._recal_asked = None
        self._surprises = 0
        self._settle = SURPRISE_SETTLE
        self._trust = True
        self._rebase = True
        self.probe_scale = 1
        self.recalibrations += 1

    def surprised(self, rnd: int, spans: list[float], contradicted: bool = False) -> bool:
        """Whether the network seems to have changed under the plan, so that every worker
        should probe a whole cycle anew (docs/BALANCE.md §7.3). Two signs, either will do:

        - ``contradicted``: one of the round's capacity probes read far off what the caps say
          its link carries (:meth:`contradicts`; which node changed, only a new cycle can
          tell);
        - the round took far longer than the plan predicts (:meth:`_slow_round`).

        Only the probing schemes are judged, and not while a re-calibration is on its way."""
        if self.scheme not in ("aware", "optimal") or self.slices is None:
            return False
        if self._recal_asked is not None:
            self._recal_wait -= 1
            if self._recal_wait >= 0:  # its cycle has not come back yet
                return False
            # lost (a worker finished, or the workers do not probe): judge afresh
            self._recal_asked, self._surprises = None, 0
        slow = self._slow_round(spans)
        if not (slow or contradicted):
            return False
        self._recal_asked, self._recal_wait = rnd, RECAL_WAIT
        log.info(
            "planner: %s in round %d; asking for a new probe cycle",
            "a probe far off its link's caps" if contradicted else "a round far too slow",
            rnd,
        )
        return True

    def _slow_round(self, spans: list[float]) -> bool:
        """Whether this round (and the one before) took far longer than predicted.

        The round's time is the median of the workers' spans (each from its first request
        to its last answer of the round); divided by the current assignment's predicted
        time it gives a ratio that is steady while the network is (~1.1-1.4: TCP does not
        reach the fluid schedule). ``SURPRISE_ROUNDS`` rounds in a row over ``SURPRISE``
        times the median of the last few are a surprise (one is a hiccup; it does not join
        the median either), and so is one round over ``SURPRISE_AT_ONCE`` times it. The
        rounds right after a plan change (its migration, its barrier) are judged only
        against ``SURPRISE_IN_SETTLE``; those right after a cycle not at all."""
        if not spans:
            return False
        settling = self._settle > 0
        if settling:
            self._settle -= 1
            if self._rebase:  # after a cycle: its own first judged round decides (below)
                return False
        net = self.node_network()
        if net is None or self.assignment is None:
            return False
        try:
            predicted = self._predict(net, self.assignment)
        except Exception:  # noqa: BLE001 - no prediction, no judgement
            return False
        if not predicted or not np.isfinite(predicted) or predicted <= 0:
            return False
        ratio = float(np.median(spans)) / predicted
        recent = self._ratios
        if settling:
            # a migration's rounds are not judged, unless one is so slow that no migration
            # explains it: a cut that came with a plan change (made from the slow round
            # itself) would otherwise go unseen for SURPRISE_SETTLE more rounds. With
            # pipelined answers the first of them may still have run the assignment before
            # the change: judged against the slower of the two predictions
            try:
                before = self._predict(net, self._before) if self._before is not None else None
            except Exception:  # noqa: BLE001 - the current prediction alone
                before = None
            if before and np.isfinite(before) and before > predicted:
                ratio = float(np.median(spans)) / before
            if len(recent) >= SURPRISE_MIN_HISTORY:
                self.last_surprise = ratio / float(np.median(recent))
                if self.last_surprise > SURPRISE_IN_SETTLE:
                    self._surprises = 0
                    return True
            return False
        rebase, self._rebase = self._rebase, False
        if len(recent) >= SURPRISE_MIN_HISTORY:
            self.last_surprise = ratio / float(np.median(recent))
            if rebase and self.last_surprise > SURPRISE:
                # a fresh cycle did not bring the rounds back to what was usual: what the
                # caps cannot show (delay, loss, a slow worker's compute in the spans) is
                # the new usual, not a reason to probe again and again
                recent[:] = [ratio]
                self._surprises = 0
                return False
            self._surprises = self._surprises + 1 if self.last_surprise > SURPRISE else 0
            if self._surprises >= SURPRISE_ROUNDS or self.last_surprise > SURPRISE_AT_ONCE:
                self._surprises = 0
                return True
            if self._surprises:  # not (yet) part of what is usual
                return False
        recent.append(ratio)
        del recent[:-SURPRISE_HISTORY]
        return False

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

    def observe_nodes(self, samples: list[tuple[int, int, float, float, float]]) -> None:
        """Update the per-node rates from one round's samples ``(src, dst, t0, t1, bytes)``.

        A node's sending rate is everything it was seen sending (its worker's pushes and its
        server's replies) over the union of those messages' transfer intervals, the time its
        uplink was busy; the same for receiving. Under per-node caps (every node's NIC, or a
        ``tc`` shaper) this is the cap itself when the node is the bottleneck, however TCP
        splits it between flows from moment to moment, which is what makes per-link samples
        so noisy. The intervals come from different receivers' clocks: on one host they agree;
        across hosts NTP's few milliseconds are small against a round's transfers."""
        for k in range(self.n_nodes):
            for est, col in ((self.up, 0), (self.down, 1)):
                mine = [x for x in samples if x[col] == k]
                total = sum(x[4] for x in mine)
                if total < NODE_MIN_BYTES:
                    continue
                busy = _union_length([(x[2], x[3]) for x in mine])
                if busy <= 0:
                    continue
                rate = total / busy
                old = est[k]
                fresh = np.isnan(old) or self._replace_busy
                est[k] = rate if fresh else old + self.node_alpha * (rate - old)
        if samples:
            self._replace_busy = False

    def observe_probe(self, src: int, dst: int, rate: float, rnd: int = -1) -> None:
        """A capacity probe from ``src`` to ``dst`` went at ``rate`` bytes/s: one more lower
        bound of ``src``'s uplink and ``dst``'s downlink, in each one's window of one
        permutation cycle. (Session 2 also let a probe clearly slower than its peer's probes
        with third nodes reset this end's window; probes that share their links with data
        read low often enough that this threw away good estimates, and the one-cycle window
        already forgets a node's old speed within a cycle.)"""
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
        return np.array(
            [
                max((v for v, at in h if self.spreads_seen - at <= turns), default=np.nan)
                for h in hist
            ]
        )

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

    def _single(self) -> tuple[np.ndarray, np.ndarray]:
        """Per node, the fastest single-flow probe of its window (NaN: none yet)."""
        return tuple(
            np.array([max(h) if h else np.nan for h in hist])
            for hist in (self._probe_up, self._probe_down)
        )  # type: ignore[return-value]

    def censored(self) -> tuple[np.ndarray, np.ndarray]:
        """Which nodes' sending (receiving) cap the single-flow probes may not show in full:
        those whose fastest probe comes within 15% of the fastest peer at the other end,
        so that every reading of them may have been the peer's limit, not theirs."""
        up, down = self._single()
        out = []
        for mine, other, ends in ((up, down, self.servers), (down, up, self.workers)):
            flags = np.zeros(self.n_nodes, dtype=bool)
            for k in range(self.n_nodes):
                peers = [other[j] for j in ends if j != k and np.isfinite(other[j])]
                if np.isfinite(mine[k]) and peers and mine[k] >= SPREAD_NEAR * max(peers):
                    flags[k] = True
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
        None when no node is censored, the scheme does not probe, or no node has two peers.
        ``live``: matrix indices of the workers still running (default: all)."""
        if self.scheme not in ("aware", "optimal"):
            return None
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
        sends faster than it can; a probe measures min(sender's up, receiver's down), and the
        permutation pairs each node with a different peer every probing round), so the larger
        is the better estimate. A probe that shared its links with data reads low, which the
        maximum over the window forgives. One that would read too fast (its forecast stamped
        late by a receive thread that was behind) never gets here: the server drops it. A
        censored node (:meth:`censored`) also takes its latest spread reading if larger."""
        caps = []
        for busy, probe, spread, cen in zip(
            (self.up, self.down),
            self._single(),
            (self.spread_up, self.spread_down),
            self.censored(),
            strict=True,
        ):
            # a spread reading counts while the node is still censored: once its single-flow
            # probes read clearly below its peers, they are its cap (it got slower)
            caps.append(np.fmax(np.fmax(busy, probe), np.where(cen, spread, np.nan)))
        return caps[0], caps[1]

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

    def _predict(self, net: Network | None, assignment: np.ndarray) -> float | None:
        """Predicted communication time of ``assignment`` on what is known now (the link
        model for aware/optimal, the fitted per-server lines for elastic)."""
        assert self.slices is not None
        lengths = np.array([s.length for s in self.slices], dtype=float)
        counts = np.bincount(np.asarray(assignment), weights=lengths, minlength=self.S)
        if net is not None:
            return float(iteration_time(net, counts, servers=self.servers, workers=self.workers))
        if self.scheme == "elastic":
            fits = [fit_linear(h) for h in self.history]
            if any(f is None for f in fits):
                return None
            return max(a + b * x for (a, b), x in zip(fits, counts, strict=True))  # type: ignore[misc]
        return None

    def _gain(self, net: Network | None, new: np.ndarray) -> float | None:
        """How many times faster ``new`` is predicted to be than the current assignment
        (None when it cannot be predicted)."""
        if self.assignment is None:
            return None
        try:
            t_old = self._predict(net, self.assignment)
            t_new = self._predict(net, new)
        except Exception:  # noqa: BLE001 - a failed prediction adopts the new plan
            return None
        if t_old is None or t_new is None or not (np.isfinite(t_old) and np.isfinite(t_new)):
            return None
        return t_old / t_new if t_new > 0 else None

    def _flow_rates(self, net: Network | None, counts: np.ndarray) -> list[float] | None:
        """The rate (bytes/s) at which every flow to and from each server moves its share
        so that all end at the assignment's predicted time: server s's share over that time.
        Workers and servers pace their connections by it (``HETPS_FLOW_PACE``, docs/BALANCE.md
        §7.4). Slice lengths are in elements and the caps in bytes/s, so the predicted time
        is in seconds per byte of element; the element size cancels out of the rate. None
        when the scheme has no link model (average, elastic) or nothing crosses the network."""
        if net is None:
            return None
        try:
            t = float(iteration_time(net, counts, servers=self.servers, workers=self.workers))
        except ValueError as exc:
            log.warning("planner: no flow rates (%s)", exc)
            return None
        if not (np.isfinite(t) and t > 0):
            return None
        return [float(c) / t for c in counts]

    def plan(self) -> dict:
        """Compute the next plan from what is known now."""
        assert self.slices is not None and self.assignment is not None
        t0 = time.perf_counter()
        total = float(sum(s.length for s in self.slices))
        bw = self.link_matrix()
        net: Network | None = None
        try:
            if self.scheme == "elastic":
                if all(len(h) >= 2 for h in self.history):
                    shares = make_plan("elastic", total, history=self.history)
                else:  # not enough (size, time) points to fit yet
                    shares = np.full(self.S, total / self.S)
            elif self.scheme == "average":
                shares = np.full(self.S, total / self.S)
            else:
                net = self.node_network() or Network.from_matrix(bw)
                shares = make_plan(
                    self.scheme, total, network=net, servers=self.servers, workers=self.workers
                )
        except Exception as exc:  # noqa: BLE001 - a planning failure keeps the old plan
            log.warning("planner: %s failed (%s); keeping the previous plan", self.scheme, exc)
            shares = self.shares if self.shares is not None else np.full(self.S, total / self.S)
        shares = np.asarray(shares, dtype=float)
        new = assign(
            self.slices,
            shares,
            previous=list(self.assignment),
            probe_num=self.probe_num if self.scheme != "average" else 0,
        )
        if not np.array_equal(new, self.assignment) and self.scheme != "average":
            # Hysteresis: measurements are noisy (TCP's short-term unfairness alone spreads
            # link samples several-fold) and every change costs migrations and a barrier, so
            # a change must be predicted more than `margin` faster, in `patience` reports in
            # a row. (Adopting big predicted gains at once was tried: on the static 8-node
            # benchmark noise alone predicts such gains, and plans churned.)
            gain = self._gain(net, new)
            if gain is not None and self.margin > 0 and gain <= 1.0 + self.margin:
                self._streak = 0
            else:
                self._streak += 1
            if self._trust and self._streak:  # a fresh cycle of probes: no need to wait
                self._streak = self.patience
            if self._streak < self.patience:  # noise or a blip: not (yet)
                new = self.assignment
                self.kept += 1
            else:
                self._streak = 0
        else:
            self._streak = 0
        self._trust = False
        if not np.array_equal(new, self.assignment):
            self.epoch += 1
            self._settle = SURPRISE_SETTLE  # its first rounds carry the migration
            self._before = self.assignment  # (pipelined: the next spans may still be its)
        self.assignment = new
        self.shares = shares
        self.plan_seconds.append(time.perf_counter() - t0)
        del self.plan_seconds[:-1000]
        counts = np.bincount(new, weights=[s.length for s in self.slices], minlength=self.S)
        up, down = self.capacity()
        single = self._single()
        # the slowest pusher's pace through the model under this assignment (bytes/s; 0 when
        # the scheme has no link model: average, elastic); workers pace their pushes by it
        pace = 0.0
        if net is not None:
            try:
                pace = push_pace(net, counts, servers=self.servers, workers=self.workers)
            except ValueError as exc:
                log.warning("planner: no push pace (%s)", exc)
            pace = pace if np.isfinite(pace) and pace > 0 else 0.0
        return {
            "pace": pace,
            "flow_rates": self._flow_rates(net, counts),
            "epoch": self.epoch,
            "assign": [int(x) for x in new],
            "shares": [float(x) / total for x in counts],
            "link_matrix": [[float(x) if np.isfinite(x) else None for x in row] for row in bw],
            "node_rates": {
                "up": _listed(up),
                "down": _listed(down),
                # what the caps come from, for reports: single-flow probes and fresh spreads
                "probe_up": _listed(single[0]),
                "probe_down": _listed(single[1]),
                "spread_up": _listed(self.spread_up),
                "spread_down": _listed(self.spread_down),
                "busy_up": _listed(self.up),
                "busy_down": _listed(self.down),
                "last_probes": [
                    [i, j, r, n] for (i, j), (r, n) in sorted(self.last_probes.items())
                ],
            },
            "plan_s": self.plan_seconds[-1],
            "kept": self.kept,
            "surprise": self.last_surprise,
            "recalibrations": self.recalibrations,
        }


def spread_rate(flows: list[tuple], peer_caps: np.ndarray, peer_col: int) -> float:
    """A node's rate from one spread's flows ``(src, dst, t0, t1, bytes, late)`` (all of
    them sent, or all received, by that node; ``peer_col`` is the tuple index of the peer).

    The total bytes over the flows' common span is a lower bound, and reads ~10% low: TCP
    shares the node's link unevenly (the flow sent first takes its peer's whole cap, the
    others split the rest), so the flows end at different times and the last one runs
    alone at no more than its peer's cap, leaving the node's link part idle. So the reading
    is also taken up to the second-to-last end, ``t2``: the last flow delivered at most
    ``SPREAD_TAIL_MARGIN`` x its peer's estimated cap after ``t2``, so at least the rest of
    the bytes arrived by then. The larger of the two readings is kept. (Logged spreads of
    the 4-node test, node 0 at 57.4 Mbit/s of goodput: 51.3 -> 53.8, 47.9 -> 50.8,
    55.3 -> 58.1.)"""
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


def _listed(values: np.ndarray) -> list[float | None]:
    """A JSON-ready list: NaN (unknown) becomes None."""
    return [float(x) if np.isfinite(x) else None for x in values]


def _union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by ``intervals`` (overlaps counted once)."""
    total, end = 0.0, -float("inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total
