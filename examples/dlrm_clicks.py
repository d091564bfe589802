"""A DLRM-style click model whose embedding tables live on the servers.

Click data shaped like Criteo's (13 dense features, ``--fields`` categorical ids per sample
drawn from a power law over ``--rows`` ids each, a click label from a hidden logistic model:
``hetps.app.clicks``), a bottom MLP for the dense features, one ``nn.EmbeddingBag`` table
per field built on the meta device (``sparse=True``: the worker never holds a table, only the
rows of its batch), their pairwise dot products (DLRM's interaction) and a top MLP. The
``DistributedOptimizer`` pulls each batch's rows before forward and pushes their sparse
gradients after backward; the servers sum them per row over the workers and update only the
rows touched (lazy AdaGrad); the MLPs' gradients are averaged as dense keys and stepped by
each worker's torch optimizer. Rank 0 prints the held-out AUC after each epoch.

    hetps launch -n 2 -s 2 -- python examples/dlrm_clicks.py
    hetps launch -n 2 -s 2 -- python examples/dlrm_clicks.py --rows 1000000 --fields 26
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from torch import nn

import hetps.kv
from hetps import optim
from hetps.app.clicks import ClickData, auc
from hetps.torch import DistributedOptimizer


class DLRM(nn.Module):
    def __init__(self, rows: int, fields: int, dense: int, dim: int) -> None:
        super().__init__()
        self.tables = nn.ModuleList(
            nn.EmbeddingBag(rows, dim, mode="sum", sparse=True, device="meta")
            for _ in range(fields)
        )
        self.bottom = nn.Sequential(nn.Linear(dense, 64), nn.ReLU(), nn.Linear(64, dim), nn.ReLU())
        pairs = (fields + 1) * fields // 2
        self.top = nn.Sequential(nn.Linear(dim + pairs, 64), nn.ReLU(), nn.Linear(64, 1))
        self.iu = torch.triu_indices(fields + 1, fields + 1, offset=1)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        d = self.bottom(x)
        embs = [t(ids[:, f : f + 1]) for f, t in enumerate(self.tables)]
        z = torch.stack([d, *embs], 1)  # batch x (fields + 1) x dim
        inter = torch.bmm(z, z.transpose(1, 2))[:, self.iu[0], self.iu[1]]
        return self.top(torch.cat([d, inter], 1)).squeeze(1)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rows", type=int, default=100_000, help="ids per field (table rows)")
    p.add_argument("--fields", type=int, default=8)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--steps", type=int, default=150, help="steps per epoch per worker")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.05, help="the tables' AdaGrad rate")
    p.add_argument("--test-size", type=int, default=20_000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    kv = hetps.kv.create("dist_sync")
    torch.manual_seed(args.seed)
    data = ClickData(rows=args.rows, fields=args.fields, seed=args.seed)
    model = DLRM(args.rows, args.fields, data.dense, args.dim)
    dense_params = [p for n, p in model.named_parameters() if not n.startswith("tables")]
    opt = DistributedOptimizer(
        torch.optim.Adam(dense_params, lr=1e-3),
        model.named_parameters(),
        kvstore=kv,
        model=model,
        sparse_optimizer=optim.AdaGrad(learning_rate=args.lr, rescale_grad=1 / kv.num_workers),
        table_init=(0.01, args.seed),
    )
    x_test, ids_test, y_test = data.batch(-1, 0, args.test_size)
    loss_fn = nn.BCEWithLogitsLoss()
    for epoch in range(args.epochs):
        t0, losses = time.perf_counter(), []
        for step in range(args.steps):
            x, ids, y = data.batch(kv.rank, epoch * args.steps + step, args.batch_size)
            opt.zero_grad()
            loss = loss_fn(model(torch.from_numpy(x), torch.from_numpy(ids)), torch.from_numpy(y))
            loss.backward()
            opt.step()
            losses.append(loss.item())
        secs = time.perf_counter() - t0
        if kv.rank == 0:
            with torch.no_grad():  # held-out AUC (these pulls push nothing: no backward)
                scores = torch.cat(
                    [
                        model(
                            torch.from_numpy(x_test[a : a + 4096]),
                            torch.from_numpy(ids_test[a : a + 4096]),
                        )
                        for a in range(0, args.test_size, 4096)
                    ]
                ).numpy()
            print(
                f"epoch {epoch}: loss {np.mean(losses[-50:]):.4f}, test AUC "
                f"{auc(y_test, scores):.4f}, {args.steps * args.batch_size / secs:,.0f} "
                "samples/s per worker",
                flush=True,
            )
        kv.barrier()
    kv.close()


if __name__ == "__main__":
    main()
