"""Row-sparse values and tables, shared by workers and servers (pure NumPy).

* :class:`Table` declares a row-sparse key: ``rows`` x ``cols`` (``rows=None``: a table that
  grows, keyed by any id >= 0, a row made on its first push), how its rows start (zeros, or
  uniform in ``[-scale, scale)`` from a seeded counter-based hash of (seed, row, column), so a
  row's first value does not depend on how many servers hold the table), and a bound on the
  bytes each server may hold of it.
* :class:`RowSparse` is MXNet's ``RowSparseNDArray`` in NumPy: sorted distinct row ids, their
  rows, and the whole table's shape.
* Row ``r`` lives on server ``r % S`` at local row ``r // S`` (fixed tables); ids of a growing
  table are spread the same way (hashed ids are spread evenly already).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from hetps.tables.lazy import distinct_inverse

__all__ = ["RowSparse", "Table", "coalesce", "first_nonfinite", "initial_rows", "row_ids"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
#: rows generated at once when a server fills its part of a table
_INIT_BLOCK = 1 << 15


@dataclass(frozen=True)
class Table:
    """A row-sparse key: ``kv.init(key, Table(rows, cols, ...))``.

    Args:
        rows: rows of the table, or None for a table that grows (ids >= 0 of any size, e.g.
            hashed feature ids; a row is made on its first push, and a pull of a row never
            pushed reads its initial value without making it).
        cols: columns (the embedding width).
        dtype: float16, float32 or float64.
        scale: rows start uniform in ``[-scale, scale)`` (0: zeros).
        seed: the seed of the initial values (the same seed gives the same table anywhere).
        value: the initial rows of a fixed table, ``rows`` x ``cols`` (instead of ``scale``):
            sent by the first worker, so only for tables that fit a worker.
        server_bytes: bound on the bytes one server holds of this table, values and
            optimizer state together; reaching it is an error naming the table (None: no
            bound for a fixed table, 1 GiB for a growing one).
        optimizer: a :mod:`hetps.optim` optimizer for this table alone (lazy: only the rows
            a round touched change); None: the servers' optimizer (``kv.set_optimizer``), or,
            with none, a round's per-row sums replace the rows pushed.
    """

    rows: int | None
    cols: int
    dtype: str = "float32"
    scale: float = 0.0
    seed: int = 0
    value: Any = None
    server_bytes: int | None = None
    optimizer: Any = None

    def __post_init__(self) -> None:
        if self.rows is not None and (
            isinstance(self.rows, bool) or not isinstance(self.rows, int) or self.rows < 0
        ):
            raise ValueError(f"Table: rows must be an int >= 0 or None, got {self.rows!r}")
        if isinstance(self.cols, bool) or not isinstance(self.cols, int) or self.cols < 1:
            raise ValueError(f"Table: cols must be an int >= 1, got {self.cols!r}")
        name = np.dtype(self.dtype).name
        if name not in ("float16", "float32", "float64"):
            raise TypeError(
                f"Table: dtype {name} is not supported; use float16, float32 or float64"
            )
        object.__setattr__(self, "dtype", name)
        if not (isinstance(self.scale, (int, float)) and math.isfinite(self.scale)):
            raise ValueError(f"Table: scale must be a finite number, got {self.scale!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"Table: seed must be an int >= 0, got {self.seed!r}")
        if self.server_bytes is not None and (
            isinstance(self.server_bytes, bool)
            or not isinstance(self.server_bytes, int)
            or self.server_bytes < 1
        ):
            raise ValueError(f"Table: server_bytes must be an int >= 1, got {self.server_bytes!r}")
        if self.value is not None:
            if self.rows is None:
                raise ValueError("Table: a growing table (rows=None) takes no value")
            shape = tuple(np.shape(self.value))
            if shape != (self.rows, self.cols):
                raise ValueError(
                    f"Table: value of shape {shape} does not match ({self.rows}, {self.cols})"
                )

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, cols); rows is -1 for a growing table."""
        return (-1 if self.rows is None else self.rows, self.cols)

    @property
    def bound(self) -> int:
        """Bytes one server may hold of this table (0: no bound)."""
        if self.server_bytes is not None:
            return self.server_bytes
        return 0 if self.rows is not None else 1 << 30

    def server_decl(self) -> dict:
        """What a server's part is declared with (``sinit``'s fields, a Shard's ``decl``)."""
        return {
            "rows": self.rows,
            "cols": self.cols,
            "dtype": self.dtype,
            "scale": float(self.scale),
            "seed": self.seed,
            "bound": self.bound,
        }


