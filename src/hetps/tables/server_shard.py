"""One server's part of one row-sparse table (:class:`Shard`): its rows by id, what it counts
toward the bounds, and a round's update of its rows (:func:`apply_rows`); the server's
requests on it are :class:`hetps.tables.server.Tables`."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any, Protocol

import numpy as np

from hetps import optim
from hetps.cluster.errors import BadRequest
from hetps.tables import lazy
from hetps.tables.rowsparse import initial_rows
from hetps.tables.server_index import IdIndex
from hetps.transport.codec import WIRE_DTYPES, Message, Rows

__all__ = [
    "INDEX_ROW_BYTES",
    "MAX_IDS",
    "TABLE_BYTES",
    "Replies",
    "Shard",
    "TableServer",
    "TablesPort",
    "apply_rows",
    "checked_ids",
    "checked_rows",
    "machine_memory",
]

#: ids one request may carry
MAX_IDS = 1 << 24

#: what a growing table's id index costs per row, counted toward the bound: 16 bytes held
#: (tables/server_index.py: its id and local row) and the copies a merge makes for a while
INDEX_ROW_BYTES = 48
#: what a part of a table costs before its rows (its objects, its declaration, its key's
#: characters on top), counted toward the server's cap: an empty table is not free (about
#: 1.1 KiB measured, and the allocator's share)
TABLE_BYTES = 2048


class CapHolder(Protocol):
    """What a shard uses of the server's tables: their cap on all tables' bytes."""

    def check_cap(self, sh: Shard, need: int) -> None: ...


class Replies(Protocol):
    """What the tables use of a server's answers: a reply to a request."""

    def reply(self, msg: Message, body: dict | None = None, arrays: list | None = None) -> None: ...


class Copies(Protocol):
    """A server's replication (hetps.faults.replicas) as its tables use it."""

    @property
    def replicated(self) -> bool: ...
    def replicas(self) -> list[int]: ...
    def copy_out(
        self, body: dict, data: list, then: Callable[[], None], errors: list | None = None
    ) -> None: ...


class Rounds(Protocol):
    """A server's elastic rounds (hetps.faults.elastic_rounds): workers let go, rounds."""

    def gone(self, worker: int) -> bool: ...
    def in_rounds(self, msg: Message) -> None: ...


class TableServer(Protocol):
    """What a server's tables use of it (a :class:`~hetps.kvstore.server.KVServer`): its node,
    mode, optimizer, workers, answers and fault parts, and its dense keys' requests."""

    node: object  # (its node table, ``nodes``, when it has one)
    sync: bool | None
    slices: Mapping[tuple[Hashable, int], object]  # (its dense keys)
    optimizer: optim.Optimizer | None
    optimizers: frozenset[str] | None
    done_workers: dict[int, str]
    answers: Replies
    replication: Copies
    elastic: Rounds

    @property
    def num_workers(self) -> int: ...
    def job_workers(self) -> int: ...
    def from_worker(self, msg: Message) -> bool: ...
    def handle(self, msg: Message) -> None: ...
    def uneven(self, sl: Any) -> str: ...


class TablesPort(CapHolder, Protocol):
    """What a server's table parts (its dumps and loads, tables/server_dump.py, and its
    copies, tables/server_replicas.py) use of its :class:`~hetps.tables.server.Tables`:
    its server and parts, and its ways to declare, update, hold and answer."""

    server: TableServer
    shards: dict[tuple[Hashable, int], Shard]

    def declare(self, msg: Message, copy: bool = False) -> Shard: ...
    def apply(self, sh: Shard, ids: np.ndarray, grad: np.ndarray) -> None: ...
    def hold(self, sh: Shard, msg: Message) -> None: ...
    def answer_round(
        self, sh: Shard, acks: list, deferred: list, backlog: list, error: str | None
    ) -> None: ...


