"""A Horovod PyTorch synthetic benchmark, as Horovod's ``pytorch_synthetic_benchmark.py`` is
written, run by hetps: the one changed line is the import (``import hetps.torch as hvd``).

    hetps launch -n 2 -s 1 -- python examples/horovod/pytorch_synthetic_benchmark.py

Adapted to run on the CPU without torchvision: a small ResNet (two residual stages) defined
here stands in for ``torchvision.models.resnet50``, with ``hvd.SyncBatchNorm`` as its norm
layer as in Horovod's script, on ``--image-size`` images (32 by default). It prints images per
second per worker, and the last loss.
"""

import argparse
import timeit

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

import hetps.torch as hvd  # was: import horovod.torch as hvd

parser = argparse.ArgumentParser(
    description="PyTorch Synthetic Benchmark",
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
)
parser.add_argument("--fp16-allreduce", action="store_true", default=False)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--image-size", type=int, default=32)
parser.add_argument("--num-warmup-batches", type=int, default=10)
parser.add_argument("--num-batches-per-iter", type=int, default=10)
parser.add_argument("--num-iters", type=int, default=10)
parser.add_argument("--use-adasum", action="store_true", default=False)
args = parser.parse_args()


class Block(nn.Module):
    def __init__(self, cin, cout, stride, norm_layer):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = norm_layer(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = norm_layer(cout)
        self.skip = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), norm_layer(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.skip(x))


class SmallResNet(nn.Module):
    def __init__(self, norm_layer, num_classes=1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), norm_layer(16), nn.ReLU())
        self.stages = nn.Sequential(Block(16, 16, 1, norm_layer), Block(16, 32, 2, norm_layer))
        self.fc = nn.Linear(32, num_classes)

    def forward(self, x):
        x = self.stages(self.stem(x))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


hvd.init()
torch.set_num_threads(1)
torch.manual_seed(0)

model = SmallResNet(norm_layer=hvd.SyncBatchNorm)
lr_scaler = 1 if args.use_adasum else hvd.size()
optimizer = optim.SGD(model.parameters(), lr=0.01 * lr_scaler)
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
optimizer = hvd.DistributedOptimizer(
    optimizer,
    named_parameters=model.named_parameters(),
    compression=compression,
    op=hvd.Adasum if args.use_adasum else hvd.Average,
)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

# fixed fake data (each worker its own)
torch.manual_seed(1 + hvd.rank())
data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
target = torch.LongTensor(args.batch_size).random_() % 1000
last_loss = [0.0]


def benchmark_step():
    optimizer.zero_grad()
    loss = F.cross_entropy(model(data), target)
    loss.backward()
    optimizer.step()
    last_loss[0] = loss.item()


def log(s):
    if hvd.rank() == 0:
        print(s, flush=True)


log(f"Model: SmallResNet, batch size: {args.batch_size}, CPUs: {hvd.size()}")
log("Running warmup...")
timeit.timeit(benchmark_step, number=args.num_warmup_batches)
log("Running benchmark...")
img_secs = []
for x in range(args.num_iters):
    t = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
    img_sec = args.batch_size * args.num_batches_per_iter / t
    log(f"Iter #{x}: {img_sec:.1f} img/sec per CPU")
    img_secs.append(img_sec)
mean, conf = np.mean(img_secs), 1.96 * np.std(img_secs)
log(f"Img/sec per CPU: {mean:.1f} +-{conf:.1f}")
log(f"Total img/sec on {hvd.size()} CPU(s): {hvd.size() * mean:.1f} +-{hvd.size() * conf:.1f}")
# the same weights everywhere: a checksum each worker prints
weights = sum(float(p.double().sum()) for p in model.state_dict().values())
print(f"rank {hvd.rank()} last loss {last_loss[0]:.6f} weights {weights:.10e}", flush=True)
