"""A server's side of checkpointing its parts of the row-sparse keys: reading a table's rows
out in chunks (``sdump``) and writing them back (``sload``).

What a part holds that a checkpoint must keep: the rows that were used (a fixed table's rows
never used are their seeded initial value, made again on first use; a growing table's rows
are its id index), their values, the optimizer state's rows (SGD momentum, Adam's moments,
AdaGrad's history) and the state's numbers (Adam's step count ``t``). Rows go by global id,
sorted, so a checkpoint can be loaded into another number of servers.

``sdump`` (``off``, ``n``): the answer's body says how many rows the part holds, the state's
per-row arrays (name, dtype, columns) and its numbers; its arrays are the ids of rows
``[off, off + n)`` of that sorted list, their values and each state array's rows. A chunk is
a copy of those rows only: the table is never copied whole.

``sload``: ``fresh`` (the first chunk of a part) starts the part again empty, with the
state's numbers; each chunk writes its ids' values and state rows. Both come from a worker
of the job only, between the table's rounds; every array is checked before anything changes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hetps.cluster.errors import BadRequest
from hetps.tables import lazy
from hetps.tables.server_shard import TablesPort, checked_ids, checked_rows

#: rows one dump or load chunk may carry
MAX_CHUNK_ROWS = 1 << 22
#: bytes one dump answer may carry (a worker asks for HETPS_CHUNK_BYTES)
MAX_CHUNK_BYTES = 1 << 28


def per_row(sh: Any) -> list[str]:
    """The names of the state's per-row arrays, sorted."""
    if not sh.has_state:
        return []
    return sorted(n for n, a in sh.state.items() if isinstance(a, np.ndarray) and a.ndim == 2)


def numbers(sh: Any) -> dict[str, Any]:
    """The state's entries that are not per-row arrays (Adam's ``t``)."""
    if not sh.has_state:
        return {}
    out = {}
    for name, v in sh.state.items():
        if isinstance(v, np.ndarray) and v.ndim == 2:
            continue
        if isinstance(v, (np.integer, np.floating)):
            v = v.item()
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise BadRequest(
                f"sdump of key {sh.key!r}: the optimizer state's entry {name!r} "
                f"({type(v).__name__}) cannot be checkpointed: keep only per-row arrays and "
                "numbers in a table's state"
            )
        out[name] = v
    return out


def used_rows(sh: Any) -> tuple[np.ndarray, np.ndarray]:
    """(global ids sorted, their local rows) of the rows ``sh`` holds."""
    if sh.growing:
        return sh.index.items()
    loc = np.flatnonzero(sh.made).astype(np.int64)
    return loc * sh.nparts + sh.part, loc


def _window(msg: Any, what: str, sh: Any) -> tuple[int, int]:
    off, n = msg.typed.offset, msg.typed.count  # (ints >= 0: an SDump, checked at decode)
    if n > MAX_CHUNK_ROWS:
        raise BadRequest(
            f"{what} of key {sh.key!r}: {n} rows in one chunk, at most {MAX_CHUNK_ROWS}"
        )
    return off, n


def _idle(sh: Any, what: str) -> None:
    if sh.pending or sh.deferred or sh.backlog or sh.copying:
        raise BadRequest(
            f"{what} of key {sh.key!r}: a round of this table is under way here; checkpoint "
            "and restore between rounds (every worker's pushes answered)"
        )


def dump(sh: Any, msg: Any) -> tuple[dict, list[np.ndarray]]:
    """The answer to an ``sdump`` of ``sh``: (body, arrays)."""
    off, n = _window(msg, "sdump", sh)
    _idle(sh, "sdump")
    cached = sh.dumped
    if off == 0 or cached is None:
        cached = sh.dumped = used_rows(sh)
    ids, loc = cached
    names = per_row(sh)
    body = {
        "count": int(ids.size),
        "state": [[m, sh.state[m].dtype.name, int(sh.state[m].shape[1])] for m in names],
        "numbers": numbers(sh),
        "has_state": bool(sh.has_state),
    }
    if n == 0:
        return body, []
    per = sh.value.itemsize * sh.cols + sum(
        sh.state[m].itemsize * sh.state[m].shape[1] for m in names
    )
    if n * per > MAX_CHUNK_BYTES:
        raise BadRequest(
            f"sdump of key {sh.key!r}: {n} rows of {per} bytes in one answer, at most "
            f"{MAX_CHUNK_BYTES} bytes: ask for fewer rows"
        )
    sel = loc[off : off + n]
    arrays = [ids[off : off + n].copy(), sh.value[sel].reshape(-1)]
    arrays += [sh.state[m][sel].reshape(-1) for m in names]
    if off + n >= ids.size:
        sh.dumped = None  # the last chunk: let the list go
    return body, arrays


