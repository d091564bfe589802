"""Row-sparse keys on the worker side: MXNet's ``row_sparse_pull`` and row-sparse pushes
(a part of :class:`~hetps.kvstore.client.DistKVStore`).

A key declared with :class:`~hetps.tables.rowsparse.Table` (``kv.init(key, Table(rows,
cols))``) is an embedding table spread over the servers by rows (row ``r`` on server
``r % S``). Only the rows asked for travel:

* ``kv.row_sparse_pull(key, out=None, row_ids=ids)`` reads rows; ids may repeat and need not
  be sorted. With no ``out`` it returns a :class:`~hetps.tables.rowsparse.RowSparse` (the
  distinct ids, sorted, and their rows: MXNet's result). ``out`` may be a ``RowSparse``
  (filled the same way), a dense array of ``len(row_ids)`` rows (each id's row in the order
  asked, duplicates included: an embedding lookup), or, for a fixed table, a dense array of
  the table's shape (the rows asked are written, every other row is zeroed, as MXNet's
  ``out`` reads when made dense). The rows come into such a dense ``out`` straight from the
  ring or channel they arrive by (distinct ids, or the table's shape): a pull that fails
  may leave it part written.
* ``kv.push(key, grad)`` with a torch sparse COO tensor, a ``RowSparse`` or a pair
  ``(row_ids, rows)``: duplicate ids are summed first; every server gets one request per
  push (one without rows when no id of the push is its), so in ``dist_sync`` a round on each
  server is one push from every worker, summed per row.

Row-sparse keys do not take ``pull``, ``pushpull`` or 2-bit compression. With
``HETPS_REPLICAS`` > 1 each part has copies on the next servers as a dense key's slice has
(tables/server_replicas.py): a push carries its round (``rnd``, the worker's count of its
earlier pushes of the table), so one sent again after a failover is not applied twice.
Network-aware balancing (``HETPS_BALANCE``) plans the dense keys only: a table's rows stay
where their ids place them.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Hashable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from hetps.cluster import protocol as P
from hetps.cluster.bodies import chunk_elems
from hetps.cluster.errors import ClusterError
from hetps.cluster.protocol import normalize_keys
from hetps.cluster.requests import Future, wait_all
from hetps.device.staging import as_numpy
from hetps.tables.lazy import distinct_inverse, put_rows, take_rows
from hetps.tables.rowsparse import RowSparse, Table, coalesce_owned, row_ids
from hetps.transport.codec import Message, Rows

if TYPE_CHECKING:
    from hetps.cluster.node import Node
    from hetps.config import NodeConfig

__all__ = ["RowSparse", "SparseKeys", "Table", "TableStore"]

log = logging.getLogger("hetps.worker")


@dataclass
class TableMeta:
    """What a worker knows of a row-sparse key."""

    table: Table
    nparts: int
    dtype: np.dtype = field(init=False)
    pushed: list[Future] = field(default_factory=list)
    rounds: int = 0  # dist_sync pushes of the table so far (with replicas, each says its own)
    recent: deque = field(default_factory=deque)  # (call, futures) of recent pushes

    def __post_init__(self) -> None:
        self.dtype = np.dtype(self.table.dtype)

    def check_ids(self, key: Any, ids: np.ndarray, what: str, uniq: Any = None) -> None:
        """Raise a ValueError naming the key and the first id out of range (``uniq``:
        ``ids`` sorted and distinct, whose ends tell when every id is in range)."""
        if ids.size == 0:
            return
        rows = self.table.rows
        if uniq is not None and uniq[0] >= 0 and (rows is None or uniq[-1] < rows):
            return
        bad = ids < 0 if rows is None else (ids < 0) | (ids >= rows)
        if bad.any():
            i = int(ids[np.argmax(bad)])
            span = "ids must be >= 0" if rows is None else f"ids must be in [0, {rows})"
            raise ValueError(
                f"{what} of row-sparse key {key!r}: row id {i} is out of range ({span}"
                f"{'' if rows is None else f' for a table of {rows} rows'})"
            )


def is_table(value: Any) -> bool:
    """Whether an init value declares a row-sparse key."""
    return isinstance(value, (Table, RowSparse))


class HostRows(Protocol):
    """A host aggregation's tables (kvstore/hostagg_tables.py), as the row-sparse keys use them."""

    def declare(self, k: Any, tm: TableMeta) -> None: ...
    def push(self, k: Any, ids: np.ndarray, rows: np.ndarray) -> bool: ...
    def pending(self, k: Any) -> bool: ...
    def pull(self, k: Any, uniq: np.ndarray, rows: np.ndarray) -> Callable[[], None]: ...


