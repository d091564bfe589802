"""``pytorch_mnist.py`` written with hetps's explicit API: the store made and passed by hand
(``hetps.kv.create``), its rank and size, the helpers given the store. It prints the same
losses as the Horovod-style script (the test runs both).

    hetps launch -n 2 -s 1 -- python examples/horovod/pytorch_mnist_explicit.py --epochs 2
"""

import argparse

import torch
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed
from fashion_mnist import FashionMNIST
from pytorch_mnist import Net

import hetps.kv
import hetps.torch as hps
from hetps.torch.optimizer import DistributedOptimizer

parser = argparse.ArgumentParser(description="PyTorch Fashion-MNIST, hetps's explicit API")
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--test-batch-size", type=int, default=1000)
parser.add_argument("--epochs", type=int, default=10)
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--momentum", type=float, default=0.5)
parser.add_argument("--seed", type=int, default=42)
parser.add_argument("--log-interval", type=int, default=10)
parser.add_argument("--data-dir", default=None)
parser.add_argument("--train-samples", type=int, default=None)
parser.add_argument("--test-samples", type=int, default=None)


def main(args):
    kv = hetps.kv.create("dist_sync")
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)

    train_set = FashionMNIST(args.data_dir, train=True, limit=args.train_samples)
    test_set = FashionMNIST(args.data_dir, train=False, limit=args.test_samples)
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_set, num_replicas=kv.num_workers, rank=kv.rank
    )
    train_loader = torch.utils.data.DataLoader(
        train_set, batch_size=args.batch_size, sampler=train_sampler
    )
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_set, num_replicas=kv.num_workers, rank=kv.rank
    )
    test_loader = torch.utils.data.DataLoader(
        test_set, batch_size=args.test_batch_size, sampler=test_sampler
    )

    model = Net()
    optimizer = optim.SGD(model.parameters(), lr=args.lr * kv.num_workers, momentum=args.momentum)
    hps.broadcast_parameters(model.state_dict(), kv, root_rank=0)
    hps.broadcast_optimizer_state(optimizer, kv, root_rank=0)
    optimizer = DistributedOptimizer(optimizer, model.named_parameters(), kvstore=kv)

    def metric_average(value, name):
        total = torch.tensor([float(value)])
        kv.init(f"metric:{name}", torch.zeros(1))  # (every worker, the same order)
        kv.pushpull(f"metric:{name}", total, out=total)  # the servers sum
        return total.item() / kv.num_workers

    for epoch in range(1, args.epochs + 1):
        model.train()
        train_sampler.set_epoch(epoch)
        for batch_idx, (data, target) in enumerate(train_loader):
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()
            if batch_idx % args.log_interval == 0:
                print(
                    f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_sampler)}]"
                    f"\tLoss: {loss.item():.6f}",
                    flush=True,
                )
        model.eval()
        test_loss, correct = 0.0, 0.0
        with torch.no_grad():
            for data, target in test_loader:
                output = model(data)
                test_loss += F.nll_loss(output, target, reduction="sum").item()
                correct += output.argmax(1).eq(target).float().sum().item()
        test_loss = metric_average(test_loss / len(test_sampler), "avg_loss")
        accuracy = metric_average(correct / len(test_sampler), "avg_accuracy")
        if kv.rank == 0:
            print(f"Test set: Average loss: {test_loss:.4f}, Accuracy: {100 * accuracy:.2f}%")


if __name__ == "__main__":
    main(parser.parse_args())
