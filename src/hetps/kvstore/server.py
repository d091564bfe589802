"""The KVStore server: holds its parts of every key, merges pushes, runs the optimizer.

Requests arrive as chunks (a range of one part of one key). Every chunk is validated against
what the server holds before it is used; a bad one is answered with an error naming the key and
the shapes, and the server goes on serving everyone.

``dist_sync``: the pushes of one round are summed in a merge buffer; when every worker has
pushed the whole part, the optimizer is applied (or, with none set, the sum replaces the value)
and only then are the pushes acknowledged. A pull from a worker that pushed in the unfinished
round waits for the round, so a pull issued after a push sees that round's result.

``dist_async``: each complete push is applied at once by the optimizer and acknowledged after.

Trust: the node checks every request's sender (its connection) against the allow-list before
it reaches :meth:`KVServer.handle` (see :mod:`hetps.cluster.allow`); the server itself checks
again that a pickle comes from a registered worker before it unpickles anything, and checks a
push's payload against its key's part before the push is kept (in a merge, or queued for the
next round).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from hetps import optim
from hetps.cluster import allow, batch
from hetps.cluster import protocol as P
from hetps.cluster.protocol import NodeInfo
from hetps.kvstore.answers import Answers
from hetps.kvstore.compression import TwoBitCompressor
from hetps.kvstore.elastic_rounds import ElasticRounds
from hetps.kvstore.replicas import Copies, _Copy
from hetps.kvstore.slices import BadRequest, Slice, put, short, slice_key
from hetps.kvstore.tables import Tables
from hetps.optim import kernels
from hetps.transport.codec import WIRE_DTYPES, Message, dtype_str

log = logging.getLogger("hetps.server")


class KVServer(Copies, ElasticRounds):
    """Request handler of a server node. ``node`` gives ``reply`` and the worker count."""

    #: commands whose arrays may be lent by the van (read straight from a shared-memory ring,
    #: valid only while :meth:`handle` runs): a push is merged from the ring into the merge
    #: buffer, and whatever keeps a push (the backlog) gets a copy when the van releases it
    #: (and a primary's copy, applied or copied out at once: see kvstore/replicas.py)
    BORROWS = frozenset({P.PUSH, P.REPLICATE})

    def __init__(self, node: Any, sync: bool | None = None) -> None:
        self.node = node
        self.sync = sync  # None: decided by each push's "sync" field
        self.slices: dict[tuple[Any, int], Slice] = {}
        self.tables = Tables(self)  # row-sparse keys (embedding tables)
        self.optimizer: optim.Optimizer | None = None
        self._fixed_workers: int | None = None if hasattr(node, "workers") else 1
        self.rounds = 0
        self.opt_s = 0.0  # seconds in the optimizer (live metrics)
        self.done_workers: dict[int, str] = {}  # worker id -> description
        # (sender, tag) -> (arrival time, whether the receive thread was behind then)
        self._forecasts: dict[tuple[int, Any], tuple[float, bool]] = {}
        self._meas: dict[tuple[int, int], list[float]] = {}  # (sender, req) -> [t0, t1, bytes]
        # answers: at once, or one message per worker for what one message produced
        self.answers = Answers(node)
        # HETPS_REPLICAS: copies on their way to replicas, each waiting for its acknowledgements
        self._copies: list[_Copy] = []
        self._optimizer_blob: bytes | None = None  # as a worker sent it (for a new replica)
        if hasattr(node, "on_failover"):
            node.on_failover = self._on_failover
            node.on_rejoin = self._on_rejoin
            node.done_workers = lambda: sorted(self.done_workers)
        if hasattr(node, "on_worker_left"):
            node.on_worker_left = self._on_worker_left

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
            if msg.cmd == P.BATCH:
                self._batch(msg)
            elif msg.cmd == P.PUSH:
                self._push(msg)
            elif msg.cmd == P.PULL:
                self._pull(msg)
            elif msg.cmd == P.INIT:
                self._init(msg)
            elif msg.cmd in P.SPARSE_COMMANDS:
                self.tables.handle(msg)
            elif msg.cmd == P.SET_OPTIMIZER:
                self._set_optimizer(msg)
            elif msg.cmd == P.GET_STATES:
                self._get_states(msg)
            elif msg.cmd == P.SET_STATES:
                self._set_states(msg)
            elif msg.cmd == P.FORECAST:
                self._forecasts[(msg.sender, self._tag(msg))] = (time.time(), msg.backlogged)
                if len(self._forecasts) > 65536:  # a peer that forecasts and never sends
                    self._forecasts.clear()
            elif msg.cmd == P.PROBE:
                self._probe(msg)
            elif msg.cmd == P.DROP:
                self._drop(msg)
            elif msg.cmd == P.WORKER_DONE:
                self._worker_done(msg)
            elif msg.cmd == P.REPLICATE:
                self._copy_in(msg)
            elif msg.cmd == P.ENTER:
                self._enter(msg)
            else:
                raise BadRequest(f"unknown command {msg.cmd!r}")
        except BadRequest as exc:
            self._meas.pop((msg.sender, msg.req), None)
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

    # -- validation helpers -----------------------------------------------------------------
    @staticmethod
    def _field(msg: Message, name: str, kind: type | tuple[type, ...]) -> Any:
        value = msg.body.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise BadRequest(f"{msg.cmd}: field {name!r} missing or not {kind}")
        return value

    @staticmethod
    def _tag(msg: Message) -> int:
        """A measured message's tag (its request id on the worker)."""
        tag = msg.body.get("tag")
        if not isinstance(tag, int) or isinstance(tag, bool):
            raise BadRequest(f"{msg.cmd}: field 'tag' must be an integer")
        return tag

    def _range(self, msg: Message) -> tuple[Any, int, int, int]:
        key = msg.body.get("k")
        if isinstance(key, bool) or not isinstance(key, (int, str)):
            raise BadRequest(f"{msg.cmd}: key {short(key)} must be an int or a str")
        if isinstance(key, str) and len(key) > 1024:
            raise BadRequest(f"{msg.cmd}: a key of {len(key)} characters is longer than 1024")
        part = self._field(msg, "part", int)
        off = self._field(msg, "off", int)
        n = self._field(msg, "n", int)
        if off < 0 or n < 0:
            raise BadRequest(f"{msg.cmd} of key {key!r}: negative offset or length")
        return key, part, off, n

    def _slice(self, msg: Message, key: Any, part: int, off: int, n: int) -> Slice:
        sl = self.slices.get((key, part))
        if sl is None:
            if not any(k == key for k, _ in self.slices):
                raise BadRequest(
                    f"key {key!r} was never initialised: call kv.init({key!r}, value) first"
                )
            raise BadRequest(f"key {key!r} has no part {part} on this server")
        shape = msg.body.get("shape")
        dtype = msg.body.get("dtype")
        if shape is not None and not isinstance(shape, list):
            raise BadRequest(f"{msg.cmd} of key {key!r}: field 'shape' must be a list")
        if dtype is not None and not isinstance(dtype, str):
            raise BadRequest(f"{msg.cmd} of key {key!r}: field 'dtype' must be a string")
        if (
            shape is not None
            and tuple(shape) != sl.shape
            or (dtype is not None and dtype != dtype_str(sl.value.dtype))
        ):
            raise BadRequest(
                f"{msg.cmd} of key {key!r}: shape {short(shape)} dtype {short(dtype)} does "
                f"not match the key's shape {sl.shape} dtype {sl.value.dtype.name}"
            )
        if off + n > sl.value.size:
            raise BadRequest(
                f"{msg.cmd} of key {key!r}: range [{off}, {off + n}) is outside part {part} "
                f"of {sl.value.size} elements (key shape {sl.shape})"
            )
        return sl

    def _payload_fits(self, msg: Message, sl: Slice, n: int) -> None:
        """Check a push's payload (count, dtype, size) against its range of ``sl`` without
        decoding it: a push is never kept unless it fits."""
        if len(msg.arrays) != 1:
            raise BadRequest(
                f"{msg.cmd} of key {sl.key!r}: expected one array, got {len(msg.arrays)}"
            )
        data = msg.arrays[0]
        if msg.body.get("comp") is not None:
            ok = data.dtype == np.uint32 and data.size == (n + 15) // 16
        else:
            ok = data.dtype == sl.value.dtype and data.size == n
        if not ok:
            raise BadRequest(
                f"{msg.cmd} of key {sl.key!r}: got {data.size} values of {data.dtype} for "
                f"{n} values of {sl.value.dtype} (key shape {sl.shape})"
            )

    def _from_worker(self, msg: Message) -> bool:
        """Whether ``msg`` came on the connection of a registered worker."""
        role_of = getattr(self.node, "role_of", None)
        return role_of is not None and role_of(msg.sender) == "worker"

    def _data(self, msg: Message, sl: Slice, n: int, packed: bool = False) -> np.ndarray:
        """The push's values, checked; a 2-bit push decoded (``packed``: its checked words,
        which :func:`~hetps.kvstore.slices.put` decodes straight into the merge buffer)."""
        if len(msg.arrays) != 1:
            raise BadRequest(
                f"{msg.cmd} of key {sl.key!r}: expected one array, got {len(msg.arrays)}"
            )
        data = msg.arrays[0].reshape(-1)
        threshold = msg.body.get("comp")
        if threshold is not None:
            if (
                not isinstance(threshold, (int, float))
                or isinstance(threshold, bool)
                or not 0 < threshold < float("inf")
            ):
                raise BadRequest(f"push of key {sl.key!r}: bad compression threshold {threshold!r}")
            words = (n + 15) // 16
            if data.dtype != np.uint32 or data.size != words:
                raise BadRequest(
                    f"push of key {sl.key!r}: 2-bit payload must be {words} uint32 words for "
                    f"{n} values, got {data.size} {data.dtype}"
                )
            if packed:
                return data
            return TwoBitCompressor(float(threshold)).decompress(data, n, sl.value.dtype)
        if data.dtype != sl.value.dtype or data.size != n:
            raise BadRequest(
                f"{msg.cmd} of key {sl.key!r}: got {data.size} values of {data.dtype}, expected "
                f"{n} of {sl.value.dtype} (key shape {sl.shape})"
            )
        return data

    # -- commands ---------------------------------------------------------------------------
    def _init(self, msg: Message) -> None:
        self._in_rounds(msg)
        key, part, off, n = self._range(msg)
        size = self._field(msg, "size", int)
        shape = msg.body.get("shape")
        dname = msg.body.get("dtype")
        if (
            not isinstance(shape, list)
            or len(shape) > 32
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
            or not isinstance(dname, str)
            or dname not in WIRE_DTYPES
            or dname.startswith(("u", "i"))
        ):
            raise BadRequest(
                f"init of key {key!r}: bad shape {short(shape)} or dtype {short(dname)}"
            )
        # a worker counts a key's rounds from its init; a slice that a plan moves here
        # (HETPS_BALANCE) comes with the rounds it has had ('rnd')
        rnd = msg.body.get("rnd", 0)
        if not isinstance(rnd, int) or isinstance(rnd, bool) or rnd < 0:
            raise BadRequest(f"init of key {key!r}: field 'rnd' must be an integer >= 0")
        elems = 1
        for d in shape:
            elems *= d
        if size < 0 or size > elems or off + n > size:
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
        data = self._data(msg, sl, n)
        self._writable(sl)
        sl.value[off : off + n] = data
        sl.rounds = rnd
        if msg.cmd == P.INIT:
            sl.primary, sl.origin = True, None
        else:  # a copy, even of a slice served here until a plan moved it to the sender
            sl.primary, sl.origin = False, msg.sender
        if msg.cmd == P.INIT and self._replicas():
            body = dict(msg.body, op="init")
            self._copy_out(body, np.array(data), lambda: self.answers.reply(msg))
            return
        self.answers.reply(msg)

    def _measure(self, msg: Message) -> None:
        """Pair a data message with its forecast: the link sample travels back in the ack."""
        fc = self._forecasts.pop((msg.sender, msg.body.get("tag")), None)
        if fc is None:
            return
        t0, late = fc
        if late and msg.cmd == P.PROBE and not msg.body.get("spread"):
            # the forecast was taken from a queue: its stamp is late, so the gap (and the
            # rate) would be read too fast; a probe is kept only when timed on time (data
            # samples, many per round, go on: the planner takes their median and busy time;
            # so do a spread probe's flows, which arrive together: the planner spans them
            # from the earliest forecast, and a late stamp only shortens one flow's span)
            return
        meas = [t0, time.time(), float(msg.nbytes)]
        if msg.cmd == P.PROBE and msg.body.get("spread"):
            meas.append(1.0 if late else 0.0)  # the planner drops a spread whose first was late
        self._meas[(msg.sender, msg.req)] = meas

    def _ack(self, msg: Message, sl: Slice) -> None:
        """Acknowledge a push that took effect; a fused push-pull ("pp") gets the value too."""
        meas = self._meas.pop((msg.sender, msg.req), None)
        body = {"meas": meas} if meas is not None else None
        if msg.body.get("pp") is True:
            off, n = msg.body["off"], msg.body["n"]  # checked when the push arrived
            self._send_value(msg, sl, off, n, body)
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
        if "tag" in msg.body:  # the worker measures this reply: announce it first
            self._forecast_to(msg)
        tracker = self.answers.reply(msg, body, arrays=[sl.value[off : off + n]], track=True)
        if tracker is not None:
            sl.inflight = [t for t in sl.inflight if not t.done]
            sl.inflight.append(tracker)

    def _push(self, msg: Message) -> None:
        if "tag" in msg.body and (msg.sender, msg.req) not in self._meas:
            self._tag(msg)
            self._measure(msg)
        if msg.body.get("rcpt") is True and not msg.body.get("_rcpt_sent"):
            # arrived: the worker may send more (its push window), long before a sync round
            # completes and acknowledges the push itself
            msg.body["_rcpt_sent"] = True  # a backlogged push is handled again later
            self.node.send(msg.sender, Message(P.RECEIPT, body={"req": msg.req}))
        key, part, off, n = self._range(msg)
        sl = self._slice(msg, key, part, off, n)
        sl.primary = True  # (a copy becomes the key itself when a worker pushes it here)
        sync = self.sync if self.sync is not None else bool(msg.body.get("sync", True))
        if not sync and self.optimizer is None:
            raise BadRequest(
                f"push of key {key!r} in dist_async needs a server optimizer: call "
                "kv.set_optimizer(...) before the first push"
            )
        worker = msg.sender
        if self._fixed_workers is None and worker in getattr(self.node, "left", ()):
            raise BadRequest("push from a worker that left the job")  # (sent before it died)
        if sl.value.size == 0:  # nothing to merge or apply: a round of nothing completes at once
            self._ack(msg, sl)
            return
        in_order = False  # the push says it is of this very round
        if sync and (sl.copying or ("rnd" in msg.body and self._replicated)):
            rnd = msg.body.get("rnd", sl.rounds)
            if not isinstance(rnd, int) or isinstance(rnd, bool) or rnd < 0:
                raise BadRequest(f"push of key {key!r}: field 'rnd' must be an integer >= 0")
            if rnd < sl.rounds:  # a resent push of a round applied here already (a failover)
                self._payload_fits(msg, sl, n)
                self._ack(msg, sl)
                return
            if sl.copying or rnd > sl.rounds:  # its round comes later
                self._payload_fits(msg, sl, n)
                sl.backlog.append(msg)
                return
            in_order = "rnd" in msg.body and self._replicated
        if sync and self.done_workers:
            raise BadRequest(self._uneven(sl))
        if sync and (
            sl.got.get(worker, 0) >= sl.value.size
            or (not in_order and any(m.sender == worker for m in sl.backlog))
        ):
            self._payload_fits(msg, sl, n)  # kept only if it fits its part
            sl.backlog.append(msg)  # this worker already pushed the whole round: next round
            return
        packed = sync and not self._elastic  # a 2-bit push is decoded into the merge buffer
        data = self._data(msg, sl, n, packed=packed)
        comp = msg.body.get("comp") if packed else None
        ce = msg.body.get("ce")
        if not isinstance(ce, int) or isinstance(ce, bool) or ce <= 0:
            raise BadRequest(f"push of key {key!r}: field 'ce' (chunk elements) must be > 0")
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
            if self._elastic:
                self._hold(msg, sl, worker, data, off, n, ce)
                return
            if sl.merge is None and off == 0 and n == sl.value.size and msg.lease is None:
                if comp is not None:
                    data = TwoBitCompressor(float(comp)).decompress(data, n, sl.value.dtype)
                # the round's first push of the whole part: keep the received array itself
                # (read-only, over the message's frame) instead of copying it; a second
                # worker's push is added into a buffer of our own. Not when it is lent ring
                # memory (the sender reuses it after this handler): then it is copied below
                sl.merge, sl.chunk, sl.written = data, ce, {0}
                sl.got[worker] = n
                sl.seen.setdefault(worker, set()).add(off)
                msg.arrays = []
                sl.acks.append(msg)
                if len(sl.got) == self.num_workers:
                    self._finish_round(sl)
                return
            if sl.merge is None:
                # reuse last round's buffer; the first contribution to each chunk is copied,
                # later ones added, so the buffer is never zero-filled
                buf = sl.spare if sl.spare is not None and sl.spare.size == sl.value.size else None
                sl.merge = buf if buf is not None else np.empty(sl.value.size, sl.value.dtype)
                sl.spare = None
                sl.written, sl.pending = set(), {}
                sl.chunk = ce
            elif ce != sl.chunk:
                raise BadRequest(
                    f"push of key {sl.key!r}: chunks of {ce} elements, but this round's other "
                    f"pushes use {sl.chunk}; set the same HETPS_CHUNK_BYTES on every worker"
                )
            self._merge_chunk(sl, msg, data, comp, off, n)
            sl.got[worker] = sl.got.get(worker, 0) + n
            sl.seen.setdefault(worker, set()).add(off)
            msg.arrays = []  # merged: the ack needs only who and which request
            sl.acks.append(msg)
            if len(sl.got) == self.num_workers and all(c >= sl.value.size for c in sl.got.values()):
                self._finish_round(sl)
            return
        # async: collect the chunks of one push, then apply it at once
        if n == sl.value.size:
            self._apply(sl, data, worker)
            msg.arrays = []  # applied: nothing to keep
            self._ack(msg, sl)
            return
        buf, count, msgs = sl.partial.get(worker, (np.zeros(sl.value.size, sl.value.dtype), 0, []))
        buf[off : off + n] = data
        msg.arrays = []
        msgs.append(msg)
        count += n
        if count >= sl.value.size:
            del sl.partial[worker]
            self._apply(sl, buf, worker)
            for m in msgs:
                self._ack(m, sl)
        else:
            sl.partial[worker] = (buf, count, msgs)

    def _merge_chunk(
        self, sl: Slice, msg: Message, data: np.ndarray, comp: Any, off: int, n: int
    ) -> None:
        """Add a push's chunk to the round's sum, in arrival order. The first push of a chunk
        (received, not the last of its offset) is held as it is, and the next one is summed
        with it in one pass (not copied in, then added to); later ones are added. At most
        one push per chunk is held, so a server never keeps more than one extra copy of a
        part however many workers push it. A chunk that must be read now (ring memory,
        2-bit words) is summed at once. Sums run on the kernel threads."""
        held = sl.pending.pop(off, [])
        others = sum(1 for s in sl.seen.values() if off in s)
        if (
            not held
            and off not in sl.written
            and others + 1 < self.num_workers
            and msg.lease is None
            and comp is None
        ):
            held.append(data)
            sl.pending[off] = held
            return
        srcs = ([sl.merge[off : off + n]] if off in sl.written else []) + held
        if sl.merge.flags.writeable:
            dst = sl.merge[off : off + n]
        else:  # the round's first push of the whole part, kept as received: sum elsewhere
            buf = sl.spare if sl.spare is not None and sl.spare.size == sl.value.size else None
            sl.spare = None
            dst = sl.merge = buf if buf is not None else np.empty(sl.value.size, sl.value.dtype)
        if comp is not None:  # decoded straight into the sum, after what came before it
            if srcs:
                kernels.sum_into(dst, srcs)
            put(dst, data, comp, add=bool(srcs))
        else:
            kernels.sum_into(dst, [*srcs, data])
        sl.written.add(off)

    def _uneven(self, sl: Slice) -> str:
        who = ", ".join(self.done_workers.values())
        return (
            f"push of key {sl.key!r} can never complete: {who} already finished its job, so this "
            "dist_sync round would wait for it forever; every worker must run the same number "
            "of rounds (give each the same number of batches)"
        )

    def _worker_done(self, msg: Message) -> None:
        """A worker finished: fail the sync rounds that still wait for it (uneven batch counts)."""
        info = NodeInfo.from_wire(msg.body["node"])
        self.done_workers[info.id] = info.describe()
        self.tables.worker_done(info.id)
        for sl in self.slices.values():
            if sl.got and sl.got.get(info.id, 0) < sl.value.size:
                text = self._uneven(sl)
                for m in sl.acks + sl.deferred + sl.backlog:
                    self.answers.reply(m, {"error": text})
                sl.acks, sl.deferred, sl.backlog, sl.got, sl.merge = [], [], [], {}, None
                sl.seen, sl.pending = {}, {}

    def _apply(self, sl: Slice, grad: np.ndarray, worker: int) -> None:
        assert self.optimizer is not None
        self._writable(sl)
        if not sl.has_state:
            sl.state = self.optimizer.create_state(sl.skey, sl.value)
            sl.has_state = True
        t0 = time.perf_counter()
        self.optimizer.apply_update(sl.skey, sl.value, grad, sl.state, sender=worker)
        self.opt_s += time.perf_counter() - t0  # live metrics (hetps.metrics.server_meter)

    def _finish_round(self, sl: Slice) -> None:
        merged = sl.merge
        assert merged is not None
        if self.optimizer is None:
            # the sum replaces the value; the old value merges the next round unless a
            # zero-copy reply still reads it (then that reply keeps it alive)
            old = sl.value
            busy = any(not t.done for t in sl.inflight)
            sl.value = merged
            sl.inflight = []
            sl.spare = None if busy or not old.flags.writeable else old
        else:
            self._apply(sl, merged, -1)
            # gradients are never sent: reusable unless it is a received message's memory
            sl.spare = merged if merged.flags.writeable else None
        sl.merge = None
        sl.got = {}
        sl.seen, sl.pending = {}, {}
        sl.rounds += 1
        self.rounds += 1
        acks, deferred, backlog = sl.acks, sl.deferred, sl.backlog
        sl.acks, sl.deferred, sl.backlog = [], [], []
        if self._replicas():
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
            self._copy_out(
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
            self._ack(m, sl)
        for m in deferred:
            self._pull(m)
        for m in backlog:
            self.handle(m)

    def _pull(self, msg: Message) -> None:
        key, part, off, n = self._range(msg)
        sl = self._slice(msg, key, part, off, n)
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
        self._send_value(msg, sl, off, n, None)

    def _forecast_to(self, msg: Message) -> None:
        self.node.send(msg.sender, Message(P.FORECAST, body={"tag": msg.req}))  # best effort

    def _probe(self, msg: Message) -> None:
        """Answer a probe: its push side is measured here, the reply is measured by the worker."""
        if "tag" in msg.body:
            self._tag(msg)
        self._measure(msg)
        size = msg.body.get("reply_bytes", 0)
        size = size if isinstance(size, int) and 0 <= size <= (1 << 26) else 0
        if size:
            self._forecast_to(msg)
        meas = self._meas.pop((msg.sender, msg.req), None)
        self.answers.reply(msg, {"meas": meas} if meas else {}, arrays=[np.zeros(size, np.uint8)])

    def _writable(self, sl: Slice) -> None:
        """Before changing ``sl.value`` in place, make sure no reply still reads it."""
        pending = [t for t in sl.inflight if not t.done]
        if pending or not sl.value.flags.writeable:  # (or it is a received message's memory)
            sl.value = sl.value.copy()
        sl.inflight = []

    def _set_optimizer(self, msg: Message) -> None:
        if not self._from_worker(msg):  # unpickling runs code: only a worker's, ever
            raise BadRequest("set_optimizer: only a worker of this job may set the optimizer")
        self._in_rounds(msg)
        if len(msg.arrays) != 1:
            raise BadRequest("set_optimizer: expected one pickled optimizer")
        try:
            opt = optim.loads(msg.arrays[0].tobytes())
        except Exception as exc:  # noqa: BLE001 - unpickling user code can raise anything
            raise BadRequest(
                f"set_optimizer: the server could not load the optimizer ({type(exc).__name__}: "
                f"{exc}); hetps ships optimizers by value with cloudpickle, so check that the "
                "modules it imports are installed on the servers"
            ) from None
        self.optimizer = opt
        self._optimizer_blob = msg.arrays[0].tobytes()
        for sl in self.slices.values():
            sl.state, sl.has_state = None, False
        self.tables.reset_states()
        log.info("server: optimizer set to %s", type(opt).__name__)
        self.answers.reply(msg)

    def _get_states(self, msg: Message) -> None:
        want = msg.body.get("slices")
        if want is not None and (not isinstance(want, list) or not all(slice_key(w) for w in want)):
            raise BadRequest("get_states: field 'slices' must be a list of [key, part]")
        keys = None if want is None else {tuple(w) for w in want}
        # with copies, all the states: only what this server serves (copies are on others);
        # named slices (a plan moves them): each one held here, served or a copy, which is
        # in step with its primary (and a server that takes over may not have heard yet)
        served = self._replicated and keys is None
        states = {
            sk: sl.state
            for sk, sl in self.slices.items()
            if sl.has_state and (keys is None or sk in keys) and (sl.primary or not served)
        }
        blob = np.frombuffer(optim.dump_states(states), dtype=np.uint8)
        self.answers.reply(msg, arrays=[blob])

    def _set_states(self, msg: Message) -> None:
        if not self._from_worker(msg):  # unpickling runs code: only a worker's, ever
            raise BadRequest("set_states: only a worker of this job may set optimizer states")
        if len(msg.arrays) != 1:
            raise BadRequest("set_states: expected one pickled state map")
        try:
            states = optim.load_states(msg.arrays[0].tobytes())
        except Exception as exc:  # noqa: BLE001 - unpickling can raise anything
            raise BadRequest(f"set_states: {type(exc).__name__}: {exc}") from None
        moved = []
        for sk, st in states.items():
            sl = self.slices.get(tuple(sk) if isinstance(sk, list) else sk)
            if sl is not None:
                sl.state, sl.has_state = st, True
                if sl.primary:
                    moved.append(sl)
        if self._replicated and msg.body.get("move") and moved:
            # slices a plan moved here: their replicas get the states before the answer
            blob = optim.dump_states({sl.skey: sl.state for sl in moved})
            body = {"op": "states"}
            self._copy_out(body, np.frombuffer(blob, np.uint8), lambda: self.answers.reply(msg))
            return
        if self._replicated and self.node.redirect:
            # a server admitted again gets no set_states (its requests come here): it gets
            # these states with the rest of what this server serves
            self._resync()
        self.answers.reply(msg)
