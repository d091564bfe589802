#!/usr/bin/env python
"""The MXNet 1.9.1 side of benchmarks/sparse_tables.py: one role of a ``dist_sync`` job (the
role from ``DMLC_ROLE``; a scheduler or server only imports mxnet, which runs it).

    DMLC_ROLE=worker ... mxpeer-venv/bin/python benchmarks/_sparse_mx.py ROWS COLS FRACS OPT ROUNDS

Each worker, for every table (``ROWS`` x each of ``COLS``, comma-separated) and every share
of rows (``FRACS``, comma-separated): a round is ``kv.push(key, grad)`` of a row-sparse
gradient of its ids, then ``kv.row_sparse_pull(key, out=rsp, row_ids=ids)``, waited for. The
ids (distinct, sorted, drawn per worker and round from a seeded generator, prepared before the
timing) and the rows are the ones the hetps side uses. Rank 0 prints ``RESULT cols frac
t1,t2,...`` (seconds per round after 3 warm-up rounds) and ``CPU cols frac s``: its process's
CPU seconds (all threads, MXNet's engine and ps-lite's included) per timed round.
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


def main():
    import mxnet as mx
    import numpy as np

    rows, cols_list = int(sys.argv[1]), [int(c) for c in sys.argv[2].split(",")]
    fracs, opt, rounds = [float(f) for f in sys.argv[3].split(",")], sys.argv[4], int(sys.argv[5])
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
            shape = (rows, cols)
            # (a server refuses an init with no rows: every row, at zero)
            full = (np.zeros(shape, np.float32), np.arange(rows, dtype=np.int64))
            kv.init(key, mx.nd.sparse.row_sparse_array(full, shape=shape))
            grads, rids = [], []
            for s in range(sets):
                ids = ids_for(rows, frac, rank, s)
                data = np.random.default_rng(s).standard_normal((ids.size, cols), np.float32)
                grads.append(mx.nd.sparse.row_sparse_array((data, ids), shape=shape))
                rids.append(mx.nd.array(ids, dtype="int64"))
            out = mx.nd.sparse.zeros("row_sparse", shape)
            mx.nd.waitall()
            kv._barrier()
            times = []
            cpu = 0.0  # (this worker process's CPU time, all its threads, in timed rounds)
            for i in range(warm + rounds):
                t0, c0 = time.perf_counter(), time.process_time()
                kv.push(key, grads[i % sets])
                kv.row_sparse_pull(key, out=out, row_ids=rids[i % sets])
                out.wait_to_read()
                if i >= warm:
                    times.append(time.perf_counter() - t0)
                    cpu += time.process_time() - c0
            kv._barrier()
            if rank == 0:
                print(f"RESULT {cols} {frac} " + ",".join(f"{t:.6f}" for t in times), flush=True)
                print(f"CPU {cols} {frac} {cpu / rounds:.6f}", flush=True)


if __name__ == "__main__":
    if ROLE == "worker":
        main()
    else:
        import mxnet  # noqa: F401  (runs the scheduler or server until the job ends)
