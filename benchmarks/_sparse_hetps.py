#!/usr/bin/env python
"""The hetps side of benchmarks/sparse_tables.py: a worker of a ``hetps launch -n 2 -s 2`` job.

    hetps launch -n 2 -s 2 -- python benchmarks/_sparse_hetps.py ROWS COLS FRACS OPT ROUNDS [TABLES]

The same rounds as ``benchmarks/_sparse_mx.py`` (the same ids and rows): ``kv.push(key, (ids,
rows))`` then ``kv.row_sparse_pull(key, row_ids=ids)``, SGD or lazy Adam on the servers; with
``TABLES`` > 1, as many tables of that size, pushed and pulled each round in one call each.
Rank 0 prints ``RESULT cols frac t1,t2,...``, ``CPU cols frac s`` (its process's CPU
seconds, all threads, per timed round) and ``TABLES cols frac n`` (the tables whose rows
the last round's pull brought back, its ids each).
"""

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _sparse_mx import ids_for, table_keys  # noqa: E402

import hetps.kv  # noqa: E402
from hetps import optim  # noqa: E402
from hetps.tables.rowsparse import Table  # noqa: E402


def main() -> None:
    rows, cols_list = int(sys.argv[1]), [int(c) for c in sys.argv[2].split(",")]
    fracs, opt, rounds = [float(f) for f in sys.argv[3].split(",")], sys.argv[4], int(sys.argv[5])
    tables = int(sys.argv[6]) if len(sys.argv) > 6 else 1
    kv = hetps.kv.create("dist_sync")
    if opt == "adam":
        kv.set_optimizer(optim.Adam(learning_rate=0.001))
    else:
        kv.set_optimizer(optim.SGD(learning_rate=0.01))
    rank, warm, sets = kv.rank, 3, 4
    key = 0
    for cols in cols_list:
        for frac in fracs:
            key += 1
            keys = table_keys(key, tables)
            for k in keys:
                kv.init(k, Table(rows, cols))
            grads = []  # per set: (ids, rows) of every table
            for s in range(sets):
                data = np.random.default_rng(s).standard_normal
                ids = [ids_for(rows, frac, rank, s + sets * j) for j in range(tables)]
                grads.append([(i, data((i.size, cols), np.float32)) for i in ids])
            kv.barrier()
            times = []
            cpu = 0.0  # (this worker process's CPU time, all its threads, in timed rounds)
            for i in range(warm + rounds):
                g = grads[i % sets]
                t0, c0 = time.perf_counter(), time.process_time()
                if tables == 1:
                    kv.push(key, g[0])
                    got = [kv.row_sparse_pull(key, row_ids=g[0][0])]
                else:  # (every table in one call, as a model's step)
                    kv.push(keys, g)
                    got = kv.row_sparse_pull(keys, row_ids=[ids for ids, _ in g])
                if i >= warm:
                    times.append(time.perf_counter() - t0)
                    cpu += time.process_time() - c0
            kv.barrier()
            if rank == 0:
                print(f"RESULT {cols} {frac} " + ",".join(f"{t:.6f}" for t in times), flush=True)
                print(f"CPU {cols} {frac} {cpu / rounds:.6f}", flush=True)
                # (the tables whose rows the last round's pull brought, checked outside the
                # timing: each its ids)
                took = sum(
                    np.array_equal(r.indices, ids) for r, (ids, _) in zip(got, g, strict=False)
                )
                print(f"TABLES {cols} {frac} {took}", flush=True)


if __name__ == "__main__":
    main()
