"""Row-sparse keys in the single-process store (mixed into
:class:`~hetps.kvstore.local.LocalKVStore`): the same ``Table``, ``row_sparse_pull`` and
row-sparse pushes as the distributed store, the table held in this process (one part)."""

from __future__ import annotations

from typing import Any

import numpy as np

from hetps import optim
from hetps.cluster.errors import BadRequest
from hetps.device.staging import as_numpy
from hetps.tables.lazy import distinct_inverse
from hetps.tables.rowsparse import RowSparse, Table, coalesce
from hetps.tables.server import Shard, apply_rows
from hetps.tables.worker import (
    TableMeta,
    fill_out,
    pull_args,
    pull_result,
    row_ids_of,
    targets_of,
)

__all__ = ["LocalSparse"]


class LocalSparse:
    """The row-sparse half of :class:`~hetps.kvstore.local.LocalKVStore`."""

    tables: dict[Any, tuple[TableMeta, Shard]]
    optimizer: optim.Optimizer | None

    def is_row_sparse(self, key: Any) -> bool:
        """Whether ``key`` was initialised as a row-sparse table."""
        return key in self.tables

    def table(self, key: Any) -> Table:
        """The :class:`Table` declared for ``key``."""
        return self.tables[key][0].table

    def _init_table(self, key: Any, value: Any) -> None:
        if isinstance(value, RowSparse):
            spec = Table(value.shape[0], value.shape[1], value.dtype.name)
            ids, rows = value.indices, value.data
        else:
            spec, ids, rows = value, None, None
            if spec.value is not None:
                rows = as_numpy(spec.value, f"init of key {key!r}").reshape(spec.rows, spec.cols)
                ids = np.arange(spec.rows, dtype=np.int64)
        tm = TableMeta(spec, 1)
        try:
            sh = Shard(key, spec.server_decl(), 0, 1)
        except BadRequest as exc:
            raise ValueError(str(exc)) from None
        sh.optimizer = spec.optimizer
        if ids is not None:
            tm.check_ids(key, ids, "init")
            sh.value[sh.local(ids, None, create=True)] = rows
        self.tables[key] = (tm, sh)
        self.store.pop(key, None)

    def _push_table(self, key: Any, value: Any) -> None:
        tm, sh = self.tables[key]
        what = f"push of row-sparse key {key!r}"
        ids, rows = coalesce(value, tm.table.cols, tm.dtype, what)
        tm.check_ids(key, ids, "push", ids)
        try:
            apply_rows(sh, self.optimizer, ids, rows)
        except BadRequest as exc:  # a growing table over its bound
            raise ValueError(str(exc)) from None

    def row_sparse_pull(
        self, key: Any, out: Any = None, priority: int = 0, row_ids: Any = None
    ) -> Any:
        """MXNet's ``row_sparse_pull`` (see :mod:`hetps.tables.worker`)."""
        results = []
        for k, rid, o in pull_args(key, out, row_ids, self.tables):
            tm, sh = self.tables[k]
            ids = row_ids_of(rid, k)
            uniq, inv = distinct_inverse(ids)
            tm.check_ids(k, ids, "row_sparse_pull", uniq)
            what = f"row_sparse_pull of key {k!r}"
            results.append(
                fill_out(
                    targets_of(o, what), o is None, tm.table, ids, uniq, inv, sh.read(uniq), what
                )
            )
        return pull_result(key, out, results)
