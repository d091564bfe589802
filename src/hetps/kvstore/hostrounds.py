"""A server's ``dist_sync`` rounds of workers whose host groups are known, a part of
:class:`~hetps.kvstore.server.KVServer`.

Each push of such a round names its host group, its local rank and the workers it stands
for (``hg``: 1 for a worker's own push, the host's worker count for a host's sum, made by
host-local aggregation: :mod:`hetps.kvstore.hostagg`). The round's pushes are kept apart
per sender (``Slice.held``) until they stand for every worker of the job, and are then
summed in one fixed order: each host's pushes in local-rank order, then the hosts' sums in
host-group order. A host that summed its workers itself pushes that very host sum, so the
round's sum is bit for bit the same with host-local aggregation on or off.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hetps.cluster.protocol import check_sender
from hetps.kvstore.aggregate import Aggregator
from hetps.kvstore.ports import ServerPort
from hetps.kvstore.slices import BadRequest, Slice
from hetps.transport.codec import Message


class HostRounds:
    """Rounds summed per host: a part of a :class:`~hetps.kvstore.server.KVServer`
    (``server``: its worker count, aggregator and round end)."""

    def __init__(self, server: ServerPort) -> None:
        self.server = server

    def finish_if_complete(self, sl: Slice) -> None:
        """Sum and finish ``sl``'s round once its pushes stand for every worker."""
        if self.complete(sl):
            merge_by_host(self.server.aggregator, sl)
            self.server.finish_round(sl)

    def check(self, sl: Slice, worker: int, host: tuple[int, int, int], ce: int) -> None:
        """Refuse a push that does not fit this round: chunk sizes, a worker without its
        host, a sender whose host changed, two senders of one (host, local rank), or more
        workers than the job has."""
        key = sl.key
        jobs = self.server.num_workers
        check_chunks(sl, ce)
        check_sender(getattr(self.server.node, "nodes", None), worker, host, f"push of key {key!r}")
        if any(w not in sl.hosts for w in sl.got):
            raise BadRequest(mixed(key))
        had = sl.hosts.get(worker)
        if had is not None and had != host:
            raise BadRequest(
                f"push of key {key!r}: this worker's chunks name host {list(had)} and "
                f"{list(host)} in one round; a worker's host does not change"
            )
        for w, h in sl.hosts.items():
            if w != worker and h[:2] == host[:2]:
                raise BadRequest(
                    f"push of key {key!r}: two workers say they are local rank {host[1]} of "
                    f"host group {host[0]}; give each worker of a host its own LOCAL_RANK"
                )
        count = host[2] + sum(h[2] for w, h in sl.hosts.items() if w != worker)
        if host[2] > jobs or count > jobs:
            raise BadRequest(
                f"push of key {key!r}: this round's pushes stand for {count} workers but the "
                f"job has {jobs}; LOCAL_WORLD_SIZE must be the number of workers each host "
                "really runs"
            )

    def complete(self, sl: Slice) -> bool:
        """Whether the round's pushes stand for every worker and each pushed all of it."""
        return (
            not sl.copying
            and sum(h[2] for h in sl.hosts.values()) == self.server.num_workers
            and all(sl.got.get(w, 0) >= sl.value.size for w in sl.hosts)
        )


def check_chunks(sl: Slice, ce: int) -> None:
    """Refuse a push whose chunks (``ce`` elements) differ from its round's other pushes'."""
    if sl.got and ce != sl.chunk:
        raise BadRequest(
            f"push of key {sl.key!r}: chunks of {ce} elements, but this round's other "
            f"pushes use {sl.chunk}; set the same HETPS_CHUNK_BYTES on every worker"
        )


def keep(msg: Message, sl: Slice, worker: int, data: np.ndarray, off: int, n: int, ce: int) -> None:
    """Keep a checked push of ``sl``'s round (chunks of ``ce`` elements) apart per sender
    until the round is complete (the received frame as it is, read-only; lent ring memory
    copied); answered then."""
    if not sl.got:
        sl.chunk = ce
    sl.held.setdefault(worker, []).append((off, data if msg.lease is None else data.copy()))
    sl.got[worker] = sl.got.get(worker, 0) + n
    sl.seen.setdefault(worker, set()).add(off)
    msg.arrays = []
    sl.acks.append(msg)


def mixed(key: Any) -> str:
    """The error for a round where some workers name their host and others do not."""
    return (
        f"push of key {key!r}: some workers of this round name their host group and others "
        "do not; set HETPS_HOST_GROUP (or GROUP_RANK) and LOCAL_RANK for every worker or "
        "for none"
    )


def merge_by_host(agg: Aggregator, sl: Slice) -> None:
    """Sum ``sl``'s held round: each host's pushes in local-rank order, then the hosts in
    group order (``a = x0; a += x1; ...`` in the key's dtype, as a host that aggregates its
    workers sums them), into the round's merge buffer."""
    # a device server (device/aggregator.py): host sums made here, added on the device in
    # the same order
    device = getattr(agg, "here", None) is not None and agg.here(sl)
    buf = agg.take_spare(sl)
    by_host: dict[int, list[tuple[int, int]]] = {}
    for w, (group, local, _) in sl.hosts.items():
        by_host.setdefault(group, []).append((local, w))
    written: set[int] = set()
    for group in sorted(by_host):
        members = [w for _, w in sorted(by_host[group])]
        chunks: dict[int, list[np.ndarray]] = {}
        for w in members:
            for off, arr in sl.held.get(w, []):
                chunks.setdefault(off, []).append(arr)
        for off, arrs in chunks.items():
            host_sum = arrs[0]
            if len(arrs) > 1:
                host_sum = arrs[0].copy()
                for a in arrs[1:]:
                    np.add(host_sum, a, out=host_sum)
            view = buf[off : off + host_sum.size]
            if device:
                up = agg.device.upload(np.ascontiguousarray(host_sum))
                view.add_(up) if off in written else view.copy_(up)
            elif off in written:
                np.add(view, host_sum, out=view)
            else:
                view[...] = host_sum
            written.add(off)
    sl.held, sl.hosts = {}, {}
    sl.merge, sl.written, sl.short = buf, written, None
