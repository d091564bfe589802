"""The load planner service: learns the link matrix from the nodes' measurements and decides, every
iteration, which server holds which slice (network-aware load distribution, docs/BALANCE.md).

Hosted by the scheduler (command ``balance_report``). Every worker reports at the start of an
iteration: the slice layout (key sizes, in init order), the link samples it collected
(forecast-then-probe timings of its pushes, measured by the servers, and of its pulls,
measured by itself) and, per server, bytes and seconds of the last iteration. When every
worker has reported the same round the planner computes the shares with the configured scheme
(:func:`hetps.balance.make_plan`), assigns slices (Algorithm 2, keeping slices in place where it
can), and answers every worker with the plan and its epoch.

The estimation of per-node caps lives in :mod:`hetps.balance.links`, change detection in
:mod:`hetps.balance.surprise`; this module parses reports, releases rounds and plans. The
role setup (:func:`hetps.roles.make_scheduler`) plugs it into the scheduler.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial

import numpy as np

from hetps.balance import EstimateTable, LoadModel, Network, assign, iteration_time, make_plan
from hetps.balance.estimate import link_matrix, used_links
from hetps.balance.hosts import HostMap, host_pushes, per_host_network, row_lookup, rows_of
from hetps.balance.links import CONTRADICT_FROM_ROUND, CONTRADICT_MIN_S, LinkEstimator
from hetps.balance.plans import fit_linear, plan_of
from hetps.balance.reports import RoundReports, host_ids, named, sample_array, spans, times_array
from hetps.balance.slicing import Slice, layout
from hetps.balance.surprise import SurpriseDetector
from hetps.balance.wire import pack_plan, reply_parts
from hetps.cluster import protocol as P
from hetps.cluster.ports import JobPort
from hetps.config import NodeConfig
from hetps.transport.codec import Message

log = logging.getLogger("hetps.planner")

REPORT = P.BALANCE_REPORT
#: samples one report may carry (the balance agent keeps at most 100,000 between reports)
MAX_REPORT_SAMPLES = 1 << 17
#: worker rank 0's answer carries the link matrix and the node rates (for reports and plots)
#: while the link model has at most this many rows (hosts and servers): an N x N matrix to one
#: worker every round is 8 MB at N=1,024; beyond, the answer is the plan alone (O(servers))
REPORT_MAX_NODES = 128
#: rounds whose reports wait for other workers at once: a synchronous job's workers are a
#: round or two apart (each waits for a round's plan one round later); more is a worker (or a
#: host's leader for it) sending rounds far ahead, each kept until every worker reports it
MAX_WAITING_ROUNDS = 16
#: a round of at least this many report messages (hosts' or workers') makes the scheduler's
#: loop gather the next round's (``gathers``: HETPS_GATHER_HOLD_MS); with fewer, holding
#: would save no wake-up worth its wait
GATHER_MIN_REPORTS = 16


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
    ) -> None:
        if colocate and num_workers != num_servers:
            raise ValueError("colocated servers need as many servers as workers")
        self.scheme, self.scheme_plan = scheme, plan_of(scheme)
        self.W, self.S = num_workers, num_servers
        # hosts: a worker's row is its host's (use_hosts); until known, each worker its own
        self.hosts = HostMap([-1] * num_workers)
        self._hosts_read = False
        self.colocate = colocate
        self.slice_elems = slice_elems
        self.probe_num = probe_num
        self.margin = margin  # hysteresis: a new assignment must be predicted this much faster
        self.patience = max(1, patience)  # reports in a row that must favour a change
        self.kept = 0  # plans computed but not adopted (not enough predicted gain)
        self._streak = 0  # consecutive reports whose new plan beat the margin
        self.n_nodes = num_workers if colocate else num_workers + num_servers
        self._alpha = alpha
        self._table: EstimateTable | None = None  # (made when first read: table)
        self.slices: list[Slice] | None = None
        self._layout: tuple[tuple[int, ...], list[Slice]] = ((), [])  # (sizes, their slices)
        self.assignment: np.ndarray | None = None
        self.shares: np.ndarray | None = None
        self.epoch = 0
        # a round's reports until every worker reported it (their data transfers: busy-time
        # rates), and its spread flows
        self.pending: dict[int, RoundReports] = {}
        # each worker's last round answered, and the last plan (a report sent again gets it)
        self._done: dict[int, int] = {}
        self._last = b""
        self._spread: dict[int, list[tuple[int, int, float, float, float, bool]]] = {}
        self._spread_done: set[int] = set()  # rounds whose reports say a spread was made
        # per-node caps from busy-time rates, capacity probes (a window of one permutation
        # cycle: each peer once) and spread probes
        cycle = num_servers - 1 if colocate else max(num_workers, num_servers)
        self.links = LinkEstimator(
            self.n_nodes, self.servers, self.workers, colocate, cycle, alpha=alpha
        )
        self.history: list[list[tuple[float, float]]] = [[] for _ in range(num_servers)]
        self.plan_seconds: list[float] = []
        # change detection (docs/BALANCE.md §7.3): per round, every worker's communication
        # span, judged against the plan's prediction
        self.detector = SurpriseDetector()
        self._before: np.ndarray | None = None  # the assignment before the last change
        self._released = 0  # rounds answered so far (reports, whatever HETPS_REPLAN_EVERY)
        self._round_msgs = 0  # report messages of the last round answered (gathers)
        self._calibration_rounds: set[int] = set()  # rounds whose reports bring a new cycle
        self._contradicted: set[int] = set()  # rounds with a probe far off its caps
        self.recalibrations = 0  # new probe cycles that came back
        self._trust = False  # the next plan rests on a fresh cycle: no patience (margin holds)
        self._used: np.ndarray | None = None  # used_links(), fixed for the job
        # the live, unfinished workers, and the sizes of the scheduler's node tables they were
        # read at (those only grow): rebuilt when a node registers, dies or finishes, not on
        # every report
        self._live: set[int] = set()
        self._live_at: tuple[int, int, int, int] | None = None
        self._live_rows: set[int] = set()  # (their rows of the link model)
        self._net_memo: list | None = None  # within a round's release: its caps, read once
        # worker rank -> its host pushes once for it (aggregation; its last report says)
        self.one_push: dict[int, bool] = {}
        self._rows()

    @classmethod
    def from_config(cls, cfg: NodeConfig) -> Planner:
        """The planner of the cluster ``cfg`` describes (``HETPS_BALANCE`` and its knobs)."""
        return cls(
            cfg.balance,
            cfg.num_worker,
            cfg.num_server,
            cfg.colocate,
            cfg.slice_elems,
            cfg.probe_num,
            margin=cfg.replan_margin,
        )

    @property
    def table(self) -> EstimateTable:
        """The per-link estimates (the link matrix of reports and plots), made when first read:
        N x N arrays (430 MB at 4,224 rows) that beyond REPORT_MAX_NODES rows only a plan
        before any node was measured reads."""
        if self._table is None:
            self._table = EstimateTable(self.n_nodes, alpha=self._alpha)
        return self._table

    # network node index of a ps-lite id
    def index(self, node_id: int) -> int:
        """Row/column of ``node_id`` in the link matrix (a worker's is its host's)."""
        rank = P.rank_of(node_id)
        if P.role_of(node_id) == "server" or self.colocate:
            return rank
        return self.S + int(self.hosts.host_of_rank[rank]) if 0 <= rank < self.W else -1

    def rows_of(self, ids: np.ndarray) -> np.ndarray:
        """:meth:`index` of an array of node ids (as floats); -1 for what names no node."""
        return rows_of(self._lookup, ids)

    def _rows(self) -> None:
        """The node id -> row table of :meth:`rows_of`."""
        ids = [P.server_id(r) for r in range(self.S)] + [P.worker_id(r) for r in range(self.W)]
        self._lookup = row_lookup(ids, [self.index(i) for i in ids])

    def use_hosts(self, groups: list[int]) -> None:
        """The workers' host groups (by rank; -1: a host of its own), before any report was
        read: a host's workers share one row of the link model (its link, measured from all
        of their transfers) and are planned as one (docs/BALANCE.md, "Hosts"). Without shared
        hosts, or with co-located servers, every worker stays a row of its own."""
        hosts = HostMap(groups)
        if not hosts.shared or self.colocate or len(groups) != self.W:
            return
        self.hosts = hosts
        self.n_nodes = self.S + hosts.n_hosts
        self._table = None
        cycle = max(hosts.n_hosts, self.S)
        self.links = LinkEstimator(
            self.n_nodes, self.servers, self.workers, False, cycle, alpha=self.links.node_alpha
        )
        self._used = None
        self._rows()

    def _ensure_hosts(self, sched: JobPort) -> None:
        """Read the workers' host groups once the node table is whole (:meth:`live_workers`)."""
        if not self._hosts_read:
            self.live_workers(sched)

    @property
    def servers(self) -> list[int]:
        """Matrix indices of the servers."""
        return list(range(self.S))

    @property
    def workers(self) -> list[int]:
        """Matrix indices of the workers (of their hosts: one row per host)."""
        if self.colocate:
            return list(range(self.W))
        return list(range(self.S, self.S + self.hosts.n_hosts))

    def node_network(self) -> Network | None:
        """The per-node caps measured so far, as the plan functions must see them: a host's
        caps shared by the pushes it makes (:func:`per_host_network`); None before any.
        Read once in a round's release (its prediction and its plan read the same caps)."""
        memo = self._net_memo
        if memo:
            return memo[0]
        net = self.links.node_network()
        if net is not None and self.hosts.shared:
            ids = np.fromiter(self._live, np.int64, len(self._live))
            live = P.rank_of(ids) if self._live_at else np.arange(self.W)
            pushes = host_pushes(self.hosts, self.one_push, live)
            net = per_host_network(net, self.servers, self.hosts, pushes)
        if memo is not None:
            memo.append(net)
        return net

    def take_round(self, rnd: int, reports: list[tuple[np.ndarray, bool]]) -> None:
        """Every report's samples of round ``rnd``, once every worker reported it, in one
        pass over them all (arrays, not a loop per sample): their nodes' rows (a worker's is
        its host's), then the few capacity probes and spread flows in report order, then the
        data transfers (:meth:`observe_round`). The reports' rows are read as one array of
        columns (one copy of them all, each column contiguous)."""
        if not reports:
            return self.observe_round([])
        lengths = [len(a) for a, _ in reports]
        cols = np.concatenate([a.T for a, _ in reports], axis=1)
        calibration = np.repeat([c for _, c in reports], lengths)
        src, dst = self.rows_of(cols[0]), self.rows_of(cols[1])
        nbytes, t0, t1, kind = cols[2], cols[3], cols[4], cols[5]
        with np.errstate(invalid="ignore"):
            ok = (src >= 0) & (dst >= 0) & (t1 > t0) & (nbytes > 0)
        for c in cols[2:]:  # (a column at a time: numpy's all(0) of rows is 6 times slower)
            ok &= np.isfinite(c)
        # (a worker and its co-located server, or a worker and its own host: no network)
        ok &= src != dst
        probe, spread = kind == 1, (kind == 2) | (kind == 3)
        for r in np.flatnonzero(ok & probe):
            i, j, rate = int(src[r]), int(dst[r]), float(nbytes[r] / (t1[r] - t0[r]))
            judged = (
                self._released + 1 >= CONTRADICT_FROM_ROUND
                and t1[r] - t0[r] >= CONTRADICT_MIN_S
                and not calibration[r]
                and not self.detector.settling  # not right after a migration or a cycle
            )
            if judged and self.links.contradicts(i, j, rate):
                self._contradicted.add(rnd)
            self.links.observe_probe(i, j, rate, rnd)
        at = np.flatnonzero(ok & spread)  # (the spread flows' rows, found once)
        flows = zip(*(c[at] for c in (src, dst, t0, t1, nbytes, kind)), strict=True)
        self._spread.setdefault(rnd, []).extend(
            (int(i), int(j), float(a), float(b), float(n), bool(k == 3))
            for i, j, a, b, n, k in flows
        )
        data = ok & ~probe & ~spread
        seq = np.repeat(np.arange(len(reports), dtype=np.int64), lengths)
        self.observe_round([seq, src, dst, t0, t1, nbytes], data)

    def observe_round(self, cols: list[np.ndarray], data: np.ndarray | None = None) -> None:
        """A whole round's data samples, once every worker reported it, as the columns
        (report, src, dst, t0, t1, bytes; nodes' rows as integers) of the rows ``data``
        selects (all without it): the link matrix (per report and link the median rate of
        its messages, blended in report order) and the per-node busy-time rates, in bulk."""
        if not cols or not len(cols[0]):
            self.links.observe_arrays(*(np.zeros(0, dtype=np.int64),) * 2, *(np.zeros(0),) * 3)
            return
        if data is not None and not data.all():  # (the rows' indices: one pass of the mask)
            rows = np.flatnonzero(data)
            cols = [c[rows] for c in cols]
        seq, i, j, t0, t1, nbytes = cols
        if not seq.size or self.n_nodes > REPORT_MAX_NODES:
            # the link matrix is for reports and plots, which get it up to REPORT_MAX_NODES
            # rows; plans read the per-node rates (a round's median per report and link is
            # most of a round's work at 4,096 workers)
            return self.links.observe_arrays(i, j, t0, t1, nbytes)
        self.table.observe_medians(seq, i, j, nbytes / (t1 - t0), t1)
        self.links.observe_arrays(i, j, t0, t1, nbytes)

    def used_links(self) -> np.ndarray:
        """Which ordered links carry traffic here (:func:`used_links`). Read-only."""
        if self._used is None:
            self._used = used_links(self.n_nodes, self.servers, self.workers)
        return self._used

    def link_matrix(self) -> np.ndarray:
        """Estimated bytes/s per link (:func:`link_matrix`: unused links 0, used links never
        measured the median of the measured ones)."""
        return link_matrix(self.table.matrix(), self.used_links())

    def plan_shares(self) -> dict | None:
        """The current plan: its epoch and each server's share of the elements (live
        metrics); None before the first layout."""
        assignment, slices = self.assignment, self.slices
        if assignment is None or not slices:
            return None
        lengths = [s.length for s in slices]
        total = float(sum(lengths)) or 1.0
        shares = [0.0] * self.S
        for server, length in zip(assignment, lengths, strict=False):
            if 0 <= int(server) < self.S:
                shares[int(server)] += length / total
        return {"epoch": self.epoch, "shares": shares}

    def handle(self, sched: JobPort, msg: Message) -> None:
        """One worker's report; answer everyone once every worker reported the round."""
        release = self.take(sched, msg)
        if release is not None:
            release()

    def take(self, sched: JobPort, msg: Message) -> Callable[[], None] | None:
        """A report's checks, and its samples kept for the round's release (what
        :meth:`handle` does before it), a few microseconds: the scheduler runs it on its loop
        while its services' thread is idle. Returns the release, to run on that thread, once
        a round has every live worker's report; None before (or when the report was
        answered with an error)."""
        b = msg.typed  # a BalanceReport: every field's type checked by the dispatch
        rnd = b.round
        self._ensure_hosts(sched)
        sizes = b.sizes
        if sizes is not None:  # the layout, first time or grown by later inits
            if tuple(sizes) != self._layout[0]:  # (every worker's first report brings it)
                self._layout = (tuple(sizes), layout(sizes, self.slice_elems))
            slices = self._layout[1]
            where = b.assign
            if where is None or len(where) != len(slices):
                sched.reply(msg, {"error": "balance report: 'assign' must give a server per slice"})
                return
            if self.slices is None or len(slices) != len(self.slices):
                self.slices = slices
                self.assignment = np.array(where, dtype=np.int64)
        if self.slices is None:
            sched.reply(msg, {"error": "the first balance report must carry the key sizes"})
            return
        if b.calibration and rnd not in self._calibration_rounds:
            # the first report of a round that re-probed a whole cycle: its readings (this
            # report's and the other workers') replace everything older
            self._calibration_rounds.add(rnd)
            self.forget_readings()
        # the report's arrays are kept as they came and read once the round is complete, all
        # reports together (take_round): per report no more than these checks
        most = MAX_REPORT_SAMPLES * len(b.host or [0])  # (a host's: its workers' together)
        samples = sample_array(msg.arrays, b.samples, most)
        times = times_array(msg.arrays, b.server_times, most)
        # a host's leader reports for its host's workers, in bulk: the ids it stands for
        ids = host_ids(sched.nodes, msg.sender, b.host, b.host_rows, msg.arrays)
        why = next((x for x in (samples, times, ids) if isinstance(x, str)), None)
        if why is not None:
            sched.reply(msg, {"error": why})
            return
        self.one_push.update(dict.fromkeys(map(P.rank_of, ids), b.one_push))  # (its host's)
        if all(self._done.get(i, 0) >= rnd for i in ids):  # sent again: its leader died
            sched.reply(msg, *reply_parts(self._last))
            return
        if rnd not in self.pending and len(self.pending) >= MAX_WAITING_ROUNDS:
            why = f"balance report of round {rnd}: {len(self.pending)} rounds already wait for "
            sched.reply(msg, {"error": why + "other workers' reports (a worker runs far ahead)"})
            return
        reads = self.pending.get(rnd) or self.pending.setdefault(rnd, RoundReports())
        span = (times, b.host_rows if b.host else None)
        added = reads.take(msg, ids, b.host is None, (samples, bool(b.calibration)), span)
        if added is not None and self.scheme_plan.needs == "history":  # (a line per server)
            for s, nbytes_s, secs_s in times[named(times, self.S)].tolist():
                (kept := self.history[int(s)]).append((nbytes_s, secs_s))
                added.append((kept, kept[-1]))
                del kept[:-20]
        done = b.spread_done  # (way, rank) or None
        if done is not None:
            self._spread_done.add(rnd)
            way, rank = done
            ends = self.workers if way == "out" else self.servers if way == "in" else []
            if way == "out" and 0 <= rank < self.W:  # (a worker rank: its host's row)
                rank = int(self.hosts.host_of_rank[rank])
            if 0 <= rank < len(ends):
                self.links.spread_turn(way, ends[rank])
        return partial(self.release, sched) if self.ripe(sched) else None

    def gathers(self) -> bool:
        """Whether a round's reports come in numbers (the last round answered had at least
        :data:`GATHER_MIN_REPORTS` report messages): the scheduler's loop then reads those
        that come close together in one turn (``Scheduler.register(gathers=)``)."""
        return self._round_msgs >= GATHER_MIN_REPORTS

    def ripe(self, sched: JobPort) -> bool:
        """Whether a waiting round has every live, unfinished worker's report (a set's size
        compared first: until a round's last report, no walk)."""
        live = self.live_workers(sched)
        return any(reads.rows.keys() >= live for reads in self.pending.values())

    def live_workers(self, sched: JobPort) -> set[int]:
        """The scheduler's live, unfinished workers. Its node table and finished nodes only
        ever grow; dead nodes grow too, but for one taken back (a let-go worker registered
        again), which counts in ``rejoined``: those sizes say when the set must be read
        again (a taken-back worker and another let go leave ``dead`` as long as it was)."""
        at = (
            len(sched.nodes),
            len(sched.dead),
            len(sched.finished),
            sum(sched.rejoined.values()),
        )
        if at != self._live_at:
            workers = [(nid, n) for nid, n in sched.nodes.items() if n.role == "worker"]
            self._live = {
                nid for nid, _ in workers if nid not in sched.dead and nid not in sched.finished
            }
            self._live_at = at
            if not self._hosts_read and len(workers) == self.W:  # (the same walk)
                self._hosts_read = True
                groups = {P.rank_of(nid): getattr(n, "group", -1) for nid, n in workers}
                self.use_hosts([groups.get(r, -1) for r in range(self.W)])
            self._live_rows = set(self.rows_of(np.fromiter(self._live, float)).tolist())
        return self._live

    def release(self, sched: JobPort) -> None:
        """Answer every round that every live, unfinished worker has reported (also called
        when a worker finishes, so the others never wait for it)."""
        self._net_memo = None
        live = self.live_workers(sched)
        for rnd in sorted(self.pending):
            reads = self.pending[rnd]
            if not reads.rows.keys() >= live:  # (in C: a set's walk)
                continue
            del self.pending[rnd]
            self.take_round(rnd, reads.samples)
            done = rnd in self._spread_done
            self.links.observe_spread(self._spread.pop(rnd, []), done=done)
            for old in [r for r in self._spread if r < rnd]:  # (older rounds)
                del self._spread[old]
            for older in [self.pending[r] for r in self.pending if r < rnd]:
                del older.samples[:], older.spans[:]
            self._released += 1
            self._round_msgs = len(reads.msgs)
            self._net_memo = []  # (the caps are the round's from here: node_network)
            contradicted = rnd in self._contradicted
            worked = spans(reads.spans, self.S)
            recal = self.surprised(rnd, worked, contradicted=contradicted)
            self._contradicted = {r for r in self._contradicted if r > rnd}
            self._calibration_rounds = {r for r in self._calibration_rounds if r >= rnd}
            self._spread_done = {r for r in self._spread_done if r > rnd}
            if not self.slices:
                # every worker gets the error (``rebalance`` raises it) rather than a timeout
                answer = {
                    "error": "rebalance() before any kv.init(): there is nothing to place "
                    "yet; initialise the keys first"
                }
                for m in reads.msgs.values():
                    sched.reply(m, answer)
                continue
            answer = self.plan()
            spread = self.spread_targets(live=self._live_rows)
            if recal:
                answer = {**answer, "recalibrate": True}
            elif spread is not None:
                answer = {**answer, "spread": spread}
            # the same plan for every worker, encoded once; rank 0 also gets what reports
            # and plots read (the link matrix, the node rates): hetps.balance.wire
            packed = self._last = pack_plan(answer)
            self._done.update(dict.fromkeys(reads.rows, rnd))
            for m in reads.msgs.values():  # (each message once: a host's, a worker's own)
                rank0 = P.worker_id(0) in (m.typed.host or [m.sender])
                if rank0 and self.n_nodes <= REPORT_MAX_NODES:
                    extras = self.report_fields()
                    body, arrays = reply_parts(packed, extras, extras.pop("link_matrix"))
                else:
                    body, arrays = reply_parts(packed)
                sched.reply(m, body, arrays)
        self._net_memo = None

    def forget_readings(self) -> None:
        """Drop the probe and spread readings: a new cycle of probes is arriving because the
        network changed. The busy-time rates stay (some caps show only in data, e.g. a
        server's sending without co-location), but those measured in the next round are
        replaced instead of blended. The link matrix (reports only) stays. Counts one
        re-calibration (``recalibrations``: cycles that came back, not requests)."""
        self.links.forget_probes()
        self.detector.cycle_arrived()
        self._trust = True
        self.recalibrations += 1

    def surprised(self, rnd: int, spans: list[float], contradicted: bool = False) -> bool:
        """Whether the network seems to have changed under the plan, so that every worker
        should probe a whole cycle anew (:meth:`SurpriseDetector.judge`). Only the probing
        schemes are judged."""
        if self.scheme_plan.needs != "network" or self.slices is None:
            return False

        def predicted(assignment: np.ndarray | None):
            def fn() -> float | None:
                net = self.node_network()
                if net is None or assignment is None:
                    return None
                try:
                    return self._predict(net, assignment)
                except Exception:  # noqa: BLE001 - no prediction, no judgement
                    return None

            return fn

        return self.detector.judge(
            rnd, spans, contradicted, predicted(self.assignment), predicted(self._before)
        )

    def spread_targets(self, live: set[int] | None = None) -> list | None:
        """The next spread probe (:meth:`LinkEstimator.spread_targets`); None when the
        scheme does not probe. With hosts, a host's turn is its lowest-ranked worker's."""
        if self.scheme_plan.needs != "network":
            return None
        spread = self.links.spread_targets(live)
        if spread is None or not self.hosts.shared:
            return spread
        way, rank, peers = spread
        first = self.hosts.first_rank
        if way == "out":
            return [way, int(first[rank]), peers]
        return [way, rank, sorted(int(first[h]) for h in peers)]

    def _predict(self, net: Network | None, assignment: np.ndarray) -> float | None:
        """Predicted communication time of ``assignment`` on what is known now (the link
        model, or the fitted per-server lines for a plan of history)."""
        assert self.slices is not None
        lengths = np.array([s.length for s in self.slices], dtype=float)
        counts = np.bincount(np.asarray(assignment), weights=lengths, minlength=self.S)
        if net is not None:
            return float(iteration_time(net, counts, servers=self.servers, workers=self.workers))
        if self.scheme_plan.needs == "history":
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
            if net is not None:  # one load model for both (what _predict builds each time)
                assert self.slices is not None
                lengths = np.array([s.length for s in self.slices], dtype=float)
                old, cand = (
                    np.bincount(np.asarray(a), weights=lengths, minlength=self.S)
                    for a in (self.assignment, new)
                )
                total = float(old.sum())
                model = LoadModel.build(net, total, servers=self.servers, workers=self.workers)
                t_old, t_new = (model.time(x / total) if total > 0 else 0.0 for x in (old, cand))
            else:
                t_old = self._predict(net, self.assignment)
                t_new = self._predict(net, new)
        except Exception:  # noqa: BLE001 - a failed prediction adopts the new plan
            return None
        if t_old is None or t_new is None or not (np.isfinite(t_old) and np.isfinite(t_new)):
            return None
        return t_old / t_new if t_new > 0 else None

    def plan(self) -> dict:
        """Compute the next plan from what is known now."""
        assert self.slices is not None and self.assignment is not None
        t0 = time.perf_counter()
        total = float(sum(s.length for s in self.slices))
        net: Network | None = None
        needs, fixed = self.scheme_plan.needs, self.scheme_plan.needs == "nothing"
        try:
            if needs == "history" and all(len(h) >= 2 for h in self.history):
                shares = make_plan(self.scheme, total, history=self.history)
            elif needs != "network":  # equal: a fixed plan, or too few (size, time) points yet
                shares = np.full(self.S, total / self.S)
            else:
                # per-node caps only (never per-link: the model stays separable, so optimal
                # is a closed form and aware the incremental loop, never the LP; §2.4)
                net = self.node_network() or Network.from_matrix(self.link_matrix())
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
            probe_num=self.probe_num if not fixed else 0,
        )
        if not np.array_equal(new, self.assignment) and not fixed:
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
            self.detector.plan_changed()  # its first rounds carry the migration
            self._before = self.assignment  # (pipelined: the next spans may still be its)
        self.assignment = new
        self.shares = shares
        self.plan_seconds.append(time.perf_counter() - t0)
        del self.plan_seconds[:-1000]
        counts = np.bincount(new, weights=[s.length for s in self.slices], minlength=self.S)
        return {
            "epoch": self.epoch,
            "assign": [int(x) for x in new],
            "shares": [float(x) / total for x in counts],
            "plan_s": self.plan_seconds[-1],
            "kept": self.kept,
            "surprise": self.detector.last_surprise,
            "recalibrations": self.recalibrations,
        }

    def report_fields(self) -> dict:
        """What reports and plots read, beside the plan (worker rank 0's answer only):
        ``link_matrix`` (estimated bytes/s per link, an N x N array, ``inf`` on the diagonal)
        and ``node_rates`` (the per-node caps and where they come from)."""
        return {"link_matrix": self.link_matrix(), "node_rates": self.links.node_rates()}
