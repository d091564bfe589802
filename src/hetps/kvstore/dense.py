"""The requests of a dense key's push and pull, a part of
:class:`~hetps.kvstore.client.DistKVStore`: one request per chunk of each part of the key
(:mod:`hetps.kvstore.placement`), each body built by :func:`hetps.cluster.bodies.chunk`, and
the round credit that keeps a worker at most ``HETPS_ROUNDS_AHEAD`` rounds ahead."""

from __future__ import annotations

from typing import Any

import numpy as np

from hetps.cluster import bodies
from hetps.cluster import protocol as P
from hetps.cluster.requests import Future
from hetps.kvstore.keys import Borrowed, KeyMeta, fill_targets, land_into
from hetps.kvstore.placement import chunk_elems, chunks
from hetps.kvstore.ports import StorePort
from hetps.transport.codec import Message, dtype_str


class DenseRequests:
    """Builds and queues the chunk requests of dense keys for the store ``kv`` (which holds
    the compressor, the round counters and the request pipeline)."""

    def __init__(self, kv: StorePort) -> None:
        self.kv = kv

    def through_rings(self, meta: KeyMeta) -> bool:
        """Whether a push of ``meta``'s key may send the caller's array itself instead of a
        captured copy: every part goes to a server through an open shared-memory ring, whose
        send copies the values into the ring before the push returns (a request that waits
        in the send queue instead takes a copy of its own as it is queued: see
        :meth:`~hetps.kvstore.pipeline.Pipeline.request`). Not when requests are kept to be
        sent again (replicas) or timed (network-aware balancing)."""
        kv = self.kv
        if kv.agent is not None or kv.node.replicas > 1:
            return False
        if meta.size * meta.dtype.itemsize < kv.node.ring_min:
            return False
        return all(kv.node.ring_open(kv.server_ids[p.server]) for p in meta.parts)

    def round_credit(self, meta: KeyMeta) -> None:
        """dist_sync: a worker may be ``HETPS_ROUNDS_AHEAD`` rounds of a key ahead of the
        servers; a further push waits here until the oldest was applied (its errors are
        reported later, as a push's are), so a fast worker never floods a server with rounds
        it must keep. Requests of this same call are never waited for (they are not sent)."""
        kv = self.kv
        recent = meta.recent
        while recent and all(f.done() for f in recent[0][1]):
            recent.popleft()
        while len(recent) >= kv.cfg.rounds_ahead and recent[0][0] < kv.calls:
            for f in recent.popleft()[1]:
                f.settle(kv.timeout)

    def push(
        self,
        k: Any,
        meta: KeyMeta,
        arr: np.ndarray,
        priority: int,
        dest: np.ndarray | None = None,
        borrowed: bool = False,
    ) -> list[Future]:
        """Requests pushing ``arr``; with ``dest`` (flat, writable) each is a fused push-pull:
        its answer carries the key's value for that range once the push took effect.
        ``borrowed``: ``arr`` is the caller's, read only while the push call runs."""
        kv = self.kv
        flat = np.ascontiguousarray(arr).reshape(-1)
        comp = kv.compressor
        if comp is not None and meta.residual is None:
            meta.residual = np.zeros(meta.size, dtype=np.float32)
        step = chunk_elems(kv.cfg.chunk_bytes, arr.dtype.itemsize)
        futs = []
        lent = Borrowed(meta) if borrowed and comp is None else None
        if kv.sync:
            meta.rounds += 1
        for p in meta.parts:
            for a, b in chunks(p.start, p.stop, step):
                if comp is not None:
                    assert meta.residual is not None
                    payload = comp.compress(flat[a:b], meta.residual[a:b])
                else:
                    payload = flat[a:b]
                body = bodies.chunk(
                    k,
                    p.index,
                    a - p.start,
                    b - a,
                    meta.shape,
                    dtype_str(meta.dtype),
                    sync=kv.sync,
                    chunk=step,
                    fused=True if dest is not None else None,
                    # a server that takes over knows a resent round by it
                    round=meta.rounds - 1 if kv.copies else None,
                    threshold=comp.threshold if comp is not None else None,
                    host=kv.host_tag,
                )
                msg = Message(P.PUSH, body=body, arrays=[payload], borrowed=lent is not None)
                futs.append(
                    kv.request(
                        k,
                        priority,
                        p.server,
                        msg,
                        None if dest is None else land_into(k, dest, a, b, kv.short_marks),
                        None if dest is None else dest[a:b],
                        None if lent is None else lent.owner(msg, a, b),
                    )
                )
        return futs

    def pull(self, k: Any, meta: KeyMeta, targets: list[np.ndarray], priority: int):
        """Requests pulling the key into ``targets``; the finisher that fills them."""
        kv = self.kv
        first = targets[0]
        direct = first.flags.c_contiguous and first.flags.writeable
        dest = first.reshape(-1) if direct else np.empty(meta.size, meta.dtype)
        step = chunk_elems(kv.cfg.chunk_bytes, meta.dtype.itemsize)
        futs = []
        for p in meta.parts:
            for a, b in chunks(p.start, p.stop, step):
                body = bodies.chunk(
                    k, p.index, a - p.start, b - a, meta.shape, dtype_str(meta.dtype)
                )
                futs.append(
                    kv.request(
                        k,
                        priority,
                        p.server,
                        Message(P.PULL, body=body),
                        land_into(k, dest, a, b, kv.short_marks),
                        dest[a:b],
                    )
                )
        return futs, fill_targets(meta, dest, targets, direct)
