"""Embedding tables that live on the servers: ``nn.Embedding(sparse=True)`` and
``nn.EmbeddingBag(sparse=True)`` under :class:`~hetps.torch.optimizer.DistributedOptimizer`.

Each such module of the model becomes a row-sparse key (``{prefix}table:{module name}``,
:class:`~hetps.tables.rowsparse.Table`). A forward pre-hook pulls the rows of the batch
(``kv.row_sparse_pull`` of its distinct ids) into a small weight of those rows only and
renumbers the input to index it; after backward, :meth:`SparseTables.push` sends that weight's
sparse gradient as (ids, rows), and the servers update the rows touched (a lazy optimizer:
:mod:`hetps.tables.lazy`). The worker never holds the whole table: build the module on the
meta device (``nn.Embedding(n, d, sparse=True, device="meta")``) and its rows start from the
table's seeded initializer; a module with a real weight sends it as the table's first value
(rank 0's) and then lets it go.

One forward per step: the pushed gradient is the last forward's. Every step pushes every
table (with no rows when a module was not used), so a dist_sync round always completes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hetps import optim
from hetps.tables.rowsparse import Table

if TYPE_CHECKING:
    from hetps.kvstore import KVStore

__all__ = ["SparseTables", "sparse_modules", "table_optimizer", "table_weights"]


def table_weights(model: torch.nn.Module | None) -> set[int]:
    """``id()`` of the weights of ``model``'s sparse embedding modules (they are no dense keys)."""
    return {id(m.weight) for _, m in sparse_modules(model)} if model is not None else set()


def sparse_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The ``nn.Embedding``/``nn.EmbeddingBag`` modules of ``model`` built with ``sparse=True``."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse
    ]


class _Entry:
    def __init__(self, name: str, module: torch.nn.Module, key: str) -> None:
        self.name, self.module, self.key = name, module, key
        self.ids: torch.Tensor | None = None  # the batch's distinct ids (global, sorted)
        self.weight: torch.nn.Parameter | None = None  # their rows
        self.padding_idx = getattr(module, "padding_idx", None)


class SparseTables:
    """The server-held embedding tables of one model (see the module's text).

    Args:
        kv: the store (``dist_sync``, ``dist_async`` or ``local``).
        model: the model whose sparse embedding modules become tables.
        optimizer: each table's server optimizer (a :mod:`hetps.optim` one; None: the servers'
            optimizer set with ``kv.set_optimizer``).
        prefix: key prefix.
        scale, seed: a meta-device table's rows start uniform in ``[-scale, scale)`` from
            ``seed`` (each table gets seed + its index).
    """

    def __init__(
        self,
        kv: KVStore,
        model: torch.nn.Module | None,
        optimizer: Any = None,
        prefix: str = "",
        scale: float = 0.01,
        seed: int = 0,
    ) -> None:
        mods = sparse_modules(model) if model is not None else []
        if mods and not hasattr(kv, "row_sparse_pull"):
            raise TypeError(
                f"sparse embeddings need a hetps KVStore with row-sparse keys, got "
                f"{getattr(kv, 'type', type(kv).__name__)!r}"
            )
        self.kv = kv
        self.entries: list[_Entry] = []
        self.weights: set[int] = set()  # id() of the full weights replaced (not dense keys)
        keys, tables = [], []
        for i, (name, m) in enumerate(mods):
            if getattr(m, "max_norm", None) is not None:
                raise ValueError(
                    f"embedding {name!r}: max_norm renormalises rows in place during forward; "
                    "a server-held table cannot do that (drop max_norm)"
                )
            w = m.weight
            self.weights.add(id(w))
            value = None if w.is_meta else w.detach().cpu().numpy()
            dtype = str(w.dtype).replace("torch.", "")
            tables.append(
                Table(
                    m.num_embeddings,
                    m.embedding_dim,
                    dtype,
                    scale=0.0 if value is not None else scale,
                    seed=seed + i,
                    value=value if getattr(kv, "live_rank", 0) == 0 else None,
                    optimizer=optimizer,
                )
            )
            e = _Entry(name, m, f"{prefix}table:{name}")
            keys.append(e.key)
            self.entries.append(e)
            m.register_forward_pre_hook(self._pre_hook(e), with_kwargs=True)
            # let the full weight go (a meta one holds nothing): the rows of a batch replace it
            m.weight = torch.nn.Parameter(torch.empty(0, m.embedding_dim, dtype=w.dtype))
        if keys:
            kv.init(keys, tables)

    @classmethod
    def of(
        cls, dopt: Any, model: Any, sparse_optimizer: Any, table_init: tuple[float, int]
    ) -> SparseTables:
        """The tables of ``model`` for a DistributedOptimizer ``dopt`` (maybe none).
        With ``update_on="worker"`` and no ``sparse_optimizer``, the tables take the wrapped
        torch SGD's settings (:func:`table_optimizer`); with ``update_on="server"``, the
        servers' optimizer."""
        if model is None or not sparse_modules(model):
            return cls(dopt.kv, None)
        if sparse_optimizer is None and dopt.update_on == "worker":
            sparse_optimizer = table_optimizer(dopt.optimizer, dopt.kv, dopt.op)
        scale, seed = table_init
        return cls(dopt.kv, model, sparse_optimizer, dopt.prefix, scale, seed)

    def _pre_hook(self, e: _Entry):
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict):
            ids = args[0] if args else kwargs["input"]
            uniq, inv = torch.unique(ids.cpu(), sorted=True, return_inverse=True)
            rows = self.kv.row_sparse_pull(e.key, row_ids=uniq.numpy()).data
            dev = ids.device
            e.ids = uniq
            e.weight = torch.nn.Parameter(torch.from_numpy(rows).to(dev))
            module.weight = e.weight
            if e.padding_idx is not None:  # its place among the batch's rows, if it is there
                pos = int(torch.searchsorted(uniq, torch.tensor(e.padding_idx)))
                hit = pos < uniq.numel() and int(uniq[pos]) == e.padding_idx
                module.padding_idx = pos if hit else None
            local = inv.reshape(ids.shape).to(dev)
            if args:
                return (local, *args[1:]), kwargs
            return args, {**kwargs, "input": local}

        return hook

    def refuse_scaler(self) -> None:
        """An AMP GradScaler cannot serve these tables: raise saying why and what to do."""
        raise RuntimeError(
            "GradScaler with server-held embedding tables (model= with sparse embeddings): "
            "their rows' gradients go to the servers still scaled and are applied there at "
            "once. Train the tables without a GradScaler (bfloat16 autocast), or keep them dense"
        )

    def push(self) -> None:
        """Push every table's gradient of the last forward (an empty push where there is
        none), then forget the batch's rows."""
        keys, values = [], []
        for e in self.entries:
            g = e.weight.grad if e.weight is not None else None
            if g is None or e.ids is None:
                ids = np.zeros(0, np.int64)
                rows = np.zeros((0, e.module.embedding_dim), _np_dtype(e.module))
            else:
                if not g.is_sparse:
                    raise TypeError(f"embedding {e.name!r}: expected a sparse gradient")
                g = g.detach().cpu()
                local = g._indices().reshape(-1)
                ids = e.ids[local].numpy()
                rows = g._values().numpy()
            keys.append(e.key)
            values.append((ids, rows))
            e.weight, e.ids = None, None
        if keys:
            self.kv.push(keys, values)


