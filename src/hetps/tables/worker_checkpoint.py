"""The row-sparse keys (embedding tables) in a checkpoint (:mod:`hetps.kvstore.checkpoint`).

For each table the first live worker reads every server's part in chunks (``sdump``,
tables/server_dump.py) and appends them to ``.npy`` files as they come, hashing what it
writes, so neither the worker nor a server ever holds a whole table:

* ``table-<i>.ids.npy``: the ids of the rows used so far (sorted per server). A fixed
  table's other rows are their seeded initial value; a growing table's ids are its index.
* ``table-<i>.value.npy``: their values, ``table-<i>.<name>.npy``: the optimizer state's rows
  (``mom``, ``mean``/``var``, ``history``).
* ``table-<i>.opt``: the table's own optimizer (``Table(optimizer=...)``), pickled.

The manifest's ``tables`` entry of each holds its key, its declaration, the files, and per
server the state's numbers (Adam's step count ``t``). Restoring: every worker declares the
tables (unless it has) and the first live worker writes the rows back (``sload``), each to
the server that holds its id now (the number of servers may differ).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hetps.cluster import protocol as P
from hetps.cluster.bodies import chunk_elems
from hetps.cluster.errors import CheckpointError
from hetps.tables.rowsparse import Table, declaration_differs, table_declaration
from hetps.transport.codec import Message

if TYPE_CHECKING:
    from hetps.tables.worker import TableStore

#: requests of a dump or restore in flight at once (each holds one chunk)
IN_FLIGHT = 4


def _chunk_rows(kv: TableStore, cols: int, itemsize: int) -> int:
    return max(1, chunk_elems(kv.cfg.chunk_bytes, itemsize) // cols)


class _NpyWriter:
    """A ``.npy`` file of ``shape`` written row block by row block, hashed as it goes."""

    def __init__(self, path: Path, dtype: np.dtype, shape: tuple[int, int], hashing: Any):
        self.f = open(path, "wb")  # noqa: SIM115 - closed by close()
        self.out = hashing(self.f)
        header = {
            "descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
            "fortran_order": False,
            "shape": shape,
        }
        np.lib.format.write_array_header_2_0(self.out, header)

    def write(self, arr: np.ndarray) -> None:
        self.out.write(np.ascontiguousarray(arr).tobytes())

    def close(self) -> dict:
        import os

        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        return self.out.summary()


def save_tables(kv: TableStore, tmp: Path, key_tag: Any, hashing: Any) -> tuple[list, dict]:
    """Write every table of ``kv`` into ``tmp`` (the first live worker, between rounds);
    returns the manifest's ``tables`` entries and the files' sizes and checksums."""
    from hetps import optim

    entries, files = [], {}
    # the row-sparse keys the servers hold (a DistKVStore's part sparse); a store without
    # that part (the single-process one) has none there
    sparse = getattr(kv, "sparse", None)
    for i, (key, tm) in enumerate(sparse.tables.items() if sparse is not None else ()):
        t = tm.table
        S = tm.nparts
        infos = [
            kv.request(key, 0, s, Message(P.SDUMP, body={"k": key, "part": s, "n": 0}))
            for s in range(S)
        ]
        infos = [f.wait(kv.timeout).body for f in infos]
        states = infos[0]["state"]
        for info in infos[1:]:
            if info["state"] and states and info["state"] != states:
                raise RuntimeError(f"table {key!r}: the servers' optimizer states differ")
            states = states or info["state"]
        total = sum(int(info["count"]) for info in infos)
        names = {"ids": f"table-{i}.ids.npy", "value": f"table-{i}.value.npy"}
        writers = {
            "ids": _NpyWriter(tmp / names["ids"], np.int64, (total,), hashing),
            "value": _NpyWriter(tmp / names["value"], np.dtype(t.dtype), (total, t.cols), hashing),
        }
        for m, dt, cols in states:
            names[m] = f"table-{i}.{m}.npy"
            writers[m] = _NpyWriter(tmp / names[m], np.dtype(dt), (total, cols), hashing)
        step = _chunk_rows(kv, t.cols, np.dtype(t.dtype).itemsize * (1 + len(states)))
        for s, info in enumerate(infos):
            count = int(info["count"])
            want = [m for m, _, _ in info["state"]]
            if want and want != [m for m, _, _ in states]:
                raise RuntimeError(f"table {key!r}: server {s} keeps another optimizer state")
            futs: list = []
            for off in range(0, count, step):
                body = {"k": key, "part": s, "off": off, "n": min(step, count - off)}
                futs.append(kv.request(key, 0, s, Message(P.SDUMP, body=body)))
                if len(futs) > IN_FLIGHT:
                    _write_chunk(writers, futs.pop(0).wait(kv.timeout).arrays, want, states)
            for f in futs:
                _write_chunk(writers, f.wait(kv.timeout).arrays, want, states)
        for name, w in writers.items():
            files[names[name]] = w.close()
        if t.optimizer is not None:
            opt_name = f"table-{i}.opt"
            with open(tmp / opt_name, "wb") as f:
                w = hashing(f)
                w.write(optim.dumps(t.optimizer))
            files[opt_name] = w.summary()
            names["opt"] = opt_name
        entries.append(
            {
                "key": key_tag(key),
                "decl": table_declaration(t),
                "rows_saved": total,
                "files": names,
                "numbers": [info["numbers"] for info in infos],
                "has_state": [bool(info["has_state"]) for info in infos],
                "state": [list(x) for x in states],
            }
        )
    return entries, files


def _write_chunk(writers: dict, arrays: list, want: list, states: list) -> None:
    if len(arrays) != 2 + len(want):
        raise RuntimeError("a server answered a table's dump with the wrong number of arrays")
    ids = arrays[0].reshape(-1)
    writers["ids"].write(ids)
    writers["value"].write(arrays[1])
    if not want:  # (a server with no state yet: its rows' state is zeros)
        arrays = arrays[:2] + [np.zeros(ids.size * c, dt) for _, dt, c in states]
    for (m, _, c), arr in zip(states, arrays[2:], strict=True):
        if arr.size != ids.size * c:
            raise RuntimeError(f"a server answered a table's dump with a wrong-sized {m!r}")
        writers[m].write(arr)


def needed_files(manifest: dict) -> list[str]:
    """The files of the manifest's tables (each must be intact)."""
    return [name for e in manifest.get("tables", []) for name in e["files"].values()]


