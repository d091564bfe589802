"""The worker's request pipeline, a part of :class:`~hetps.kvstore.client.DistKVStore`: every
request of the store leaves through it. (docs/MODULES.md, "hetps.kvstore.pipeline")"""

from __future__ import annotations

import threading
from functools import partial
from typing import Any

from hetps.cluster import batch
from hetps.cluster import protocol as P
from hetps.cluster.batch import array_bytes
from hetps.cluster.node import Node
from hetps.cluster.requests import Future, wait_all
from hetps.kvstore.keys import detach
from hetps.kvstore.sender import Sender
from hetps.transport.codec import Message


class Pipeline:
    """The requests of one worker's store on their way to the servers (docs/MODULES.md,
    "hetps.kvstore.pipeline"). ``meter`` (live metrics) and ``agent`` (network-aware
    balancing) are set by the store once it made them."""

    def __init__(
        self, node: Node, server_ids: list[int], window: int, batch_bytes: int, timeout: float
    ) -> None:
        self.node = node
        self.server_ids = server_ids
        self.sender = Sender(window, node.send_batch)
        self.batch_bytes = batch_bytes
        self.timeout = timeout
        self.meter: Any = None
        self.agent: Any = None
        self._outstanding: list[Future] = []
        self._out_lock = threading.Lock()
        self._tl = threading.local()

    def track(self, futs: list[Future]) -> None:
        """Keep ``futs`` until :meth:`wait_outstanding` (their errors are raised once)."""
        with self._out_lock:
            self._outstanding.extend(futs)
            if len(self._outstanding) > 256:  # prune now and then, not on every call
                self._outstanding = [
                    f for f in self._outstanding if not f.done() or f.unreported_error()
                ]

    def wait_outstanding(self) -> None:
        """Wait for every request in flight; raise the first error no call has raised yet."""
        self.sender.drain()  # (parked requests go now, not after PARK_S)
        with self._out_lock:
            futs = [f for f in self._outstanding if not f.done() or f.unreported_error()]
            self._outstanding = []
        wait_all(futs, self.timeout, "outstanding requests")

    def request(
        self,
        key: Any,
        priority: int,
        server_rank: int,
        msg: Message,
        callback=None,
        landing=None,
        own=None,
    ) -> Future:
        """Queue ``msg`` for server ``server_rank`` at ``priority``; the future gets the
        reply, after ``callback(reply)`` ran. ``key`` orders it behind earlier requests of
        the same key's slice (None: no order). A ``borrowed`` message is given its own
        arrays by ``own()`` (default: copies) if it has to wait."""
        if msg.borrowed and own is None:
            own = partial(detach, msg)
        peer = self.server_ids[server_rank]
        msg.priority = priority
        if self.meter is not None and msg.cmd in (P.PUSH, P.PULL):
            callback = self.meter.timed(msg.cmd == P.PUSH, callback)
        watch = self.agent.watch(msg, server_rank, peer) if self.agent is not None else None
        cost = (
            sum(getattr(a, "nbytes", 0) for a in msg.arrays)
            if msg.cmd == P.PUSH and self.sender.window > 0
            else 0
        )
        if cost:
            msg.body = {**msg.body, "rcpt": True}  # confirmed on arrival: credit comes back
        sender = self.sender
        plain = watch is None and not cost
        if plain:
            on_reply = callback
        else:

            def on_reply(reply: Message) -> None:
                if watch is not None:
                    watch.on_reply(reply)
                if cost:
                    sender.release(reply.req)
                if callback is not None:
                    callback(reply)

        collect = self.collecting() if plain and msg.cmd in P.BATCH_COMMANDS else None
        fut = self.node.request(
            peer,
            msg,
            on_reply,
            what=partial(_what, msg.cmd, key, self.node, peer),  # (made only for an error)
            landing=landing,
            send=False,
        )
        part = msg.body.get("part") if key is not None else None
        slice_key = key if part is None else (key, part)
        if fut.done():
            return fut
        table = msg.cmd in (P.SPUSH, P.SPULL)  # (a table's push and pull: any size)
        if collect is not None and (table or array_bytes(msg) <= self.batch_bytes):
            if msg.borrowed:  # a batch may leave after the call: small, so copied now
                own()
            collect.append((slice_key, server_rank, fut, msg))  # sent at the call's end
            return fut

        def send() -> None:
            if cost:
                sender.hold(fut.req, cost, fut)
            if watch is not None:
                watch.before_send(fut.req)
            if not self.node.send_request(fut, msg):
                sender.release(fut.req)

        # requests are kept in order per slice (a key's part), not per key: the server keeps
        # every part's rounds apart, so a part's pull needs only that part's push before it,
        # and the pulls of a big key's first slices go while its later slices are still being
        # pushed (in key order, every slice of a 40-slice key waited for the last one's push)
        sender.submit(slice_key, priority, send, cost, detach=own if msg.borrowed else None)
        return fut

    def collecting(self) -> list | None:
        """The requests of the call in progress on this thread that wait to be batched."""
        return getattr(self._tl, "items", None)

    def collect(self, items: list | None) -> list | None:
        """This thread's requests go into ``items`` from now on (None: sent as they come);
        returns ``items``."""
        self._tl.items = items
        return items

    def batched(self, deferred: bool = False, park: bool = False) -> _Batched:
        """Within: the small requests of the call go to each server as one message (a batch,
        :mod:`hetps.cluster.batch`) when the block ends, each request with its own id and
        future, in order behind the earlier requests of its slices (``deferred`` and
        ``park``: as :meth:`flush`'s)."""
        return _Batched(self, deferred, park)

    def flush(self, items: list, deferred: bool = False, park: bool = False) -> None:
        """Send the call's collected requests, one batch per server. ``deferred`` (a push,
        which returns at once): the sender thread sends them, so the pushes of the next
        calls (a per-key loop) join them in one message while it is busy; else this thread
        sends them, with the requests waiting before them when the sender thread is idle
        (a table's pull joins the push before it). ``park`` (deferred, a table's push): they
        wait for the next call's drain (its pull), the sender thread sends them only if none
        came within :data:`~hetps.kvstore.sender.PARK_S`."""
        by_server: dict[int, list] = {}
        for item in items:
            by_server.setdefault(item[1], []).append(item)
        for rank, mine in by_server.items():
            peer = self.server_ids[rank]
            for group in batch.groups(mine, lambda item: array_bytes(item[3])):
                futs = [item[2] for item in group]
                msgs = [item[3] for item in group]

                def send(peer=peer, futs=futs, msgs=msgs) -> None:
                    self.node.send_batch(peer, futs, msgs)

                self.sender.submit(
                    None,
                    max(m.priority for m in msgs),
                    send,
                    keys=[item[0] for item in group],
                    merge=(peer, list(zip(futs, msgs, strict=True))),
                    inline=not deferred,
                    later=not deferred,
                    park=deferred and park,
                )
        if not deferred:  # (this thread sends what waits: no hand-off to the sender thread)
            self.sender.drain()

    def on_message(self, msg: Message) -> None:
        """Non-reply messages to a worker: forecasts of the replies it is about to receive,
        and receipts of its pushes (credit for the push window)."""
        if msg.cmd == P.FORECAST and self.agent is not None:
            self.agent.on_forecast(msg)
        elif msg.cmd == P.RECEIPT:
            self.sender.release(msg.typed.req)  # (a Receipt: an int, checked)

    def close(self) -> None:
        self.sender.close()


class _Batched:
    """The block of :meth:`Pipeline.batched` (a class, not a generator's context manager:
    that costs a microsecond more, and a push and a pull each make one)."""

    __slots__ = ("pipe", "deferred", "park", "items")

    def __init__(self, pipe: Pipeline, deferred: bool, park: bool) -> None:
        self.pipe, self.deferred, self.park = pipe, deferred, park
        self.items: list | None = None

    def __enter__(self) -> None:
        pipe = self.pipe
        if pipe.batch_bytes and pipe.collecting() is None:  # (else: an outer block's)
            self.items = pipe.collect([])

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> bool:
        items = self.items
        if items is not None:  # (sent even when the block raised: its futures exist)
            self.items = self.pipe.collect(None)
            if items:
                self.pipe.flush(items, self.deferred, self.park)
        return False


def _what(cmd: str, key: Any, node: Node, peer: int) -> str:
    """What a request of the pipeline is, as its errors say it."""
    return f"{cmd} of key {key!r} on {node.describe(peer)}"
