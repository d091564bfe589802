"""Batches: several small requests to one server (or their answers to one worker) in one
message, as ps-lite sends a list of keys as one ``KVPairs`` message per server.

A :data:`~hetps.cluster.protocol.BATCH` message's body holds ``items``: one
``[cmd, req, body, arrays]`` entry per request (or answer), in order; ``arrays`` is how many
of the batch's arrays are the item's own, following the previous items' arrays. Each item
keeps its own request id, so a worker matches every answer to its request as if it had come
alone. Only :data:`~hetps.cluster.protocol.BATCH_COMMANDS` (init, push, pull, spush, spull)
may be batched: never a pickle, never a batch in a batch.

:func:`unpack` checks the whole batch (types, the item count, that the array counts add up)
before it returns any item; each item is then handled exactly like a message that came alone
(the receiver validates its body field by field).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from hetps.cluster import protocol as P
from hetps.cluster.bodies import Body, Count, W, command, explain
from hetps.transport.codec import MAX_HEADER_BYTES, Message, encode

log = logging.getLogger("hetps.batch")

#: a request (or answer) with more bytes of arrays than this goes alone (HETPS_BATCH_BYTES
#: lowers it); a batch's arrays take the same-host ring like any message's (transport/van.py)
ITEM_BYTES_MAX = 1 << 20
#: a batch carries at most this many bytes of arrays (more: the next batch)
MAX_BATCH_BYTES = 8 << 20


def groups(items: list[Any], size: Any) -> list[list[Any]]:
    """``items`` in order, cut into groups of at most :data:`~hetps.cluster.protocol.
    MAX_BATCH_ITEMS` items and :data:`MAX_BATCH_BYTES` bytes (``size(item)``; an item bigger
    than that is a group of its own)."""
    out: list[list[Any]] = []
    cur: list[Any] = []
    nbytes = 0
    for item in items:
        n = size(item)
        if cur and (len(cur) >= P.MAX_BATCH_ITEMS or nbytes + n > MAX_BATCH_BYTES):
            out.append(cur)
            cur, nbytes = [], 0
        cur.append(item)
        nbytes += n
    if cur:
        out.append(cur)
    return out


def array_bytes(msg: Message) -> int:
    """Bytes of ``msg``'s arrays (a list summed: a generator costs 3x, a dozen times a round)."""
    return sum([getattr(a, "nbytes", 0) for a in msg.arrays])


def wire_bytes(msg: Message) -> int:
    """The bytes ``msg`` counts against its receiver's ``HETPS_MAX_MESSAGE_BYTES``: its
    header (with room for a ring's field) and its arrays (not copied to encode it)."""
    nbytes = msg.nbytes
    head = encode(msg)[0]
    msg.nbytes = nbytes
    return len(head) + 64 + 9 * len(msg.arrays) + array_bytes(msg)