def initial_rows(scale: float, seed: int, ids: np.ndarray, cols: int, dtype: Any) -> np.ndarray:
    """The first value of rows ``ids`` (len(ids) x cols): zeros, or uniform in
    ``[-scale, scale)`` from splitmix64 of (seed, row * cols + column)."""
    out = np.zeros((ids.size, cols), dtype)
    if scale == 0 or ids.size == 0:
        return out
    cols_u = np.arange(cols, dtype=np.uint64)
    base = np.uint64(((seed + 1) * int(_GOLDEN)) & 0xFFFFFFFFFFFFFFFF)
    for a in range(0, ids.size, _INIT_BLOCK):
        blk = ids[a : a + _INIT_BLOCK].astype(np.uint64)
        z = blk[:, None] * np.uint64(cols) + cols_u + base
        z ^= z >> np.uint64(30)
        z *= _M1
        z ^= z >> np.uint64(27)
        z *= _M2
        z ^= z >> np.uint64(31)
        u = (z >> np.uint64(40)).astype(np.float64) * (1.0 / (1 << 24))  # [0, 1), 24 bits
        out[a : a + _INIT_BLOCK] = (u * 2.0 - 1.0) * scale
    return out


class RowSparse:
    """MXNet's ``RowSparseNDArray``: ``indices`` (sorted, distinct, int64), ``data``
    (len(indices) x cols) and ``shape`` (the table's; rows -1 for a growing table)."""

    def __init__(self, indices: Any, data: Any, shape: tuple[int, int]) -> None:
        self.indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        self.data = np.asarray(data).reshape(self.indices.size, shape[1])
        self.shape = (int(shape[0]), int(shape[1]))

    @property
    def dtype(self) -> np.dtype:
        return self.data.dtype

    def asnumpy(self) -> np.ndarray:
        """The dense table (rows not held are zeros); a fixed table's only."""
        if self.shape[0] < 0:
            raise ValueError("a growing table has no dense form: read .indices and .data")
        out = np.zeros(self.shape, self.data.dtype)
        out[self.indices] = self.data
        return out

    def __repr__(self) -> str:
        return f"RowSparse({self.indices.size} rows of {self.shape}, {self.data.dtype})"


def row_ids(value: Any, what: str) -> np.ndarray:
    """Row ids as a 1-D int64 array (from a list, NumPy array or CPU torch tensor)."""
    if type(value).__module__.startswith("torch"):
        if value.device.type != "cpu":
            raise TypeError(f"{what}: row_ids must be on the CPU; call .cpu() first")
        value = value.detach().numpy()
    arr = np.asarray(value)
    if arr.size == 0:
        return np.zeros(0, np.int64)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{what}: row_ids must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False).reshape(-1)


def coalesce(value: Any, cols: int, dtype: np.dtype, what: str) -> tuple[np.ndarray, np.ndarray]:
    """A row-sparse gradient as (sorted distinct int64 ids, their summed rows): from a torch
    sparse COO tensor (rows x cols), a :class:`RowSparse`, or a pair (row ids, rows)
    (duplicate ids are summed, in the order given)."""
    return coalesce_owned(value, cols, dtype, what)[:2]


