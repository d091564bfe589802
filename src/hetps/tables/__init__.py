"""Row-sparse keys (embedding tables), the wing of :mod:`hetps.kvstore` that holds them.

Shared by both sides: :mod:`~hetps.tables.rowsparse` (``Table``, ``RowSparse``) and
:mod:`~hetps.tables.lazy` (the optimizers' rules on the rows a round touched). A worker's
side: :mod:`~hetps.tables.worker` (``row_sparse_pull`` and row-sparse pushes, a part of
``DistKVStore``), :mod:`~hetps.tables.worker_checkpoint` (the tables in a checkpoint) and
:mod:`~hetps.tables.local` (the same in ``LocalKVStore``). A server's side:
:mod:`~hetps.tables.server` (the requests, rounds and bounds), ``server_shard`` (one part of
one table), ``server_index`` (a growing table's ids), ``server_replicas`` (HETPS_REPLICAS) and
``server_dump`` (a checkpoint's reads and writes).
"""
