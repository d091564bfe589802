#!/usr/bin/env python
"""MXNet's side of train_overhead.py: the same model's step on MXNet 1.9.1, alone and with a
``dist_sync`` parameter server (1 worker, 1 server), run by MXNet's python.

    python _overhead_mx.py --model mlp|lenet --batch-size 64 --rounds N --kvstore none|dist_sync

The models are hetps's ``mlp`` (784-256-256-10, ReLU) and ``lenet`` (conv 6@5x5 pad 2, ReLU,
max-pool 2, conv 16@5x5, ReLU, max-pool 2, 120-84-10 with ReLU), written as MXNet symbols with
the same parameter counts (printed, and checked against ``--expect-params`` when given). The
data is Fashion-MNIST's training images from Debian's ``dataset-fashion-mnist`` (the first
``--train-limit``), normalised as hetps does; labels as given. ``Module.fit`` trains with plain
SGD: ``--kvstore none`` updates on the worker (no KVStore), ``dist_sync`` on the server, as
MXNet's own examples do. A step's time is the interval between consecutive
``batch_end_callback`` calls (the whole iteration as ``fit`` runs it); the line
``STEP-MEDIAN s`` gives the median after ``--warmup`` steps.

Under ``DMLC_ROLE=scheduler`` or ``server`` the ``import mxnet`` below runs that ps-lite node and
exits the process when the job ends.
"""

import argparse
import gzip
import os
import statistics
import time

import mxnet as mx
import numpy as np

if os.environ.get("DMLC_ROLE", "worker") != "worker":
    raise SystemExit(0)  # not reached: import mxnet runs server/scheduler

DATA = "/usr/share/datasets/fashion-mnist"  # hetps.app.data's default
MEAN, STD = 0.2860, 0.3530  # hetps.app.data's normalisation


def load(data_dir: str, limit: int):
    with gzip.open(os.path.join(data_dir, "train-images-idx3-ubyte.gz")) as f:
        images = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 1, 28, 28)
    with gzip.open(os.path.join(data_dir, "train-labels-idx1-ubyte.gz")) as f:
        labels = np.frombuffer(f.read(), np.uint8, offset=8)
    x = ((images[:limit].astype(np.float32) / 255.0) - MEAN) / STD
    return x, labels[:limit].astype(np.float32)


def model(name: str):
    data = mx.sym.Variable("data")
    if name == "mlp":
        net = mx.sym.Flatten(data)
        net = mx.sym.FullyConnected(net, num_hidden=256, name="fc1")
        net = mx.sym.Activation(net, act_type="relu")
        net = mx.sym.FullyConnected(net, num_hidden=256, name="fc2")
        net = mx.sym.Activation(net, act_type="relu")
        net = mx.sym.FullyConnected(net, num_hidden=10, name="fc3")
    elif name == "lenet":
        net = mx.sym.Convolution(data, kernel=(5, 5), pad=(2, 2), num_filter=6, name="c1")
        net = mx.sym.Activation(net, act_type="relu")
        net = mx.sym.Pooling(net, kernel=(2, 2), stride=(2, 2), pool_type="max")
        net = mx.sym.Convolution(net, kernel=(5, 5), num_filter=16, name="c2")
        net = mx.sym.Activation(net, act_type="relu")
        net = mx.sym.Pooling(net, kernel=(2, 2), stride=(2, 2), pool_type="max")
        net = mx.sym.Flatten(net)
        net = mx.sym.FullyConnected(net, num_hidden=120, name="fc1")
        net = mx.sym.Activation(net, act_type="relu")
        net = mx.sym.FullyConnected(net, num_hidden=84, name="fc2")
        net = mx.sym.Activation(net, act_type="relu")
        net = mx.sym.FullyConnected(net, num_hidden=10, name="fc3")
    else:
        raise SystemExit(f"unknown model {name!r}: mlp or lenet")
    return mx.sym.SoftmaxOutput(net, name="softmax")


class Done(Exception):
    """Raised by the batch callback after ``--rounds`` steps: ends ``fit()`` there. With one
    worker (what train_overhead.py runs) nothing waits for a round this worker leaves
    unfinished; the store's shutdown at exit ends the scheduler and the server."""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=240)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--train-limit", type=int, default=8192)
    ap.add_argument("--data-dir", default=DATA)
    ap.add_argument("--kvstore", default="none", help="none (no KVStore) or dist_sync")
    ap.add_argument("--expect-params", type=int, default=0)
    args = ap.parse_args()

    x, y = load(args.data_dir, args.train_limit)  # before joining: a missing file fails alone
    kv = None if args.kvstore == "none" else mx.kv.create(args.kvstore)
    it = mx.io.NDArrayIter(x, y, args.batch_size, shuffle=True, last_batch_handle="discard")
    mod = mx.mod.Module(model(args.model), context=mx.cpu())
    stamps = []

    def on_batch(_param) -> None:
        stamps.append(time.perf_counter())
        if len(stamps) > args.rounds:
            raise Done

    epochs = -(-args.rounds * args.batch_size // len(x)) + 1
    try:
        mod.fit(
            it,
            num_epoch=epochs,
            kvstore=kv,
            optimizer="sgd",
            optimizer_params={"learning_rate": args.lr, "rescale_grad": 1.0 / args.batch_size},
            initializer=mx.init.Xavier(),
            batch_end_callback=on_batch,
            eval_metric="acc",
        )
    except Done:
        pass
    arg_params, _ = mod.get_params()
    n_params = sum(int(np.prod(v.shape)) for v in arg_params.values())
    if args.expect_params and n_params != args.expect_params:
        raise SystemExit(f"{args.model}: {n_params} parameters, hetps's has {args.expect_params}")
    steps = [stamps[i + 1] - stamps[i] for i in range(len(stamps) - 1)][args.warmup :]
    print(f"PARAMS {n_params}", flush=True)
    print(f"STEP-MEDIAN {statistics.median(steps):.9f} ({len(steps)} steps)", flush=True)


if __name__ == "__main__":
    main()
