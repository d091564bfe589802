"""Host-local aggregation of row-sparse keys (tables), a part of
:class:`~hetps.kvstore.hostagg.HostAggregation` (docs/HOSTS.md, docs/SPARSE.md).

In ``dist_sync`` the local ranks of a host merge a table's rounds: each call of the host's
workers (a push, or the ``row_sparse_pull`` that follows a push) is an event every local
rank makes in the same order. A local rank publishes its event's ids (and a push's rows) in
a file of its own in ``/dev/shm`` (made whole under a name of its own, then linked, mode
0600) and its event count in the table's segment of counters (the dense keys' layout, no
slots); the table's parts, one per server, are dealt over the local ranks as the dense
parts are, and the owner of a part:

* for a push: merges the host's ids of its server (the union, sorted; the rows of one id
  summed in local-rank order, :func:`hetps.tables.lazy.sum_rows`, as a server sums a
  host's workers) and sends that once, standing for the host's workers (``hg``);
* for a pull: asks its server once for the union of the ids the host's local ranks asked
  (the reply bound split as a worker's own), and publishes the rows in a file each local
  rank copies its own rows out of.

A pull goes through the host when it follows a push (else per process); a local rank at a
barrier after a push makes an empty pull, so a pull only some make (an evaluation) goes
too. A file goes once every local rank read it (a push's once every owner marked the event
in the counters; a pull's rows once every local rank marked it copied), and at ``close``.
Under ``HETPS_ELASTIC`` the tables go per process (said once): a local rank let go in a
round would take its host's merged push with it. A dead local rank ends the waits as for
dense keys (:meth:`HostAggregation.wait`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from hetps.cluster import protocol as P
from hetps.cluster.errors import ClusterError
from hetps.cluster.requests import Future
from hetps.kvstore.hostshm import MAGIC, PID_SLOT, SHM_DIR, alive, make, unlink
from hetps.kvstore.keys import KeyMeta
from hetps.kvstore.placement import Part
from hetps.kvstore.ports import StorePort
from hetps.tables.lazy import distinct, put_rows, sum_rows, take_rows
from hetps.tables.worker import land_rows
from hetps.transport.codec import Message

log = logging.getLogger("hetps.worker")
_HEAD = 16  # int64 words before a file's ids: magic, 1, ids, cols, event, rows, [PID_SLOT] pid


@dataclass
class HostTable:
    """What this worker knows of one table's events through its host."""

    key: Any
    meta: KeyMeta  # the counters' segment: no slots, a part per server
    tm: Any  # the table's TableMeta
    events: int = 0  # events this worker made
    kinds: dict[int, str] = field(default_factory=dict)  # event -> "push" or "pull"
    done: dict[int, int] = field(default_factory=dict)  # my part -> its last event handled
    futs: dict[int, list[Future]] = field(default_factory=dict)  # part -> its last push
    asked: dict[int, tuple] = field(default_factory=dict)  # part -> (event, futs, ids, rows)
    errors: dict[int, BaseException] = field(default_factory=dict)  # event -> my part's error
    files: list[tuple[str, int, str]] = field(default_factory=list)  # mine: name, event, kind

    @property
    def hkey(self) -> tuple:
        return ("table", self.key)


class Segment(Protocol):
    """A key's segment (``hostagg.HostKey``): counters, parts this rank sends, their senders."""

    head: np.ndarray
    mine: list[int]
    owner: list[int]


class AggHost(Protocol):
    """What the tables use of their host's aggregation (a
    :class:`~hetps.kvstore.hostagg.HostAggregation`): its store, place on the host, key
    segments (``HostKey``) and the ways to make, map, read and wait on them."""

    kv: StorePort
    #: its host group, local rank and local ranks; its job's name for its files
    group: int
    local: int
    size: int
    job: str
    #: local ranks let go (HETPS_ELASTIC); its keys' segments (``HostKey``), their generations
    elastic: bool
    dead: set[int]
    keys: dict[Hashable, Segment]
    gens: dict[Hashable, int]
    lock: threading.RLock

    def create(self, k: Any, meta: KeyMeta) -> None: ...
    def release(self, k: Any) -> None: ...
    def attach(self, k: Any, meta: KeyMeta) -> Segment: ...
    def unname(self, hk: Any) -> None: ...
    def members(self, hk: Any, t: int) -> list[int]: ...
    def slot(self, hk: Any, what: str, i: int) -> int: ...
    def wait(self, k: Any, ready: Callable[[], bool], what: str) -> None: ...