class ThroughHost(Protocol):
    """A store's host aggregation (kvstore/hostagg.py): its tables."""

    tables: HostRows


class DenseRounds(Protocol):
    """A store's dense requests (kvstore/dense.py): a sync round's credit."""

    def round_credit(self, meta: TableMeta) -> None: ...


class SendQueue(Protocol):
    """A store's send queue (kvstore/pipeline.py): one message per server, and its futures."""

    def batched(self) -> AbstractContextManager[None]: ...
    def track(self, futs: list[Future]) -> None: ...


class TableStore(Protocol):
    """What the row-sparse keys and their checkpoints use of the worker's store (a
    :class:`~hetps.kvstore.client.DistKVStore`): its node, mode, dense keys and parts, and
    its way to the servers."""

    cfg: NodeConfig
    node: Node
    sync: bool
    balance: bool
    timeout: float
    num_servers: int
    meta: dict[Hashable, object]
    order: list[Hashable]
    compressor: object | None
    #: its dense requests (kvstore/dense.py), host aggregation, host tag and send queue
    dense: DenseRounds
    hostagg: ThroughHost | None
    host_tag: tuple[int, int, int] | None
    pipeline: SendQueue
    #: queue a request for a server by rank
    request: Callable[..., Future]

    @property
    def rank(self) -> int: ...
    def barrier(self) -> None: ...
    def init(self, key: Any, value: Any) -> None: ...
    def is_row_sparse(self, key: Any) -> bool: ...
    def table(self, key: Any) -> Table: ...


