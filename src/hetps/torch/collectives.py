"""Horovod's and BytePS's tensor collectives, through the servers: ``allreduce``,
``allgather``, ``broadcast``, ``broadcast_object`` and BytePS's ``push_pull``.
(docs/MODULES.md, "hetps.torch.collectives")"""

from __future__ import annotations

import pickle
from typing import Any, Protocol

import torch

from hetps.kvstore.base import completed
from hetps.torch.broadcasting import KV_DTYPES, check_root, exchange, exchange_bytes
from hetps.torch.process import store_for

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "Sum",
    "allgather",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "broadcast",
    "broadcast_",
    "broadcast_object",
    "poll",
    "push_pull",
    "push_pull_async",
    "push_pull_inplace",
    "synchronize",
]

#: Horovod's reduction ops (``op=hvd.Average``); the strings ``DistributedOptimizer`` takes
Average = "average"
Sum = "sum"
Adasum = "adasum"  # refused with the reason: hetps's servers sum


class _NoneCompressor:
    """No compression: the tensor travels as it is."""

    wire_dtype = None

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The tensor to send, and what :meth:`decompress` needs."""
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """The received tensor, as the caller's."""
        return tensor


class _FP16Compressor:
    """Floating-point tensors travel, and are summed, as float16 (half the bytes)."""

    wire_dtype = torch.float16

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The tensor as float16 (a floating-point one), and its own dtype."""
        if tensor.dtype.is_floating_point:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """The received tensor in its own dtype again."""
        return tensor.to(ctx) if ctx is not None and tensor.dtype != ctx else tensor


class Compression:
    """Horovod's ``hvd.Compression``: ``none`` or ``fp16``."""

    none = _NoneCompressor
    fp16 = _FP16Compressor


_unnamed: dict[str, int] = {}  # kind -> unnamed calls so far in this process
_made: set[tuple[int, str]] = set()  # (id of the store, key) made already


def _name(kind: str, name: str | None) -> str:
    if name is not None:
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, not {type(name).__name__}")
        return name
    n = _unnamed.get(kind, 0)
    _unnamed[kind] = n + 1
    return f"noname.{n}"


class SumStore(Protocol):
    """What a collective uses of its store (and its ``hostagg``, when it has one)."""

    type: str

    def init(self, key: Any, value: Any) -> None: ...
    def push(self, key: Any, value: Any, *args: Any, **kw: Any) -> Any: ...
    def pull(self, key: Any, *args: Any, **kw: Any) -> Any: ...
    def pushpull(self, key: Any, value: Any, *args: Any, **kw: Any) -> Any: ...
    def barrier(self) -> None: ...


def _done(kv: SumStore, name: str | None, *keys: str) -> None:
    """An unnamed call's keys are used once (the next unnamed call has the next number):
    their host-local aggregation segments go (kept for a named call's, reused each time)."""
    hostagg = getattr(kv, "hostagg", None)
    if name is None and hostagg is not None:
        for key in keys:
            hostagg.release(key)


def _staged(tensor: torch.Tensor, what: str) -> torch.Tensor:
    """A flat CPU copy of ``tensor`` in a dtype the store carries."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} takes a torch.Tensor, not {type(tensor).__name__}")
    if tensor.is_complex() or tensor.is_sparse:
        raise TypeError(f"{what}: complex and sparse tensors are not supported")
    dtype = tensor.dtype if tensor.dtype in KV_DTYPES else torch.float64
    return tensor.detach().to("cpu", dtype).reshape(-1).clone()


def _summed(kv: SumStore, key: str, flat: torch.Tensor, out: torch.Tensor) -> Any:
    """Start the sum of ``flat`` over the workers into ``out``; the request (``wait()``).

    ``dist_sync``: one round of ``key``. ``dist_async`` (whose servers apply each push with
    their optimizer, which must sum these keys: :class:`hetps.optim.sums.SumKeys`): the key
    made zero again, every worker's push added, then read once all pushed."""
    if not str(getattr(kv, "type", "")).startswith("dist_async"):
        if (id(kv), key) not in _made:  # (made the first time: a collective)
            kv.init(key, torch.zeros_like(flat))
            _made.add((id(kv), key))
        return kv.pushpull(key, flat, out=out, block=False)
    kv.init(key, torch.zeros_like(flat))  # (returns on every worker once it is stored)
    kv.push(key, flat)
    kv.barrier()  # every push applied
    kv.pull(key, out=out)
    kv.barrier()  # every pull done before the key is made zero again
    return completed()


