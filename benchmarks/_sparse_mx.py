#!/usr/bin/env python
"""The MXNet 1.9.1 side of benchmarks/sparse_tables.py: one role of a ``dist_sync`` job (the
role from ``DMLC_ROLE``; a scheduler or server only imports mxnet, which runs it).

    DMLC_ROLE=worker ... mxpeer-venv/bin/python benchmarks/_sparse_mx.py \
        ROWS COLS FRACS OPT ROUNDS [TABLES]

Each worker, for every table (``ROWS`` x each of ``COLS``, comma-separated) and every share
of rows (``FRACS``, comma-separated): a round is ``kv.push(key, grad)`` of a row-sparse
gradient of its ids, then ``kv.row_sparse_pull(key, out=rsp, row_ids=ids)``, waited for; with
``TABLES`` > 1, as many tables of that size, pushed and pulled each round in one call each. The
ids (distinct, sorted, drawn per worker and round from a seeded generator, prepared before the
timing) and the rows are the ones the hetps side uses. Rank 0 prints ``RESULT cols frac
t1,t2,...`` (seconds per round after 3 warm-up rounds) and ``CPU cols frac s``: its process's
CPU seconds (all threads, MXNet's engine and ps-lite's included) per timed round, and
``TABLES cols frac n``: the tables whose rows the last round's pull brought back, its ids each.
"""

import os
import sys
import time

ROLE = os.environ.get("DMLC_ROLE")


def ids_for(rows, frac, rank, rnd):
    import numpy as np

    n = max(1, int(rows * frac))
    rng = np.random.default_rng([rank, rnd, n])
    return np.sort(rng.choice(rows, n, replace=False)).astype(np.int64)


def table_keys(key, tables):
    """The keys of a cell's tables: ``key`` itself for one, else ``key * 1000 + j``."""
    return [key] if tables == 1 else [key * 1000 + j for j in range(tables)]


def main():
    import mxnet as mx
    import numpy as np

    rows, cols_list = int(sys.argv[1]), [int(c) for c in sys.argv[2].split(",")]
    fracs, opt, rounds = [float(f) for f in sys.argv[3].split(",")], sys.argv[4], int(sys.argv[5])
    tables = int(sys.argv[6]) if len(sys.argv) > 6 else 1
    kv = mx.kv.create("dist_sync")
    if opt == "adam":
        kv.set_optimizer(mx.optimizer.Adam(learning_rate=0.001, lazy_update=True))
    else:
        kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.01))
    rank, warm, sets = kv.rank, 3, 4
    key = 0
    for cols in cols_list:
        for frac in fracs:
            key += 1
            keys = table_keys(key, tables)
            shape = (rows, cols)
            for k in keys:
                # (a server refuses an init with no rows: every row, at zero)
                full = (np.zeros(shape, np.float32), np.arange(rows, dtype=np.int64))
                kv.init(k, mx.nd.sparse.row_sparse_array(full, shape=shape))
            grads, rids = [], []  # per set: every table's gradient and row ids
            for s in range(sets):
                data = np.random.default_rng(s).standard_normal
                ids = [ids_for(rows, frac, rank, s + sets * j) for j in range(tables)]
                grads.append(
                    [
                        mx.nd.sparse.row_sparse_array((data((i.size, cols), np.float32), i), shape)
                        for i in ids
                    ]
                )
                rids.append([mx.nd.array(i, dtype="int64") for i in ids])
            outs = [mx.nd.sparse.zeros("row_sparse", shape) for _ in keys]
            mx.nd.waitall()
            kv._barrier()
            times = []
            cpu = 0.0  # (this worker process's CPU time, all its threads, in timed rounds)
            for i in range(warm + rounds):
                g, r = grads[i % sets], rids[i % sets]
                t0, c0 = time.perf_counter(), time.process_time()
                if tables == 1:
                    kv.push(key, g[0])
                    kv.row_sparse_pull(key, out=outs[0], row_ids=r[0])
                else:  # (every table in one call, as a model's step)
                    kv.push(keys, g)
                    kv.row_sparse_pull(keys, out=outs, row_ids=r)
                for o in outs:
                    o.wait_to_read()
                if i >= warm:
                    times.append(time.perf_counter() - t0)
                    cpu += time.process_time() - c0
            kv._barrier()
            if rank == 0:
                print(f"RESULT {cols} {frac} " + ",".join(f"{t:.6f}" for t in times), flush=True)
                print(f"CPU {cols} {frac} {cpu / rounds:.6f}", flush=True)
                # (the tables whose rows the last round's pull brought, checked outside the
                # timing: each its ids)
                took = sum(
                    np.array_equal(o.indices.asnumpy(), i.asnumpy())
                    for o, i in zip(outs, r, strict=False)
                )
                print(f"TABLES {cols} {frac} {took}", flush=True)


if __name__ == "__main__":
    if ROLE == "worker":
        main()
    else:
        import mxnet  # noqa: F401  (runs the scheduler or server until the job ends)
