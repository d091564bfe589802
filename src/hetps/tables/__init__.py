"""Row-sparse keys (embedding tables). Shared: ``rowsparse`` (Table, RowSparse), ``lazy`` (the
optimizers' rules on the rows a round touched); a worker's side: ``worker``,
``worker_checkpoint``, ``local`` (LocalKVStore's); a server's side: ``server`` (Tables),
``server_shard``, ``server_index``, ``server_replicas``, ``server_dump``."""