def _op(op: str | None, average: bool | None) -> str:
    if op is None:
        op = Average if average is None or average else Sum
    if op == Adasum:
        raise ValueError(
            "op=Adasum is Horovod's adaptive summation between workers; hetps's servers sum: "
            "use op=hvd.Average (the default) or op=hvd.Sum"
        )
    if op not in (Average, Sum):
        raise ValueError(f"op must be hvd.Average or hvd.Sum, not {op!r}")
    return op


class Handle:
    """A reduction in flight (:func:`allreduce_async`): its ``request``, and the ``finish``
    that makes its result of the answer, which :func:`synchronize` gives."""

    def __init__(self, kv: SumStore, request: Any, out: torch.Tensor, finish: Any) -> None:
        self._kv, self.request, self._out, self.finish = kv, request, out, finish
        self._result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        """Wait for the answer; the result (the same tensor on every later call)."""
        if self._result is None:
            self.request.wait()
            self._result = self.finish(self._out)
        return self._result


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: Any = Compression.none,
    op: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    kvstore: Any = None,
) -> Handle:
    """Start the sum (``op=Sum``) or mean (``op=Average``, the default) of ``tensor`` over
    the workers; :func:`synchronize` on the handle gives it, a new tensor like ``tensor``."""
    op = _op(op, average)
    kv = store_for(kvstore)
    given = name
    name = _name("allreduce", name)
    sent, ctx = compression.compress(tensor.detach() * prescale_factor)
    flat = _staged(sent, "allreduce")
    key = f"hvd.allreduce:{name}:{flat.dtype}:{flat.numel()}"
    out = torch.empty_like(flat)
    request = _summed(kv, key, flat, out)
    scale = postscale_factor / (kv.num_workers if op == Average else 1)
    like = tensor

    def finish(total: torch.Tensor) -> torch.Tensor:
        _done(kv, given, key)
        if scale != 1.0:
            total.mul_(scale)
        back = compression.decompress(total.view(sent.shape), ctx)
        return back.to(like.device, like.dtype if ctx is None else back.dtype)

    return Handle(kv, request, out, finish)


def synchronize(handle: Handle) -> torch.Tensor:
    """Wait for a collective started by :func:`allreduce_async`; its result."""
    return handle.wait()


def poll(handle: Handle) -> bool:
    """Whether the collective behind ``handle`` is done (its result may be read at once)."""
    request = handle.request
    done = getattr(request, "done", None)
    return bool(done() if callable(done) else done) if done is not None else False


def allreduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The sum (``op=Sum``) or mean (``op=Average``, the default) of ``tensor`` over the
    workers, a new tensor: Horovod's ``hvd.allreduce(tensor, name=...)``, e.g. to average a
    metric. Takes :func:`allreduce_async`'s arguments."""
    return allreduce_async(tensor, *args, **kwargs).wait()


