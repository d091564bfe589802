"""MXNet's classic distributed example in PyTorch on the hetps KVStore.

Learns f(x) = 5x + 2 with an MLP (FC 256 -> 64 -> 1) in ``dist_sync`` mode: every worker
computes gradients on its own shard, pushes them, the servers sum them and apply SGD, and every
worker pulls the new weights. It prints samples/sec per worker like MXNet's Speedometer, logs every batch's phases (compute,
push, wait, pull) and link bytes into ``runs/linreg-<time>/`` (docs/METRICS.md), and at the end
rank 0 writes the run's trace (``trace.json``: open it in https://ui.perfetto.dev) and a
timeline figure (``timeline.png``) and prints where they are. ``--log-dir none``: no logs.

    hetps launch -n 2 -s 1 -- python examples/linear_regression.py
    # or MXNet style, one command per role:
    DMLC_ROLE=scheduler ... python examples/linear_regression.py   (and server, worker)
    # MXNet's own linear regression example's data, batch size and optimizer
    # (X = arange(1000, step=0.001), batch 16384, plain SGD at 1e-9):
    hetps launch -n 2 -s 1 -- python examples/linear_regression.py --data arange \
        --num-samples 1000000 --batch-size 16384 --lr 1e-9 --momentum 0 --epochs 1
"""

from __future__ import annotations

import argparse
import contextlib
import time

import numpy as np
import torch
from torch import nn

import hetps.kv
from hetps import optim
from hetps.metrics.roundlog import RoundLog, pictures


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--kv-store", default="dist_sync")
    p.add_argument("--num-samples", type=int, default=10000)
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument(
        "--data",
        choices=["uniform", "arange"],
        default="uniform",
        help="x uniform in [-1, 1), or MXNet's example's x = 0.001 * i (i < num-samples)",
    )
    p.add_argument("--lr", type=float, default=0.005)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--frequent", type=int, default=20, help="print speed every N batches")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--log-dir",
        default="runs",
        help="write the run's logs, trace and timeline under DIR/linreg-<time>/ ('none': off)",
    )
    args = p.parse_args()

    kv = hetps.kv.create(args.kv_store)  # under DMLC_ROLE=server/scheduler this serves and exits
    rank, nworker = kv.rank, kv.num_workers

    rng = np.random.default_rng(args.seed)
    if args.data == "arange":
        x = (np.arange(args.num_samples, dtype=np.float64) * 0.001).astype(np.float32)[:, None]
    else:
        x = rng.uniform(-1, 1, size=(args.num_samples, 1)).astype(np.float32)
    y = 5 * x + 2
    shard = np.arange(args.num_samples)[rank::nworker]  # this worker's part of the data

    torch.manual_seed(args.seed)
    model = nn.Sequential(
        nn.Linear(1, 256), nn.ReLU(), nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 1)
    )
    params = list(model.parameters())
    keys = list(range(len(params)))
    for i, prm in enumerate(params):
        kv.init(i, prm.data)  # rank 0's initial weights win
    for i, prm in enumerate(params):
        kv.pull(i, out=prm.data)
    # Gradients are sums over a worker's batch; the servers sum over workers.
    kv.set_optimizer(
        optim.SGD(
            learning_rate=args.lr,
            momentum=args.momentum,
            rescale_grad=1.0 / (args.batch_size * nworker),
        )
    )

    log = None
    if args.log_dir.lower() not in ("", "none"):
        # one record per batch: when each phase ran, and the bytes on each link
        log = RoundLog(
            kv,
            args.log_dir,
            "linreg",
            mode="async" if "async" in args.kv_store else "sync",
            network="mlp-linreg",
            batch_size=args.batch_size,
        )
    phase = log.phase if log else _untimed
    pull = log.pull if log else _untimed

    loss_fn = nn.MSELoss(reduction="sum")
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    for epoch in range(args.epochs):
        order = rng.permutation(shard)
        tic, seen, mse_sum, count = time.time(), 0, 0.0, 0
        nbatch = len(order) // args.batch_size
        for b in range(nbatch):
            idx = torch.from_numpy(order[b * args.batch_size : (b + 1) * args.batch_size])
            with phase("compute"):
                model.zero_grad()
                loss = loss_fn(model(xt[idx]), yt[idx])
                loss.backward()
            # every key in one call: one message to each server and one back (a per-key loop
            # works too, with a message per key)
            with phase("push"):
                kv.push(keys, [prm.grad for prm in params])
            with pull():  # waits for every worker's push; then the new weights are copied in
                kv.pull(keys, out=[prm.data for prm in params])
            if log:
                log.end_round(
                    samples=args.batch_size, loss=loss.item() / args.batch_size, epoch=epoch
                )
            seen += args.batch_size
            mse_sum += loss.item()
            count += args.batch_size
            if (b + 1) % args.frequent == 0 or b + 1 == nbatch:
                speed = seen / max(time.time() - tic, 1e-9)
                print(
                    f"Worker[{rank}] Epoch[{epoch}] Batch [{b + 1}]\tSpeed: {speed:.2f} samples/sec"
                    f"\tmse={mse_sum / count:.6f}",
                    flush=True,
                )
                tic, seen = time.time(), 0
        with torch.no_grad():  # in slices: 1e6 samples at once would take GBs of activations
            sq = sum(
                float(((model(xt[i : i + 65536]) - yt[i : i + 65536]) ** 2).double().sum())
                for i in range(0, len(xt), 65536)
            )
            full = sq / len(xt)
        print(f"Worker[{rank}] Epoch[{epoch}] Train-mse={full:.6f}", flush=True)
    if log:
        log.close()
    kv.barrier()  # after it, every worker's log is complete
    print(f"Worker[{rank}] done", flush=True)
    if log and rank == 0:
        pictures(log.run_dir)  # prints "trace: ..." and "figure: ..."


@contextlib.contextmanager
def _untimed(*_):
    yield


if __name__ == "__main__":
    main()