def refuse_sparse(name: str, grad: torch.Tensor) -> None:
    """A dense key cannot take a sparse gradient: say how to make it a table."""
    if grad.is_sparse:
        raise TypeError(
            f"parameter {name!r} has a sparse gradient (nn.Embedding(sparse=True)): pass "
            "model=model to DistributedOptimizer, so its embedding tables are held by the "
            "servers (or make the embedding dense: sparse=False)"
        )


def _np_dtype(module: torch.nn.Module) -> np.dtype:
    return torch.empty(0, dtype=module.weight.dtype).numpy().dtype


def table_optimizer(optimizer: Any, kv: KVStore, op: str) -> optim.Optimizer:
    """The servers' lazy rule for the embedding tables when the dense parameters step on the
    workers: the wrapped ``torch.optim.SGD``'s (:func:`servers_sgd`), averaged over the
    workers with ``op="average"``. Other torch optimizers need an explicit
    ``sparse_optimizer``."""
    W = kv.num_workers if op == "average" else 1
    return servers_sgd(
        optimizer, "embedding tables are updated on the servers", "sparse_optimizer", 1 / W
    )


def servers_sgd(opt: Any, what: str, arg: str, rescale_grad: float = 1.0) -> optim.SGD:
    """The servers' SGD with the learning rate, momentum and weight decay of ``opt``, a
    ``torch.optim.SGD`` of one parameter group; anything else is refused, naming ``arg``
    (the argument that gives the servers' optimizer) as the fix after ``what``."""
    if not isinstance(opt, torch.optim.SGD) or len(opt.param_groups) != 1:
        raise ValueError(
            f"{what}: pass {arg}= (a hetps.optim optimizer) unless "
            "the torch optimizer is one torch.optim.SGD with one parameter group"
        )
    g = opt.param_groups[0]
    if g.get("nesterov") or g.get("dampening"):
        raise ValueError(f"{arg}: give one explicitly for nesterov or dampening")
    return optim.SGD(
        learning_rate=g["lr"],
        momentum=g["momentum"],
        wd=g["weight_decay"],
        rescale_grad=rescale_grad,
    )