def allreduce_(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """:func:`allreduce` into ``tensor`` itself; returns it."""
    with torch.no_grad():
        tensor.copy_(allreduce(tensor, *args, **kwargs))
    return tensor


def byteps_args(
    average: bool = True,
    name: str | None = None,
    version: int = 0,
    priority: int = 0,
    compression: Any = Compression.none,
    kvstore: Any = None,
) -> dict[str, Any]:
    """BytePS's arguments of a push_pull as :func:`allreduce_async` takes them (``version``
    and ``priority`` are accepted and not needed)."""
    return {"average": average, "name": name, "compression": compression, "kvstore": kvstore}


def push_pull_async(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Handle:
    """BytePS's ``push_pull_async``: the mean (or sum, ``average=False``) of ``tensor`` over
    the workers, written into ``tensor`` by :func:`synchronize` (:func:`byteps_args`)."""
    handle = allreduce_async(tensor, **byteps_args(*args, **kwargs))
    inner = handle.finish

    def into_tensor(total: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            tensor.copy_(inner(total))
        return tensor

    handle.finish = into_tensor
    return handle


def push_pull(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """BytePS's ``push_pull``: the mean (or sum, ``average=False``) of ``tensor`` over the
    workers, a new tensor (:func:`byteps_args`)."""
    return allreduce(tensor, **byteps_args(*args, **kwargs))


def push_pull_inplace(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """BytePS's ``push_pull_inplace``: :func:`push_pull` into ``tensor`` itself."""
    return push_pull_async(tensor, *args, **kwargs).wait()


def allgather(tensor: torch.Tensor, name: str | None = None, kvstore: Any = None) -> torch.Tensor:
    """Every worker's ``tensor`` concatenated along the first dimension, in rank order (the
    first dimension may differ between workers, the others may not)."""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
        raise ValueError("allgather takes a tensor of at least one dimension")
    kv = store_for(kvstore)
    given, name = name, _name("allgather", name)
    W, me = int(kv.num_workers), int(kv.rank)
    flat = _staged(tensor, "allgather")
    rows = torch.full((W,), -0.0, dtype=torch.float64)
    rows[me] = float(tensor.shape[0])
    row_numel = flat.numel() // max(1, tensor.shape[0])
    rest = "x".join(str(d) for d in tensor.shape[1:])
    key = f"hvd.allgather-rows:{name}:{W}:{rest}"
    _summed(kv, key, rows.clone(), rows).wait()
    _done(kv, given, key)
    counts = [int(n) for n in rows.tolist()]
    start = sum(counts[:me]) * row_numel
    total = torch.full((sum(counts) * row_numel,), -0.0, dtype=flat.dtype)
    total[start : start + flat.numel()] = flat
    key = f"hvd.allgather:{name}:{flat.dtype}:{total.numel()}"
    _summed(kv, key, total.clone(), total).wait()
    _done(kv, given, key)
    shape = (sum(counts), *tensor.shape[1:])
    return total.view(shape).to(tensor.device, tensor.dtype)


def broadcast(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, kvstore: Any = None
) -> torch.Tensor:
    """Worker ``root_rank``'s ``tensor``, on every worker (a new tensor), bit for bit."""
    kv = store_for(kvstore)
    root = check_root(kv, root_rank)
    given, name = name, _name("broadcast", name)
    flat = _staged(tensor, "broadcast")
    key = f"hvd.broadcast:{name}:{flat.dtype}:{flat.numel()}"
    exchange(kv, [key], [flat], root)
    _done(kv, given, key)  # (a segment only from a root other than 0: a sum)
    kv.barrier()  # every pull is done before the root may initialise the key again
    return flat.view(tensor.shape).to(tensor.device, tensor.dtype)


def broadcast_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, kvstore: Any = None
) -> torch.Tensor:
    """:func:`broadcast` into ``tensor`` itself; returns it."""
    with torch.no_grad():
        tensor.copy_(broadcast(tensor, root_rank, name, kvstore))
    return tensor


def broadcast_object(
    obj: Any = None, root_rank: int = 0, name: str | None = None, kvstore: Any = None
) -> Any:
    """Worker ``root_rank``'s ``obj`` (any picklable object: a dict of metrics, an epoch to
    resume from), on every worker. The root's pickle is unpickled by the others: the job's
    workers trust each other, as they do with every value they exchange."""
    import cloudpickle

    kv = store_for(kvstore)
    root = check_root(kv, root_rank)
    given, name = name, _name("broadcast_object", name)
    mine = int(kv.rank) == root
    keys = (f"hvd.object-bytes:{name}", f"hvd.object:{name}")
    blob = exchange_bytes(kv, keys, cloudpickle.dumps(obj) if mine else b"", root)
    _done(kv, given, *keys)
    kv.barrier()  # every pull is done before the root may initialise the keys again
    return obj if mine else pickle.loads(blob)
