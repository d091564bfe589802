"""The worker's side of network-aware load distribution: measure, report, adopt plans.

A :class:`BalanceAgent` rides on a worker's store (:class:`hetps.kvstore.client.DistKVStore`)
when ``HETPS_BALANCE`` is on. It

- times the store's data messages (:meth:`BalanceAgent.watch`): a tiny forecast goes first,
  the receiver times the gap to the data; pushes are timed by the servers, pull replies here;
- keeps each server's span of the round (first request to last answer);
- at every ``kv.rebalance()`` reports the samples to the planner
  (:mod:`hetps.balance.service`), adopts its answer and migrates the slices that move (values
  and optimizer state);
- sends capacity probes: a whole permutation cycle before the first init, one per probing
  round, spread probes when the planner asks, a whole cycle anew when it sees a change.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import replace
from typing import Any, Protocol

import numpy as np

from hetps import optim
from hetps.balance.plans import plan_of
from hetps.balance.reports import times_shrink
from hetps.balance.wire import unpack_plan
from hetps.cluster import bodies, commands
from hetps.cluster import protocol as P
from hetps.cluster.errors import ClusterError
from hetps.cluster.node import Node
from hetps.cluster.requests import Future, wait_all
from hetps.config import NodeConfig
from hetps.transport.codec import Message

log = logging.getLogger("hetps.worker")

MEASURE_MIN_BYTES = 64 * 1024  # smallest message whose transfer time is used as a link sample
SPAN_MIN_BYTES = 1024  # smallest push or pull that counts in its server's span of a round
MAX_SAMPLES = 100_000  # link samples kept between two reports (about 15 MB)
SPREAD_WAIT_S = 30.0  # longest a spread probe may hold the other workers at their barrier


class Watch:
    """What the agent does around one request: before it is sent, and when it is answered."""

    __slots__ = ("agent", "msg", "server_rank", "peer", "measure", "noted")

    def __init__(
        self,
        agent: BalanceAgent,
        msg: Message,
        server_rank: int,
        peer: int,
        measure: bool,
        noted: bool,
    ) -> None:
        self.agent, self.msg, self.server_rank, self.peer = agent, msg, server_rank, peer
        self.measure, self.noted = measure, noted

    def before_send(self, req: int) -> None:
        """Stamp the request (``req`` is its id) and send its forecast."""
        agent, msg = self.agent, self.msg
        if self.noted:
            nbytes = sum(getattr(a, "nbytes", 0) for a in msg.arrays)
            agent.note(self.server_rank, nbytes, time.time(), first=True)
        if self.measure:
            msg.body = {**msg.body, "tag": req}  # (a new body: the one made is never changed)
            if msg.cmd != P.PULL:
                agent.node.send(self.peer, Message(P.FORECAST, body={"tag": req}))
                msg.timed = True

    def on_reply(self, reply: Message) -> None:
        """Record the samples the answer carries (in the receive thread)."""
        agent, msg, peer = self.agent, self.msg, self.peer
        now = time.time()
        if self.measure:
            meas = bodies.answer(reply).meas
            if meas is not None:  # our push, timed by the server
                # 1: a capacity probe, alone on its link; 2: one flow of a spread probe,
                # 3: the same, its forecast stamped late (its receive thread was busy)
                kind = 0
                if msg.cmd == P.PROBE and commands.decode(msg) is None:  # (answered: typed)
                    kind = 1 if not msg.typed.spread else 3 if meas[3:] == [1.0] else 2
                agent.samples.append([agent.node.id, peer, meas[2], meas[0], meas[1], kind])
            t0 = agent.forecasts.pop((peer, reply.req), None)
            if t0 is not None and reply.mark is not None:  # (from its bulk channel's mark to
                t0, now = reply.mark[0], reply.mark[2]  # when it was whole)
            if t0 is not None and reply.arrays:  # its reply, timed here
                agent.samples.append([peer, agent.node.id, float(reply.nbytes), t0, now, 0])
        if self.noted:
            agent.note(self.server_rank, reply.nbytes, now, first=False)


class Layout(Protocol):
    """A key's layout as the agent reads and moves it (a ``kvstore.keys.KeyMeta``)."""

    size: int
    shape: tuple[int, ...]
    dtype: np.dtype
    rounds: int
    parts: list  # its slices (``kvstore.placement.Part``): the agent re-places them


