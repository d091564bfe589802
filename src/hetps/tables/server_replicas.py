"""Copies of the row-sparse keys on other servers (HETPS_REPLICAS), as a part of
:class:`hetps.tables.server.Tables`. The dense keys' :class:`~hetps.kvstore.replicas.Replication`
carries them: the same replicas (the next R-1 live servers), the same copies that hold the
answer back until every replica applied them, the same failover and resync.

A table's part is copied as a dense slice is. Its primary copies each ``sinit`` and ``sload``
as it came (ops ``sinit``, ``sload``) and each finished ``dist_sync`` round (op ``sround``:
the round's distinct row ids and the per-row sums the optimizer took, or ``dropped`` when the
round failed there), and answers nothing of the part until every replica applied it. A
replica applies the round with the same optimizer, so the rows, the rows a growing table
makes on first push and the lazy optimizer state (momentum, Adam's m, v and t, AdaGrad's
history) stay identical. A worker's push carries its round (``rnd``): a push of a round
applied already (resent after a failover) is acknowledged and not applied again; one of a
later round waits for its round (the same round's push twice is kept until its round is
applied, then acknowledged only). After a failover, a rejoin or a refused copy the primary sends each replica
its whole parts (op ``ssync``: the declaration, the round count and the state's numbers,
then the used rows with their state rows, in chunks), which replace what the replica had.
docs/FAULTS.md says what a user sees.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from hetps.cluster.errors import BadRequest, short
from hetps.tables import server_dump
from hetps.tables.server_shard import TablesPort, checked_ids, checked_rows
from hetps.transport.codec import Message

log = logging.getLogger("hetps.server")

#: the servers' cap on table memory, as its refusal names it (tables/server.py)
CAP_VAR = "HETPS_TABLE_MAX_BYTES"
#: the ops of a REPLICATE message that carry a table's part
TABLE_OPS = frozenset({"sinit", "sload", "sround", "ssync"})
#: bytes of rows (values and state) one ``ssync`` chunk carries
SYNC_CHUNK_BYTES = 1 << 24
#: the declaration's fields, as an ``sinit`` has them (an ``ssync`` header carries them too)
DECL_FIELDS = ("rows", "cols", "dtype", "scale", "seed", "bound")


class TableCopies:
    """The copies of a server's table parts (``tables``: its :class:`Tables`)."""

    def __init__(self, tables: TablesPort) -> None:
        self.tables = tables
        self.server = tables.server

    # -- the primary's side --------------------------------------------------------------
    def send(self, msg: Message, op: str) -> bool:
        """Copy a worker's ``sinit`` or ``sload`` (applied here) to every replica and answer
        it once each applied it; False (nothing sent) with no replicas."""
        rep = self.server.replication
        if not rep.replicas():
            return False
        errors: list[str] = []

        def then() -> None:
            # a declaration any replica refused fails; a load only for want of room (a
            # replica that lacked the part gets it whole, loaded rows included)
            text = _refused(msg.cmd, msg.typed.key, errors, every=op == "sinit")
            self.server.answers.reply(msg, {"error": text} if text else None)

        rep.copy_out(dict(msg.body, op=op), list(msg.arrays), then, errors)
        return True

    def by_round(self, sh: Any, msg: Message) -> bool | None:
        """Place a ``dist_sync`` push by the round it carries: True when it was handled here
        (acknowledged, or kept for its round), False when it is of this very round, None when
        it carries none (no replicas). (The same round's push twice is kept for the next
        round, as without replicas, and there found applied: acknowledged only.)"""
        rnd = msg.typed.round  # (an SPush's: None or an int >= 0)
        if rnd is None or not self.server.replication.replicated:
            return None
        if sh.copying or rnd > sh.rounds:  # its round comes later (or the last one's copy)
            self.tables.hold(sh, msg)
            sh.backlog.append(msg)
            return True
        if rnd < sh.rounds:  # a resent push of a round applied here already (a failover)
            self.server.answers.reply(msg)
            return True
        return False

    def round_out(
        self, sh: Any, ids: np.ndarray, grad: np.ndarray, error: str | None, *answers: list
    ) -> bool:
        """Copy a finished round of ``sh`` to every replica, then answer it (``answers``: its
        acks, deferred pulls and backlog). False (nothing sent) with no replicas."""
        rep = self.server.replication
        if not rep.replicas():
            return False
        body: dict = {"op": "sround", "k": sh.key, "part": sh.part, "rnd": sh.rounds}
        if error:
            body["dropped"] = True
        arrays = [] if error else [ids, np.ascontiguousarray(grad).reshape(-1)]
        # while the copy is out the part takes no push or pull (they wait in its backlog), so
        # neither array changes before every replica answered
        sh.copying = True
        errors: list[str] = []

        def then() -> None:
            full = _refused("the round", sh.key, errors, every=False)
            self.tables.answer_round(sh, *answers, error or full)

        rep.copy_out(body, arrays, then, errors)
        return True

    def served(self) -> list[Any]:
        return [sh for sh in self.tables.shards.values() if sh.primary]

    def sync_messages(self) -> list[tuple[dict, list[np.ndarray]]]:
        """The whole of every part served here, as ``ssync`` copies (a header per part, then
        its used rows in chunks of at most :data:`SYNC_CHUNK_BYTES`)."""
        out: list[tuple[dict, list[np.ndarray]]] = []
        for sh in self.served():
            try:
                out += _part_messages(sh)
            except BadRequest as exc:  # a state that cannot travel (as in a checkpoint)
                log.warning("server: table %r part %d is not copied: %s", sh.key, sh.part, exc)
        return out

    def on_failover(self, dead: int, to: int, me: Any) -> None:
        """``dead``'s copies here are ours now if we took over, else ``to``'s."""
        for sh in self.tables.shards.values():
            if sh.origin == dead:
                if to == me:
                    sh.primary, sh.origin = True, None
                else:
                    sh.origin = to

    # -- the replica's side --------------------------------------------------------------
    def copy_in(self, msg: Message) -> None:
        """A primary's copy of a table's part (ops :data:`TABLE_OPS`)."""
        op, b = type(msg.typed).__struct_config__.tag, msg.typed  # (a member of Replicate)
        tables = self.tables
        if op == "sinit":
            sh = tables.declare(msg, copy=True)
            sh.primary, sh.origin, sh.rounds = False, msg.sender, 0
        elif op == "ssync" and b.fresh:
            sh = tables.declare(msg, copy=True)  # (the header carries no rows)
            sh = server_dump.load(tables, sh, msg, copy=True)
            if b.round is None:
                raise BadRequest("replicate: a table part's copy needs 'rnd', an int >= 0")
            sh.rounds, sh.primary, sh.origin = b.round, False, msg.sender
        else:
            sh = self._copy_of(msg)
            if sh is not None and op == "sround":
                self._round_in(sh, msg)
            elif sh is not None:  # sload, or an ssync chunk
                server_dump.load(tables, sh, msg, copy=True)
        self.server.answers.reply(msg)

    def _copy_of(self, msg: Message) -> Any:
        """The copy a message is for; None for a late copy of a part served here now (its
        primary died and this server took it over: the resent pushes make the round)."""
        key, part = msg.typed.key, msg.typed.part
        sh = self.tables.shards.get((key, part))
        if sh is None:
            raise BadRequest(f"replicate: no copy of table {key!r} part {short(part)} here")
        return None if sh.primary else sh

    def _round_in(self, sh: Any, msg: Message) -> None:
        rnd = msg.typed.round  # (a ReplicaSRound's: an int >= 0)
        if rnd > sh.rounds + 1:
            raise BadRequest(
                f"replicate: round {rnd} of table {sh.key!r} part {sh.part}, but this copy "
                f"has {sh.rounds}: a round is missing"
            )
        if rnd <= sh.rounds:  # (an earlier one again is only acknowledged)
            return
        if not msg.typed.dropped:
            if len(msg.arrays) != 2:
                raise BadRequest(f"replicate: a round of table {sh.key!r} needs ids and rows")
            ids = checked_ids(msg, sh, msg.arrays[0].reshape(-1), True)
            grad = checked_rows(msg, sh, msg.arrays[1], ids.size)
            self.tables.apply(sh, ids, grad)  # the same optimizer on the same sums
        sh.rounds = rnd


