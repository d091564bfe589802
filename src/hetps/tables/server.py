"""A server's parts of the row-sparse keys (embedding tables): rows by id, rounds, lazy updates.

A table's rows are spread over the servers by id: row ``r`` lives on part ``r % S`` at local
row ``r // S`` (a fixed table), or, for a table that grows (``rows=None``), at the local row
its id was given when it was first pushed. Every request is checked before it is used: its
ids (int64, in range, on this part, and for a push sorted and distinct) and the size and dtype
of its rows; a bad one is answered with an error naming the key and the first bad id.

``dist_sync``: every worker pushes each table once per round to every server (a push may carry
no rows). When every live worker pushed, the pushes are summed per row in worker order, and the
optimizer updates only the rows touched (:func:`hetps.tables.lazy.update_rows`); with no
optimizer the sums replace those rows. Then the pushes are acknowledged and the pulls that
waited for the round are answered. ``dist_async``: each push is applied at once.

Memory: each table has its own bound (``Table(server_bytes=...)``), and all of a server's
tables together the server's cap (HETPS_TABLE_MAX_BYTES), both checked before a table is
made, grows or gets its optimizer state. Checkpoints read and write the parts through
``sdump`` and ``sload`` (tables/server_dump.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from hetps.cluster import protocol as P
from hetps.cluster.errors import BadRequest, short
from hetps.cluster.protocol import check_sender
from hetps.tables import lazy, server_dump
from hetps.tables.rowsparse import first_nonfinite
from hetps.tables.server_replicas import TableCopies
from hetps.tables.server_shard import (  # (re-exported: they were here)
    INDEX_ROW_BYTES,
    MAX_IDS,
    TABLE_BYTES,
    Replies,
    Shard,
    TableServer,
    apply_rows,
    checked_ids,
    checked_rows,
    machine_memory,
)
from hetps.transport.codec import Message

log = logging.getLogger("hetps.server")

__all__ = [
    "INDEX_ROW_BYTES",
    "MAX_AHEAD",
    "MAX_IDS",
    "PULL_BYTES",
    "TABLE_BYTES",
    "Replies",
    "Shard",
    "TableServer",
    "Tables",
    "apply_rows",
    "machine_memory",
]

#: requests of one worker that may wait here for the table's later rounds (a worker is at
#: most HETPS_ROUNDS_AHEAD rounds ahead, each a push and its pull, on every server)
MAX_AHEAD = 64
#: bytes of rows one pull may ask (HETPS_TABLE_PULL_BYTES; a server's is set at its start)
PULL_BYTES = 16 << 20


class Tables:
    """The row-sparse keys of one server (``server``: its :class:`~hetps.kvstore.server.KVServer`,
    for the optimizer, the worker count, the answers and the mode)."""

    def __init__(self, server: TableServer) -> None:
        self.server = server
        self.shards: dict[tuple[Any, int], Shard] = {}  # (key, part) -> part, served or a copy
        self.copies = TableCopies(self)  # HETPS_REPLICAS
        #: bytes all tables here may take together (HETPS_TABLE_MAX_BYTES; 0: no cap)
        self.cap = 0
        #: bytes of rows one pull may ask (HETPS_TABLE_PULL_BYTES)
        self.pull_bound = PULL_BYTES

    def check_cap(self, sh: Shard, need: int) -> None:
        """Refuse (BadRequest naming the table, the cap and the fix) when ``sh`` taking
        ``need`` bytes would put this server's tables over :attr:`cap`."""
        if not self.cap:
            return
        opt = self.server.optimizer
        others = sum(o.reserved(opt) for k, o in self.shards.items() if k != sh.skey)
        need += sh.fixed_bytes()
        if others + need > self.cap:
            raise BadRequest(
                f"row-sparse key {sh.key!r}: this server's part would take {need} bytes"
                + (f" and its other tables take {others}" if others else "")
                + f", over the server's cap on table memory of {self.cap} bytes "
                "(HETPS_TABLE_MAX_BYTES); raise HETPS_TABLE_MAX_BYTES on the servers, add "
                "servers, or make the table smaller (fewer rows or columns, a growing table "
                "with Table(server_bytes=...))"
            )

    # -- entry ---------------------------------------------------------------------------
    def handle(self, msg: Message) -> None:
        if msg.cmd == P.SINIT:
            self._init(msg)
        elif msg.cmd == P.SPUSH:
            self._push(msg)
        elif msg.cmd == P.SPULL:
            self._pull(msg)
        elif msg.cmd == P.SDUMP:  # a checkpoint reads the part (tables/server_dump.py)
            body, arrays = server_dump.dump(self._shard(msg), msg)
            self.server.answers.reply(msg, body, arrays=arrays)
        else:  # P.SLOAD: a restore writes it (and each replica its copy)
            server_dump.load(self, self._shard(msg), msg)
            if not self.copies.send(msg, "sload"):
                self.server.answers.reply(msg)

    def reset_states(self) -> None:
        """A new optimizer: every table's state starts again."""
        for sh in self.shards.values():
            if sh.optimizer is None:
                sh.state, sh.has_state = None, False

    def nbytes(self) -> int:
        """Bytes held by every table here (values and optimizer states)."""
        return sum(sh.nbytes() for sh in self.shards.values())

    # -- checks --------------------------------------------------------------------------
    def _shard(self, msg: Message) -> Shard:
        key = msg.typed.key  # (an int or a str of at most 1,024 characters)
        part = msg.typed.part
        sh = self.shards.get((key, part))
        if sh is None:
            held = sorted(p for k, p in self.shards if k == key)
            if held:
                raise BadRequest(
                    f"{msg.cmd} of key {key!r}: part {short(part)}, this server holds "
                    + ", ".join(map(str, held))
                )
            raise BadRequest(
                f"{msg.cmd}: row-sparse key {key!r} was never initialised here: call "
                f"kv.init({key!r}, Table(rows, cols)) first"
            )
        if not sh.primary:  # a worker sends a copy's requests here: its server died
            sh.primary, sh.origin = True, None
        return sh

    # -- commands ------------------------------------------------------------------------
    def _init(self, msg: Message) -> None:
        """A worker's declaration of this server's part (with rows of its first value):
        made here, then on every replica (HETPS_REPLICAS), then answered."""
        sh = self.declare(msg)
        # (a worker counts its pushes of a table from its init, as the part's rounds here)
        sh.primary, sh.origin, sh.rounds = True, None, 0
        if not self.copies.send(msg, "sinit"):
            self.server.answers.reply(msg)

    def declare(self, msg: Message, copy: bool = False) -> Shard:
        """Make (or keep) the part an ``sinit`` declares and write its rows; ``copy``: a
        primary's copy of it (from a server of the job: its optimizer pickle is taken)."""
        key = msg.typed.key  # (an int or a str of at most 1,024 characters)
        b = msg.typed  # an SInit: every field's type and bound checked by the dispatch
        rows, cols, dname = b.rows, b.cols, b.dtype
        part, nparts = b.part, b.parts
        scale, seed, bound = b.scale, b.seed, b.bound
        if part >= nparts:
            raise BadRequest(f"sinit of key {key!r}: part {part} of a table of {nparts} parts")
        if any(k == key for k, _ in self.server.slices):
            raise BadRequest(f"sinit: key {key!r} is a dense key here; use another key")
        decl = {
            "rows": rows,
            "cols": cols,
            "dtype": dname,
            "scale": float(scale),
            "seed": seed,
            "bound": bound,
        }
        sh = self.shards.get((key, part))
        if copy and sh is not None and sh.primary:
            raise BadRequest(f"replicate: table {key!r} part {part} is served here, not a copy")
        if sh is None or sh.decl != decl or sh.nparts != nparts:
            if sh is not None and (sh.pending or sh.deferred or sh.backlog or sh.copying):
                raise BadRequest(
                    f"sinit of key {key!r}: a round of this table is under way here; declare "
                    "it again only between rounds (every worker's pushes answered)"
                )
            try:
                new = Shard(key, decl, part, nparts, self)
            except (MemoryError, ValueError) as exc:
                raise BadRequest(f"sinit of key {key!r}: cannot hold the table ({exc})") from None
            if self.server.optimizer is not None and b.optimizer is None:
                new.check_bound(new.n, new.row_bytes(self.server.optimizer))
            self.shards[(key, part)] = sh = new
        blob = b.optimizer
        if blob is not None:
            if not (copy or self.server.from_worker(msg)):
                raise BadRequest(f"sinit of key {key!r}: a table's optimizer comes from a worker")
            from hetps import optim

            try:
                opt = optim.loads(blob, None if copy else self.server.optimizers)
            except Exception as exc:  # noqa: BLE001 - unpickling user code can raise anything
                raise BadRequest(
                    f"sinit of key {key!r}: the server could not load the table's optimizer "
                    f"({type(exc).__name__}: {exc})"
                ) from None
            try:
                sh.check_bound(sh.n, sh.row_bytes(opt))  # with its state
            except BadRequest:
                self.shards.pop((key, part), None)  # (not kept half declared)
                raise
            sh.optimizer, sh.opt_blob = opt, blob
            sh.state, sh.has_state = None, False
        if msg.arrays:
            if len(msg.arrays) != 2:
                raise BadRequest(f"sinit of key {key!r}: expected row ids and rows")
            ids = checked_ids(msg, sh, msg.arrays[0].reshape(-1), False)
            vals = checked_rows(msg, sh, msg.arrays[1], ids.size)
            opt = sh.optimizer if sh.optimizer is not None else self.server.optimizer
            sh.settle()
            sh.value[sh.local(ids, opt, create=True)] = vals
        return sh

    def _push(self, msg: Message) -> None:
        sh = self._shard(msg)
        if len(msg.arrays) != 2:
            raise BadRequest(f"spush of key {sh.key!r}: expected row ids and rows")
        ids = checked_ids(msg, sh, msg.arrays[0].reshape(-1), True)
        vals = checked_rows(msg, sh, msg.arrays[1], ids.size)
        bad = first_nonfinite(vals)
        if bad is not None:  # (a worker refuses them before sending: a broken peer's)
            raise BadRequest(
                f"spush of key {sh.key!r}: the row of id {int(ids[bad])} holds a NaN or an "
                "infinity; refused (it would make the row NaN for good)"
            )
        srv = self.server
        sync = srv.sync if srv.sync is not None else msg.typed.sync
        if not sync and srv.optimizer is None and sh.optimizer is None:
            raise BadRequest(
                f"push of row-sparse key {sh.key!r} in dist_async needs a server optimizer: "
                "call kv.set_optimizer(...) before the first push"
            )
        worker = msg.sender
        if srv.elastic.gone(worker):
            raise BadRequest("spush from a worker that left the job")  # (sent before it died)
        if not sync:
            self.apply(sh, ids, vals)
            srv.answers.reply(msg)
            return
        # HETPS_REPLICAS: a push carries its round: a resent one is acknowledged only, a
        # later round's waits for it (True: done here; False: of this very round)
        order = self.copies.by_round(sh, msg)
        if order:
            return
        if srv.done_workers:
            raise BadRequest(srv.uneven(sh))
        if worker in sh.pending or (order is None and any(m.sender == worker for m in sh.backlog)):
            self.hold(sh, msg)
            sh.backlog.append(msg)  # this worker pushed this round already: the next one
            return
        host = msg.typed.host
        self._check_host(sh, worker, host)
        sh.pending[worker] = (ids, vals, host)
        msg.arrays = []
        sh.acks.append(msg)
        if _standing(sh) >= srv.num_workers:
            self._finish_round(sh)

    def _check_host(self, sh: Shard, worker: int, host: Sequence[int] | None) -> None:
        """Refuse a push whose host tag does not fit the round's other pushes (tagged and
        untagged mixed, a (host group, local rank) twice, more workers than the job's)."""
        tags = [h for w, (_, _, h) in sh.pending.items() if w != worker]
        what = f"spush of key {sh.key!r}"
        if any((h is None) != (host is None) for h in tags):
            raise BadRequest(
                f"{what}: a round of pushes with and without their host group (hg); give "
                "every worker its HETPS_HOST_GROUP, LOCAL_RANK and LOCAL_WORLD_SIZE, or none"
            )
        if host is None:
            return
        check_sender(getattr(self.server.node, "nodes", None), worker, host, what)
        if any(h[:2] == host[:2] for h in tags):
            raise BadRequest(
                f"{what}: two workers say they are local rank {host[1]} of host group "
                f"{host[0]}; give each worker of a host its own LOCAL_RANK"
            )
        if host[2] + sum(h[2] for h in tags) > self.server.num_workers:
            raise BadRequest(
                f"{what}: its round's pushes stand for more workers than the job's "
                f"{self.server.num_workers}; a host's LOCAL_WORLD_SIZE counts its workers"
            )

    def apply(self, sh: Shard, ids: np.ndarray, grad: np.ndarray) -> None:
        """Apply a round's per-row sums of (checked) ``ids`` to ``sh`` (:func:`apply_rows`)."""
        apply_rows(sh, self.server.optimizer, ids, grad)

    def hold(self, sh: Shard, msg: Message) -> None:
        """A worker may have :data:`MAX_AHEAD` requests of a table waiting for later rounds
        here; one more is refused (a worker that ran away would fill the server's memory)."""
        waiting = sum(1 for m in sh.backlog if m.sender == msg.sender)
        waiting += sum(1 for m in sh.deferred if m.sender == msg.sender)
        if waiting >= MAX_AHEAD:
            raise BadRequest(
                f"{msg.cmd} of key {sh.key!r}: this worker is {MAX_AHEAD} requests ahead of the "
                "table's rounds here; wait for its pushes before sending more"
            )

    def _finish_round(self, sh: Shard) -> None:
        # a deterministic order: worker order, or, with host groups known, each host's
        # pushes in local-rank order, then the hosts' sums in host-group order (a host that
        # summed its workers itself pushed that very sum: docs/HOSTS.md)
        pending, standing = sh.pending, _standing(sh)
        acks, deferred, backlog = sh.acks, sh.deferred, sh.backlog
        sh.pending, sh.acks, sh.deferred, sh.backlog = {}, [], [], []
        hosts: dict[Any, list] = {}
        for w in sorted(pending, key=lambda w: pending[w][2] or (w,)):
            ids, vals, host = pending[w]
            hosts.setdefault(w if host is None else host[0], []).append((ids, vals))
        sums = [lazy.sum_rows(h, sh.cols, sh.dtype) for h in hosts.values()]
        ids, grad = lazy.sum_rows(sums, sh.cols, sh.dtype)
        opt = sh.optimizer if sh.optimizer is not None else self.server.optimizer
        job = self.server.job_workers()  # (those that left included)
        if opt is not None and standing < job:
            # workers left (HETPS_ELASTIC): the sum is scaled to the job's count, as a dense
            # key's, so the optimizer's rescale_grad (set for it) gives the survivors' mean
            grad = grad * (job / standing)
        error = None
        try:
            self.apply(sh, ids, grad)
        except BadRequest as exc:  # (a growing table over its bound) the round is dropped
            error = str(exc)
        except Exception as exc:  # an optimizer with no lazy rule, a bug: every worker hears
            log.exception("update of table %r failed", sh.key)
            error = f"the update of table {sh.key!r} failed: {type(exc).__name__}: {exc}"
        sh.rounds += 1
        if self.copies.round_out(sh, ids, grad, error, acks, deferred, backlog):
            return  # answered once every replica applied it too
        self.answer_round(sh, acks, deferred, backlog, error)

    def answer_round(
        self, sh: Shard, acks: list, deferred: list, backlog: list, error: str | None
    ) -> None:
        """Acknowledge a finished round's pushes (with its error), answer the pulls that
        waited for it, then handle what came for later rounds (and while it was copied)."""
        if sh.copying:
            sh.copying = False
            backlog, sh.backlog = backlog + sh.backlog, []
        answers = self.server.answers
        for m in acks:
            answers.reply(m, {"error": error} if error else None)
        for m in deferred:  # (each answered, whatever the others' requests held)
            try:
                self._pull(m, checked=True)
            except BadRequest as exc:
                answers.reply(m, {"error": str(exc)})
        for m in backlog:
            self.server.handle(m)

    def _pull(self, msg: Message, checked: bool = False) -> None:
        """Answer a pull with its rows (or keep it for its round); ``checked``: a pull that
        waited for its round here, whose ids were checked when it came."""
        sh = self._shard(msg)
        if checked:
            ids = msg.arrays[0].reshape(-1)
        else:
            if len(msg.arrays) != 1:
                raise BadRequest(f"spull of key {sh.key!r}: expected one array of row ids")
            # sorted and distinct (a worker sends each id once), so the reply's size is known
            # from its ids before anything is built
            ids = checked_ids(msg, sh, msg.arrays[0].reshape(-1), True)
            row = sh.cols * sh.dtype.itemsize
            if ids.size * row > self.pull_bound:
                raise BadRequest(
                    f"spull of key {sh.key!r}: {ids.size} row ids ({int(ids[0])} to "
                    f"{int(ids[-1])}) of {row} bytes a row ask {ids.size * row} bytes, over the "
                    f"bound on one pull's reply of {self.pull_bound} bytes "
                    "(HETPS_TABLE_PULL_BYTES); a worker splits its pulls by it: give the workers "
                    "and the servers the same value"
                )
        worker = msg.sender
        if sh.copying or any(m.sender == worker for m in sh.backlog):
            self.hold(sh, msg)  # (a round's copy is out: answered once it is applied there)
            sh.backlog.append(msg)
            return
        if worker in sh.pending:  # this worker pushed in the unfinished round: after it
            self.hold(sh, msg)  # (each waiting pull holds its ids, and its reply comes)
            sh.deferred.append(msg)
            return
        self.server.answers.reply(msg, arrays=[sh.reply_rows(ids)])

    def worker_left(self, gone: int) -> None:
        """A worker died and the job goes on without it (HETPS_ELASTIC): drop what it sent
        that is not applied, and finish the rounds the other workers have all pushed (the
        survivors' sum; with an optimizer scaled to the job's count of workers)."""
        for sh in self.shards.values():
            sh.backlog = [m for m in sh.backlog if m.sender != gone]
            sh.deferred = [m for m in sh.deferred if m.sender != gone]
            if sh.pending.pop(gone, None) is not None:
                sh.acks = [m for m in sh.acks if m.sender != gone]
            if sh.pending and _standing(sh) >= self.server.num_workers:
                self._finish_round(sh)

    def worker_done(self, worker: int) -> None:
        """A worker finished: fail the rounds that still wait for it."""
        for sh in self.shards.values():
            if sh.pending and worker not in sh.pending:
                text = self.server.uneven(sh)
                for m in sh.acks + sh.deferred + sh.backlog:
                    self.server.answers.reply(m, {"error": text})
                sh.pending, sh.acks, sh.deferred, sh.backlog = {}, [], [], []


def _standing(sh: Shard) -> int:
    """The workers the round's pushes so far stand for (a host's sum: its workers)."""
    return sum(1 if h is None else h[2] for _, _, h in sh.pending.values())
