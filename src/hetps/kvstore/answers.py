"""How a server answers: at once, or collected while it handles one message and sent
together, one message per worker (a batch's answers, and those of every round the message
completes), as ps-lite answers a ``KVPairs`` request with one message."""

from __future__ import annotations

from typing import Any

from hetps.cluster import batch
from hetps.cluster import protocol as P
from hetps.cluster.node import Node
from hetps.transport.codec import Message


class Pending:
    """The tracker of an answer collected to go out later: not done until it was sent and
    ZeroMQ no longer reads its arrays."""

    __slots__ = ("tracker", "sent")

    def __init__(self) -> None:
        self.tracker: Any = None
        self.sent = False

    @property
    def done(self) -> bool:
        return self.sent and (self.tracker is None or self.tracker.done)


class Answers:
    """A server's answers to its workers. ``node`` gives ``reply`` (one answer) and, for
    collecting, ``send_replies`` (several answers to one destination in one message) and
    ``cfg.batch_bytes``; without them every answer goes at once."""

    def __init__(self, node: Node) -> None:
        self.node = node
        # answers collected while a message is handled: destination -> [(answer, pending)]
        self._out: dict[int, list] | None = None
        # answers with at most this many bytes of arrays are collected (0: none are)
        cfg = getattr(node, "cfg", None)
        self._max_bytes = (
            min(cfg.batch_bytes, batch.ITEM_BYTES_MAX)
            if cfg is not None and hasattr(node, "send_replies")
            else 0
        )

    def begin(self) -> bool:
        """Start collecting (False: collecting is off, or already on for an outer message)."""
        if self._out is not None or self._max_bytes <= 0:
            return False
        self._out = {}
        return True

    def reply(
        self,
        msg: Message,
        body: dict | None = None,
        arrays: list | None = None,
        track=False,
        timed=False,
    ) -> Any:
        """Answer ``msg``: collected while a message is handled (small answers of the
        batchable commands), else at once. With ``track``, what comes back tells when the
        answer's arrays are no longer read (``.done``), as a ZeroMQ tracker does; ``timed``:
        its receiver times it from a forecast sent just before (Message.timed)."""
        out = self._out
        size = sum(int(a.nbytes) for a in arrays) if arrays else 0
        big = size > self._max_bytes and msg.cmd != P.SPULL  # (a table's rows: any size)
        if out is None or big or msg.cmd not in P.BATCH_COMMANDS:
            kw = {"timed": True} if timed else {}  # (only the measured answers say it)
            return self.node.reply(msg, body, arrays, track=track, **kw)
        answer = Message(
            msg.cmd, req=msg.req, reply=True, body=body or {}, arrays=arrays or [], timed=timed
        )
        pending = Pending() if track else None
        out.setdefault(msg.sender, []).append((answer, pending))
        return pending

    def flush(self) -> None:
        """Send what was collected, one message per destination, and stop collecting."""
        out, self._out = self._out, None
        for dest, items in (out or {}).items():
            for group in batch.groups(items, lambda item: batch.array_bytes(item[0])):
                pendings = [p for _, p in group if p is not None]
                answers = [m for m, _ in group]
                tracker = self.node.send_replies(dest, answers, track=bool(pendings))
                for p in pendings:
                    p.tracker, p.sent = tracker, True