def _refused(what: str, key: Any, errors: list[str], every: bool) -> str | None:
    """The error to answer a copied request with when a replica refused its copy: any
    refusal (``every``: a declaration), or only one for want of room (a replica that lacks
    the part refuses too, and then gets the whole part again)."""
    why = next((e for e in errors if every or CAP_VAR in e), None)
    if why is None:
        return None
    if CAP_VAR in why:  # (a replica over its cap: its copies of its neighbours' parts count)
        fix = (
            "with HETPS_REPLICAS each server also holds copies of its neighbours' parts: give "
            f"the servers room for them ({CAP_VAR}), or run with fewer replicas"
        )
    else:
        fix = "fix what it names on that server, or run with HETPS_REPLICAS=1"
    return f"{what} of row-sparse key {key!r}: a replica could not take its copy ({why}); {fix}"


def _part_messages(sh: Any) -> list[tuple[dict, list[np.ndarray]]]:
    """One part's ``ssync`` copies: the header (declaration, rounds, the optimizer state's
    names and numbers, the table's own optimizer), then chunks of its used rows."""
    ids, loc = server_dump.used_rows(sh)
    names = server_dump.per_row(sh)
    head = {
        "op": "ssync",
        "k": sh.key,
        "part": sh.part,
        "nparts": sh.nparts,
        **{f: sh.decl[f] for f in DECL_FIELDS},
        "rnd": sh.rounds,
        "fresh": True,
        "state": names,
        "numbers": server_dump.numbers(sh),
    }
    if sh.opt_blob is not None:
        head["opt"] = sh.opt_blob
    out: list[tuple[dict, list[np.ndarray]]] = [(head, [])]
    per = sh.value.itemsize * sh.cols + sum(
        sh.state[m].itemsize * sh.state[m].shape[1] for m in names
    )
    step = max(1, min(server_dump.MAX_CHUNK_ROWS, SYNC_CHUNK_BYTES // per))
    for a in range(0, ids.size, step):
        sel = loc[a : a + step]  # (indexing copies: later rounds do not change them)
        arrays = [ids[a : a + step].copy(), sh.value[sel].reshape(-1)]
        arrays += [sh.state[m][sel].reshape(-1) for m in names]
        out.append(({"op": "ssync", "k": sh.key, "part": sh.part, "state": names}, arrays))
    return out