def load(tables: TablesPort, sh: Any, msg: Any, copy: bool = False) -> Any:
    """Apply an ``sload`` to ``sh`` (``tables``: the server's :class:`Tables`); returns the
    part now in place (a ``fresh`` load makes it again). ``copy``: a primary's copy of its
    part (HETPS_REPLICAS: tables/server_replicas.py), which a server of the job sends."""
    if not copy:
        if not tables.server.from_worker(msg):
            raise BadRequest("sload: only a worker of this job may write a table's rows")
        tables.server.elastic.in_rounds(msg)
        _idle(sh, "sload")
    b = msg.typed  # an SLoad (or a copy's): names and numbers of the right types, checked
    names, numbers = b.state, b.numbers
    opt = sh.optimizer if sh.optimizer is not None else tables.server.optimizer
    if b.fresh:
        if (names or numbers) and opt is None:
            raise BadRequest(
                f"sload of key {sh.key!r}: the checkpoint holds the table's optimizer state, "
                "but the servers have no optimizer: call kv.set_optimizer(...) (as before the "
                "checkpoint) before restoring"
            )
        fresh = type(sh)(sh.key, sh.decl, sh.part, sh.nparts, tables)  # (a Shard)
        fresh.optimizer, fresh.opt_blob = sh.optimizer, sh.opt_blob
        # (its rounds go on: a worker's pushes carry their count with HETPS_REPLICAS)
        fresh.rounds, fresh.primary, fresh.origin = sh.rounds, sh.primary, sh.origin
        if names or numbers:
            st = lazy.create_table_state(opt, fresh.value.shape[0], fresh.cols, fresh.dtype)
            have = sorted(m for m, a in st.items() if isinstance(a, np.ndarray) and a.ndim == 2)
            scalars = sorted(m for m in st if m not in have)
            if have != sorted(names) or scalars != sorted(numbers):
                raise BadRequest(
                    f"sload of key {sh.key!r}: the checkpoint's optimizer state has "
                    f"{sorted(names) + sorted(numbers)}, the servers' optimizer "
                    f"{type(opt).__name__} keeps {have + scalars}: set the optimizer the job "
                    "had when the checkpoint was taken"
                )
            fresh.check_bound(fresh.value.shape[0], fresh.row_bytes(opt))
            st.update(numbers)
            fresh.state, fresh.has_state = st, True
        sh = fresh  # (in place once every check below passed)
    elif sorted(names) != per_row(sh):
        raise BadRequest(
            f"sload of key {sh.key!r}: state arrays {names} differ from the first chunk's"
        )
    if len(msg.arrays) != 2 + len(names):
        if msg.arrays or not b.fresh:
            raise BadRequest(
                f"sload of key {sh.key!r}: expected ids, rows and {len(names)} state arrays"
            )
        tables.shards[sh.skey] = sh
        return sh
    ids = checked_ids(msg, sh, msg.arrays[0].reshape(-1), True)
    if ids.size > MAX_CHUNK_ROWS:
        raise BadRequest(f"sload of key {sh.key!r}: {ids.size} rows, at most {MAX_CHUNK_ROWS}")
    vals = checked_rows(msg, sh, msg.arrays[1], ids.size)
    rows = []
    for m, arr in zip(names, msg.arrays[2:], strict=True):
        want = sh.state[m]
        if arr.dtype != want.dtype or arr.size != ids.size * want.shape[1]:
            raise BadRequest(
                f"sload of key {sh.key!r}: state {m!r}: got {arr.size} values of {arr.dtype} "
                f"for {ids.size} rows of {want.shape[1]} {want.dtype.name}"
            )
        rows.append(arr.reshape(ids.size, want.shape[1]))
    sh.settle()
    loc = sh.local(ids, opt, create=True)  # (a growing table: its bound is checked here)
    sh.value[loc] = vals
    for m, r in zip(names, rows, strict=True):
        sh.state[m][loc] = r
    tables.shards[sh.skey] = sh
    return sh