def restore_tables(path: Path, manifest: dict, kv: TableStore, damaged: Any) -> None:
    """Every worker: declare the checkpoint's tables (unless declared already, then their
    declaration must match) and, on the first live worker, write their rows back."""
    from hetps import optim

    tables = manifest.get("tables", [])
    for e in tables:
        kind, key = e["key"]
        key = int(key) if kind == "int" else str(key)
        e["_key"] = key
        d = e["decl"]
        if kv.is_row_sparse(key):
            differ = declaration_differs(d, table_declaration(kv.table(key)), "this job has")
            if differ:
                raise CheckpointError(
                    f"{path}: table {key!r} was declared at the checkpoint with {differ}; "
                    "declare it as the checkpoint's job did"
                )
            continue
        opt = None
        if "opt" in e["files"]:
            try:
                opt = optim.loads((path / e["files"]["opt"]).read_bytes())
            except Exception as exc:  # noqa: BLE001 - unpickling can raise anything
                raise damaged(path, e["files"]["opt"], f"cannot be loaded ({exc})") from exc
        kv.init(key, Table(**d, optimizer=opt))
    if tables and getattr(kv, "live_rank", kv.rank) == 0:
        for e in tables:
            _write_back(path, e, kv, damaged)
    kv.barrier()  # every table written back before anyone pushes


def _write_back(path: Path, e: dict, kv: TableStore, damaged: Any) -> None:
    key = e["_key"]
    S = kv.num_servers
    arrays = {}
    for name, f in e["files"].items():
        if name == "opt":
            continue
        try:
            arrays[name] = np.load(path / f, mmap_mode="r")
        except Exception as exc:  # noqa: BLE001 - a cut header fails in many ways
            raise damaged(path, f, f"cannot be loaded ({exc})") from exc
    states = [m for m, _, _ in e["state"]]
    numbers = e["numbers"]
    if len(numbers) != S:
        if any(n != numbers[0] for n in numbers):
            raise CheckpointError(
                f"{path}: table {key!r}'s optimizer step counts differ between its "
                f"{len(numbers)} servers; resume with {len(numbers)} servers"
            )
        numbers = [numbers[0]] * S
        has = [any(e["has_state"])] * S
    else:
        has = e["has_state"]
    ids = arrays["ids"]
    cols = e["decl"]["cols"]
    step = _chunk_rows(kv, cols, arrays["value"].dtype.itemsize * (1 + len(states)))
    futs: list = []
    for s in range(S):
        mine = np.flatnonzero(np.asarray(ids) % S == s) if S > 1 else np.arange(ids.size)
        mine = mine[np.argsort(ids[mine], kind="stable")]
        first = True
        for a in range(0, max(mine.size, 1), step):
            sel = mine[a : a + step]
            body = {"k": key, "part": s, "fresh": first}
            if first and has[s]:
                body.update(state=states, numbers=numbers[s])
            elif has[s]:
                body["state"] = states
            first = False
            out = []
            if sel.size:
                out = [np.ascontiguousarray(ids[sel]), arrays["value"][sel].reshape(-1)]
                out += [arrays[m][sel].reshape(-1) for m in (states if has[s] else [])]
            futs.append(kv.request(key, 0, s, Message(P.SLOAD, body=body, arrays=out)))
            while len(futs) > IN_FLIGHT:
                futs.pop(0).wait(kv.timeout)
    for f in futs:
        f.wait(kv.timeout)
