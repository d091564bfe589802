"""The KVStore server: holds its parts of every key, merges pushes, runs the optimizer.
(docs/MODULES.md, "hetps.kvstore.server")"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from hetps import optim
from hetps.cluster import allow, batch, commands
from hetps.cluster import protocol as P
from hetps.cluster.bodies import Init, Pull, Push
from hetps.cluster.protocol import NodeInfo
from hetps.kvstore import checks
from hetps.kvstore.aggregate import Aggregator, writable
from hetps.kvstore.answers import Answers
from hetps.kvstore.hostrounds import HostRounds, keep, mixed
from hetps.kvstore.linkmeter import LinkMeter
from hetps.kvstore.slices import BadRequest, Slice
from hetps.tables.server import Tables
from hetps.transport.codec import WIRE_DTYPES, Message

if TYPE_CHECKING:
    from hetps.cluster.node import Node

log = logging.getLogger("hetps.server")


class KVServer:
    """Request handler of a server node. ``node`` gives ``reply`` and the worker count.
    (docs/MODULES.md, "hetps.kvstore.server")"""

    #: commands whose arrays may be lent by the van (read straight from a shared-memory ring,
    #: valid only while :meth:`handle` runs): a push is merged from the ring into the merge
    #: buffer, and whatever keeps a push (the backlog) gets a copy when the van releases it
    #: (and a primary's copy, applied or copied out at once: see faults/replicas.py)
    BORROWS = frozenset({P.PUSH, P.REPLICATE})

    def __init__(
        self,
        node: Node,
        sync: bool | None = None,
        *,
        replication: Callable[[KVServer], Any],
        elastic: Callable[[KVServer], Any],
        aggregator: Callable[..., Aggregator] = Aggregator,
    ) -> None:
        self.node = node
        self.sync = sync  # None: decided by each push's "sync" field
        self.slices: dict[tuple[Any, int], Slice] = {}
        self.optimizer: optim.Optimizer | None = None
        self.optimizer_blob: bytes | None = None  # as a worker sent it (for a new replica)
        self.optimizers: frozenset[str] | None = None  # HETPS_OPTIMIZERS' names (None: any)
        self._fixed_workers: int | None = None if hasattr(node, "workers") else 1
        self.rounds = 0
        self.done_workers: dict[int, str] = {}  # worker id -> description
        # answers: at once, or one message per worker for what one message produced
        self.answers = Answers(node)
        # (HETPS_SERVER_DEVICE: the composition root gives one that sums on a device)
        self.aggregator = aggregator(lambda: self.num_workers, lambda: self.optimizer)
        self.links = LinkMeter(node)
        self.replication = replication(self)
        self.elastic = elastic(self)
        self.hostrounds = HostRounds(self)  # rounds summed per host (host groups known)
        self.tables = Tables(self)  # row-sparse keys (embedding tables)
        self.handlers: dict[str, Callable[[Message], None]] = {}
        for cmd, handler in (
            (P.BATCH, self._batch),
            (P.PUSH, self._push),
            (P.PULL, self._pull),
            (P.INIT, self.init),
            (P.SET_OPTIMIZER, self._set_optimizer),
            (P.GET_STATES, self._get_states),
            (P.SET_STATES, self._set_states),
            (P.FORECAST, self.links.forecast),
            (P.PROBE, lambda msg: self.links.probe(msg, self.answers)),
            (P.WORKER_DONE, self._worker_done),
            (P.DROP, self.replication.drop),
            (P.REPLICATE, self.replication.copy_in),
            (P.ENTER, self.elastic.enter),
            *((cmd, self.tables.handle) for cmd in P.SPARSE_COMMANDS),
        ):
            self.on(cmd, handler)
        if hasattr(node, "on_failover"):
            node.on_failover = self.replication.on_failover
            node.on_rejoin = self.replication.on_rejoin
            node.done_workers = lambda: sorted(self.done_workers)
        if hasattr(node, "on_worker_left"):
            node.on_worker_left = self.elastic.on_worker_left

    def on(self, cmd: str, handler: Callable[[Message], None]) -> None:
        """Handle requests of ``cmd`` with ``handler`` (raising BadRequest refuses one)."""
        self.handlers[cmd] = handler

    @property
    def num_workers(self) -> int:
        """Workers in the job (read from the node table, so it is right from the first push)."""
        if self._fixed_workers is not None:
            return self._fixed_workers
        if getattr(self.node, "left", None):  # (HETPS_ELASTIC) workers that died, let go
            return len(self.node.live_workers())
        return len(self.node.workers())

    @num_workers.setter
    def num_workers(self, value: int) -> None:
        self._fixed_workers = value

    @property
    def workers_fixed(self) -> bool:
        """Whether the worker count was set by hand (no node table): none leaves or joins."""
        return self._fixed_workers is not None

    def job_workers(self) -> int:
        """The workers of the job, those that left included."""
        if self._fixed_workers is not None:
            return self._fixed_workers
        return len(self.node.workers())

    @property
    def opt_s(self) -> float:
        """Seconds spent in the optimizer (live metrics)."""
        return self.aggregator.opt_s

    # -- entry point ------------------------------------------------------------------------
    def handle(self, msg: Message) -> None:
        """Handle one request; errors are answered, never raised."""
        if self.answers.begin():
            try:
                self._handle(msg)
            finally:
                self.answers.flush()
        else:
            self._handle(msg)

    def _handle(self, msg: Message) -> None:
        try:
            handler = self.handlers.get(msg.cmd)
            if handler is None:
                raise BadRequest(f"unknown command {msg.cmd!r}")
            # (what came through a node was decoded by its dispatch: here a batch's items)
            why = commands.decode(msg)
            if why is not None:
                raise BadRequest(why)
            handler(msg)
        except BadRequest as exc:
            self.links.take(msg)
            log.warning("server: refused %s from node %d: %s", msg.cmd, msg.sender, exc)
            self.answers.reply(msg, {"error": str(exc)})
        except Exception as exc:  # noqa: BLE001 - the server must keep serving
            log.exception("server: error in %s from node %d", msg.cmd, msg.sender)
            self.answers.reply(
                msg, {"error": f"server error in {msg.cmd}: {type(exc).__name__}: {exc}"}
            )

    def _batch(self, msg: Message) -> None:
        """Several requests in one message: each is checked and handled as if it came alone,
        in order; their answers go back together (see :meth:`_reply`)."""
        try:
            items = batch.unpack(msg)
        except batch.BadBatch as exc:
            raise BadRequest(f"batch: {exc}") from None
        role_of = getattr(self.node, "role_of", None)
        role = role_of(msg.sender) if role_of is not None else None
        for item in items:
            if not allow.permits(allow.SERVER, role, item.cmd):
                raise BadRequest(f"batch: a server does not take {item.cmd!r} from this sender")
        for item in items:
            self._handle(item)

    def from_worker(self, msg: Message) -> bool:
        """Whether ``msg`` came on the connection of a registered worker."""
        role_of = getattr(self.node, "role_of", None)
        return role_of is not None and role_of(msg.sender) == "worker"

    # -- commands ---------------------------------------------------------------------------
    def init(self, msg: Message) -> None:
        """A chunk of a key's first value (or a replica's copy of one: op ``init``)."""
        self.elastic.in_rounds(msg)
        # every field's type and bound checked at decode; a worker counts a key's rounds from
        # its init, and a slice that a plan moves here (HETPS_BALANCE) comes with its rounds
        b = checks.body(msg, Init)
        key, part, off, n, size = b.key, b.part, b.offset, b.count, b.size
        shape, dname = b.shape, b.dtype
        elems = 1
        for d in shape:
            elems *= d
        if size > elems or off + n > size:
            raise BadRequest(
                f"init of key {key!r}: a part of {size} elements with range [{off}, {off + n}) "
                f"does not fit a key of shape {tuple(shape)}"
            )
        sl = self.slices.get((key, part))
        if (
            sl is None
            or sl.value.size != size
            or sl.value.dtype.name != dname
            or sl.shape != tuple(shape)
        ):
            try:
                value = np.zeros(size, dtype=WIRE_DTYPES[dname])
            except (MemoryError, ValueError) as exc:
                raise BadRequest(
                    f"init of key {key!r}: cannot hold a part of {size} elements ({exc})"
                ) from None
            sl = Slice(key, part, tuple(shape), value)
            self.slices[(key, part)] = sl
        data = checks.push_data(msg, sl, b)
        writable(sl)
        sl.value[off : off + n] = data
        self.aggregator.value_changed(sl)
        sl.rounds = b.round
        if msg.cmd == P.INIT:
            sl.primary, sl.origin = True, None
        else:  # a copy, even of a slice served here until a plan moved it to the sender
            sl.primary, sl.origin = False, msg.sender
        if msg.cmd == P.INIT and self.replication.replicas():
            body = dict(msg.body, op="init")
            self.replication.copy_out(body, np.array(data), lambda: self.answers.reply(msg))
            return
        self.answers.reply(msg)

    def ack(self, msg: Message, sl: Slice) -> None:
        """Acknowledge a push that took effect; a fused push-pull ("pp") gets the value too."""
        meas = self.links.take(msg)
        body = {"meas": meas} if meas is not None else None
        b = checks.body(msg, Push)  # (decoded when the push arrived)
        if b.fused:
            self._send_value(msg, sl, b.offset, b.count, body)
        else:
            self.answers.reply(msg, body)

    def _send_value(self, msg: Message, sl: Slice, off: int, n: int, body: dict | None) -> None:
        """Answer ``msg`` with ``sl.value[off:off+n]``, zero-copy: the reply is tracked so the
        value is not changed in place while ZeroMQ still reads it."""
        if off == 0 and self.optimizer is not None:
            if not sl.has_state:  # a pull before any push: the pulled weight still counts
                sl.state = self.optimizer.create_state(sl.skey, sl.value)
                sl.has_state = True
            self.optimizer.on_pull(sl.skey, sl.value, sl.state, sender=msg.sender)
        if sl.short is not None and self.optimizer is None:
            body = {**(body or {}), "w": sl.short}  # a sum of fewer workers than the job's
        if msg.typed.tag is not None:  # the worker measures this reply: announce it first
            self.links.forecast_to(msg)
        tracker = self.answers.reply(
            msg, body, arrays=[sl.value[off : off + n]], track=True, timed=msg.typed.tag is not None
        )
        if tracker is not None:
            sl.inflight = [t for t in sl.inflight if not t.done]
            sl.inflight.append(tracker)

    def _push(self, msg: Message) -> None:
        b = checks.body(msg, Push)  # (decoded by the dispatch, once)
        if b.tag is not None and not self.links.measured(msg):
            self.links.measure(msg)
        if b.receipt:
            # arrived: the worker may send more (its push window), long before a sync round
            # completes and acknowledges the push itself; once (a push kept for a later
            # round is handled again, with the body it was decoded to)
            b.receipt = False
            self.node.send(msg.sender, Message(P.RECEIPT, body={"req": msg.req}))
        key, part, off, n, ce = b.key, b.part, b.offset, b.count, b.chunk
        sl = checks.find_slice(self.slices, msg, b)
        self.replication.check(sl)
        sl.primary = True  # (a copy becomes the key itself when a worker pushes it here)
        sync = self.sync if self.sync is not None else b.sync
        if not sync and self.optimizer is None:
            raise BadRequest(
                f"push of key {key!r} in dist_async needs a server optimizer: call "
                "kv.set_optimizer(...) before the first push"
            )
        worker = msg.sender
        if self.elastic.gone(worker):
            raise BadRequest("push from a worker that left the job")  # (sent before it died)
        if sl.value.size == 0:  # nothing to merge or apply: a round of nothing completes at once
            self.ack(msg, sl)
            return
        in_order = False  # the push says it is of this very round
        if sync and (sl.copying or (b.round is not None and self.replication.replicated)):
            rnd = sl.rounds if b.round is None else b.round
            if rnd < sl.rounds:  # a resent push of a round applied here already (a failover)
                checks.payload_fits(msg, sl, b)
                self.ack(msg, sl)
                return
            if sl.copying or rnd > sl.rounds:  # its round comes later
                checks.payload_fits(msg, sl, b)
                sl.backlog.append(msg)
                return
            in_order = b.round is not None and self.replication.replicated
        if sync and b.host is not None and self.elastic.applied(msg, sl, b.round):
            return
        if sync and self.done_workers:
            raise BadRequest(self.uneven(sl))
        if sync and (
            sl.got.get(worker, 0) >= sl.value.size
            or (not in_order and any(m.sender == worker for m in sl.backlog))
        ):
            checks.payload_fits(msg, sl, b)  # kept only if it fits its part
            sl.backlog.append(msg)  # this worker already pushed the whole round: next round
            return
        # a 2-bit push is decoded into the merge buffer (not one kept apart until the round ends)
        grouped = sync and b.host is not None and not self.elastic.active
        packed = sync and not self.elastic.active and not grouped
        data = checks.push_data(msg, sl, b, packed=packed)
        comp = b.threshold if packed else None
        if ce is None:
            raise BadRequest(
                f"push of key {key!r}: field 'ce' (elements per chunk the worker cuts parts "
                "into) is missing"
            )
        if off % ce or n != min(ce, sl.value.size - off):
            raise BadRequest(
                f"push of key {key!r}: range [{off}, {off + n}) is not a chunk of {ce} elements "
                f"of part {part} ({sl.value.size} elements)"
            )
        if sync:
            if off in sl.seen.get(worker, ()):  # twice in a round would leave a chunk unwritten
                raise BadRequest(
                    f"push of key {key!r}: chunk at {off} pushed twice in one round by this worker"
                )
            if self.elastic.active or grouped:  # kept per sender until the round is whole
                rounds = self.elastic if self.elastic.active else self.hostrounds
                rounds.check(sl, worker, b.host, ce)  # (refused: the round is unchanged)
                if b.host is not None:
                    sl.hosts[worker] = b.host
                keep(msg, sl, worker, data, off, n, ce)
                rounds.finish_if_complete(sl)
                return
            if sl.hosts:
                raise BadRequest(mixed(key))
            self._add_to_round(msg, sl, worker, data, comp, off, n, ce)
            return
        # async: collect the chunks of one push, then apply it at once
        for m in self.aggregator.collect(sl, worker, data, off, msg):
            self.ack(m, sl)

    def _add_to_round(
        self, msg: Message, sl: Slice, worker: int, data: Any, comp: Any, off: int, n: int, ce: int
    ) -> None:
        """A checked push of this round goes into its sum; the round finishes with the
        last worker's."""
        agg = self.aggregator
        whole = agg.first_whole(sl, msg, data, comp, off, n, ce)
        if not whole:
            agg.start(sl, ce)
            agg.add_chunk(sl, msg, data, comp, off, n)
        sl.got[worker] = sl.got.get(worker, 0) + n
        sl.seen.setdefault(worker, set()).add(off)
        msg.arrays = []  # merged: the ack needs only who and which request
        sl.acks.append(msg)
        if len(sl.got) == self.num_workers and all(c >= sl.value.size for c in sl.got.values()):
            self.finish_round(sl)

    def uneven(self, sl: Slice) -> str:
        who = ", ".join(self.done_workers.values())
        return (
            f"push of key {sl.key!r} can never complete: {who} already finished its job, so this "
            "dist_sync round would wait for it forever; every worker must run the same number "
            "of rounds (give each the same number of batches)"
        )

    def _worker_done(self, msg: Message) -> None:
        """A worker finished: fail the sync rounds that still wait for it (uneven batch counts)."""
        info = NodeInfo.from_wire(msg.typed.node)
        self.done_workers[info.id] = info.describe()
        self.tables.worker_done(info.id)
        for sl in self.slices.values():
            if sl.got and sl.got.get(info.id, 0) < sl.value.size:
                text = self.uneven(sl)
                for m in sl.acks + sl.deferred + sl.backlog:
                    self.answers.reply(m, {"error": text})
                sl.acks, sl.deferred, sl.backlog, sl.got, sl.merge = [], [], [], {}, None
                sl.seen, sl.pending = {}, {}
                if sl.hosts:
                    sl.held, sl.hosts = {}, {}

    def finish_round(self, sl: Slice) -> None:
        """Every worker pushed the whole part: apply the round, then answer it (once it
        exists on every replica, with HETPS_REPLICAS)."""
        merged = self.aggregator.finish(sl)
        self.rounds += 1
        acks, deferred, backlog = sl.acks, sl.deferred, sl.backlog
        sl.acks, sl.deferred, sl.backlog = [], [], []
        if self.replication.replicas():
            # the round is acknowledged (and the slice goes on) once it exists on every
            # replica: the replicas run the same optimizer on the same merged pushes
            grad = self.optimizer is not None
            body = {
                "op": "round",
                "k": sl.key,
                "part": sl.part,
                "rnd": sl.rounds,
                "mode": "grad" if grad else "value",
            }
            sl.copying = True
            # sent as it is, no copy: while the copy is out the slice takes no push (they
            # wait in the backlog), so neither array changes before every replica answered,
            # and an answer means the replica has read it all
            self.replication.copy_out(
                body,
                merged if grad else sl.value,
                lambda: self._answer_round(sl, acks, deferred, backlog),
            )
            return
        self._answer_round(sl, acks, deferred, backlog)

    def _answer_round(
        self, sl: Slice, acks: list[Message], deferred: list[Message], backlog: list[Message]
    ) -> None:
        """Answer a finished round: acknowledge its pushes, answer the pulls that waited for
        it, then handle what came for the next round (and, while it was being copied, since)."""
        if sl.copying:
            sl.copying = False
            backlog, sl.backlog = backlog + sl.backlog, []
        for m in acks:
            self.ack(m, sl)
        for m in deferred:
            self._pull(m)
        for m in backlog:
            self.handle(m)

    def _pull(self, msg: Message) -> None:
        b = checks.body(msg, Pull)
        sl = checks.find_slice(self.slices, msg, b)
        self.replication.check(sl)
        worker = msg.sender
        if sl.copying:  # answered once the last round exists on every replica
            sl.backlog.append(msg)
            return
        if sl.got.get(worker, 0) > 0 or any(m.sender == worker for m in sl.backlog):
            # this worker pushed in the unfinished round: answer after the round
            if any(m.sender == worker for m in sl.backlog):
                sl.backlog.append(msg)
            else:
                sl.deferred.append(msg)
            return
        self._send_value(msg, sl, b.offset, b.count, None)

    def _set_optimizer(self, msg: Message) -> None:
        if not self.from_worker(msg):  # unpickling runs code: only a worker's, ever
            raise BadRequest("set_optimizer: only a worker of this job may set the optimizer")
        self.elastic.in_rounds(msg)
        if len(msg.arrays) != 1:
            raise BadRequest("set_optimizer: expected one pickled optimizer")
        try:
            opt = optim.loads(msg.arrays[0].tobytes(), self.optimizers)
        except PermissionError as exc:  # HETPS_OPTIMIZERS does not take it (nothing ran)
            raise BadRequest(f"set_optimizer: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - unpickling user code can raise anything
            raise BadRequest(
                f"set_optimizer: the server could not load the optimizer ({type(exc).__name__}: "
                f"{exc}); hetps ships optimizers by value with cloudpickle, so check that the "
                "modules it imports are installed on the servers"
            ) from None
        self.optimizer = opt
        self.optimizer_blob = msg.arrays[0].tobytes()
        for sl in self.slices.values():
            sl.state, sl.has_state = None, False
        self.tables.reset_states()
        log.info("server: optimizer set to %s", type(opt).__name__)
        self.answers.reply(msg)

    def _get_states(self, msg: Message) -> None:
        want = msg.typed.slices  # [(key, part), ...] or None: every state
        keys = None if want is None else set(want)
        # with copies, all the states: only what this server serves (copies are on others);
        # named slices (a plan moves them): each one held here, served or a copy, which is
        # in step with its primary (and a server that takes over may not have heard yet)
        served = self.replication.replicated and keys is None
        states = {
            sk: self.aggregator.host_state(sl)
            for sk, sl in self.slices.items()
            if sl.has_state and (keys is None or sk in keys) and (sl.primary or not served)
        }
        blob = np.frombuffer(optim.dump_states(states), dtype=np.uint8)
        self.answers.reply(msg, arrays=[blob])

    def _set_states(self, msg: Message) -> None:
        if not self.from_worker(msg):  # unpickling runs code: only a worker's, ever
            raise BadRequest("set_states: only a worker of this job may set optimizer states")
        if len(msg.arrays) != 1:
            raise BadRequest("set_states: expected one pickled state map")
        try:
            states = optim.load_states(msg.arrays[0].tobytes(), self.optimizers)
        except PermissionError as exc:  # HETPS_OPTIMIZERS: arrays only (nothing ran)
            raise BadRequest(f"set_states: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - unpickling can raise anything
            raise BadRequest(f"set_states: {type(exc).__name__}: {exc}") from None
        moved = []
        for sk, st in states.items():
            sl = self.slices.get(tuple(sk) if isinstance(sk, list) else sk)
            if sl is not None:
                sl.state, sl.has_state = st, True
                if sl.primary:
                    moved.append(sl)
        if self.replication.replicated and msg.typed.move and moved:
            # slices a plan moved here: their replicas get the states before the answer
            blob = optim.dump_states({sl.skey: sl.state for sl in moved})
            body = {"op": "states"}
            self.replication.copy_out(
                body, np.frombuffer(blob, np.uint8), lambda: self.answers.reply(msg)
            )
            return
        if self.replication.replicated and self.node.redirect:
            # a server admitted again gets no set_states (its requests come here): it gets
            # these states with the rest of what this server serves
            self.replication.resync()
        self.answers.reply(msg)
