"""A server's round aggregator: sums the pushes of a ``dist_sync`` round into one buffer per
slice and applies the result (the optimizer's step, or the sum as the new value).
(docs/MODULES.md, "hetps.kvstore.aggregate")"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from hetps.kvstore.compression import TwoBitCompressor
from hetps.kvstore.slices import BadRequest, Slice, put
from hetps.optim import kernels
from hetps.transport.codec import Message


class Aggregator:
    """Sums and applies rounds. ``workers()``: the job's worker count now (a round is
    complete with that many workers' pushes); ``optimizer()``: the server's optimizer, or
    None (then a round's sum replaces the value)."""

    #: what a refused request raises (the device's rounds, which import no kvstore, too)
    Refused = BadRequest

    def __init__(self, workers: Callable[[], int], optimizer: Callable[[], Any]) -> None:
        self.workers = workers
        self.optimizer = optimizer
        self.opt_s = 0.0  # seconds in the optimizer (live metrics)

    # -- hooks the server calls -------------------------------------------------------------
    def value_changed(self, sl: Slice) -> None:
        """``sl.value`` was written in place (an init): nothing to do here; an aggregator
        that keeps a copy of it elsewhere (:mod:`hetps.device.aggregator`) takes it again."""

    def host_state(self, sl: Slice) -> Any:
        """``sl``'s optimizer state as host arrays (what ``get_states`` sends): here it is."""
        return sl.state

    # -- a dist_sync round ------------------------------------------------------------------
    def first_whole(
        self, sl: Slice, msg: Message, data: np.ndarray, comp: Any, off: int, n: int, ce: int
    ) -> bool:
        """Keep the round's first push of the whole part itself (read-only, over the
        message's frame) instead of copying it; a second worker's push is added into a
        buffer of our own. Not when it is lent ring memory (the sender reuses it after the
        handler): then it goes through :meth:`add_chunk`. Returns whether it was kept."""
        if not (sl.merge is None and off == 0 and n == sl.value.size and msg.lease is None):
            return False
        sl.merge, sl.chunk, sl.written = self.decoded(sl, data, comp, n), ce, {0}
        return True

    def start(self, sl: Slice, ce: int) -> None:
        """Make sure the round has a sum buffer; chunks of one size in a round."""
        if sl.merge is None:
            # reuse last round's buffer; the first contribution to each chunk is copied,
            # later ones added, so the buffer is never zero-filled
            sl.merge = self.take_spare(sl)
            sl.written, sl.pending = set(), {}
            sl.chunk = ce
        elif ce != sl.chunk:
            raise BadRequest(
                f"push of key {sl.key!r}: chunks of {ce} elements, but this round's other "
                f"pushes use {sl.chunk}; set the same HETPS_CHUNK_BYTES on every worker"
            )

    def add_chunk(
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
            and others + 1 < self.workers()
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
            dst = sl.merge = self.take_spare(sl)
        if comp is not None:  # decoded straight into the sum, after what came before it
            if srcs:
                kernels.sum_into(dst, srcs)
            put(dst, data, comp, add=bool(srcs))
        else:
            kernels.sum_into(dst, [*srcs, data])
        sl.written.add(off)

    def merge_held(self, sl: Slice, job: int) -> None:
        """Sum an elastic round's pushes (kept apart per worker) in worker order. With fewer
        workers than the job's ``job`` (some left): with an optimizer the sum is scaled to
        the job's count, so the optimizer's rescale_grad (set for it) gives the survivors'
        mean; without one the value is their sum, and its answers say how many workers it
        holds (``w``)."""
        buf = self.take_spare(sl)
        written: set[int] = set()
        for w in sorted(sl.held):
            for off, arr in sl.held[w]:
                if off in written:
                    view = buf[off : off + arr.size]
                    kernels.add_into(view, view, arr)
                else:
                    buf[off : off + arr.size] = arr
                    written.add(off)
        # (a host's sum stands for its workers: docs/HOSTS.md)
        count = sum(h[2] for h in sl.hosts.values()) if sl.hosts else len(sl.held)
        sl.held, sl.hosts = {}, {}
        sl.merge, sl.written, sl.short = buf, written, None
        if count < job:
            if self.optimizer() is None:
                sl.short = count
            elif buf.dtype.kind == "f":
                buf *= job / count

    def finish(self, sl: Slice) -> np.ndarray:
        """The round is complete: its sum becomes the value (through the optimizer, if one is
        set). Returns the sum (what a replica applies the same way)."""
        merged = sl.merge
        assert merged is not None
        if self.optimizer() is None:
            # the sum replaces the value; the old value merges the next round unless a
            # zero-copy reply still reads it (then that reply keeps it alive)
            old = sl.value
            busy = any(not t.done for t in sl.inflight)
            sl.value = merged
            sl.inflight = []
            sl.spare = None if busy or not old.flags.writeable else old
        else:
            self.apply(sl, merged, -1)
            # gradients are never sent: reusable unless it is a received message's memory
            sl.spare = merged if merged.flags.writeable else None
        sl.merge = None
        sl.got = {}
        sl.seen, sl.pending = {}, {}
        sl.rounds += 1
        return merged

    # -- the update -------------------------------------------------------------------------
    def apply(self, sl: Slice, grad: np.ndarray, worker: int) -> None:
        """One optimizer step of ``sl`` with ``grad`` (from ``worker``; -1 for a round)."""
        optimizer = self.optimizer()
        assert optimizer is not None
        writable(sl)
        if not sl.has_state:
            sl.state = optimizer.create_state(sl.skey, sl.value)
            sl.has_state = True
        t0 = time.perf_counter()
        optimizer.apply_update(sl.skey, sl.value, grad, sl.state, sender=worker)
        self.opt_s += time.perf_counter() - t0  # live metrics (hetps.metrics.server_meter)

    def collect(self, sl: Slice, worker: int, data: np.ndarray, off: int, msg: Message) -> list:
        """``dist_async``: collect the chunks of one push; once it is whole, apply it and
        return the messages to acknowledge (else [])."""
        n = data.size
        if n == sl.value.size:
            self.apply(sl, data, worker)
            msg.arrays = []  # applied: nothing to keep
            return [msg]
        buf, count, msgs = sl.partial.get(worker, (np.zeros(sl.value.size, sl.value.dtype), 0, []))
        buf[off : off + n] = data
        msg.arrays = []
        msgs.append(msg)
        count += n
        if count < sl.value.size:
            sl.partial[worker] = (buf, count, msgs)
            return []
        del sl.partial[worker]
        self.apply(sl, buf, worker)
        return msgs

    @staticmethod
    def decoded(sl: Slice, data: np.ndarray, comp: Any, n: int) -> np.ndarray:
        """A push's ``n`` values: ``data``, or its 2-bit words decoded (``comp``: the threshold)."""
        if comp is None:
            return data
        return TwoBitCompressor(float(comp)).decompress(data, n, sl.value.dtype)

    @staticmethod
    def take_spare(sl: Slice) -> np.ndarray:
        """Last round's buffer if it fits, else a new one (never zero-filled)."""
        buf = sl.spare if sl.spare is not None and sl.spare.size == sl.value.size else None
        sl.spare = None
        return buf if buf is not None else np.empty(sl.value.size, sl.value.dtype)


def writable(sl: Slice) -> None:
    """Before changing ``sl.value`` in place, make sure no reply still reads it."""
    pending = [t for t in sl.inflight if not t.done]
    if pending or not sl.value.flags.writeable:  # (or it is a received message's memory)
        sl.value = sl.value.copy()
    sl.inflight = []