class StoreLink(Protocol):
    """What the agent uses of its store (a :class:`hetps.kvstore.client.DistKVStore`)."""

    cfg: NodeConfig
    node: Node
    meta: dict[Hashable, Layout]  # each key's parts and where they are
    order: list[Hashable]
    num_servers: int
    timeout: float

    #: its rank, and the job's workers
    @property
    def rank(self) -> int: ...
    @property
    def num_workers(self) -> int: ...

    #: queue a request for a server (:meth:`DistKVStore.request`)
    request: Callable[..., Future]

    #: the node id of a server by rank
    def server_id(self, server_rank: int) -> int: ...
    #: wait for every request in flight
    def wait_outstanding(self) -> None: ...


class BalanceAgent:
    """A worker's balance agent, bound to its store ``kv``."""

    def __init__(self, kv: StoreLink) -> None:
        self.kv = kv
        self.node = kv.node
        self.cfg = kv.cfg
        self.forecasts: dict[tuple[int, int], float] = {}  # (peer, tag) -> arrival time
        # bounded: a script that never calls rebalance() keeps the newest MAX_SAMPLES only
        self.samples: deque[list[float]] = deque(maxlen=MAX_SAMPLES)
        self._stats: dict[int, list[float]] = {}  # server rank -> [bytes, t_first, t_last]
        self._stats_lock = threading.Lock()
        self._round = 0
        self._reported_keys = 0
        self.plan: dict | None = None
        self._pending_plan: Any = None  # the answer to the last report (pipelined)
        self._probes_sent = 0
        self._calibrated = False  # the first init probed a whole permutation cycle
        self._spread_made: list | None = None  # the spread this worker took part in
        self._recalibrated = False  # probed a whole cycle on the planner's word (a surprise)
        self._recal_due = False  # a superseded answer asked for a new cycle
        self._probed_at = -1  # the last round that sent a capacity probe

    @property
    def rank(self) -> int:
        return self.kv.rank

    @property
    def num_workers(self) -> int:
        return self.kv.num_workers

    @property
    def num_servers(self) -> int:
        return self.kv.num_servers

    @property
    def timeout(self) -> float:
        return self.kv.timeout

    # -- hooks the store calls ------------------------------------------------------------
    def watch(self, msg: Message, server_rank: int, peer: int) -> Watch | None:
        """How to time ``msg`` to server ``server_rank`` (node ``peer``), or None.

        Only messages big enough to take measurable time on the wire are timed: for small
        ones the forecast and the data arrive together and the "rate" is dispatch noise.
        Every push and pull of data (not probes) counts in its server's round span, timed or
        not: the planner compares each round's span with its plan's prediction; elastic fits
        it. Not a message of a few bytes: it says nothing of a server's load, and a control
        value sent before the forward pass (hetps train's stop flag, when it does not ride
        with the gradients) would stretch its server's span over the compute."""
        if msg.cmd == P.PULL:  # (its body as a Pull, not kept: its tag is added when sent)
            pull = bodies.decode(P.PULL, msg.body, bodies.Pull)
            size = pull.count * np.dtype(pull.dtype or "float32").itemsize
        else:
            size = sum(getattr(a, "nbytes", 0) for a in msg.arrays)
        measure = msg.cmd in (P.PUSH, P.PULL, P.PROBE) and (
            msg.cmd == P.PROBE or size >= MEASURE_MIN_BYTES
        )
        noted = msg.cmd in (P.PUSH, P.PULL) and size >= SPAN_MIN_BYTES
        if not (measure or noted):
            return None
        return Watch(self, msg, server_rank, peer, measure, noted)

    def on_forecast(self, msg: Message) -> None:
        """A server announced the reply it is about to send (receive thread)."""
        self.forecasts[(msg.sender, msg.typed.tag)] = time.time()  # (a Forecast: an int)

    def before_init(self) -> None:
        """Called by ``kv.init``: the first init probes a whole cycle first."""
        if not self._calibrated and self._probes_used():
            self._calibrate()

    def note(self, server_rank: int, nbytes: int, t: float, first: bool) -> None:
        """Count ``nbytes`` to or from server ``server_rank`` at time ``t`` in its span."""
        with self._stats_lock:
            st = self._stats.setdefault(server_rank, [0.0, t, t])
            st[0] += nbytes
            if first:
                st[1] = min(st[1], t)
            st[2] = max(st[2], t)

    # -- rebalancing ---------------------------------------------------------------------
    def rebalance(self) -> dict | None:
        """Call at an iteration boundary (every worker, the same iterations). Reports this
        worker's link measurements to the scheduler and switches to the plan it decided; a
        slice that moves takes its value and optimizer state along. Returns the plan (epoch,
        shares per server; on rank 0 also the link matrix and node rates) or None when
        balancing is off.

        Reports are pipelined: the plan applied now was decided from the previous report, and
        this call's report is answered while the iteration runs. Every worker applies the same
        answer at the same call, and waiting for it does not wait for the slowest worker to
        reach this boundary (it reported one iteration ago). Only the first report is waited
        for at once, because the layout needs a plan before any push. In probing rounds (every
        ``1/HETPS_PROBE_PROB``-th, and the first two) the worker waits for this report's
        answer, which comes once every worker finished its previous round, applies it, then
        sends its capacity probe and waits for it: the links are quiet and the probe leaves
        before this worker's next pushes. The first ``init`` has already probed a whole
        permutation cycle (``_calibrate``), so the first report carries a reading of every
        link and the first plan rests on them. The samples go out with the next report."""
        self.kv.wait_outstanding()
        self._round += 1
        if (self._round - 1) % self.cfg.replan_every:
            return self.plan
        probing = self._probe_round()
        with self._stats_lock:
            # per server: rank, bytes, seconds of the last round (one array: read in bulk)
            times = np.array(
                [[s, v[0], max(0.0, v[2] - v[1])] for s, v in self._stats.items()],
                dtype=np.float64,
            ).reshape(-1, 3)
            self._stats = {}
        old, self.samples = self.samples, deque(maxlen=MAX_SAMPLES)
        samples = list(old)
        if len(samples) == MAX_SAMPLES:
            log.warning(
                "balance: %d link samples since the last report, the oldest dropped; call "
                "kv.rebalance() once per round so the planner gets them all",
                MAX_SAMPLES,
            )
        # the samples as one float64 array (src, dst, bytes, t0, t1, kind): the planner reads
        # every report's in bulk
        table = np.array(samples, dtype=np.float64).reshape(-1, 6)
        body = {"round": self._round}
        agg = getattr(self.kv, "hostagg", None)  # (the planner's pushes of this host)
        if agg is not None and agg.size - len(agg.dead) > 1:  # (one left: it pushes its own)
            body["one_push"] = True
        if self._spread_made:  # a turn of the planner's spread rotation, even if all failed
            body["spread_done"], self._spread_made = self._spread_made[:2], None
        fresh, self._recalibrated = self._recalibrated, False
        if fresh:  # these samples hold a whole new cycle: the planner starts its windows anew
            body["calibration"] = True
        if self.plan is None or self._reported_keys != len(self.kv.order):
            # the layout (first report, or keys initialised since): sizes and where slices are
            body["sizes"] = [self.kv.meta[k].size for k in self.kv.order]
            body["assign"] = self._current_assignment()
            self._reported_keys = len(self.kv.order)
        msg = Message(P.BALANCE_REPORT, body=body, arrays=[table, times])
        lead = getattr(self.node, "hostlead", None)  # the host's one report (cluster/hostlead.py)
        if lead is not None:
            lead.shrink_times = times_shrink(self.node.cfg.balance, self.node.cfg.num_server)
            fut = lead.report(self._round, msg)
        else:
            fut = self.node.request(1, msg, what="balance report")
        # this report carries a new cycle's readings, or the last probing round's probe
        news = fresh or self._probed_at == self._round - self.cfg.replan_every
        if self.plan is None or "sizes" in body or probing or news:
            # the layout needs a plan at once; a probing round waits for this report's answer,
            # which comes when every worker has finished its previous round, so that the
            # probe has its links to itself (not the tail of another worker's pulls); the
            # plan made from a new cycle, or the answer to a probe that says the network
            # changed (docs/BALANCE.md §7.3), is wanted now, not a round later
            skipped, self._pending_plan = self._pending_plan, None
            answer = fut
            if skipped is not None:
                # the last report's answer is superseded by this one, but a re-calibration
                # it asked for still stands (it is here by now: the planner answers in order)
                recal = unpack_plan(skipped.wait(self.timeout)).get("recalibrate") is True
                self._recal_due = self._recal_due or recal
        else:
            answer = self._pending_plan
            self._pending_plan = fut
        if answer is None:  # the second report: nothing decided since the first one
            return self.plan
        got = unpack_plan(answer.wait(self.timeout))  # the plan (rank 0: with the link matrix)
        before = self._current_assignment()
        adopted = self._adopt(got)
        moved = self._current_assignment() != before
        recalibrate, self._recal_due = self._recal_due or got.get("recalibrate"), False
        if recalibrate and self._probes_used():
            # the planner saw a round far slower than its plan predicted, or a probe far off
            # its link's caps: the network changed under it (docs/BALANCE.md §7.3). Every
            # worker got this answer at the same call: probe a whole cycle
            # (between barriers, so every probe has its links to itself) instead of this
            # round's one probe; the planner drops its older readings when these arrive
            self._probe_cycle()
            self._recalibrated = True
        elif probing:  # after any migration; the samples go out with the next report
            if self._round > 1:
                # (not in round 1: the first init probed a whole cycle, whose readings are
                # fresh, and a probe now would ride connections rank 0's init has widened)
                self._probe()
                self._probed_at = self._round
            spread = got.get("spread")
            # A spread's flows share one node's link, and TCP already splits it unevenly
            # (planner.spread_rate); no flow should start with a wider window than the
            # others. Not in round 1: rank 0's connections still have the wide windows of
            # its init. Not in a round that moved slices: connections that carried moved
            # slices start wider than the rest. (The planner asks again next time.)
            if isinstance(spread, list) and len(spread) == 3 and self._round >= 2 and not moved:
                # every worker got the same answer: all take part in both barriers, so the
                # spread has the links to itself (no permutation probe still running before
                # it, no worker's next pushes during it)
                self.node.barrier("worker", self.timeout)
                try:
                    self._spread_probe(*spread)
                finally:
                    self._spread_made = list(spread)
                    self.node.barrier("worker", self.timeout)
        return adopted

    def _adopt(self, plan: dict) -> dict | None:
        """Switch to the assignment of the planner's answer ``plan`` (migrating slices)."""
        if "error" in plan:
            raise RuntimeError(f"load planner: {plan['error']}")
        new = plan["assign"]
        old = self._current_assignment()
        if len(new) != len(old):  # decided before keys were added: the next answer will fit
            return self.plan
        if new != old:
            # the workers that move slices: every worker, or under HETPS_ELASTIC the live
            # ones as the scheduler listed them at a barrier (the same list on every worker)
            elastic = bool(getattr(self.node, "elastic", 0))
            movers = self._movers(self.node.barrier("worker", self.timeout) if elastic else None)
            drops = self._migrate(old, new, movers)
            # every worker's moves have landed, and every worker has finished its previous
            # round's requests (rebalance() began with wait_outstanding()): only now may the
            # old copies go, and only now may anyone push by the new plan
            live = self._movers(self.node.barrier("worker", self.timeout))
            while any(r not in live for r in movers):
                # a mover died before it was done (HETPS_ELASTIC): nothing it moved was
                # dropped yet, so the others move its share again, and wait for each other
                gone = [r for r in movers if r not in live]
                log.warning(
                    "balance: worker(s) %s died moving slices; %d of theirs move again here",
                    gone,
                    sum(len(w) for _, w in self._migrate(old, new, live, redo=(movers, gone))),
                )
                movers, live = live, self._movers(self.node.barrier("worker", self.timeout))
            if elastic:  # every worker drops every moved slice: a worker may die meanwhile
                drops = self._drops(old, new)
            wait_all(
                [
                    self.kv.request(None, 0, s_old, Message(P.DROP, body={"slices": want}))
                    for s_old, want in drops
                ],
                self.timeout,
                "slice migration (drop)",
            )
            i = 0
            for k in self.kv.order:
                meta = self.kv.meta[k]
                meta.parts = [replace(p, server=new[i + j]) for j, p in enumerate(meta.parts)]
                i += len(meta.parts)
        self.plan = plan
        return plan

    def _slices(self) -> list[tuple[Any, int, int, int]]:
        """(key, slice index, start, stop) in layout order."""
        out = []
        for k in self.kv.order:
            for p in self.kv.meta[k].parts:
                out.append((k, p.index, p.start, p.stop))
        return out

    def _current_assignment(self) -> list[int]:
        return [p.server for k in self.kv.order for p in self.kv.meta[k].parts]

    def _movers(self, members: list[int] | None) -> list[int]:
        """The ranks of the workers that move slices: those of a barrier's ``members`` (node
        ids, HETPS_ELASTIC), else every worker."""
        if members is None:
            return list(range(self.num_workers))
        ranks = {n.id: n.rank for n in self.node.workers()}
        return sorted(ranks[i] for i in members if i in ranks)

    def _mover(self, idx: int, s_new: int, movers: list[int]) -> int:
        """The worker rank that moves slice ``idx`` to server ``s_new``: with co-located
        servers the worker beside the new server (one network hop, the init is local), if it
        moves slices; otherwise the slices are dealt round-robin over ``movers``."""
        if self.cfg.colocate and s_new < self.num_workers and s_new in movers:
            return s_new
        return movers[idx % len(movers)]

    def _migrate(
        self,
        old: list[int],
        new: list[int],
        movers: list[int],
        redo: tuple[list[int], list[int]] | None = None,
    ) -> list[tuple[int, list]]:
        """Move re-assigned slices (value and optimizer state) from their old servers to their
        new ones. Every worker in ``movers`` runs this with the same plan and moves its own
        share of the slices (:meth:`_mover`). ``redo`` = (the earlier movers, those of them
        that died): only the dead ones' share, dealt over ``movers`` now. All of a worker's
        requests are in flight at once: pulls and state reads, then inits and state writes.
        Returns the drops (old server, slices) to send once every worker is done (after a
        barrier)."""
        moves: dict[tuple[int, int], list[tuple[Any, int, int, int]]] = {}
        for idx, ((k, j, a, b), s_old, s_new) in enumerate(
            zip(self._slices(), old, new, strict=True)
        ):
            if self._serving(s_old) == self._serving(s_new):
                # (one server already serves both: a dead one's keys went to the other)
                continue
            if redo is not None and self._mover(idx, s_new, redo[0]) not in redo[1]:
                continue  # (moved by a worker that lived through it)
            if self._mover(idx, s_new, movers) == self.rank:
                moves.setdefault((s_old, s_new), []).append((k, j, a, b))
        if not moves:
            return []

        def body(k: Any, j: int, a: int, b: int) -> dict:
            meta = self.kv.meta[k]
            return bodies.chunk(k, j, 0, b - a, meta.shape, meta.dtype.name)

        # 1. read every moved value and state, all requests in flight together
        reads = []
        for (s_old, s_new), items in moves.items():
            want = [[k, j] for k, j, _, _ in items]
            states = self.kv.request(None, 0, s_old, Message(P.GET_STATES, body={"slices": want}))
            pulls = [
                self.kv.request(k, 0, s_old, Message(P.PULL, body=body(k, j, a, b)))
                for k, j, a, b in items
            ]
            reads.append((s_old, s_new, items, want, states, pulls))
        wait_all([f for r in reads for f in [r[4], *r[5]]], self.timeout, "slice migration (read)")
        # 2. write them on the new servers
        writes = []
        for _s_old, s_new, items, _want, states, pulls in reads:
            for (k, j, a, b), fut in zip(items, pulls, strict=True):
                data = np.array(fut.wait(self.timeout).arrays[0], copy=True)
                # the slice's rounds so far go with it (with HETPS_REPLICAS pushes name theirs)
                meta = self.kv.meta[k]
                init = bodies.chunk(
                    k, j, 0, b - a, meta.shape, meta.dtype.name, size=b - a, round=meta.rounds
                )
                writes.append(
                    self.kv.request(k, 0, s_new, Message(P.INIT, body=init, arrays=[data]))
                )
            blob = states.wait(self.timeout).arrays[0]
            if optim.load_states(blob.tobytes()):
                # ("move": with HETPS_REPLICAS the new server's replicas get the states too)
                msg = Message(P.SET_STATES, body={"move": True}, arrays=[np.array(blob)])
                writes.append(self.kv.request(None, 0, s_new, msg))
        wait_all(writes, self.timeout, "slice migration (write)")
        # 3. the caller drops them where they were, after a barrier
        return [
            (s_old, [[k, j, self.kv.server_id(s_new)] for k, j, _, _ in items])
            for s_old, s_new, items, _want, _states, _pulls in reads
        ]

    def _drops(self, old: list[int], new: list[int]) -> list[tuple[int, list]]:
        """Every moved slice, by the server it moved from: (old server, [[key, part, new
        server's node id], ...])."""
        out: dict[int, list] = {}
        for (k, j, _, _), s_old, s_new in zip(self._slices(), old, new, strict=True):
            if self._serving(s_old) != self._serving(s_new):
                out.setdefault(s_old, []).append([k, j, self.kv.server_id(s_new)])
        return list(out.items())

    def _serving(self, server_rank: int) -> int:
        """The node that serves what the plan gives server ``server_rank``: the server
        itself, or the one that took its keys over when it died (HETPS_REPLICAS)."""
        return self.kv.node.route(self.kv.server_id(server_rank))

    def _probes_used(self) -> bool:
        """Whether this store's scheme plans from capacity probes."""
        return self.cfg.probe_prob > 0 and plan_of(self.cfg.balance).needs == "network"

    def _calibrate(self) -> None:
        """Probe one whole permutation cycle, one probe per worker between worker barriers
        (every worker calls this at the same point). The first init calls it before rank 0
        sends any value: rank 0's init fills its connections' congestion windows (to hundreds
        of segments behind a deep FIFO bottleneck), and a node whose own outbound probe leaves
        with a wide window holds the acks of the probe coming in behind it, so the inbound
        probe of rank 0's node read ~35% low when the cycle came after the init
        (docs/BALANCE.md §7.1). Before any data every connection is alike."""
        self._calibrated = True
        self._probe_cycle()

    def _probe_cycle(self) -> None:
        """One probe per peer for every worker, each probe between worker barriers."""
        # one permutation cycle: afterwards every node has probed each peer once (so the first
        # plans do not rest on a single probe per node, which reads the slower of its two ends)
        S, W = self.num_servers, self.num_workers
        n = S - 1 if self.cfg.colocate else max(W, S)
        for _ in range(n):
            self.node.barrier("worker", self.timeout)  # each probe has its links to itself
            self._probe()
        if n:  # nobody's init data may share a link with the cycle's last probes
            self.node.barrier("worker", self.timeout)

    def _probe_round(self) -> bool:
        """Whether this round probes (the same answer on every worker): the first two (round 1
        only waits for its answer, the first init having probed a whole cycle; round 2 probes
        and may take a spread probe), then every ``round(1 / probe_prob)``-th round (rounds 5,
        9, 13, ... at the default 0.25)."""
        if not self._probes_used():
            return False  # only the link-model schemes use the probes
        if self._round <= 2:
            return True
        base = max(1, round(1.0 / self.cfg.probe_prob))
        return (self._round - 1) % base == 0

    def _probe(self) -> None:
        """A capacity probe: every worker sends one probe to one server, the servers chosen
        as a permutation that shifts each probing round (worker r probes server (r + k) mod S;
        with co-located nodes never its own). So each probe has its sender's uplink and its
        receiver's downlink to itself and measures what the data traffic cannot: how fast a
        node *can* go, also one that the plan keeps idle or that waits for slower peers. The
        worker waits for the answer (it carries the sample); in training this falls between
        the last pull and the next forward pass."""
        S = self.num_servers
        k = self._probes_sent
        self._probes_sent += 1
        if self.cfg.colocate and S > 1:
            s = (self.rank + 1 + k % (S - 1)) % S
        elif S >= self.num_workers:
            # every worker probes a different server, shifting so each server is probed by
            # each worker in turn
            s = (self.rank + k) % S
        else:
            # more workers than servers: S of them probe, in turn, one server each
            slot = (self.rank - k) % self.num_workers
            if slot >= S:
                return
            s = slot
        size = self.cfg.probe_bytes
        msg = Message(P.PROBE, body={"reply_bytes": 0}, arrays=[np.zeros(size, np.uint8)])
        try:
            self.kv.request(None, 0, s, msg).wait(self.timeout)
        except ClusterError as exc:  # measurement is best effort; the round goes on
            log.warning("worker: capacity probe to server %d failed: %s", s, exc)

    def _spread_probe(self, way: Any, rank: Any, peers: Any) -> None:
        """A spread probe, after the permutation probe of a probing round (docs/BALANCE.md
        §7.2). ``["out", r, servers]``: worker r sends a probe to each of those servers at
        once; ``["in", s, workers]``: each of those workers sends one to server s at once. A
        single-flow probe reads min(sender's up, receiver's down), so a node faster than every
        peer is only ever seen at its fastest peer's rate; the planner sums a spread's flows
        over their common span instead: min(the node's cap, the sum of its peers'). Each flow
        is a whole probe: the span is timed from stamps a millisecond or two apart, so it must
        last tens of milliseconds."""
        if not isinstance(peers, list) or not all(isinstance(x, int) for x in peers):
            return
        if way == "out" and rank == self.rank:
            targets = [s for s in peers if 0 <= s < self.num_servers]
        elif way == "in" and self.rank in peers and isinstance(rank, int):
            targets = [rank] if 0 <= rank < self.num_servers else []
        else:
            return
        if self.cfg.colocate:
            targets = [s for s in targets if s != self.rank]  # never the co-located server
        size = self.cfg.probe_bytes
        # the other workers wait for this one in a barrier: never longer than a spread
        # could take, and an error here is logged, not raised (measurement is best effort)
        deadline = time.monotonic() + min(SPREAD_WAIT_S, self.timeout / 2)
        futs = []
        try:
            for s in targets:
                msg = Message(
                    P.PROBE,
                    body={"reply_bytes": 0, "spread": True},
                    arrays=[np.zeros(size, np.uint8)],
                )
                futs.append((s, self.kv.request(None, 0, s, msg)))
            for _server, fut in futs:
                fut.wait(max(0.0, deadline - time.monotonic()))
        except Exception as exc:  # noqa: BLE001 - ClusterError, a timeout, a send failure
            log.warning("worker: spread probe (%s %s) failed: %s", way, rank, exc)
