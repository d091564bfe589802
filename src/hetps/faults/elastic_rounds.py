"""A server's rounds when workers may leave and join (HETPS_ELASTIC), as a part of
:class:`hetps.kvstore.server.KVServer`. (docs/MODULES.md, "hetps.faults.elastic_rounds")"""

from __future__ import annotations

from collections.abc import Sequence

from hetps.cluster.protocol import check_sender
from hetps.kvstore.hostrounds import check_chunks
from hetps.kvstore.ports import ServerPort
from hetps.kvstore.slices import BadRequest, Slice
from hetps.transport.codec import Message


class ElasticRounds:
    """Per-worker rounds, leaves and joins: a part of a :class:`~hetps.kvstore.server.KVServer`
    (``server``: its slices, answers, aggregator and round end)."""

    def __init__(self, server: ServerPort) -> None:
        self.server = server
        self.node = server.node

    @property
    def active(self) -> bool:
        """Whether a worker may leave mid-job (HETPS_ELASTIC): rounds are kept per worker."""
        return not self.server.workers_fixed and getattr(self.node, "elastic", 0) > 0

    # -- HETPS_ELASTIC: a round is kept per worker until it is complete ----------------------
    def check(self, sl: Slice, worker: int, host: Sequence[int] | None, ce: int) -> None:
        """Refuse a push whose chunks differ from its round's others' (a round is kept per
        worker, merged once complete: a worker that dies before leaves nothing in it; a
        host's sum, ``host``, stands for its workers: docs/HOSTS.md)."""
        check_chunks(sl, ce)
        if host is not None:
            check_sender(
                getattr(self.server.node, "nodes", None), worker, host, f"push of key {sl.key!r}"
            )

    def finish_if_complete(self, sl: Slice) -> None:
        """Finish ``sl``'s round if every worker still in the job pushed all of it."""
        srv = self.server
        if (
            sl.got
            and not sl.copying
            and self._covered(sl)
            and all(c >= sl.value.size for c in sl.got.values())
        ):
            srv.aggregator.merge_held(sl, len(self.node.workers()))
            srv.finish_round(sl)

    def _covered(self, sl: Slice) -> bool:
        """Whether every live worker is in the round: pushed itself, or its host's sum (one
        per host; two while one of a let-go sender is not dropped yet) stands for it."""
        if not sl.hosts:
            return len(sl.got) == self.server.num_workers
        sums = [h[0] for h in sl.hosts.values() if h[2] > 1]
        if len(sums) != len(set(sums)):
            return False
        return all(n.id in sl.got or n.group in sums for n in self.node.live_workers())

    def applied(self, msg: Message, sl: Slice, rnd: int | None) -> bool:
        """A host's part sent again by the local rank that took it over from one let go
        (``rnd``: its round) whose round was applied already: answered with the value."""
        if rnd is None or rnd >= sl.rounds or not self.active:
            return False
        self.server.ack(msg, sl)
        return True

    def on_worker_left(self, gone: int) -> None:
        """A worker died and the job goes on without it (the receive thread calls this,
        between handlers): drop what it sent that is not applied yet, and finish the rounds
        that now have every other worker's push."""
        srv = self.server
        for sl in list(srv.slices.values()):
            sl.backlog = [m for m in sl.backlog if m.sender != gone]
            sl.deferred = [m for m in sl.deferred if m.sender != gone]
            sl.partial.pop(gone, None)
            if gone in sl.got or gone in sl.held:
                sl.held.pop(gone, None)
                sl.hosts.pop(gone, None)
                sl.got.pop(gone, None)
                sl.seen.pop(gone, None)
                sl.acks = [m for m in sl.acks if m.sender != gone]
            self.finish_if_complete(sl)
        srv.tables.worker_left(gone)  # row-sparse keys (tables/server.py)
        srv.links.forget(gone)

    def gone(self, worker: int) -> bool:
        """Whether ``worker`` was let go (and has not entered again)."""
        return not self.server.workers_fixed and worker in getattr(self.node, "left", ())

    def in_rounds(self, msg: Message) -> None:
        """Refuse what would change the job's keys from a worker that is out of its rounds (let
        go, or started again and not joined yet: HETPS_ELASTIC)."""
        if self.gone(msg.sender):
            raise BadRequest(
                f"{msg.cmd} from a worker that is not in the job's rounds (it was let go; a "
                "worker started again joins first: kv.join())"
            )

    def enter(self, msg: Message) -> None:
        """A let-go worker started again joins (HETPS_ELASTIC): it counts in every round from
        now on. The live workers wait at a round boundary meanwhile, so no round is under way."""
        left = getattr(self.node, "left", None)
        if left is None:
            raise BadRequest("enter: only a worker that was let go and joins again enters")
        left.discard(msg.sender)  # (already counted: nothing to do)
        self.node.revive(msg.sender)
        self.server.answers.reply(msg, {})
