"""The worker side of the distributed KVStore (``dist_sync``, ``dist_async``).

Each call is cut into requests, one per chunk of each part of each key (see
:mod:`hetps.kvstore.placement`), and sent in priority order: among the requests waiting to be
sent the highest priority goes first, but a request never overtakes an earlier one of the same
key, so per-key order is preserved. Blocking is the default; ``block=False`` returns a
:class:`~hetps.kvstore.base.Handle`.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hetps import optim
from hetps.cluster.errors import ClusterError, RequestError
from hetps.cluster.node import Node
from hetps.cluster.requests import Future, wait_all
from hetps.config import NodeConfig
from hetps.kvstore import commands as C
from hetps.kvstore.base import (
    Handle,
    check_dtype,
    completed,
    normalize_keys,
    out_arrays,
    per_key,
    reduce_values,
)
from hetps.kvstore.compression import TwoBitCompressor, parse_compression_params
from hetps.kvstore.placement import Part, chunk_elems, chunks, parts_of
from hetps.transport.codec import Message

log = logging.getLogger("hetps.worker")

MEASURE_MIN_BYTES = 64 * 1024  # smallest message whose transfer time is used as a link sample
FLOW_PACE_CHANGE = 0.05  # a flow's pace is sent again when it changed by more than this
#: flows slower than this (bytes/s) are not paced. The kernel paces by departure times: each
#: packet pushes the next one back by its length over the rate, so on a connection paced at
#: a few hundred bytes/s (a server whose share is one key's tail) every later message, a
#: receipt, a pull request, a probe sent after the pace is lifted, waits seconds to minutes.
#: Such a flow carries too little to matter; at 1 Mbit/s a full-size packet holds the next
#: one back ~12 ms (~23 ms for a two-segment TSO burst).
FLOW_PACE_MIN_BPS = 125_000
SPAN_MIN_BYTES = 1024  # smallest push or pull that counts in its server's span of a round
SPREAD_WAIT_S = 30.0  # longest a spread probe may hold the other workers at their barrier


@dataclass
class KeyMeta:
    """What a worker knows of one key."""

    shape: tuple[int, ...]
    dtype: np.dtype
    parts: list[Part]
    residual: np.ndarray | None = None

    @property
    def size(self) -> int:
        """Number of elements."""
        return int(np.prod(self.shape, dtype=np.int64))


@dataclass(order=True)
class _Op:
    prio: int
    seq: int
    key: Any = field(compare=False)
    send: Any = field(compare=False)
    cost: int = field(default=0, compare=False)  # bytes of push credit it needs


class _Sender:
    """Sends requests in priority order without reordering requests of one key.

    With a ``window`` (bytes, > 0) pushes also need credit: at most ``window`` bytes of
    pushes may be on their way to the servers (sent, not yet confirmed received; one push is
    always allowed). Then a worker's pushes leave in priority (key) order at the pace its
    uplink drains them, instead of all at once as parallel TCP flows that share the uplink
    evenly. Every server then gets its slices in key order at the rate it is owed, and the
    pull replies of finished slices flow while later pushes are still going out (push and
    pull overlap). While a push waits for credit, requests that need none (pulls) still go,
    unless an earlier request of the same key is waiting.

    With a pace (:meth:`set_pace`, bytes/s > 0) a push also waits until the pushes before it
    would have left at that rate: a push of ``c`` bytes moves the earliest time of the next
    one ``c / pace`` seconds on. The planner's pace is the rate at which the slowest pusher
    gets through the model (``balance.push_pace``); going faster only fills the servers'
    downlinks with pushes whose rounds cannot complete yet.
    """

    def __init__(self, window: int = 0, clock: Any = time.monotonic) -> None:
        self._heap: list[_Op] = []
        self._seq = itertools.count()
        self._last_prio: dict[Any, tuple[int, int]] = {}  # key -> (prio, seq) of its last queued op
        self._first: dict[Any, list[_Op]] = {}  # key -> its queued ops, oldest first
        # ops that need no credit and are the oldest of their key: they may pass a push that
        # waits for credit (a heap in the same order; entries already sent are skipped)
        self._free: list[_Op] = []
        self._sent: set[int] = set()  # seqs popped from one heap, still in the other
        self._cv = threading.Condition()
        self._busy = False
        self._closed = False
        self.window = int(window)
        self._clock = clock
        self.pace_bps = 0.0  # 0: no pacing
        self._pace_t = 0.0  # (clock) the earliest time the next paced push may go
        self._inflight = 0
        self._credit: dict[int, tuple[int, Any]] = {}  # req -> (bytes, future)
        self._thread = threading.Thread(target=self._loop, name="hetps-sender", daemon=True)
        self._thread.start()

    def _has_credit(self, cost: int, now: float | None = None) -> bool:
        if cost == 0:
            return True
        if self.pace_bps > 0 and (self._clock() if now is None else now) < self._pace_t:
            return False
        return self._inflight == 0 or self._inflight + cost <= self.window

    def _spend(self, cost: int) -> None:
        """A push of ``cost`` bytes goes now (lock held): take its credit and pace."""
        self._inflight += cost
        if cost and self.pace_bps > 0:
            self._pace_t = max(self._clock(), self._pace_t) + cost / self.pace_bps

    def set_pace(self, bytes_per_s: float) -> None:
        """Pace pushes at ``bytes_per_s`` (0, negative or not finite: no pacing)."""
        pace = float(bytes_per_s)
        pace = pace if 0 < pace < float("inf") else 0.0
        with self._cv:
            old, self.pace_bps = self.pace_bps, pace
            now = self._clock()
            if old > 0 and pace > 0 and self._pace_t > now:
                # the wait left from the last push, at the new rate
                self._pace_t = now + (self._pace_t - now) * old / pace
            self._cv.notify_all()

    def _wait_s(self, now: float) -> float:
        """How long the loop may sleep while the top push waits (lock held; ``now`` is the
        clock reading its credit check used: a window wait ends with a release's notify)."""
        if self.pace_bps > 0 and self._pace_t > now:
            return min(0.2, max(0.0005, self._pace_t - now))
        return 0.2

    def submit(self, key: Any, priority: int, send: Any, cost: int = 0) -> None:
        """Send ``send()`` for ``key`` at ``priority`` (higher first): at once from the calling
        thread when nothing waits or is being sent (no thread hand-off), else queued.
        ``cost`` > 0 (push bytes, with a window) makes it wait for credit too."""
        cost = cost if self.window > 0 else 0
        with self._cv:
            if not self._heap and not self._busy and not self._closed and self._has_credit(cost):
                self._busy = True
                self._spend(cost)
                inline = True
            else:
                inline = False
                prio = -priority
                last = self._last_prio.get(key)
                if last is not None:
                    prio = max(prio, last[0])  # never go before an earlier op of the same key
                op = _Op(prio, next(self._seq), key, send, cost)
                self._last_prio[key] = (prio, op.seq)
                queue = self._first.setdefault(key, [])
                queue.append(op)
                if cost == 0 and len(queue) == 1:
                    heapq.heappush(self._free, op)
                heapq.heappush(self._heap, op)
                self._cv.notify()
        if inline:
            try:
                send()
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify()

    def hold(self, req: int, cost: int, fut: Any) -> None:
        """Record that request ``req`` (a push of ``cost`` bytes) holds credit until
        :meth:`release`d (its receipt or its answer) or its future ends otherwise."""
        if self.window > 0 and cost > 0:
            with self._cv:
                self._credit[req] = (cost, fut)

    def release(self, req: int) -> None:
        """Give back the credit of request ``req`` (idempotent)."""
        if self.window <= 0:
            return
        with self._cv:
            item = self._credit.pop(req, None)
            if item is not None:
                self._inflight -= item[0]
                self._cv.notify_all()

    def _reap(self) -> None:
        """Credit of requests that ended without a receipt (errors, a peer gone)."""
        for req, (_cost, fut) in list(self._credit.items()):
            if fut is not None and fut.done():
                self._inflight -= self._credit.pop(req)[0]

    def _pop_live(self, heap: list[_Op]) -> _Op | None:
        """Drop entries of ``heap`` that were sent from the other heap; the top live one."""
        while heap and heap[0].seq in self._sent:
            self._sent.discard(heapq.heappop(heap).seq)
        return heap[0] if heap else None

    def _pick(self) -> _Op | None:
        """The next op that may go now (called with the lock held)."""
        top = self._pop_live(self._heap)
        if top is None:
            return None
        if self._has_credit(top.cost):
            op = heapq.heappop(self._heap)
        else:
            op = self._pop_live(self._free)
            if op is None:
                return None
            heapq.heappop(self._free)
        # a credit-free op sits in both heaps: the other one must skip it
        if op is not top or op.cost == 0:
            self._sent.add(op.seq)
        queue = self._first[op.key]
        queue.remove(op)
        if queue:
            nxt = queue[0]
            if nxt.cost == 0:
                heapq.heappush(self._free, nxt)
        else:
            del self._first[op.key]
        if self._last_prio.get(op.key, (0, -1))[1] == op.seq:
            del self._last_prio[op.key]
        self._spend(op.cost)
        return op

    def _loop(self) -> None:
        while True:
            with self._cv:
                op = None
                while not self._closed or self._heap:
                    if self._heap and not self._busy:
                        op = self._pick()
                        if op is not None:
                            break
                        self._reap()  # waiting for credit: was any lost to a failure?
                        top = self._pop_live(self._heap)
                        now = self._clock()
                        if top is None or self._has_credit(top.cost, now):
                            continue
                        self._cv.wait(self._wait_s(now))
                    elif self._busy and self._closed:  # closing while an inline send runs
                        self._cv.wait(0.05)
                    elif not self._heap and self._closed:
                        break
                    else:
                        self._cv.wait()
                if op is None:
                    return
                self._busy = True
            try:
                op.send()
            except Exception:  # reported through the op's future
                log.exception("worker: send failed")
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def close(self) -> None:
        """Send what is queued (unpaced: nobody waits for a round any more), then stop."""
        with self._cv:
            self._closed = True
            self.pace_bps = 0.0
            self._cv.notify()
        self._thread.join(timeout=10)


class DistKVStore:
    """A worker's handle on the distributed KVStore (MXNet's ``KVStoreDist``)."""

    def __init__(self, name: str, cfg: NodeConfig) -> None:
        self.type = name
        self.sync = name.startswith("dist_sync")
        self.cfg = cfg
        self.node = Node(cfg).start()
        self.num_servers = len(self.node.servers())
        self._server_ids = [s.id for s in self.node.servers()]
        self.meta: dict[Any, KeyMeta] = {}
        self.compressor: TwoBitCompressor | None = None
        self._outstanding: list[Future] = []
        self._out_lock = threading.Lock()
        # network-aware mode paces pushes with a credit window (see _Sender)
        self._sender = _Sender(cfg.push_window if cfg.balance != "none" else 0)
        self._closed = False
        # network-aware load distribution (HETPS_BALANCE): slices, measurements, plans
        self.balance = cfg.balance != "none"
        self._order: list[Any] = []
        self._next_slice = 0
        self._fc: dict[tuple[int, int], float] = {}
        self._samples: list[list[float]] = []
        self._stats: dict[int, list[float]] = {}  # server rank -> [bytes, t_first, t_last]
        self._stats_lock = threading.Lock()
        self._round = 0
        self._reported_keys = 0
        self.plan: dict | None = None
        self._pending_plan: Future | None = None  # the answer to the last report (pipelined)
        self._probes_sent = 0
        self._calibrated = False  # the first init probed a whole permutation cycle
        self._spread_made: list | None = None  # the spread this worker took part in
        self._recalibrated = False  # probed a whole cycle on the planner's word (a surprise)
        self._recal_due = False  # a superseded answer asked for a new cycle
        self._probed_at = -1  # the last round that sent a capacity probe
        self._last_probe_round = 1  # the last probing round after the first two (see below)
        self._paced: dict[int, float] = {}  # server rank -> its flows' pace (HETPS_FLOW_PACE)
        self._own_unpaced = False  # this worker's own connections are unpaced for probes
        self._pace_acks: dict[int, Any] = {}  # server rank -> sockets it paced (last answer)
        if self.balance:
            self.node.handler = self._on_message  # forecasts and push receipts
        if cfg.verbose >= 1:
            log.info("worker rank %d of %d is up (%s)", self.rank, self.num_workers, name)

    # -- identity ---------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This worker's rank, 0 .. num_workers-1."""
        return self.node.rank

    @property
    def num_workers(self) -> int:
        """Number of workers in the job."""
        return len(self.node.workers())

    @property
    def timeout(self) -> float:
        """Seconds a call waits for its answers before raising."""
        return self.cfg.request_timeout

    # -- plumbing ---------------------------------------------------------------------------
    def _track(self, futs: list[Future]) -> None:
        with self._out_lock:
            self._outstanding.extend(futs)
            if len(self._outstanding) > 256:  # prune now and then, not on every call
                self._outstanding = [f for f in self._outstanding if not f.done()]

    def _request(
        self, key: Any, priority: int, server_rank: int, msg: Message, callback=None, landing=None
    ) -> Future:
        peer = self._server_ids[server_rank]
        fut = self.node.requests.new(
            peer, f"{msg.cmd} of key {key!r} on {self.node.describe(peer)}", callback
        )
        if fut.done():
            return fut
        fut.landing = landing
        msg.req = fut.req
        msg.priority = priority
        # only messages big enough to take measurable time on the wire are timed: for small
        # ones the forecast and the data arrive together and the "rate" is dispatch noise
        if msg.cmd == C.PULL:
            size = int(msg.body.get("n", 0)) * np.dtype(msg.body.get("dtype", "float32")).itemsize
        else:
            size = sum(getattr(a, "nbytes", 0) for a in msg.arrays)
        measure = (
            self.balance
            and msg.cmd in (C.PUSH, C.PULL, C.PROBE)
            and (msg.cmd == C.PROBE or size >= MEASURE_MIN_BYTES)
        )
        # every push and pull of data (not probes) counts in its server's round span, timed
        # or not: the planner compares each round's span with its plan's prediction; elastic
        # fits it. Not a message of a few bytes: it says nothing of a server's load, and a
        # control value sent before the forward pass (hetps train's stop flag, when it does
        # not ride with the gradients) would stretch its server's span over the compute
        noted = self.balance and msg.cmd in (C.PUSH, C.PULL) and size >= SPAN_MIN_BYTES
        cost = size if msg.cmd == C.PUSH and self._sender.window > 0 else 0
        if cost:
            msg.body["rcpt"] = True  # the server confirms arrival at once: credit comes back
            credit_cb = fut._callback
            req = fut.req

            def credited(reply: Message) -> None:
                self._sender.release(req)
                if credit_cb is not None:
                    credit_cb(reply)

            fut._callback = credited
        if measure:
            msg.body["tag"] = fut.req
            user_cb = fut._callback
            me = self.node.id

            def measured(reply: Message) -> None:
                now = time.time()
                meas = reply.body.get("meas")
                if isinstance(meas, list) and len(meas) in (3, 4):  # our push, timed by the server
                    # 1: a capacity probe, alone on its link; 2: one flow of a spread probe,
                    # 3: the same, its forecast stamped late (its receive thread was busy)
                    kind = 0
                    if msg.cmd == C.PROBE:
                        kind = 1 if not msg.body.get("spread") else 3 if meas[3:] == [1.0] else 2
                    self._samples.append([me, peer, meas[2], meas[0], meas[1], kind])
                t0 = self._fc.pop((peer, fut.req), None)
                if t0 is not None and reply.arrays:  # its reply, timed here
                    self._samples.append([peer, me, float(reply.nbytes), t0, now])
                if noted:
                    self._note(server_rank, reply.nbytes, now, first=False)
                if user_cb is not None:
                    user_cb(reply)

            fut._callback = measured
        elif noted:
            plain_cb = fut._callback

            def spanned(reply: Message) -> None:
                self._note(server_rank, reply.nbytes, time.time(), first=False)
                if plain_cb is not None:
                    plain_cb(reply)

            fut._callback = spanned

        def send() -> None:
            try:
                if cost:
                    self._sender.hold(fut.req, cost, fut)
                if noted:
                    nbytes = sum(getattr(a, "nbytes", 0) for a in msg.arrays)
                    self._note(server_rank, nbytes, time.time(), first=True)
                if measure and msg.cmd != C.PULL:
                    self.node.van.send(peer, Message(C.FORECAST, body={"tag": fut.req}))
                self.node.van.send(peer, msg)
            except Exception as exc:  # noqa: BLE001
                self._sender.release(fut.req)
                self.node.requests.resolve(fut.req, None, f"could not send to node {peer}: {exc}")

        # requests are kept in order per slice (a key's part), not per key: the server keeps
        # every part's rounds apart, so a part's pull needs only that part's push before it,
        # and the pulls of a big key's first slices go while its later slices are still being
        # pushed (in key order, every slice of a 40-slice key waited for the last one's push)
        part = msg.body.get("part") if key is not None else None
        self._sender.submit(key if part is None else (key, part), priority, send, cost)
        return fut

    def _placement(self, key: Any, size: int) -> list[Part]:
        if not self.balance:
            return parts_of(key, size, self.num_servers, self.cfg.bigarray_bound)
        x = self.cfg.slice_elems
        parts = []
        for j, a in enumerate(range(0, max(size, 1), x)):
            b = min(a + x, size)
            parts.append(Part((self._next_slice + j) % self.num_servers, j, a, b))
        self._next_slice += len(parts)
        return parts

    def _on_message(self, msg: Message) -> None:
        """Non-reply messages to a worker: forecasts of the replies it is about to receive."""
        if msg.cmd == C.FORECAST:
            self._fc[(msg.sender, msg.body.get("tag"))] = time.time()
        elif msg.cmd == C.RECEIPT:
            req = msg.body.get("req")
            if isinstance(req, int):
                self._sender.release(req)

    def _note(self, server_rank: int, nbytes: int, t: float, first: bool) -> None:
        with self._stats_lock:
            st = self._stats.setdefault(server_rank, [0.0, t, t])
            st[0] += nbytes
            if first:
                st[1] = min(st[1], t)
            st[2] = max(st[2], t)

    def _meta(self, key: Any, what: str) -> KeyMeta:
        m = self.meta.get(key)
        if m is None:
            raise KeyError(
                f"{what}: key {key!r} was never initialised: call kv.init({key!r}, value) first"
            )
        return m

    def _check(self, key: Any, meta: KeyMeta, arr: np.ndarray, what: str) -> None:
        if arr.shape != meta.shape or arr.dtype != meta.dtype:
            raise ValueError(
                f"{what} of key {key!r}: shape {arr.shape} dtype {arr.dtype} does not match the "
                f"key's shape {meta.shape} dtype {meta.dtype}"
            )

    def _finish_call(self, futs: list[Future], block: bool, what: str, finish=None) -> Handle:
        self._track(futs)
        handle = Handle(futs, self.timeout, what, finish)
        if block:
            handle.wait()
        return handle

    # -- API --------------------------------------------------------------------------------
    def init(self, key: Any, value: Any) -> None:
        """Initialise keys; rank 0's values are stored. Returns once they are on the servers."""
        self.node.check()
        keys, is_list = normalize_keys(key)
        entries = per_key(value, len(keys), is_list, "init")
        if not self._calibrated and self._probes_used():
            self._calibrate()
        futs: list[Future] = []
        for k, entry in zip(keys, entries, strict=False):
            arr = reduce_values(entry, f"init of key {k!r}")
            check_dtype(arr.dtype, k)
            if k not in self.meta:
                self._order.append(k)
            parts = self._placement(k, arr.size)
            self.meta[k] = KeyMeta(tuple(arr.shape), arr.dtype, parts)
            if self.rank != 0:
                continue
            flat = np.ascontiguousarray(arr).reshape(-1)
            step = chunk_elems(self.cfg.chunk_bytes, arr.dtype.itemsize)
            for p in parts:
                for a, b in chunks(p.start, p.stop, step):
                    body = {
                        "k": k,
                        "part": p.index,
                        "off": a - p.start,
                        "n": b - a,
                        "size": p.size,
                        "shape": list(arr.shape),
                        "dtype": arr.dtype.name,
                    }
                    msg = Message(C.INIT, body=body, arrays=[flat[a:b]])
                    futs.append(self._request(k, 0, p.server, msg))
        wait_all(futs, self.timeout, "init")
        self.node.barrier("worker", self.timeout)

    def push(self, key: Any, value: Any, priority: int = 0, block: bool = True) -> Handle:
        """Push values (a list per key is summed first). In dist_sync the push is acknowledged
        when every worker pushed the round and the server applied it."""
        self.node.check()
        keys, is_list = normalize_keys(key)
        entries = per_key(value, len(keys), is_list, "push")
        futs: list[Future] = []
        for k, entry in zip(keys, entries, strict=False):
            meta = self._meta(k, "push")
            arr = reduce_values(entry, f"push of key {k!r}")
            self._check(k, meta, arr, "push")
            futs += self._push_one(k, meta, arr, priority)
        return self._finish_call(futs, block, "push")

    def _push_one(
        self,
        k: Any,
        meta: KeyMeta,
        arr: np.ndarray,
        priority: int,
        dest: np.ndarray | None = None,
    ) -> list[Future]:
        """Requests pushing ``arr``; with ``dest`` (flat, writable) each is a fused push-pull:
        its answer carries the key's value for that range once the push took effect."""
        flat = np.ascontiguousarray(arr).reshape(-1)
        comp = self.compressor
        if comp is not None and meta.residual is None:
            meta.residual = np.zeros(meta.size, dtype=np.float32)
        step = chunk_elems(self.cfg.chunk_bytes, arr.dtype.itemsize)
        futs = []
        for p in meta.parts:
            for a, b in chunks(p.start, p.stop, step):
                body = {
                    "k": k,
                    "part": p.index,
                    "off": a - p.start,
                    "n": b - a,
                    "sync": self.sync,
                    "ce": step,
                    "shape": list(meta.shape),
                    "dtype": meta.dtype.name,
                }
                if dest is not None:
                    body["pp"] = True
                if comp is not None:
                    assert meta.residual is not None
                    payload = comp.compress(flat[a:b], meta.residual[a:b])
                    body["comp"] = comp.threshold
                else:
                    payload = flat[a:b]
                futs.append(
                    self._request(
                        k,
                        priority,
                        p.server,
                        Message(C.PUSH, body=body, arrays=[payload]),
                        None if dest is None else _lander(k, dest, a, b),
                        None if dest is None else dest[a:b],
                    )
                )
        return futs

    def pull(
        self,
        key: Any,
        out: Any = None,
        priority: int = 0,
        block: bool = True,
        ignore_sparse: bool = True,
    ) -> Any:
        """Pull keys into ``out`` (in place; a list of outs each gets the value). With no
        ``out``, blocking calls return new arrays. Non-blocking calls return a Handle."""
        self.node.check()
        keys, is_list = normalize_keys(key)
        futs: list[Future] = []
        finishers = []
        results = []
        outs = per_key(out, len(keys), is_list, "pull") if out is not None else [None] * len(keys)
        for k, entry in zip(keys, outs, strict=False):
            meta = self._meta(k, "pull")
            targets = (
                out_arrays(entry, f"pull of key {k!r}")
                if entry is not None
                else [np.empty(meta.shape, meta.dtype)]
            )
            for t in targets:
                self._check(k, meta, t, "pull")
            f, fin = self._pull_one(k, meta, targets, priority)
            futs += f
            finishers.append(fin)
            results.append(targets[0])

        def finish() -> Any:
            for fin in finishers:
                fin()
            if out is None:
                return results if is_list else results[0]
            return None

        handle = self._finish_call(futs, block, "pull", finish)
        return handle.wait() if block else handle

    def _pull_one(self, k: Any, meta: KeyMeta, targets: list[np.ndarray], priority: int):
        first = targets[0]
        direct = first.flags.c_contiguous and first.flags.writeable
        dest = first.reshape(-1) if direct else np.empty(meta.size, meta.dtype)
        step = chunk_elems(self.cfg.chunk_bytes, meta.dtype.itemsize)
        futs = []
        for p in meta.parts:
            for a, b in chunks(p.start, p.stop, step):
                body = {
                    "k": k,
                    "part": p.index,
                    "off": a - p.start,
                    "n": b - a,
                    "shape": list(meta.shape),
                    "dtype": meta.dtype.name,
                }

                futs.append(
                    self._request(
                        k,
                        priority,
                        p.server,
                        Message(C.PULL, body=body),
                        _lander(k, dest, a, b),
                        dest[a:b],
                    )
                )

        return futs, _finisher(meta, dest, targets, direct)

    def pushpull(
        self, key: Any, value: Any, out: Any = None, priority: int = 0, block: bool = True
    ) -> Any:
        """Push, then pull the result into ``out`` (or into ``value``), as one request per
        chunk: the server answers the push with the value once the push took effect (after
        the round in dist_sync, after the update in dist_async), so the pull sees the round
        this push belongs to, with half the messages of a push and a pull."""
        self.node.check()
        keys, is_list = normalize_keys(key)
        entries = per_key(value, len(keys), is_list, "pushpull")
        outs = per_key(out, len(keys), is_list, "pushpull") if out is not None else entries
        futs: list[Future] = []
        finishers = []
        for k, entry, out_entry in zip(keys, entries, outs, strict=False):
            meta = self._meta(k, "pushpull")
            arr = reduce_values(entry, f"pushpull of key {k!r}")
            self._check(k, meta, arr, "push")
            targets = out_arrays(out_entry, f"pushpull of key {k!r}")
            for t in targets:
                self._check(k, meta, t, "pull")
            first = targets[0]
            direct = first.flags.c_contiguous and first.flags.writeable
            # landing in the pushed array itself is safe: a range's answer comes after the
            # server has received that range
            dest = first.reshape(-1) if direct else np.empty(meta.size, meta.dtype)
            futs += self._push_one(k, meta, arr, priority, dest)
            finishers.append(_finisher(meta, dest, targets, direct))

        def finish() -> None:
            for fin in finishers:
                fin()

        handle = self._finish_call(futs, False, "pushpull", finish)
        return handle.wait() if block else handle

    def broadcast(self, key: Any, value: Any, out: Any, priority: int = 0) -> None:
        """Initialise ``key`` with rank 0's ``value`` and pull it into ``out`` on every worker."""
        self.init(key, value)
        self.pull(key, out, priority)

    def wait_outstanding(self) -> None:
        """Wait for every request this worker has in flight."""
        with self._out_lock:
            # requests already answered were reported to their callers (or their handles)
            futs = [f for f in self._outstanding if not f.done()]
            self._outstanding = []
        wait_all(futs, self.timeout, "outstanding requests")

    def barrier(self) -> None:
        """Wait for this worker's outstanding pushes, then for every worker."""
        self.wait_outstanding()
        self.node.barrier("worker", self.timeout)

    def set_optimizer(self, optimizer: optim.Optimizer) -> None:
        """Ship ``optimizer`` (by value) to every server; returns on every worker only when
        every server has it."""
        self.node.check()
        if not isinstance(optimizer, optim.Optimizer):
            raise TypeError(
                f"set_optimizer takes a hetps.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if self.rank == 0:
            blob = np.frombuffer(optim.dumps(optimizer), dtype=np.uint8)
            futs = [
                self._request(None, 0, s, Message(C.SET_OPTIMIZER, arrays=[blob]))
                for s in range(self.num_servers)
            ]
            wait_all(futs, self.timeout, "set_optimizer")
        self.node.barrier("worker", self.timeout)

    def set_gradient_compression(self, params: dict) -> None:
        """Turn on MXNet's 2-bit compression of pushes: ``{'type': '2bit', 'threshold': t}``."""
        self.compressor = parse_compression_params(params)
        for m in self.meta.values():
            m.residual = None

    def save_optimizer_states(self, fname: str) -> None:
        """Write every server's optimizer state to ``fname``."""
        futs = [self._request(None, 0, s, Message(C.GET_STATES)) for s in range(self.num_servers)]
        replies = wait_all(futs, self.timeout, "save_optimizer_states")
        merged: dict = {}
        for r in replies:
            merged.update(optim.load_states(r.arrays[0].tobytes()))
        tmp = f"{fname}.tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(optim.dump_states(merged))
        os.replace(tmp, fname)

    def load_optimizer_states(self, fname: str) -> None:
        """Load optimizer states written by :meth:`save_optimizer_states` onto the servers."""
        with open(fname, "rb") as f:
            blob = np.frombuffer(f.read(), dtype=np.uint8)
        futs = [
            self._request(None, 0, s, Message(C.SET_STATES, arrays=[blob]))
            for s in range(self.num_servers)
        ]
        wait_all(futs, self.timeout, "load_optimizer_states")

    # -- network-aware load distribution ---------------------------------------------------
    def rebalance(self) -> dict | None:
        """Call at an iteration boundary (every worker, the same iterations). Reports this
        worker's link measurements to the scheduler and switches to the plan it decided; a
        slice that moves takes its value and optimizer state along. Returns the plan (epoch,
        shares per server, link matrix) or None when balancing is off.

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
        if not self.balance:
            return None
        self.wait_outstanding()
        self._round += 1
        if (self._round - 1) % self.cfg.replan_every:
            return self.plan
        probing = self._probe_round()
        with self._stats_lock:
            stats = {str(s): [v[0], max(0.0, v[2] - v[1])] for s, v in self._stats.items()}
            self._stats = {}
        samples, self._samples = self._samples, []
        body = {"round": self._round, "samples": samples, "server_times": stats}
        if self._spread_made:  # a turn of the planner's spread rotation, even if all failed
            body["spread_done"], self._spread_made = self._spread_made[:2], None
        fresh, self._recalibrated = self._recalibrated, False
        if fresh:  # these samples hold a whole new cycle: the planner starts its windows anew
            body["calibration"] = True
        if self.plan is None or self._reported_keys != len(self._order):
            # the layout (first report, or keys initialised since): sizes and where slices are
            body["sizes"] = [self.meta[k].size for k in self._order]
            body["assign"] = self._current_assignment()
            self._reported_keys = len(self._order)
        fut = self.node.request(1, Message("balance_report", body=body), what="balance report")
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
                recal = skipped.wait(self.timeout).body.get("recalibrate") is True
                self._recal_due = self._recal_due or recal
        else:
            answer = self._pending_plan
            self._pending_plan = fut
        if answer is None:  # the second report: nothing decided since the first one
            return self.plan
        body = answer.wait(self.timeout).body
        before = self._current_assignment()
        adopted = self._adopt(body)
        moved = self._current_assignment() != before
        recalibrate, self._recal_due = self._recal_due or body.get("recalibrate"), False
        if (recalibrate and self._probes_used()) or probing:
            self._unpace_own()  # a probe measures what a link can carry, not a pace
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
            spread = body.get("spread")
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
        self._pace_flows(adopted)
        return adopted

    def _pace_flows(self, plan: dict | None) -> None:
        """Pace this worker's connection to each remote server, and ask that server to pace
        its connection back, at ``HETPS_FLOW_PACE`` times the plan's flow rate for it: the
        server's share over the plan's predicted iteration time (docs/BALANCE.md §7.4). A
        server without a share (or one under FLOW_PACE_MIN_BPS), or a plan without flow
        rates, gets no cap. Only paces that changed by more than FLOW_PACE_CHANGE are sent
        again; this worker's own side is set again after probes lifted it."""
        factor = self.cfg.flow_pace
        if factor <= 0 and not self._paced:
            return  # off (the default): nothing to do in any round
        rates = plan.get("flow_rates") if factor > 0 and isinstance(plan, dict) else None
        want: dict[int, float] = {}
        for s in range(self.num_servers):
            if self.cfg.colocate and s == self.rank:
                continue  # its own node: no link to share
            r = rates[s] if isinstance(rates, list) and s < len(rates) else None
            ok = isinstance(r, (int, float)) and np.isfinite(r) and r * factor >= FLOW_PACE_MIN_BPS
            want[s] = float(r) * factor if ok else 0.0
        if not any(self._paced.values()) and not any(want.values()):
            return
        changed = {
            s: r
            for s, r in want.items()
            if abs(r - self._paced.get(s, 0.0)) > FLOW_PACE_CHANGE * max(r, self._paced.get(s, 0.0))
        }
        if self._own_unpaced:  # probes lifted our side: set it again where it stays
            for s, r in self._paced.items():
                if s not in changed and r > 0:
                    self._pace_own(s, r)
            self._own_unpaced = False
        self._set_paces(changed)

    def _pace_own(self, s: int, rate: float) -> None:
        if not self.node.van.pace(self._server_ids[s], rate) and rate > 0:
            log.info("worker %d: no connection to server %d to pace", self.rank, s)

    def _set_paces(self, paces: dict[int, float]) -> None:
        """Set this worker's side and ask each server for its side; a pace counts (and is
        not sent again) only once its server acknowledged it, so a lost request is retried
        with the next plan. Failures are logged: pacing never stops the round."""
        futs = []
        for s, r in paces.items():
            self._pace_own(s, r)
            futs.append((s, r, self._request(None, 0, s, Message(C.PACE, body={"rate": r}))))
        deadline = time.monotonic() + self.timeout
        for s, r, fut in futs:
            try:
                reply = fut.wait(max(0.0, deadline - time.monotonic()))
            except (ClusterError, RequestError) as exc:
                log.warning("worker: flow pacing of server %d: %s", s, exc)
                self._pace_own(s, self._paced.get(s, 0.0))  # back to what it last acknowledged
                continue
            self._paced[s] = r
            self._pace_acks[s] = reply.body.get("paced")  # sockets it paced (for checks)

    def _unpace_own(self) -> None:
        """Lift this worker's own connection paces (before capacity probes)."""
        if any(self._paced.values()) and not self._own_unpaced:
            for s, r in self._paced.items():
                if r > 0:
                    self._pace_own(s, 0.0)
            self._own_unpaced = True

    def _unpace_all(self) -> None:
        """Lift every pace, this worker's and its servers' (before slices migrate, so that
        they do not crawl at the old plan's rate to a server whose share grew); the plan's
        paces are set again at the end of the round's rebalance."""
        self._set_paces({s: 0.0 for s, r in self._paced.items() if r > 0})
        self._own_unpaced = False

    def _adopt(self, plan: dict) -> dict | None:
        """Switch to the assignment of the planner's answer ``plan`` (migrating slices)."""
        if "error" in plan:
            raise RuntimeError(f"load planner: {plan['error']}")
        new = plan["assign"]
        old = self._current_assignment()
        if len(new) != len(old):  # decided before keys were added: the next answer will fit
            return self.plan
        if new != old:
            if any(self._paced.values()):
                self._unpace_all()
            drops = self._migrate(old, new)
            # every worker's moves have landed, and every worker has finished its previous
            # round's requests (rebalance() began with wait_outstanding()): only now may the
            # old copies go, and only now may anyone push by the new plan
            self.node.barrier("worker", self.timeout)
            wait_all(
                [
                    self._request(None, 0, s_old, Message(C.DROP, body={"slices": want}))
                    for s_old, want in drops
                ],
                self.timeout,
                "slice migration (drop)",
            )
            self._apply_assignment(new)
        self.plan = plan
        # pushes go at the plan's critical pace (times the margin); 0: the scheme has no link
        # model, or pacing is off (HETPS_PUSH_PACE=0)
        self._sender.set_pace(float(plan.get("pace") or 0.0) * self.cfg.push_pace)
        return plan

    def _slices(self) -> list[tuple[Any, int, int, int]]:
        """(key, slice index, start, stop) in layout order."""
        out = []
        for k in self._order:
            for p in self.meta[k].parts:
                out.append((k, p.index, p.start, p.stop))
        return out

    def _current_assignment(self) -> list[int]:
        return [p.server for k in self._order for p in self.meta[k].parts]

    def _apply_assignment(self, assignment: list[int]) -> None:
        i = 0
        for k in self._order:
            meta = self.meta[k]
            meta.parts = [
                Part(assignment[i + j], p.index, p.start, p.stop) for j, p in enumerate(meta.parts)
            ]
            i += len(meta.parts)

    def _migrate(self, old: list[int], new: list[int]) -> list[tuple[int, list]]:
        """Move re-assigned slices (value and optimizer state) from their old servers to their
        new ones. Every worker runs this with the same plan and moves its own share of the
        slices: with co-located servers the worker beside the new server (one network hop,
        the init is local), otherwise slices are dealt round-robin. All of a worker's requests
        are in flight at once: pulls and state reads, then inits and state writes. Returns the
        drops (old server, slices) to send once every worker is done (after a barrier)."""
        moves: dict[tuple[int, int], list[tuple[Any, int, int, int]]] = {}
        for idx, ((k, j, a, b), s_old, s_new) in enumerate(
            zip(self._slices(), old, new, strict=True)
        ):
            if s_old == s_new:
                continue
            if self.cfg.colocate and s_new < self.num_workers:
                mine = s_new == self.rank
            else:
                mine = idx % self.num_workers == self.rank
            if mine:
                moves.setdefault((s_old, s_new), []).append((k, j, a, b))
        if not moves:
            return []

        def body(k: Any, j: int, a: int, b: int) -> dict:
            meta = self.meta[k]
            return {
                "k": k,
                "part": j,
                "off": 0,
                "n": b - a,
                "shape": list(meta.shape),
                "dtype": meta.dtype.name,
            }

        # 1. read every moved value and state, all requests in flight together
        reads = []
        for (s_old, s_new), items in moves.items():
            want = [[k, j] for k, j, _, _ in items]
            states = self._request(None, 0, s_old, Message(C.GET_STATES, body={"slices": want}))
            pulls = [
                self._request(k, 0, s_old, Message(C.PULL, body=body(k, j, a, b)))
                for k, j, a, b in items
            ]
            reads.append((s_old, s_new, items, want, states, pulls))
        wait_all([f for r in reads for f in [r[4], *r[5]]], self.timeout, "slice migration (read)")
        # 2. write them on the new servers
        writes = []
        for _s_old, s_new, items, _want, states, pulls in reads:
            for (k, j, a, b), fut in zip(items, pulls, strict=True):
                data = np.array(fut.wait(self.timeout).arrays[0], copy=True)
                msg = Message(C.INIT, body=dict(body(k, j, a, b), size=b - a), arrays=[data])
                writes.append(self._request(k, 0, s_new, msg))
            blob = states.wait(self.timeout).arrays[0]
            if optim.load_states(blob.tobytes()):
                writes.append(
                    self._request(None, 0, s_new, Message(C.SET_STATES, arrays=[np.array(blob)]))
                )
        wait_all(writes, self.timeout, "slice migration (write)")
        # 3. the caller drops them where they were, after a barrier
        return [(s_old, want) for s_old, _s_new, _items, want, _states, _pulls in reads]

    def _probes_used(self) -> bool:
        """Whether this store's scheme plans from capacity probes."""
        return self.balance and self.cfg.probe_prob > 0 and self.cfg.balance in ("aware", "optimal")

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
        n = self._calibration_probes()
        for _ in range(n):
            self.node.barrier("worker", self.timeout)  # each probe has its links to itself
            self._probe()
        if n:  # nobody's init data may share a link with the cycle's last probes
            self.node.barrier("worker", self.timeout)

    def _probe_round(self) -> bool:
        """Whether this round probes (the same answer on every worker): the first two (round 1
        only waits for its answer, the first init having probed a whole cycle; round 2 probes
        and may take a spread probe), then every ``round(1 / probe_prob)``-th round (rounds 5,
        9, 13, ... at the default 0.25), times the planner's ``probe_scale``: it doubles
        after each probing round that showed no change, up to ``HETPS_PROBE_BACKOFF``, and
        falls back to 1 at any sign of one. Every worker adopts the same answers at the same
        calls, so all count the same rounds."""
        if not self._probes_used():
            return False  # only the link-model schemes use the probes
        if self._round <= 2:
            return True
        base = max(1, round(1.0 / self.cfg.probe_prob))
        if (self._round - 1) % base:
            return False  # (only rounds of the base schedule may probe, whatever the scale)
        scale = (self.plan or {}).get("probe_scale", 1)
        scale = int(scale) if isinstance(scale, int) and scale >= 1 else 1
        if self._round - self._last_probe_round < base * scale:
            return False
        self._last_probe_round = self._round
        return True

    def _calibration_probes(self) -> int:
        """Probes of one permutation cycle: afterwards every node has probed each peer once
        (so the first plans do not rest on a single probe per node, which reads the slower
        of its two ends)."""
        S, W = self.num_servers, self.num_workers
        return S - 1 if self.cfg.colocate else max(W, S)

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
        msg = Message(C.PROBE, body={"reply_bytes": 0}, arrays=[np.zeros(size, np.uint8)])
        try:
            self._request(None, 0, s, msg).wait(self.timeout)
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
                    C.PROBE,
                    body={"reply_bytes": 0, "spread": True},
                    arrays=[np.zeros(size, np.uint8)],
                )
                futs.append((s, self._request(None, 0, s, msg)))
            for _server, fut in futs:
                fut.wait(max(0.0, deadline - time.monotonic()))
        except Exception as exc:  # noqa: BLE001 - ClusterError, a timeout, a send failure
            log.warning("worker: spread probe (%s %s) failed: %s", way, rank, exc)

    # -- shutdown ---------------------------------------------------------------------------
    def close(self, error: str | None = None) -> None:
        """Finish this worker: wait for its requests, tell the scheduler, close the sockets.

        With ``error`` (the worker is failing) the scheduler is told at once so that the
        other nodes stop with a clear message instead of waiting for a heartbeat timeout.
        """
        if self._closed:
            return
        self._closed = True
        try:
            if error is not None:
                self.node.leave(error)
            elif self.node.failure is None:
                try:
                    self.wait_outstanding()
                except RequestError as exc:  # already reported to the caller; still finish
                    log.debug("worker: outstanding request failed at close: %s", exc)
                self.node.finish(self.timeout)
        finally:
            self._sender.close()
            self.node.close()


def _lander(k: Any, dest: np.ndarray, a: int, b: int):
    """The callback that copies an answer's values into ``dest[a:b]``."""

    def land(reply: Message) -> None:
        if not reply.arrays or reply.arrays[0].size != b - a:
            raise ClusterError(f"pull of key {k!r}: server sent a wrong-sized reply")
        got = reply.arrays[0]
        if got.ctypes.data != dest[a:b].ctypes.data:  # (else the van copied it in place)
            dest[a:b] = got.reshape(-1)
        reply.arrays = []  # copied out: do not keep a second copy in the future

    return land


def _finisher(meta: KeyMeta, dest: np.ndarray, targets: list[np.ndarray], direct: bool):
    """What a pull does once all its answers landed: fill the targets that were not ``dest``."""
    first = targets[0]

    def finish() -> None:
        if not direct:
            first[...] = dest.reshape(meta.shape)
        for t in targets[1:]:
            t[...] = first

    return finish


def completed_handle() -> Handle:
    """Exported for stores whose calls complete at once."""
    return completed()