def fitting(msgs: list[Message], limit: int, reply: bool = False) -> list[list[Message]]:
    """``msgs`` in order, in runs that each :func:`pack` into a message of at most ``limit``
    bytes (:func:`wire_bytes`; a receiver drops a bigger one): one run while the arrays leave
    room for the largest header, else runs halved until each fits. A run of one may still
    exceed it (:func:`over` says why)."""
    if sum(map(array_bytes, msgs)) + MAX_HEADER_BYTES <= limit:
        return [msgs]
    out: list[list[Message]] = []
    todo = [msgs]
    while todo:
        run = todo.pop()
        if len(run) > 1 and wire_bytes(pack(run, reply)) > limit:
            todo += [run[len(run) // 2 :], run[: len(run) // 2]]
        else:
            out.append(run)
    return out


def answers(replies: list[Message], limit: int) -> list[Message]:
    """The messages that carry the answers ``replies`` to one worker, each within ``limit``
    bytes (:func:`fitting`): batches, lone answers, and an error answer in place of one that
    alone would exceed it (logged)."""
    out = []
    for run in fitting(replies, limit, reply=True):
        if len(run) == 1 and (why := over(run[0], limit)) is not None:
            log.warning("%s (answered with this error)", why)
            run = [Message(run[0].cmd, req=run[0].req, reply=True, body={"error": why})]
        out.append(run[0] if len(run) == 1 else pack(run, reply=True))
    return out


class Trackers:
    """The trackers of several sends as one: done once each is (None: nothing to wait on)."""

    def __init__(self, trackers: list[Any]) -> None:
        self.trackers = trackers

    @property
    def done(self) -> bool:
        """Whether no send still reads its arrays."""
        return all(t is None or t.done for t in self.trackers)


def over(msg: Message, limit: int) -> str | None:
    """Why ``msg`` cannot go to a receiver whose bound is ``limit`` (None: it can)."""
    if array_bytes(msg) + MAX_HEADER_BYTES <= limit or (size := wire_bytes(msg)) <= limit:
        return None
    return (
        f"a {msg.cmd} of {size} bytes exceeds HETPS_MAX_MESSAGE_BYTES={limit}, the largest "
        "message a node accepts: raise it on every node"
    )


class Batch(Body, kw_only=True):
    """``items``: [[cmd, req, body, arrays], ...]: one request (from a worker) or one answer (from a
    server) each, in order: its command (init, push, pull, spush or spull), its request id, its own body (the
    fields of that command, or of its answer), and how many of the batch's arrays are its own
    (they follow the previous items' arrays)"""

    items: Annotated[
        list[
            tuple[
                Literal["init", "push", "pull", "spush", "spull"],
                Annotated[int, Meta(ge=1)],
                dict[str, Any],
                Count,
            ]
        ],
        Meta(min_length=1, max_length=P.MAX_BATCH_ITEMS),
    ]


command(P.BATCH, Batch, reply=Batch, server=W)  # (a request's, an answer's)


class BadBatch(ValueError):
    """A batch that cannot be unpacked; the text says what is wrong."""


def pack(items: list[Message], reply: bool = False, req: int = 0) -> Message:
    """One BATCH message carrying ``items`` (requests, or answers with ``reply``)."""
    entries = []
    arrays: list[Any] = []
    for m in items:
        entries.append([m.cmd, m.req, m.body, len(m.arrays)])
        arrays += m.arrays
    return Message(
        P.BATCH,
        req=req,
        reply=reply,
        priority=max(m.priority for m in items),
        body={"items": entries},
        arrays=arrays,
        timed=any(m.timed for m in items),
    )


def layout(body: Any, total: int) -> list[tuple[str, int, dict, int]]:
    """The items of a batch's ``body`` (a :class:`~hetps.cluster.commands.Batch`, or the map
    that came) as (cmd, req, body, array count), checked whole: its declared type (at most
    MAX_BATCH_ITEMS items, each a batchable command, a positive request id, a map body and an
    array count) and the counts adding up to the batch's ``total`` arrays. Raises
    :class:`BadBatch` (nothing else) otherwise."""
    try:
        items = (body if isinstance(body, Batch) else msgspec.convert(body, Batch)).items
    except msgspec.ValidationError as exc:
        raise BadBatch(explain(P.BATCH, body, Batch, str(exc)).removeprefix("batch: ")) from None
    taken = sum(item[3] for item in items)
    if taken != total:
        raise BadBatch(f"the items take {taken} arrays but the batch carries {total}")
    return items


def landings(
    look: Callable[[int], Any], cmd: str, req: int, body: Any, count: int
) -> dict[int, Any] | None:
    """Where an answer's arrays (``count`` of them) may land, ``{array index: place}``: the
    first array of the answer to ``req`` (or of each answer in a batch) in ``look(its req)``.
    The body is not checked yet when this is asked, so all or nothing: an error answer, or a
    batch that :func:`layout` refuses, lands nowhere."""
    if not isinstance(body, dict) or "error" in body:
        return None
    if cmd != P.BATCH:
        target = look(req) if count else None
        return None if target is None else {0: target}
    try:
        items = layout(body, count)
    except BadBatch:
        return None
    out: dict[int, Any] = {}
    at = 0
    for _, r, _, n in items:
        if n:
            target = look(r)
            if target is not None:
                out[at] = target
        at += n
    return out or None


def unpack(msg: Message) -> list[Message]:
    """The items of the batch ``msg`` as messages from its sender (answers if it is one).
    Raises :class:`BadBatch` (nothing else) when the batch is malformed."""
    out = []
    at = 0
    for cmd, req, body, count in layout(msg.typed or msg.body, len(msg.arrays)):
        arrays = msg.arrays[at : at + count]
        at += count
        out.append(
            Message(
                cmd,
                sender=msg.sender,
                req=req,
                reply=msg.reply,
                priority=msg.priority,
                body=body,
                arrays=arrays,
                sent_at=msg.sent_at,
                nbytes=sum([a.nbytes for a in arrays]),
                backlogged=msg.backlogged,
                origin=msg.origin,
                mark=msg.mark,
            )
        )
    return out


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