class SparseKeys:
    """The row-sparse half of the worker's store ``kv`` (see the module's text)."""

    def __init__(self, kv: TableStore) -> None:
        self.kv = kv
        self.tables: dict[Any, TableMeta] = {}

    def table(self, key: Any) -> Table:
        """The :class:`Table` declared for ``key`` (KeyError if it is not row-sparse)."""
        return self.tables[key].table

    def any_of(self, keys: list) -> bool:
        """Whether any of ``keys`` is a row-sparse key."""
        return bool(self.tables) and any(k in self.tables for k in keys)

    def is_row_sparse(self, key: Any) -> bool:
        """Whether ``key`` was initialised as a row-sparse table."""
        return key in self.tables

    def init_table(self, key: Any, value: Any, lead: bool) -> list[Future]:
        if self.kv.balance:
            if key in self.kv.order:  # (a dense key made a table: the planner forgets it)
                self.kv.order.remove(key)
            if lead:  # (said once, by the worker that declares it)
                log.warning(
                    "worker: HETPS_BALANCE plans the dense keys only; row-sparse key %r stays "
                    "where its row ids place it (row r on server r %% %d)",
                    key,
                    self.kv.num_servers,
                )
        if isinstance(value, RowSparse):  # MXNet's kv.init(key, row_sparse_array)
            if value.shape[0] < 0:
                raise ValueError(f"init of key {key!r}: a RowSparse value needs a fixed shape")
            spec = Table(value.shape[0], value.shape[1], value.dtype.name)
            rows_ids, rows = value.indices, value.data
        else:
            spec = value
            rows_ids, rows = None, None
            if spec.value is not None:
                rows = as_numpy(spec.value, f"init of key {key!r}").reshape(spec.rows, spec.cols)
                if rows.dtype != np.dtype(spec.dtype):
                    raise ValueError(
                        f"init of key {key!r}: value of dtype {rows.dtype}, the Table says "
                        f"{spec.dtype}"
                    )
                rows_ids = np.arange(spec.rows, dtype=np.int64)
        S = self.kv.num_servers
        tm = self.tables[key] = TableMeta(spec, S)
        self.kv.meta.pop(key, None)
        if self.kv.hostagg is not None:  # (its rounds merged per host: docs/HOSTS.md)
            self.kv.hostagg.tables.declare(key, tm)
        if rows_ids is not None:
            tm.check_ids(key, rows_ids, "init")
        if not lead:
            return []
        decl = {"k": key, "nparts": S, **spec.server_decl()}
        if spec.optimizer is not None:
            from hetps import optim

            if not isinstance(spec.optimizer, optim.Optimizer):
                raise TypeError(
                    f"init of key {key!r}: Table(optimizer=...) takes a hetps.optim.Optimizer, "
                    f"got {type(spec.optimizer).__name__}"
                )
            decl["opt"] = optim.dumps(spec.optimizer)
        futs = []
        step = max(1, chunk_elems(self.kv.cfg.chunk_bytes, tm.dtype.itemsize) // spec.cols)
        for s in range(S):
            body = dict(decl, part=s)
            futs.append(self.kv.request(key, 0, s, Message(P.SINIT, body=body)))
            body = {k: v for k, v in body.items() if k != "opt"}  # (the rows: without it)
            if rows_ids is None:
                continue
            mine = np.flatnonzero(rows_ids % S == s)
            for a in range(0, mine.size, step):
                sel = mine[a : a + step]
                arrays = [rows_ids[sel], np.ascontiguousarray(rows[sel]).reshape(-1)]
                futs.append(self.kv.request(key, 0, s, Message(P.SINIT, body=body, arrays=arrays)))
        return futs

    def push_table(
        self, key: Any, value: Any, priority: int, call: int, rounds: bool
    ) -> list[Future]:
        """Send a row-sparse push of ``key`` (``call``: the store's count of push calls;
        ``rounds``: each push carries its round, for the replicas)."""
        tm = self.tables[key]
        what = f"push of row-sparse key {key!r}"
        if self.kv.compressor is not None:
            raise ValueError(f"{what}: 2-bit compression is for dense keys")
        ids, rows, owned = coalesce_owned(value, tm.table.cols, tm.dtype, what)
        tm.check_ids(key, ids, "push", ids)  # (sorted and distinct)
        if self.kv.sync:
            self.kv.dense.round_credit(tm)
            tm.rounds += 1
        host = self.kv.hostagg
        if host is not None and host.tables.push(key, ids, rows):
            return []  # (its errors: the pull's, wait_outstanding's)
        S = tm.nparts
        owner = owners(ids, S)
        futs = []
        for s in range(S):
            # the caller's rows are copied now (it may reuse its arrays: the push is sent
            # later), by index, no per-row Python; rows summed here are the push's own: sent
            # as they are, or gathered per server only as they leave (into the ring: one copy)
            if owner is None:
                pid, prow = (ids, rows) if owned else (ids.copy(), np.array(rows, order="C"))
                flat: Any = prow.reshape(-1)
            else:
                sel = np.flatnonzero(owner == s)
                pid = ids[sel]
                flat = Rows(rows, sel) if owned else take_rows(rows, sel).reshape(-1)
            body = {"k": key, "part": s, "sync": self.kv.sync}
            if rounds:  # a server that takes over knows a resent round by it
                body["rnd"] = tm.rounds - 1
            if self.kv.sync and self.kv.host_tag is not None:  # (summed per host)
                body["hg"] = list(self.kv.host_tag)
            msg = Message(P.SPUSH, body=body, arrays=[pid, flat])
            futs.append(self.kv.request(key, priority, s, msg))
        tm.pushed = futs
        if self.kv.sync:
            tm.recent.append((call, futs))
        return futs

    def row_sparse_pull(
        self, key: Any, out: Any = None, priority: int = 0, row_ids: Any = None
    ) -> Any:
        """Read the rows ``row_ids`` of row-sparse keys (MXNet's ``row_sparse_pull``; see the
        module's text for ``out``). A list of keys takes a list of outs and of row_ids (one
        row_ids for every out of a key). Returns the :class:`RowSparse` results when ``out``
        is None, else None. Sees this worker's earlier pushes of the keys."""
        self.kv.node.check()
        futs: list[Future] = []
        finishers = []
        # (one message per server: with the push before it, if that is still waiting)
        with self.kv.pipeline.batched():
            for k, rid, o in pull_args(key, out, row_ids, self.tables):
                f, fin = self._pull_rows(k, self.tables[k], row_ids_of(rid, k), o, priority)
                futs += f
                finishers.append(fin)
        self.kv.pipeline.track(futs)
        wait_all(futs, self.kv.timeout, "row_sparse_pull")
        results = [fin() for fin in finishers]
        return pull_result(key, out, results)

    def _pull_rows(self, key: Any, tm: TableMeta, ids: np.ndarray, out: Any, priority: int):
        what = f"row_sparse_pull of key {key!r}"
        uniq, inv = distinct_inverse(ids)  # (repeated ids travel once)
        tm.check_ids(key, ids, "row_sparse_pull", uniq)
        cols = tm.table.cols
        targets = targets_of(out, what)
        host = self.kv.hostagg
        hosted = host is not None and host.tables.pending(key)
        direct = None if hosted else landing_in(targets, tm, ids, uniq, inv)
        if direct is not None:  # the rows land in ``out`` itself (one copy)
            rows, at = direct
            targets = []
        else:
            rows, at = np.empty((uniq.size, cols), tm.dtype), None
        if hosted:  # the host's union, pulled once
            wait = host.tables.pull(key, uniq, rows)

            def through_host() -> Any:
                wait()
                return fill_out(targets, out is None, tm.table, ids, uniq, inv, rows, what)

            return [], through_host
        S = tm.nparts
        owner = owners(uniq, S)
        futs = []
        # one request per server, split where its reply would pass HETPS_TABLE_PULL_BYTES
        step = max(1, self.kv.cfg.table_pull_bytes // (cols * tm.dtype.itemsize))
        for s in range(S):
            mine = np.arange(uniq.size) if owner is None else np.flatnonzero(owner == s)
            for a in range(0, mine.size, step):
                sel = mine[a : a + step]
                msg = Message(P.SPULL, body={"k": key, "part": s}, arrays=[uniq[sel]])
                land = land_rows(key, rows, sel if at is None else at[sel], cols)
                futs.append(self.kv.request(key, priority, s, msg, land, land))
        # the earlier push's errors are this pull's too (it may have been refused)
        futs = [f for f in tm.pushed if not f.reported] + futs
        tm.pushed = []

        def finish() -> Any:
            return fill_out(targets, out is None, tm.table, ids, uniq, inv, rows, what)

        return futs, finish


def pull_args(key: Any, out: Any, row_ids: Any, tables: Any) -> list[tuple[Any, Any, Any]]:
    """``row_sparse_pull``'s arguments checked, as (key, its row_ids, its out) per key
    (``tables``: the row-sparse keys declared); the errors name the fix."""
    keys, is_list = normalize_keys(key)
    if row_ids is None:
        raise ValueError("row_sparse_pull needs row_ids (the rows to read)")
    ids_list = list(row_ids) if is_list else [row_ids]
    outs = list(out) if is_list and out is not None else [out] * len(keys)
    if len(ids_list) != len(keys) or len(outs) != len(keys):
        raise ValueError(f"row_sparse_pull: give one row_ids and one out per key ({len(keys)})")
    for k in keys:
        if k not in tables:
            raise KeyError(
                f"row_sparse_pull: key {k!r} is not a row-sparse key: call "
                f"kv.init({k!r}, Table(rows, cols)) first (a dense key takes kv.pull)"
            )
    return list(zip(keys, ids_list, outs, strict=True))


def pull_result(key: Any, out: Any, results: list) -> Any:
    """What ``row_sparse_pull`` returns: the RowSparse results when no ``out`` was given
    (a list for a list of keys), else None."""
    if out is not None:
        return None
    return results if isinstance(key, (list, tuple)) else results[0]


def fill_out(
    targets: list, want: bool, table: Table, ids, uniq, inv, rows: np.ndarray, what: str
) -> Any:
    """Write a pull's rows into its outs (see the module's text); the RowSparse result when
    ``want`` (no out was given)."""
    cols = table.cols
    lone = len(targets) == 1 and not want  # (then ``rows``, the pull's own, become its data)
    for t in targets:
        if isinstance(t, RowSparse):
            own = uniq if lone and inv is not None else uniq.copy()  # (inv None: the ids')
            t.indices, t.data, t.shape = own, rows if lone else rows.copy(), table.shape
            continue
        if t.ndim == 2 and t.shape == (ids.size, cols):
            # a lookup: each id's row, in the order asked (inv None: ids were uniq already)
            t[...] = rows if inv is None else take_rows(rows, inv)
        elif t.shape == table.shape:
            t[...] = 0
            t[uniq] = rows
        else:
            raise ValueError(
                f"{what}: out of shape {t.shape}: give ({ids.size}, {cols}) (the rows "
                f"asked, in order) or the table's shape {table.shape}, or a RowSparse"
            )
    if not want:
        return None
    # (ids sorted and distinct already are the caller's array: the result gets its own)
    return RowSparse(uniq.copy() if inv is None else uniq, rows, table.shape)


def landing_in(
    targets: list, tm: TableMeta, ids: np.ndarray, uniq: np.ndarray, inv: Any
) -> tuple[np.ndarray, np.ndarray | None] | None:
    """Where a pull's reply rows may land straight in its one dense ``out`` (C-contiguous,
    of the table's dtype): ``(out, at)``, the reply's row ``u`` (of ``uniq``) going to
    ``out[at[u]]`` (``at`` None: to ``out[u]``). A lookup of distinct ids (sorted or not) or
    a fixed table's shape (zeroed first); None otherwise (the rows land in a buffer of their
    own, :func:`fill_out` copies them). A pull that fails then may leave ``out`` part written."""
    if len(targets) != 1 or isinstance(targets[0], RowSparse):
        return None
    t = targets[0]
    if t.dtype != tm.dtype or not t.flags.c_contiguous or not t.flags.writeable:
        return None
    cols = tm.table.cols
    if t.shape == (ids.size, cols) and uniq.size == ids.size:
        if inv is None:
            return t, None
        at = np.empty(ids.size, np.int64)  # (distinct ids, unsorted: where each one was asked)
        at[inv] = np.arange(ids.size)
        return t, at
    if t.shape == tm.table.shape and t.shape != (ids.size, cols):
        t[...] = 0
        return t, uniq
    return None


def owners(ids: np.ndarray, servers: int) -> np.ndarray | None:
    """Each id's server, ``ids % servers`` (None for one): by a mask for a power of two, 10x
    faster than an int64 modulo."""
    if servers == 1:
        return None
    return ids & (servers - 1) if servers & (servers - 1) == 0 else ids % servers


def row_ids_of(value: Any, key: Any) -> np.ndarray:
    return row_ids(value, f"row_sparse_pull of key {key!r}")


def targets_of(out: Any, what: str) -> list[Any]:
    if out is None:
        return []
    items = list(out) if isinstance(out, (list, tuple)) else [out]
    return [o if isinstance(o, RowSparse) else as_numpy(o, what) for o in items]


def land_rows(key: Any, rows: np.ndarray, sel: np.ndarray, cols: int) -> _Landing:
    """The callback of a pull's request (and its landing: :class:`_Landing`)."""
    return _Landing(key, rows, sel)


class _Landing:
    """Where a pull's reply goes: its rows to ``rows[sel]``, straight from the shared-memory
    ring or bulk channel they came in (:meth:`land`, as the reply is decoded: one copy), else
    from the reply's array when it is handled (the request's callback)."""

    __slots__ = ("key", "rows", "sel", "mark")

    def __init__(self, key: Any, rows: np.ndarray, sel: np.ndarray) -> None:
        self.key, self.rows, self.sel = key, rows, sel
        self.mark = np.empty(0, rows.dtype)  # (what a reply that landed holds instead)

    def land(self, view: np.ndarray) -> np.ndarray:
        """Copy the reply's rows out of ``view`` (the ring's memory); a reply of the wrong
        size or dtype is copied as it is, for the callback to refuse."""
        if view.dtype != self.rows.dtype or view.size != self.sel.size * self.rows.shape[1]:
            return view.copy()
        put_rows(self.rows, self.sel, view)
        return self.mark

    def __call__(self, reply: Message) -> None:
        got = reply.arrays[0] if len(reply.arrays) == 1 else None
        if got is not self.mark:
            if got is None or got.size != self.sel.size * self.rows.shape[1]:
                raise ClusterError(
                    f"row_sparse_pull of key {self.key!r}: server sent a wrong-sized reply"
                )
            put_rows(self.rows, self.sel, got)
        reply.arrays = []