def coalesce_owned(
    value: Any, cols: int, dtype: np.dtype, what: str
) -> tuple[np.ndarray, np.ndarray, bool]:
    """:func:`coalesce`'s (ids, rows) and whether both are new arrays of its own (summed:
    the ids repeated or were not sorted), not the caller's memory."""
    if type(value).__module__.startswith("torch") and getattr(value, "is_sparse", False):
        t = value.detach().cpu()
        if t.sparse_dim() != 1:
            raise ValueError(
                f"{what}: a sparse tensor with {t.sparse_dim()} sparse dimensions; row-sparse "
                "gradients have one (the rows), as nn.Embedding(sparse=True) makes"
            )
        # uncoalesced (as autograd makes it): summed below in the order of its entries, as
        # nn.Embedding's dense backward sums them (so a row's sum is the dense one, bit for bit)
        ids = t._indices().reshape(-1).numpy().astype(np.int64, copy=False)
        rows = t._values().numpy().reshape(ids.size, -1)
    elif isinstance(value, RowSparse):
        ids, rows = value.indices, value.data
    elif isinstance(value, (tuple, list)) and len(value) == 2:
        ids = row_ids(value[0], what)
        rows = value[1]
        if type(rows).__module__.startswith("torch"):
            rows = rows.detach().cpu().numpy()
        rows = np.asarray(rows)
        if rows.size != ids.size * cols:
            raise ValueError(
                f"{what}: {ids.size} row ids but values of shape {rows.shape}; give "
                f"{ids.size} rows of {cols} columns"
            )
        rows = rows.reshape(ids.size, cols)
    else:
        raise TypeError(
            f"{what}: a row-sparse key takes a torch sparse COO tensor, a RowSparse or a pair "
            f"(row_ids, rows), got {type(value).__name__}"
        )
    if rows.ndim != 2 or rows.shape[1] != cols:
        raise ValueError(f"{what}: rows of shape {rows.shape}, the table has {cols} columns")
    if rows.dtype != dtype:
        raise ValueError(f"{what}: rows of dtype {rows.dtype}, the table's is {dtype}")
    bad = first_nonfinite(rows)
    if bad is not None:
        raise ValueError(
            f"{what}: the row of id {int(ids[bad])} holds a NaN or an infinity; nothing was "
            "sent (a non-finite row would make the table's row, and its optimizer state, "
            "NaN for good): check the loss and the learning rate, or clip the gradients"
        )
    uniq, inv = distinct_inverse(ids)
    if inv is not None:  # duplicates or unsorted: sum
        summed = np.zeros((uniq.size, cols), rows.dtype)
        np.add.at(summed, inv, rows)
        return uniq, summed, True
    return ids, rows, False


def first_nonfinite(rows: np.ndarray) -> int | None:
    """The index of the first row of 2-D ``rows`` with a NaN or an infinity, or None: the
    span of the values tells (their maximum less their minimum: a NaN carries through both,
    an infinity makes it infinite; two vectorised passes, about twice as fast as a sum), the
    rows are searched only when it is not finite (or the span of finite values overflowed)."""
    if rows.size == 0:
        return None
    with np.errstate(over="ignore", invalid="ignore"):
        span = np.maximum.reduce(rows, axis=None) - np.minimum.reduce(rows, axis=None)
        if np.isfinite(span):
            return None
    bad = ~np.isfinite(rows).all(axis=1)
    return int(np.argmax(bad)) if bad.any() else None


def table_declaration(t: Table) -> dict:
    """What declares ``t`` on another worker (its first value and optimizer aside): the
    keyword arguments of :class:`Table`."""
    return {
        "rows": t.rows,
        "cols": t.cols,
        "dtype": t.dtype,
        "scale": float(t.scale),
        "seed": t.seed,
        "server_bytes": t.server_bytes,
    }


def declaration_differs(mine: dict, theirs: dict, whose: str) -> str | None:
    """Where two :func:`table_declaration` differ (``rows``, ``cols``, ``dtype``, ``scale``,
    ``seed``), said as "mine ..., ``whose`` has ..."; None when they agree."""
    differ = [f for f in ("rows", "cols", "dtype", "scale", "seed") if mine[f] != theirs[f]]
    if not differ:
        return None
    return (
        ", ".join(f"{f}={mine[f]!r}" for f in differ)
        + f", {whose} "
        + ", ".join(f"{f}={theirs[f]!r}" for f in differ)
    )
