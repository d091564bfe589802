#!/usr/bin/env python
"""MXNet's side of linreg_vs_mxnet.py: MXNet's linear-regression example, run by MXNet's python.

The reference peer's ``../shared/peers/mxnet/linreg_mx.py`` with one addition, ``--num-samples``
(its default, 1e6, is the original's ``np.arange(1000, step=0.001)``), so that a quick run gives
both systems the same smaller data. Everything else is the original: f(x) = 5x + 2, the MLP
FC 256 -> 64 -> 1 (relu), LinearRegressionOutput, ``Module.fit`` with a ``dist_sync`` KVStore
(SGD on the servers), each worker on its own 1/num_workers shard, Speedometer lines
(``Epoch[e] Batch [a-b]\\tSpeed: N samples/sec``) every ``--frequent`` batches.

Every role runs this script (``import mxnet`` turns a scheduler or server process into its
ps-lite node, which exits when the job ends).
"""

import argparse
import logging
import os
import time

import mxnet as mx
import numpy as np

if os.environ.get("DMLC_ROLE", "worker") != "worker":
    raise SystemExit(0)  # not reached: import mxnet runs server/scheduler

ap = argparse.ArgumentParser()
ap.add_argument("--batch-size", type=int, default=16384)
ap.add_argument("--epochs", type=int, default=2)
ap.add_argument("--lr", type=float, default=1e-9)
ap.add_argument("--frequent", type=int, default=5, help="Speedometer period")
ap.add_argument("--kvstore", default="dist_sync")
ap.add_argument("--num-samples", type=int, default=1_000_000)
ap.add_argument("--no-shard", action="store_true")
args = ap.parse_args()

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
t_launch = float(os.environ.get("LAUNCH_T0", time.time()))

kv = mx.kv.create(args.kvstore)
logging.info(
    "kvstore %s rank %d/%d ready %.2fs after launch",
    kv.type,
    kv.rank,
    kv.num_workers,
    time.time() - t_launch,
)


def f(x):
    return 5 * x + 2


if args.num_samples == 1_000_000:
    X = np.arange(1000, step=0.001).astype(np.float32).reshape(-1, 1)  # the original
else:
    X = (np.arange(args.num_samples, dtype=np.float64) * 0.001).astype(np.float32).reshape(-1, 1)
Y = f(X).astype(np.float32).reshape(-1)
if not args.no_shard:
    X = X[kv.rank :: kv.num_workers]
    Y = Y[kv.rank :: kv.num_workers]
train_iter = mx.io.NDArrayIter(X, Y, args.batch_size, shuffle=True, label_name="lin_reg_label")

data = mx.sym.Variable("data")
label = mx.sym.Variable("lin_reg_label")
net = mx.sym.FullyConnected(data, name="fc1", num_hidden=256)
net = mx.sym.Activation(net, name="relu1", act_type="relu")
net = mx.sym.FullyConnected(net, name="fc2", num_hidden=64)
net = mx.sym.Activation(net, name="relu2", act_type="relu")
net = mx.sym.FullyConnected(net, name="fc3", num_hidden=1)
lro = mx.sym.LinearRegressionOutput(net, label=label, name="lro")

mod = mx.mod.Module(lro, data_names=["data"], label_names=["lin_reg_label"], context=mx.cpu())
t0 = time.time()
mod.fit(
    train_iter,
    num_epoch=args.epochs,
    kvstore=kv,
    optimizer="sgd",
    optimizer_params={"learning_rate": args.lr},
    eval_metric="mse",
    batch_end_callback=mx.callback.Speedometer(args.batch_size, args.frequent),
)
dt = time.time() - t0
n = X.shape[0] * args.epochs
logging.info(
    "rank %d: fit() %d samples in %.2fs = %.0f samples/s (this worker)",
    kv.rank,
    n,
    dt,
    n / dt,
)
