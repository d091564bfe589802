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

With ``--checkpoint-dir D`` it takes a checkpoint every ``--checkpoint-every`` steps and at
the end (the tables' rows and AdaGrad history on the servers, each worker's MLPs and Adam
state), and a job started again with the same ``D`` goes on from the last one, as if it had
not stopped. ``--stop-at N`` stops after step N (with its checkpoint), as a job interrupted
there would.
"""

from __future__ import annotations

import argparse
import hashlib
import time

import numpy as np
import torch
from torch import nn

import hetps.kv
from hetps import optim
from hetps.app.clicks import ClickData, auc
from hetps.kvstore import checkpoint
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
    p.add_argument("--checkpoint-dir", default=None, metavar="D")
    p.add_argument("--checkpoint-every", type=int, default=50, metavar="K", help="steps")
    p.add_argument("--stop-at", type=int, default=None, metavar="N", help="stop after step N")
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
    ck = checkpoint.latest(args.checkpoint_dir) if args.checkpoint_dir else None
    done = 0  # steps taken
    if ck is not None:  # go on from it: the servers' keys and tables, then this worker's part
        ck.restore(kv)
        state = ck.state(kv.rank)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n in state["dense"]:
                    p.copy_(state["dense"][n])
        opt.optimizer.load_state_dict(state["adam"])
        done = state["step"]
        if kv.rank == 0:
            print(f"going on from {ck.path} (after step {done})", flush=True)

    def save(step: int) -> None:
        dense = {n: p.detach().clone() for n, p in model.named_parameters() if n in names}
        state = {"step": step, "dense": dense, "adam": opt.optimizer.state_dict()}
        checkpoint.save(kv, args.checkpoint_dir, step, state=state)

    names = {n for n, _ in model.named_parameters() if not n.startswith("tables")}
    x_test, ids_test, y_test = data.batch(-1, 0, args.test_size)
    loss_fn = nn.BCEWithLogitsLoss()
    for epoch in range(args.epochs):
        t0, losses = time.perf_counter(), [float("nan")]
        for step in range(args.steps):
            g = epoch * args.steps + step
            if g < done:
                continue
            x, ids, y = data.batch(kv.rank, g, args.batch_size)
            opt.zero_grad()
            loss = loss_fn(model(torch.from_numpy(x), torch.from_numpy(ids)), torch.from_numpy(y))
            loss.backward()
            opt.step()
            losses.append(loss.item())
            last = g + 1 == args.epochs * args.steps or g + 1 == args.stop_at
            if args.checkpoint_dir and (last or (g + 1) % args.checkpoint_every == 0):
                save(g + 1)
            if g + 1 == args.stop_at:
                kv.barrier()
                kv.close()
                return
        if (epoch + 1) * args.steps <= done:
            continue  # (an epoch the checkpoint had done)
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
                f"epoch {epoch}: loss {np.nanmean(losses[-50:]):.4f}, test AUC "
                f"{auc(y_test, scores):.4f}, {(len(losses) - 1) * args.batch_size / secs:,.0f} "
                "samples/s per worker",
                flush=True,
            )
            if epoch + 1 == args.epochs:  # (equal digests: equal models, tables included)
                print(f"scores digest {hashlib.sha256(scores.tobytes()).hexdigest()}", flush=True)
        kv.barrier()
    kv.close()


if __name__ == "__main__":
    main()
