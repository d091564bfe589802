"""Start every worker from the same place: broadcast parameters and optimizer state.

Both are collectives: every worker calls them, in the same order, with the same names; they
return once every worker has the root's values, bit for bit (the last step is a barrier, so
the keys can be broadcast again). ``kv.init`` stores rank 0's values and every worker pulls
them; from another root the workers sum into the key (the others add negative zeros), so
``root_rank != 0`` needs a ``dist_sync`` store without gradient compression whose servers
have no optimizer set (one would apply the sum as a gradient)."""

from __future__ import annotations

import io
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from hetps.kvstore import KVStore

__all__ = ["broadcast_optimizer_state", "broadcast_parameters"]

#: dtypes the KVStore carries as they are; others travel as float64 (exact for bfloat16,
#: bool and integers below 2**53) and are cast back
KV_DTYPES = (torch.float16, torch.float32, torch.float64)


def check_root(kv: KVStore, root_rank: int) -> int:
    workers = int(getattr(kv, "num_workers", 1))
    if isinstance(root_rank, bool) or not isinstance(root_rank, int):
        raise TypeError(f"root_rank must be an int, got {root_rank!r}")
    if not 0 <= root_rank < workers:
        raise ValueError(f"root_rank {root_rank} is not a worker rank (0..{workers - 1})")
    if root_rank != 0 and not str(getattr(kv, "type", "")).startswith("dist_sync"):
        raise ValueError(
            f"broadcast from root_rank {root_rank} needs a dist_sync KVStore (the workers sum "
            f"into the key); this one is {getattr(kv, 'type', type(kv).__name__)!r}: "
            "broadcast from rank 0 instead"
        )
    if root_rank != 0 and getattr(kv, "compressor", None) is not None:
        raise ValueError(
            f"broadcast from root_rank {root_rank} sums pushes, which gradient compression "
            "would round: broadcast from rank 0 instead"
        )
    return root_rank


def exchange(kv: KVStore, keys: list[str], tensors: list[torch.Tensor], root_rank: int = 0) -> None:
    """Overwrite CPU ``tensors`` (float16/32/64, contiguous) with ``root_rank``'s values, on
    every worker; the keys are (re)initialised. The transport under the helpers below and
    under ``DistributedOptimizer``'s and ESync's start (rank 0's weights for everyone)."""
    kv.init(keys, tensors)  # rank 0's values are stored
    if root_rank == 0:
        kv.pull(keys, out=tensors)
        return
    # the sum over the workers of the root's values and -0.0 elsewhere is the root's values
    # exactly (x + -0.0 == x for every x, +0.0 and -0.0 included)
    mine = kv.rank == root_rank
    values = tensors if mine else [torch.full_like(t, -0.0) for t in tensors]
    kv.pushpull(keys, values, out=tensors)


def _store(kv: KVStore | int | None, root_rank: int) -> tuple[KVStore, int]:
    """Horovod's form (no store: the process's; ``root_rank`` maybe second) or hetps's."""
    if kv is None or (isinstance(kv, int) and not isinstance(kv, bool)):
        from hetps.torch.process import store_for

        return store_for(None), (root_rank if kv is None else kv)
    return kv, root_rank


def _named(params: Any) -> list[tuple[str, torch.Tensor]]:
    if isinstance(params, Mapping):
        items = sorted(params.items())  # a state_dict: by name, as Horovod does
    elif isinstance(params, Iterable):
        items = list(params)
    else:
        raise TypeError(
            "params must be a state_dict or (name, tensor) pairs such as "
            f"model.named_parameters(), got {type(params).__name__}"
        )
    seen: set[str] = set()
    for item in items:
        if not (
            isinstance(item, tuple)
            and len(item) == 2
            and isinstance(item[0], str)
            and isinstance(item[1], torch.Tensor)
        ):
            raise TypeError(
                "params must be a state_dict or (name, tensor) pairs such as "
                f"model.named_parameters(); got an item {item!r:.80}"
            )
        if item[0] in seen:
            raise ValueError(f"params has the name {item[0]!r} twice")
        seen.add(item[0])
    return items