class HostTables:
    """The tables of a host's aggregation ``agg`` (``agg.tables``)."""

    def __init__(self, agg: AggHost) -> None:
        self.agg = agg
        self.tables: dict[Any, HostTable] = {}
        self.noticed = False

    def declare(self, k: Any, tm: Any) -> None:
        """At every local rank's init of table ``k``: its events start again."""
        agg = self.agg
        old = self.tables.pop(k, None)
        if old is not None:
            self._forget(old)
        if agg.elastic:
            if not self.noticed:
                self.noticed = True
                log.warning(
                    "host aggregation: row-sparse keys go per process under HETPS_ELASTIC (a "
                    "local rank let go in a round would take its host's merged push with it)"
                )
            return
        S = tm.nparts
        w = max(1, (tm.table.rows or S) // S)  # (each server's share of rows: its load)
        # a part per server, then one of no size per local rank: its "summed" counter is
        # the last pull whose rows that local rank copied out
        parts = [Part(s, s, 0, w) for s in range(S)] + [Part(0, 0, 0, 0)] * agg.size
        meta = KeyMeta((0,), np.dtype(tm.dtype), parts)
        ht = self.tables[k] = HostTable(k, meta, tm)
        agg.release(ht.hkey)
        agg.create(ht.hkey, meta)

    def pending(self, k: Any) -> bool:
        """Whether a ``row_sparse_pull`` of ``k`` goes through the host (it follows a push
        through the host)."""
        ht = self.tables.get(k)
        return ht is not None and ht.kinds.get(ht.events) == "push"

    # -- events ------------------------------------------------------------------------------
    def push(self, k: Any, ids: np.ndarray, rows: np.ndarray) -> bool:
        """This worker's round of table ``k`` (sorted distinct ``ids``, their ``rows``)
        into its host; False when ``k`` goes per process."""
        ht = self.tables.get(k)
        if ht is None:
            return False
        self._event(ht, "push", ids, rows)
        return True

    def pull(self, k: Any, uniq: np.ndarray, rows: np.ndarray) -> Any:
        """Ask for the rows of sorted distinct ``uniq`` through the host; what, called,
        waits and writes them into ``rows``."""
        ht = self.tables[k]
        e = self._event(ht, "pull", uniq, np.empty((0, ht.tm.table.cols), ht.tm.dtype))
        S = ht.tm.nparts

        def finish() -> None:
            self._answered(ht, e)
            owner = uniq % S
            for s in range(S):
                sel = np.flatnonzero(owner == s)
                if sel.size:
                    got, grows = self._read(ht, self._name(ht, "rows", e, s))
                    pos = np.minimum(np.searchsorted(got, uniq[sel]), max(got.size - 1, 0))
                    if got.size == 0 or not (got[pos] == uniq[sel]).all():
                        raise ClusterError(f"host aggregation: table {k!r}: rows missing")
                    put_rows(rows, sel, take_rows(grows, pos))
            self._copied(ht, e)

        return finish

    def _answered(self, ht: HostTable, e: int) -> None:
        """Wait until every part's rows of pull ``e`` are published (its errors raised)."""
        self._drive(ht, e)
        self.agg.wait(ht.hkey, lambda: self._results(ht, e), "row_sparse_pull")

    def _copied(self, ht: HostTable, e: int) -> None:
        """This rank has its rows of pull ``e``: the owners may remove them."""
        hk = self.agg.keys[ht.hkey]
        hk.head[self._read_slot(hk, ht, self.agg.local)] = e
        self._clean(ht, hk)

    def _event(self, ht: HostTable, kind: str, ids: np.ndarray, rows: np.ndarray) -> int:
        agg = self.agg
        hk = agg.keys.get(ht.hkey) or agg.attach(ht.hkey, ht.meta)
        agg.unname(hk)
        self._clean(ht, hk)
        e = ht.events + 1
        name = self._name(ht, kind, e, agg.local)
        self._write(ht, name, e, ids, rows)
        ht.files.append((name, e, kind))
        ht.kinds[e], ht.events = kind, e
        hk.head[agg.slot(hk, "contrib", agg.local)] = e
        with agg.lock:
            self.pump()
        return e

    def pump(self) -> None:
        """Handle what is ready of this rank's parts (never waits)."""
        for ht in list(self.tables.values()):
            if ht.hkey in self.agg.keys:
                for s in self._mine(ht):
                    while self._step(ht, s, block=False):
                        pass

    def skip(self) -> None:
        """At a barrier: an empty pull for every table whose last event is a push, so that
        a pull only some local ranks make after it (rank 0's evaluation) is the host's
        with the others' asking nothing, and every local rank's events stay the same."""
        for k, ht in list(self.tables.items()):
            if self.pending(k):
                self._event(ht, "pull", np.empty(0, np.int64), np.empty((0, ht.tm.table.cols)))

    def settle(self) -> None:
        """Send every event this worker made of its parts and wait for their answers
        (``barrier``, ``wait_outstanding``)."""
        for ht in list(self.tables.values()):
            if ht.hkey in self.agg.keys:
                e = ht.events
                if ht.kinds.get(e) == "pull":  # (a barrier's empty pull: its errors)
                    self._answered(ht, e)
                    self._copied(ht, e)
                self._drive(ht, e)
                for futs in ht.futs.values():
                    for f in futs:
                        f.settle(self.agg.kv.timeout)

    def _drive(self, ht: HostTable, e: int) -> None:
        for s in self._mine(ht):
            while ht.done.get(s, 0) < e or s in ht.asked:
                if not self._step(ht, s, block=True):
                    self.agg.wait(ht.hkey, lambda s=s: s not in ht.asked, "row_sparse_pull")

    def _mine(self, ht: HostTable) -> list[int]:
        return [s for s in self.agg.keys[ht.hkey].mine if s < ht.tm.nparts]

    def _read_slot(self, hk: Any, ht: HostTable, r: int) -> int:
        return self.agg.slot(hk, "summed", ht.tm.nparts + r)

    def _step(self, ht: HostTable, s: int, block: bool) -> bool:
        """Part ``s``'s next event: a pull's answer published, or the next event handled
        (waiting for every local rank's when ``block``). Whether something was done."""
        agg = self.agg
        hk = agg.keys[ht.hkey]
        if s in ht.asked:
            e, futs, ids, rows = ht.asked[s]
            if not all(f.done() for f in futs):
                return False
            del ht.asked[s]
            failed = [f.error for f in futs if f.error is not None]
            if failed:
                ht.errors[e] = failed[0]
            else:
                name = self._name(ht, "rows", e, s)
                self._write(ht, name, e, ids, rows)
                ht.files.append((name, e, "rows"))
            hk.head[agg.slot(hk, "result", s)] = -e if failed else e
            return True
        e = ht.done.get(s, 0) + 1
        if e > ht.events:
            return False
        contrib = agg.slot(hk, "contrib", 0)

        def ready() -> bool:
            got = hk.head[contrib : contrib + agg.size]
            return all(got[r] >= e for r in range(agg.size) if r not in agg.dead)

        if not ready():
            if not block:
                return False
            agg.wait(ht.hkey, ready, "row_sparse_pull" if ht.kinds[e] == "pull" else "push")
            if ht.done.get(s, 0) >= e:  # (the wait's own pump handled it)
                return True
        members = agg.members(hk, e)
        got = [self._read(ht, self._name(ht, ht.kinds[e], e, r), s) for r in members]
        tm, kv = ht.tm, agg.kv
        if ht.kinds[e] == "push":
            ids, rows = sum_rows(got, tm.table.cols, tm.dtype)  # in local-rank order
            body = {
                "k": ht.key,
                "part": s,
                "sync": True,
                "hg": [agg.group, agg.local, len(members)],
            }
            msg = Message(P.SPUSH, body=body, arrays=[ids, np.ascontiguousarray(rows).reshape(-1)])
            ht.futs[s] = [kv.request(ht.key, 0, s, msg)]
        else:
            ids = distinct(np.concatenate([g[0] for g in got]))
            rows = np.empty((ids.size, tm.table.cols), tm.dtype)
            futs = [f for f in ht.futs.pop(s, []) if not f.reported]  # (the push's errors)
            for sel, msg in _asks(ht.key, s, ids, kv.cfg.table_pull_bytes, rows.shape[1], tm):
                land = _land(ht.key, rows, sel)  # (out of the ring as the reply is decoded)
                futs.append(kv.request(ht.key, 0, s, msg, land, land))
            ht.asked[s] = (e, futs, ids, rows)
        hk.head[agg.slot(hk, "summed", s)] = e  # (its files are read)
        ht.done[s] = e
        return True

    def _results(self, ht: HostTable, e: int) -> bool:
        hk = self.agg.keys[ht.hkey]
        res = self.agg.slot(hk, "result", 0)
        got = hk.head[res : res + ht.tm.nparts]
        for s in range(ht.tm.nparts):
            if got[s] == -e:
                err = ht.errors.pop(e, None)
                if err is not None:
                    raise err
                raise ClusterError(
                    f"the host's row_sparse_pull of key {ht.key!r} (server {s}) failed on "
                    f"another local rank of host group {self.agg.group}: its log says why"
                )
        return bool((got >= e).all())

    # -- files -------------------------------------------------------------------------------
    def _name(self, ht: HostTable, kind: str, e: int, who: int) -> str:
        gen = self.agg.gens.get(ht.hkey, 0)
        what = f"table:{type(ht.key).__name__}:{ht.key}:{gen}:{kind}:{e}:{who}"
        digest = hashlib.sha256(what.encode()).hexdigest()
        return f"hetps-host-{self.agg.job[:32]}-{self.agg.group}-{digest[:24]}"

    def _write(self, ht: HostTable, name: str, e: int, ids: np.ndarray, rows: np.ndarray) -> None:
        head = np.zeros(_HEAD, np.int64)
        head[:6] = (MAGIC, 1, ids.size, ht.tm.table.cols, e, rows.shape[0])
        head[PID_SLOT] = os.getpid()  # (a crash's file is swept as a segment is)
        data = np.ascontiguousarray(rows, ht.tm.dtype)
        blob = b"".join((head.tobytes(), ids.astype(np.int64).tobytes(), data.tobytes()))
        blob += b"\0" * (-len(blob) % 8)
        unlink(name)  # (a name is one event's: a file there is a crashed run's, or planted)
        os.close(make(os.path.join(SHM_DIR, name), len(blob), blob, f"table {ht.key!r}"))

    def _read(self, ht: HostTable, name: str, part: int = -1) -> tuple[np.ndarray, np.ndarray]:
        """A local rank's published ids and rows (of server ``part`` only, if >= 0)."""
        cols, dtype = ht.tm.table.cols, ht.tm.dtype
        where = f"host group {self.agg.group}'s file {name} of table {ht.key!r}"
        try:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise ClusterError(
                f"host aggregation: the local ranks of host group {self.agg.group} made "
                f"different calls of table {ht.key!r} at one point (a push and a "
                "row_sparse_pull): every worker of a host makes the same calls of a table; "
                "a pull only some make goes after a kv.barrier() or a pull of them all"
            ) from None
        except OSError as exc:  # (a link planted there: ELOOP)
            raise ClusterError(f"{where} is not a private file: refused ({exc.strerror})") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
                raise ClusterError(f"{where} is not a private file: refused")
            blob = bytearray(st.st_size)
            view, got = memoryview(blob), 0
            while got < st.st_size:
                n = os.readv(fd, [view[got:]])
                if n <= 0:
                    break
                got += n
        finally:
            os.close(fd)
        head = np.frombuffer(blob, np.int64, _HEAD)
        n, m = int(head[2]), int(head[5])  # ids, rows (a pull's: none)
        if (
            head[0] != MAGIC
            or head[3] != cols
            or m not in (0, n)
            or (_HEAD + n) * 8 + m * cols * dtype.itemsize > got
        ):
            raise ClusterError(f"{where} is torn or not of this table: refused")
        ids = np.frombuffer(blob, np.int64, n, _HEAD * 8)
        rows = np.frombuffer(blob, dtype, m * cols, (_HEAD + n) * 8).reshape(m, cols)
        if part >= 0 and ht.tm.nparts > 1:
            sel = np.flatnonzero(ids % ht.tm.nparts == part)
            return ids[sel], take_rows(rows, sel) if m else rows
        return ids, rows

    def _clean(self, ht: HostTable, hk: Any) -> None:
        """Unlink this rank's files every local rank has read."""
        agg = self.agg
        summed = agg.slot(hk, "summed", 0)
        handled = int(hk.head[summed : summed + ht.tm.nparts].min())
        read = min(
            int(hk.head[self._read_slot(hk, ht, r)]) for r in range(agg.size) if r not in agg.dead
        )
        keep = []
        for name, e, kind in ht.files:
            if e <= (handled if kind != "rows" else read):
                unlink(name)
            else:
                keep.append((name, e, kind))
        ht.files = keep

    def _forget(self, ht: HostTable) -> None:
        for name, _, _ in ht.files:
            unlink(name)
        ht.files = []

    def close(self) -> None:
        """Unlink this worker's files once the other live local ranks read them (a few
        seconds at most), and those a dead local rank left of the last events."""
        agg = self.agg
        for ht in self.tables.values():
            hk = agg.keys.get(ht.hkey)
            if hk is not None:
                contrib = agg.slot(hk, "contrib", 0)
                pids = [int(p) for p in hk.head[PID_SLOT : PID_SLOT + agg.size]]
                end = time.monotonic() + 5.0
                while time.monotonic() < end and any(
                    e > hk.head[self._read_slot(hk, ht, r)] and pids[r] > 0 and alive(pids[r])
                    for _, e, kind in ht.files
                    if kind == "rows"
                    for r in range(agg.size)
                    if r != agg.local
                ):
                    time.sleep(0.005)
                gone = [r for r in range(agg.size) if pids[r] <= 0 or not alive(pids[r])]
                last = max(ht.events, int(hk.head[contrib : contrib + agg.size].max()))
                for e in range(max(1, last - 3), last + 1):
                    for r in gone:
                        unlink(self._name(ht, "push", e, r))
                        unlink(self._name(ht, "pull", e, r))
                    for s in range(ht.tm.nparts):  # (the rows of a dead rank's parts)
                        if hk.owner[s] in gone:
                            unlink(self._name(ht, "rows", e, s))
            self._forget(ht)


def _asks(key: Any, s: int, ids: np.ndarray, bound: int, cols: int, tm: Any):
    """Server ``s``'s requests for ``ids``, split where a reply would pass ``bound``."""
    step = max(1, bound // (cols * tm.dtype.itemsize))
    for a in range(0, ids.size, step):
        sel = np.arange(a, min(a + step, ids.size))
        yield sel, Message(P.SPULL, body={"k": key, "part": s}, arrays=[ids[a : a + step]])


def _land(key: Any, rows: np.ndarray, sel: np.ndarray) -> Any:
    return land_rows(key, rows, sel, rows.shape[1])