class Shard:
    """One server's part of one table."""

    def __init__(
        self, key: Any, decl: dict, part: int, nparts: int, owner: CapHolder | None = None
    ) -> None:
        self.key = key
        self.owner = owner  # the server's Tables (its cap on all tables), or None
        self.dumped: Any = None  # (ids, rows) of an sdump in progress (tables/server_dump.py)
        self.decl = decl
        self.rows_total: int | None = decl["rows"]
        self.cols: int = decl["cols"]
        self.dtype = WIRE_DTYPES[decl["dtype"]]
        self.scale: float = float(decl["scale"])
        self.seed: int = decl["seed"]
        self.bound: int = decl["bound"]
        self.part, self.nparts = part, nparts
        # (a power of two parts: an id's part and local row by a mask and a shift, 4-7x
        # faster than NumPy's int64 remainder and floor division, the same for every id)
        self.shift = nparts.bit_length() - 1 if nparts > 0 and nparts & (nparts - 1) == 0 else None
        self._per = None
        if self.rows_total is not None:
            n = max(0, (self.rows_total - part + nparts - 1) // nparts)
            self.n = n
            self.check_bound(n, 0)
            self.value = np.zeros((n, self.cols), self.dtype)  # (pages come as rows are used)
            # rows get their initial value when first used, not here: a table of 30M rows
            # starts at once and holds only what is used (a byte per row for this mark,
            # which also tells a checkpoint the rows to keep)
            self.made = np.zeros(n, bool)
        else:
            self.n = 0
            self.check_bound(0, 0)  # (its fixed cost)
            self.index = IdIndex()
            self.value = np.zeros((0, self.cols), self.dtype)
        self.state: Any = None
        self.has_state = False
        self.optimizer: Any = None  # this table's own (Table(optimizer=...)), else the server's
        self.pending: dict[int, tuple] = {}  # worker -> its push: ids, rows, host tag
        self.acks: list[Message] = []
        self.deferred: list[Message] = []
        self.backlog: list[Message] = []
        self.rounds = 0
        # HETPS_REPLICAS (tables/server_replicas.py): served here, or a copy of ``origin``'s;
        # a finished round's copy on its way to the replicas; the table's optimizer pickled
        self.primary, self.origin = True, None
        self.copying = False
        self.opt_blob: bytes | None = None
        self.lent: list[Rows] = []  # replies' rows gathered as they leave (reply_rows)
        self._per: tuple | None = None  # (optimizer, has_state, row_bytes) last counted

    @property
    def growing(self) -> bool:
        return self.rows_total is None

    @property
    def skey(self) -> tuple[Any, int]:
        return (self.key, self.part)

    # -- memory --------------------------------------------------------------------------
    def row_bytes(self, optimizer: Any) -> int:
        """Bytes one row takes here: its value, its optimizer state and (a growing table)
        its entry in the id index."""
        # (a growing table's entry in its id index; a fixed table's byte of its use mark)
        per = self.cols * self.dtype.itemsize + (INDEX_ROW_BYTES if self.growing else 1)
        if optimizer is not None:
            try:
                st = (
                    self.state
                    if self.has_state
                    else lazy.create_table_state(optimizer, 0, self.cols, self.dtype)
                )
            except lazy.LazyUnsupported:  # (its first round says so, naming the fix)
                return per
            per += sum(
                a.dtype.itemsize * a.shape[1]
                for a in st.values()
                if isinstance(a, np.ndarray) and a.ndim == 2
            )
        return per

    def nbytes(self) -> int:
        total = self.value.nbytes
        if self.has_state:
            total += sum(a.nbytes for a in self.state.values() if isinstance(a, np.ndarray))
        return total

    def fixed_bytes(self) -> int:
        """What this part takes whatever its rows: :data:`TABLE_BYTES` and its key."""
        return TABLE_BYTES + len(repr(self.key))

    def reserved(self, optimizer: Any) -> int:
        """Bytes this part counts toward the server's cap: its fixed cost, and a fixed
        table's every row (each may be used) or a growing table's rows made."""
        if not self.n:
            return self.fixed_bytes()
        opt = self.optimizer if self.optimizer is not None else optimizer
        cached = self._per
        if cached is None or cached[0] is not opt or cached[1] != self.has_state:
            self._per = cached = (opt, self.has_state, self.row_bytes(opt))
        return self.fixed_bytes() + self.n * cached[2]

    def check_bound(self, rows: int, per: int) -> None:
        """Refuse ``rows`` rows of ``per`` bytes (0: a row's own) over the table's bound or
        the server's cap."""
        per = per or self.cols * self.dtype.itemsize + (0 if self.growing else 1)
        if self.owner is not None:
            self.owner.check_cap(self, rows * per)
        if self.bound and rows * per > self.bound:
            raise BadRequest(
                f"row-sparse key {self.key!r}: {rows} rows here would take {rows * per} bytes "
                f"({per} per row with the optimizer state"
                f"{' and the id index' if self.growing else ''}), over the table's bound of "
                f"{self.bound} bytes per server; raise Table(server_bytes=...), add servers, "
                "or hash the ids into fewer rows"
            )

    # -- rows by id -----------------------------------------------------------------------
    def local(self, ids: np.ndarray, optimizer: Any = None, create: bool = False) -> np.ndarray:
        """Local rows of ``ids`` (checked ids); for a growing table -1 where a row was never
        made, unless ``create`` (then it is made, at its initial value)."""
        if not self.growing:
            loc = ids // self.nparts if self.shift is None else np.right_shift(ids, self.shift)
            fresh = loc[~self.made[loc]]
            if fresh.size:
                if self.lent:
                    self.settle()
                if self.scale:
                    self.value[fresh] = initial_rows(
                        self.scale,
                        self.seed,
                        fresh * self.nparts + self.part,
                        self.cols,
                        self.dtype,
                    )
                self.made[fresh] = True
            return loc
        out = self.index.lookup(ids)
        if create:
            miss = out < 0
            if miss.any():
                self._make(lazy.distinct(ids[miss]), optimizer)
                out[miss] = self.index.lookup(ids[miss])
        return out

    def make_every_row(self) -> None:
        """Give every row of a fixed table not used yet its initial value."""
        fresh = np.flatnonzero(~self.made)
        for a in range(0, fresh.size, 1 << 16):
            loc = fresh[a : a + (1 << 16)]
            if self.scale:
                ids = loc * self.nparts + self.part
                self.value[loc] = initial_rows(self.scale, self.seed, ids, self.cols, self.dtype)
            self.made[loc] = True

    def _make(self, ids: np.ndarray, optimizer: Any) -> None:
        need = self.n + ids.size
        per = self.row_bytes(optimizer)
        self.check_bound(need, per)
        if need > self.value.shape[0]:
            cap = max(need, 2 * self.value.shape[0], 64)
            if self.bound:  # the room made ahead stays within the bound too
                cap = max(need, min(cap, self.bound // per))
            grown = np.zeros((cap, self.cols), self.dtype)
            grown[: self.n] = self.value[: self.n]
            self.value = grown
            if self.has_state:
                lazy.grow_state(self.state, cap)
        self.value[self.n : need] = initial_rows(self.scale, self.seed, ids, self.cols, self.dtype)
        self.index.add(ids, np.arange(self.n, need, dtype=np.int64))
        self.n = need

    def reply_rows(self, ids: np.ndarray) -> Any:
        """The rows of (checked) ``ids`` for a reply: gathered as it leaves, straight into
        its shared-memory ring's slot where it takes one (a fixed table's; :class:`Rows`).
        Until then the table is read-only, and :meth:`settle` (before any write) gathers
        them first."""
        if self.growing:
            return self.read(ids).reshape(-1)
        rows = Rows(self.value, self.local(ids), self._gathered)
        self.lent.append(rows)
        self.value.flags.writeable = False  # (a write that did not settle fails loudly)
        return rows

    def _gathered(self, rows: Rows) -> None:
        self.lent.remove(rows)
        if not self.lent:
            self.value.flags.writeable = True

    def settle(self) -> None:
        """Gather the replies' rows not sent yet: the table may change now."""
        for rows in list(self.lent):
            rows.gather()
        self.value.flags.writeable = True

    def read(self, ids: np.ndarray) -> np.ndarray:
        """The rows of (checked) ``ids``, in that order."""
        loc = self.local(ids)
        if not self.growing:
            return lazy.take_rows(self.value, loc)
        out = np.empty((ids.size, self.cols), self.dtype)
        have = loc >= 0
        out[have] = self.value[loc[have]]
        if not have.all():
            out[~have] = initial_rows(self.scale, self.seed, ids[~have], self.cols, self.dtype)
        return out


def apply_rows(sh: Shard, optimizer: Any, ids: np.ndarray, grad: np.ndarray) -> None:
    """Apply a round's per-row sums ``grad`` of (checked, distinct) ``ids`` to ``sh``: the
    table's own optimizer, else ``optimizer``, lazily; with neither, the sums replace the
    rows. Raises BadRequest when a growing table would pass its bound (nothing changed)."""
    opt = sh.optimizer if sh.optimizer is not None else optimizer
    if sh.lent:
        sh.settle()
    loc = sh.local(ids, opt, create=True)
    if opt is None:
        lazy.put_rows(sh.value, loc, grad)
        return
    if not sh.has_state:
        # the state's rows count toward the bound: refused before anything is made
        sh.check_bound(sh.value.shape[0], sh.row_bytes(opt))
        sh.state = lazy.create_table_state(opt, sh.value.shape[0], sh.cols, sh.dtype)
        sh.has_state = True
    if getattr(opt, "lazy_update", True):
        lazy.update_rows(opt, sh.skey, sh.value, loc, grad, sh.state)
        return
    # lazy_update=False, as MXNet: every row of the part moves (a fixed table's rows not
    # used yet are made, at their initial value, first; a growing table's are the rows made)
    if not sh.growing:
        sh.make_every_row()
    lazy.update_every_row(opt, sh.skey, sh.value, sh.n, loc, grad, sh.state)


def machine_memory() -> int:
    """Bytes of memory this process may use: the machine's, or its container's limit."""
    import os

    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass
    return total


def checked_ids(msg: Message, sh: Shard, arr: np.ndarray, sorted_distinct: bool) -> np.ndarray:
    """``arr`` as a request's row ids of ``sh`` (1-D int64, in range, on this part; with
    ``sorted_distinct`` sorted and distinct), else BadRequest naming the first bad id."""
    if arr.dtype != np.int64 or arr.ndim != 1:
        raise BadRequest(f"{msg.cmd} of key {sh.key!r}: row ids must be a 1-D int64 array")
    if arr.size > MAX_IDS:
        raise BadRequest(f"{msg.cmd} of key {sh.key!r}: {arr.size} ids, at most {MAX_IDS}")
    if arr.size == 0:
        return arr
    ordered = arr.size < 2 or bool((arr[1:] > arr[:-1]).all())
    if sorted_distinct and not ordered:
        raise BadRequest(f"{msg.cmd} of key {sh.key!r}: row ids must be sorted and distinct")
    if ordered:  # (the range: its ends tell)
        hi = sh.rows_total
        bad_range = arr[0] < 0 or (hi is not None and arr[-1] >= hi)
    else:
        bad_range = True
    bad = None
    if bad_range:
        bad = arr < 0
        if sh.rows_total is not None:
            bad |= arr >= sh.rows_total
    if sh.nparts > 1:
        off = (
            np.remainder(arr, sh.nparts) if sh.shift is None else arr & (sh.nparts - 1)
        ) != sh.part
        bad = off if bad is None else bad | off
    if bad is not None and bad.any():
        i = int(arr[np.argmax(bad)])
        where = (
            f"a table of {sh.rows_total} rows takes ids in [0, {sh.rows_total})"
            if sh.rows_total is not None and not 0 <= i < sh.rows_total
            else "ids must be >= 0"
            if i < 0
            else f"it belongs to part {i % sh.nparts}, not {sh.part}"
        )
        raise BadRequest(f"{msg.cmd} of key {sh.key!r}: row id {i} is out of range ({where})")
    return arr


def checked_rows(msg: Message, sh: Shard, arr: np.ndarray, n: int) -> np.ndarray:
    """``arr`` as ``n`` rows of ``sh`` (its dtype and columns), else BadRequest."""
    if arr.dtype != sh.dtype or arr.size != n * sh.cols:
        raise BadRequest(
            f"{msg.cmd} of key {sh.key!r}: got {arr.size} values of {arr.dtype} for {n} rows "
            f"of {sh.cols} {sh.dtype.name}"
        )
    return arr.reshape(n, sh.cols)