def broadcast_parameters(
    params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    kv: KVStore | int | None = None,
    root_rank: int = 0,
    prefix: str = "",
) -> None:
    """Give every worker ``root_rank``'s values of ``params``, in place.

    ``params`` is a ``model.state_dict()`` (parameters and buffers) or ``(name, tensor)``
    pairs such as ``model.named_parameters()``; tensors may live on any device and have any
    real dtype. Keys are ``f"{prefix}bcast:{name}"``; ``kv`` left out: the process's store."""
    kv, root_rank = _store(kv, root_rank)
    named = _named(params)
    root = check_root(kv, root_rank)
    if int(getattr(kv, "num_workers", 1)) == 1 or not named:
        return
    staged: list[torch.Tensor] = []
    for name, t in named:
        if t.is_complex():
            raise TypeError(f"parameter {name!r}: complex tensors are not supported")
        src = t.detach()
        dtype = src.dtype if src.dtype in KV_DTYPES else torch.float64
        direct = src.device.type == "cpu" and dtype == src.dtype and src.is_contiguous()
        staged.append(src if direct else src.to("cpu", dtype).contiguous())
    exchange(kv, [f"{prefix}bcast:{n}" for n, _ in named], staged, root)
    with torch.no_grad():
        for (_, t), s in zip(named, staged, strict=True):
            if s.data_ptr() != t.data_ptr():
                t.copy_(s)  # back to its device and dtype
    kv.barrier()  # every pull is done before anyone may re-initialise these keys


def exchange_bytes(kv: KVStore, keys: tuple[str, str], blob: bytes, root: int) -> bytes:
    """Worker ``root``'s ``blob`` on every worker (the others' is not read), through
    ``keys``: its length, then its bytes as float32 values, three bytes each (integers below
    2**24: exact, and a sum with zeros leaves them as they are)."""
    mine = kv.rank == root
    size = torch.tensor([float(len(blob))], dtype=torch.float64)
    exchange(kv, [keys[0]], [size], root)
    if mine:
        raw = np.frombuffer(blob + b"\0" * (-len(blob) % 3), dtype=np.uint8).reshape(-1, 3)
        u = raw.astype(np.uint32)
        data = torch.from_numpy((u[:, 0] | (u[:, 1] << 8) | (u[:, 2] << 16)).astype(np.float32))
    else:
        data = torch.zeros(-(-int(size.item()) // 3), dtype=torch.float32)
    exchange(kv, [keys[1]], [data], root)
    if mine:
        return blob
    u = data.numpy().astype(np.uint32)
    raw = np.stack([u & 0xFF, (u >> 8) & 0xFF, u >> 16], axis=1).astype(np.uint8)
    return raw.tobytes()[: int(size.item())]


def broadcast_optimizer_state(
    optimizer: Any, kv: KVStore | int | None = None, root_rank: int = 0, prefix: str = ""
) -> None:
    """Give every worker ``root_rank``'s optimizer state: its ``state_dict()`` (per-parameter
    state such as momentum buffers and Adam's moments, and the hyperparameters of every
    parameter group, e.g. the learning rate), loaded with ``load_state_dict``.

    ``optimizer`` is a ``torch.optim.Optimizer`` or a :class:`DistributedOptimizer` (its
    wrapped optimizer; with ``update_on="server"`` the state lives on the servers and there
    is nothing to do). Workers whose optimizer has no state yet (before its first step) get
    the root's. Keys are ``f"{prefix}bcast-optim:..."``; ``kv`` left out: the process's store."""
    kv, root_rank = _store(kv, root_rank)
    opt = optimizer if isinstance(optimizer, torch.optim.Optimizer) else optimizer.optimizer
    root = check_root(kv, root_rank)
    if opt is None or int(getattr(kv, "num_workers", 1)) == 1:
        return
    mine = kv.rank == root
    buf = io.BytesIO()
    if mine:
        torch.save(opt.state_dict(), buf)
    keys = (f"{prefix}bcast-optim:bytes", f"{prefix}bcast-optim:data")
    blob = exchange_bytes(kv, keys, buf.getvalue(), root)
    if not mine:
        opt.load_state_dict(torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True))
    kv.barrier()  # every pull is done before anyone may re-initialise these keys
