"""The worker side of the distributed KVStore (``dist_sync``, ``dist_async``): MXNet's API.

Each call is cut into requests, one per chunk of each part of each key (see
:mod:`hetps.kvstore.placement`), and handed to the send queue (:mod:`hetps.kvstore.sender`):
highest priority first, but a request never overtakes an earlier one of the same slice, so
per-key order is preserved.

As in MXNet, ``push`` returns once the values are captured (copied: a later write to the
caller's array changes nothing that is sent) and ``pull`` blocks. A pull of a key sees this
worker's earlier pushes of it. In dist_sync, when a worker pulls each key it pushed (the
training loop), the push of a small key asks the server to answer with the key's value once the push took effect
(a fused push-pull), and the pull that follows takes that answer instead of a second round
trip. ``block=False`` returns a :class:`~hetps.kvstore.base.Handle`; ``wait_all``/``barrier``
wait for every push. With network-aware balancing on, a
:class:`~hetps.balance.agent.BalanceAgent` times the traffic and moves slices between servers
at every :meth:`DistKVStore.rebalance`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from hetps import optim
from hetps.cluster import bodies
from hetps.cluster import protocol as P
from hetps.cluster.errors import RequestError
from hetps.cluster.node import Node
from hetps.cluster.requests import Future, wait_all
from hetps.config import NodeConfig
from hetps.kvstore import hostagg, states
from hetps.kvstore.base import (
    Handle,
    check_dtype,
    check_like,
    normalize_keys,
    out_arrays,
    per_key,
    reduce_values,
    settle,
    settle_after,
    staged_call,
)
from hetps.kvstore.compression import TwoBitCompressor, parse_compression_params
from hetps.kvstore.dense import DenseRequests
from hetps.kvstore.keys import KeyMeta, fill_targets
from hetps.kvstore.pipeline import Pipeline
from hetps.kvstore.placement import Part, chunk_elems, chunks, parts_of
from hetps.tables.rowsparse import Table
from hetps.tables.worker import SparseKeys, is_table
from hetps.transport.codec import Message

log = logging.getLogger("hetps.worker")


class DistKVStore:
    """A worker's handle on the distributed KVStore (MXNet's ``KVStoreDist``). Its parts:
    ``pipeline`` (every request on its way), ``dense`` (a dense key's chunk requests),
    ``sparse`` (row-sparse keys), ``joins`` (a worker joining a running job). Its fault
    parts come from above (:mod:`hetps.faults`): its Node's recovery and its own
    ``joining`` (:class:`hetps.faults.joining.Joining`). The composition root
    (:func:`hetps.roles.new_worker_store`) builds the Node, the pipeline, the fault part,
    the balance agent and the meter, and hands them in."""

    def __init__(
        self,
        name: str,
        cfg: NodeConfig,
        *,
        node: Node,
        pipeline: Pipeline,
        joining: Callable[[DistKVStore], Any],
    ) -> None:
        self.type = name
        self.sync = name.startswith("dist_sync")
        self.cfg = cfg
        self.node = node
        self.num_servers = len(self.node.servers())
        #: the servers' node ids by rank (a plan names servers by rank, requests go to ids)
        self.server_ids = [s.id for s in self.node.servers()]
        self.meta: dict[Any, KeyMeta] = {}
        self.order: list[Any] = []  # keys in init order (the balance layout's order)
        self.compressor: TwoBitCompressor | None = None
        self.balance = cfg.balance != "none"
        self.pipeline = pipeline
        self.request = pipeline.request  # queue a request for a server by rank
        self._sender = self.pipeline.sender  # the send queue (read by tests and benchmarks)
        self.dense = DenseRequests(self)
        self.sparse = SparseKeys(self)  # row-sparse keys (tables/worker.py)
        self.joins = joining(self)  # a worker started again joins (faults/joining.py)
        self._next_slice = 0  # balance layout: the server of the next slice, round-robin
        self._closed = False
        # key -> {(start, stop): workers}: ranges last received as a sum of fewer workers
        # than the job's (a worker left: HETPS_ELASTIC); see short_rounds()
        self.short_marks: dict[Any, dict[tuple[int, int], int]] = {}
        # push calls since the last pull, and in the run before: a run of several (a per-key
        # loop) hands its pushes to the sender thread so that they coalesce; a lone push
        # (push, then pull) is sent by the caller, one thread hand-off less
        self._push_run = 0
        self._last_push_run = 0
        self.calls = 0  # push calls so far (which call made which of a key's pushes)
        # network-aware load distribution (HETPS_BALANCE): slices, measurements, plans;
        # and live metrics (docs/LIVE.md): both plugged in by the composition root (plug)
        self.agent: Any = None
        self.meter: Any = None
        # pulls answered by the push before them (dist_sync, slices that stay where they are)
        self._prefetch = self.sync and not self.balance
        self.node.handler = self.pipeline.on_message  # forecasts and push receipts
        # copies of every key on several servers (HETPS_REPLICAS): pushes carry their round
        self.copies = self.node.replicas > 1 and self.sync
        # the host's workers sum through shared memory, push and pull once (docs/HOSTS.md)
        self.hostagg, self.host_tag = hostagg.plan(self)
        if cfg.verbose >= 1:
            log.info("worker rank %d of %d is up (%s)", self.rank, self.num_workers, name)

    # -- identity ---------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This worker's rank, 0 .. num_workers-1."""
        return self.node.rank

    def server_id(self, server_rank: int) -> int:
        """The node id of server ``server_rank`` (as registered; a plan names servers by
        rank, requests go to node ids)."""
        return self.server_ids[server_rank]

    @property
    def num_workers(self) -> int:
        """Number of workers in the job (as started; see :attr:`live_workers`)."""
        return len(self.node.workers())

    @property
    def live_workers(self) -> int:
        """Workers still in the job: fewer than :attr:`num_workers` once a worker died and
        the job went on without it (``HETPS_ELASTIC``)."""
        return len(self.node.live_workers())

    @property
    def live_rank(self) -> int:
        """This worker's place among the live workers, 0 .. live_workers-1 (its data shard
        after a worker left); :attr:`rank` stays what it was. -1 on a worker started again
        that has not joined yet (:attr:`rejoining`): it leads nothing."""
        if self.rejoining:
            return -1
        return [n.id for n in self.node.live_workers()].index(self.node.id)

    def short_rounds(self, key: Any) -> list[tuple[int, int, int]]:
        """Ranges ``(start, stop, workers)`` of the flat value of ``key`` last received
        (pull or pushpull) that hold the sum of fewer workers than :attr:`num_workers`: a
        worker left in that round (``HETPS_ELASTIC``, dist_sync without a server optimizer).
        Divide those ranges by ``workers`` instead of ``num_workers`` to average. Empty
        while every worker takes part."""
        marks = self.short_marks.get(key)
        out: list[tuple[int, int, int]] = []
        for (a, b), w in sorted(marks.items()) if marks else ():
            if out and out[-1][1] == a and out[-1][2] == w:  # chunks of one range: joined
                out[-1] = (out[-1][0], b, w)
            else:
                out.append((a, b, w))
        return out

    @property
    def timeout(self) -> float:
        """Seconds a call waits for its answers before raising."""
        return self.cfg.request_timeout

    @property
    def plan(self) -> dict | None:
        """The load plan in force (None: balancing is off or no plan yet)."""
        return self.agent.plan if self.agent is not None else None

    # -- plumbing ---------------------------------------------------------------------------
    def end_push_run(self) -> None:
        """A pull ends a run of push calls (how long it was decides whether the next run's
        pushes go through the sender thread, to coalesce)."""
        if self._push_run:
            self._last_push_run, self._push_run = self._push_run, 0

    def plug(self, agent: Any = None, meter: Any = None) -> None:
        """Take the balance agent (HETPS_BALANCE) and the live metrics meter that the
        composition root made for this store (:func:`hetps.roles.new_worker_store`); the
        pipeline times and reports through them too."""
        self.agent = self.pipeline.agent = agent
        self.meter = self.pipeline.meter = meter

    def send_metrics(self, body: dict) -> None:
        """Send a live metrics report to the scheduler (the meter's way out)."""
        self.node.send(P.SCHEDULER_ID, Message(P.METRICS_REPORT, body=body))

    def link_bytes(self) -> dict[int, tuple[int, int]]:
        """Bytes sent to and received from each server (by rank), since the start."""
        snap = self.node.counters.snapshot()
        return {
            rank: (snap[sid].bytes_sent, snap[sid].bytes_recv)
            for rank, sid in enumerate(self.server_ids)
            if sid in snap
        }

    def placement(self, key: Any, size: int) -> list[Part]:
        """Where the parts of a new key of ``size`` elements go (by the balance layout's
        round-robin of slices when balancing is on)."""
        if not self.balance:
            return parts_of(key, size, self.num_servers, self.cfg.bigarray_bound)
        x = self.cfg.slice_elems
        parts = []
        for j, a in enumerate(range(0, max(size, 1), x)):
            b = min(a + x, size)
            parts.append(Part((self._next_slice + j) % self.num_servers, j, a, b))
        self._next_slice += len(parts)
        return parts

    def _meta(self, key: Any, what: str) -> KeyMeta:
        m = self.meta.get(key)
        if m is None and key in self.sparse.tables:
            raise TypeError(
                f"{what} of key {key!r}: a row-sparse key; read its rows with "
                f"kv.row_sparse_pull({key!r}, out=..., row_ids=...)"
            )
        if m is None:
            raise KeyError(
                f"{what}: key {key!r} was never initialised: call kv.init({key!r}, value) first"
            )
        return m

    def _finish_call(self, futs: list[Future], block: bool, what: str, finish=None) -> Handle:
        self.pipeline.track(futs)
        handle = Handle(futs, self.timeout, what, finish)
        if block:
            handle.wait()
        return handle

    # -- API --------------------------------------------------------------------------------
    def init(self, key: Any, value: Any) -> None:
        """Initialise keys; rank 0's values are stored (the first live worker's, once rank 0
        died and the job went on without it). Returns once they are on the servers."""
        self.node.check()
        keys, is_list = normalize_keys(key)
        lead = self.live_rank == 0
        entries = per_key(value, len(keys), is_list, "init")
        if self.agent is not None:
            self.agent.before_init()
        futs: list[Future] = []
        with staged_call(futs), self.pipeline.batched():
            for k, entry in zip(keys, entries, strict=False):
                if is_table(entry):  # a row-sparse key
                    futs += self.sparse.init_table(k, entry, lead)
                    continue
                self.sparse.tables.pop(k, None)
                arr, _ = reduce_values(entry, f"init of key {k!r}")
                check_dtype(arr.dtype, k)
                if k not in self.meta:
                    self.order.append(k)
                parts = self.placement(k, arr.size)
                self.meta[k] = KeyMeta(tuple(arr.shape), arr.dtype, parts)
                if self.hostagg is not None:
                    self.hostagg.create(k, self.meta[k])
                if not lead:
                    continue
                flat = np.ascontiguousarray(arr).reshape(-1)
                step = chunk_elems(self.cfg.chunk_bytes, arr.dtype.itemsize)
                for p in parts:
                    for a, b in chunks(p.start, p.stop, step):
                        body = bodies.chunk(
                            k, p.index, a - p.start, b - a, arr.shape, arr.dtype.name, size=p.size
                        )
                        msg = Message(P.INIT, body=body, arrays=[flat[a:b]])
                        futs.append(self.request(k, 0, p.server, msg))
        settle(futs)
        wait_all(futs, self.timeout, "init")
        self.node.barrier("worker", self.timeout)

    def push(self, key: Any, value: Any, priority: int = 0, block: bool = False) -> Handle:
        """Push values (a list per key is summed first); returns once they are captured, as
        MXNet's push does: a later write to ``value`` changes nothing that is sent. A later
        pull of the key sees this push; its errors are raised by that pull, by the handle's
        ``wait()``, by :meth:`wait_outstanding` and by :meth:`barrier`. With ``block=True``
        it returns when the push took effect (in dist_sync: every worker pushed the round and
        the server applied it)."""
        self.node.check()
        keys, is_list = normalize_keys(key)
        entries = per_key(value, len(keys), is_list, "push")
        futs: list[Future] = []
        hosted: list = []  # keys pushed through the host (block: waited for below)
        self._push_run += 1
        self.calls += 1
        # (a table's push is parked: the row_sparse_pull that follows it sends it, merged in
        # one message per server, or the sender thread does if no pull comes soon)
        park = not block and self.sparse.any_of(keys)
        deferred = park or (not block and max(self._push_run, self._last_push_run) > 1)
        with staged_call(futs), self.pipeline.batched(deferred=deferred, park=park):
            for k, entry in zip(keys, entries, strict=False):
                if k in self.sparse.tables:
                    futs += self.sparse.push_table(k, entry, priority, self.calls, self.copies)
                    continue
                meta = self._meta(k, "push")
                if self.meter is not None:
                    self.meter.pushed(k)
                arr, staged = reduce_values(entry, f"push of key {k!r}")
                check_like(k, meta, arr, "push")
                if self.hostagg is not None and self.hostagg.takes(k):
                    self.hostagg.push(k, meta, arr)  # (its errors: the pull's)
                    hosted.append(k)
                    continue
                if self.sync:
                    self.dense.round_credit(meta)
                borrowed = False
                # (compression makes its own copy; a device tensor's staging buffer is the
                # push's own until it is answered)
                if not block and self.compressor is None and not staged:
                    borrowed = self.dense.through_rings(meta)
                    if not borrowed:
                        arr = meta.capture(arr)
                dest = meta.prefetch_into() if self._prefetch else None
                pushed = self.dense.push(k, meta, arr, priority, dest, borrowed)
                meta.pushed = pushed
                meta.pushed_since_pull = True
                if self.sync:
                    meta.recent.append((self.calls, pushed))
                if dest is not None:
                    meta.prefetch = (pushed, dest)
                futs += pushed
        settle(futs)
        for k in hosted if block else ():  # (sent once the call's batch left)
            self.hostagg.settle(k)
        return self._finish_call(futs, block, "push")

    def pull(
        self,
        key: Any,
        out: Any = None,
        priority: int = 0,
        block: bool = True,
        ignore_sparse: bool = True,
    ) -> Any:
        """Pull keys into ``out`` (in place; a list of outs each gets the value). With no
        ``out``, blocking calls return new arrays. Non-blocking calls return a Handle.
        ``ignore_sparse`` is MXNet's and taken as it is (tables answer ``row_sparse_pull``)."""
        self.node.check()
        self.end_push_run()
        keys, is_list = normalize_keys(key)
        futs: list[Future] = []
        finishers = []
        results = []
        outs = per_key(out, len(keys), is_list, "pull") if out is not None else [None] * len(keys)
        with staged_call(futs), self.pipeline.batched():
            for k, entry in zip(keys, outs, strict=False):
                meta = self._meta(k, "pull")
                targets = (
                    out_arrays(entry, f"pull of key {k!r}")
                    if entry is not None
                    else [np.empty(meta.shape, meta.dtype)]
                )
                for t in targets:
                    check_like(k, meta, t, "pull")
                if self.hostagg is not None and self.hostagg.pending(k):  # through the host
                    f, fin = [], self.hostagg.pull(k, meta, targets)
                elif meta.prefetch is not None:  # the last push brings the value: no request
                    f, fin = meta.take_prefetch(targets)
                    if self.meter is not None:  # timed all the same (docs/LIVE.md)
                        fin = self.meter.timed_fused_pull(fin)
                else:
                    f, fin = self.dense.pull(k, meta, targets, priority)
                    # the earlier push's errors are this pull's too (it may have been refused)
                    f = meta.pushed + f if meta.pushed_since_pull else f
                    if meta.pushed_since_pull and self._prefetch:
                        meta.prefetching = True  # pulls follow pushes: fuse them from now on
                meta.pushed_since_pull = False
                futs += f
                finishers.append(fin)
                results.append(targets[0])

        done = settle_after(futs, finishers)

        def finish() -> Any:
            done()
            if out is None:
                return results if is_list else results[0]
            return None

        handle = self._finish_call(futs, block, "pull", finish)
        return handle.wait() if block else handle

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
        with staged_call(futs), self.pipeline.batched():
            for k, entry, out_entry in zip(keys, entries, outs, strict=False):
                meta = self._meta(k, "pushpull")
                if self.meter is not None:
                    self.meter.pushed(k)
                arr, _ = reduce_values(entry, f"pushpull of key {k!r}")
                check_like(k, meta, arr, "push")
                targets = out_arrays(out_entry, f"pushpull of key {k!r}")
                for t in targets:
                    check_like(k, meta, t, "pull")
                if self.hostagg is not None and self.hostagg.takes(k):
                    self.hostagg.push(k, meta, arr)
                    finishers.append(self.hostagg.pull(k, meta, targets))
                    continue
                first = targets[0]
                direct = first.flags.c_contiguous and first.flags.writeable
                # landing in the pushed array itself is safe: a range's answer comes after the
                # server has received that range
                dest = first.reshape(-1) if direct else np.empty(meta.size, meta.dtype)
                pushed = self.dense.push(k, meta, arr, priority, dest)
                # a later pull sees this round: not the value an earlier push brings
                meta.prefetch, meta.pushed, meta.pushed_since_pull = None, pushed, False
                futs += pushed
                finishers.append(fill_targets(meta, dest, targets, direct))
        finish = settle_after(futs, finishers)
        handle = self._finish_call(futs, False, "pushpull", finish)
        return handle.wait() if block else handle

    def broadcast(self, key: Any, value: Any, out: Any, priority: int = 0) -> None:
        """Initialise ``key`` with rank 0's ``value`` and pull it into ``out`` on every worker."""
        self.init(key, value)
        self.pull(key, out, priority)

    def wait_outstanding(self) -> None:
        """Wait for every request this worker has in flight; raise the first error no call
        has raised yet (a push's, whose call returned before its answer)."""
        if self.hostagg is not None:  # (the rounds pushed through the host, applied)
            self.hostagg.settle()
        self.pipeline.wait_outstanding()

    def barrier(self) -> None:
        """Wait for this worker's outstanding pushes, then for every worker."""
        if self.hostagg is not None:  # (a table's pull only some local ranks make: theirs)
            self.hostagg.tables.skip()
        self.wait_outstanding()
        self.node.barrier("worker", self.timeout)

    def set_optimizer(self, optimizer: optim.Optimizer) -> None:
        """Ship ``optimizer`` (by value) to every server; returns on every worker only when
        every server has it."""
        self.node.check()
        self.wait_outstanding()
        if not isinstance(optimizer, optim.Optimizer):
            raise TypeError(
                f"set_optimizer takes a hetps.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if self.live_rank == 0:
            blob = np.frombuffer(optim.dumps(optimizer), dtype=np.uint8)
            futs = [
                self.request(None, 0, s, Message(P.SET_OPTIMIZER, arrays=[blob]))
                for s in range(self.num_servers)
            ]
            wait_all(futs, self.timeout, "set_optimizer")
        self.node.barrier("worker", self.timeout)

    def set_gradient_compression(self, params: dict) -> None:
        """Turn on MXNet's 2-bit compression of pushes: ``{'type': '2bit', 'threshold': t}``."""
        self.compressor = parse_compression_params(params)
        if self.hostagg is not None:  # the host's sum is compressed, its residual the host's
            self.hostagg.compression()
        for m in self.meta.values():
            m.residual = None

    def save_optimizer_states(self, fname: str) -> None:
        """Write every server's optimizer state to ``fname`` (after this worker's pushes)."""
        states.save(self, fname)

    def load_optimizer_states(self, fname: str) -> None:
        """Load optimizer states written by :meth:`save_optimizer_states` onto the servers
        (after this worker's pushes took effect)."""
        states.load(self, fname)

    # -- row-sparse keys (the part ``sparse``) ---------------------------------------------
    def row_sparse_pull(
        self, key: Any, out: Any = None, priority: int = 0, row_ids: Any = None
    ) -> Any:
        """Read the rows ``row_ids`` of row-sparse keys (MXNet's ``row_sparse_pull``):
        :meth:`hetps.tables.worker.SparseKeys.row_sparse_pull`."""
        self.end_push_run()  # (a pull ends a run of pushes, as pull's)
        return self.sparse.row_sparse_pull(key, out, priority, row_ids)

    def table(self, key: Any) -> Table:
        """The :class:`~hetps.tables.rowsparse.Table` declared for ``key`` (KeyError if it
        is not row-sparse)."""
        return self.sparse.table(key)

    def is_row_sparse(self, key: Any) -> bool:
        """Whether ``key`` was initialised as a row-sparse table."""
        return self.sparse.is_row_sparse(key)

    # -- a worker joining a running job (the part ``joins``: docs/FAULTS.md) --------------
    @property
    def rejoining(self) -> bool:
        """Whether this worker was started again after it died and the job went on without
        it: call :meth:`join` before any round (its pushes are refused until then)."""
        return self.joins.rejoining

    @property
    def joining(self) -> bool:
        """Whether a worker waits to join: the live workers let it in with :meth:`admit` at
        a round boundary that all of them take."""
        return self.joins.joining

    def admit(self, state: bytes | None = None) -> None:
        """Let the workers that wait to join in (every live worker, at the same round
        boundary): :meth:`hetps.faults.joining.Joining.admit`."""
        self.joins.admit(state)

    def join(self) -> bytes | None:
        """Wait until the live workers admit this worker started again, and return the state
        the first live worker gave: :meth:`hetps.faults.joining.Joining.join`."""
        return self.joins.join()

    def declare(self, key: Any, value: Any) -> None:
        """Make keys that exist on the servers already known to this worker, with no request
        and no barrier: :meth:`hetps.faults.joining.Joining.declare`."""
        self.joins.declare(key, value)

    # -- network-aware load distribution ---------------------------------------------------
    def rebalance(self) -> dict | None:
        """Call at an iteration boundary (every worker, the same iterations). Reports this
        worker's link measurements to the scheduler and switches to the plan it decided; a
        slice that moves takes its value and optimizer state along. Returns the plan (epoch,
        shares per server; on rank 0 also the link matrix and node rates) or None when
        balancing is off (:meth:`hetps.balance.agent.BalanceAgent.rebalance`)."""
        if self.agent is None:
            return None
        return self.agent.rebalance()

    # -- shutdown ---------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._closed

    def close(self, error: str | None = None) -> None:
        """Finish this worker: wait for its requests, tell the scheduler, close the sockets.

        With ``error`` (the worker is failing) the scheduler is told at once so that the
        other nodes stop with a clear message instead of waiting for a heartbeat timeout.
        """
        if self._closed:
            return
        self._closed = True
        try:
            if self.meter is not None:  # a last report: the scheduler gets the final totals
                self.meter.close()
            if error is not None:
                self.node.leave(error)
            elif self.node.failure is None:
                try:
                    self.wait_outstanding()
                except RequestError as exc:  # already reported to the caller; still finish
                    log.debug("worker: outstanding request failed at close: %s", exc)
                self.node.finish(self.timeout)
        finally:
            if self.hostagg is not None:
                self.hostagg.close()
            self.pipeline.close()
            self.node.close()
