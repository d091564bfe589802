"""Run element-wise array arithmetic in place, in cache-sized chunks, on several threads.
(docs/MODULES.md, "hetps.optim.kernels")"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

__all__ = [
    "CHUNK",
    "MAX_DEFAULT_THREADS",
    "MIN_PARALLEL",
    "add_into",
    "run",
    "set_threads",
    "sum_into",
    "threads",
]

#: Elements per chunk: 32 Ki float32 values (128 KiB) per array, so the arrays of one chunk and
#: their scratch buffers fit a core's L2 cache.
CHUNK = 1 << 15
#: Below this many elements an update runs on the calling thread alone (handing chunks to
#: other threads costs more than it saves).
MIN_PARALLEL = 8 * CHUNK

#: Chain of operations on one chunk: ``body(views, scratch)`` where ``views`` are the chunk's
#: slices of the arrays given to :func:`run` (None stays None) and ``scratch`` are buffers of
#: the same length, for intermediate results.
Body = Callable[[list, list], None]

_lock = threading.Lock()
_threads = 0  # 0: not chosen yet (see threads())
_pool: ThreadPoolExecutor | None = None
_pool_pid = 0  # the process that started the pool's threads (a forked child has none)
_local = threading.local()
#: the default number of threads at most: element-wise passes are bound by memory bandwidth,
#: which a few cores already use up (and several servers may share one machine)
MAX_DEFAULT_THREADS = 4


def _default_threads() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_DEFAULT_THREADS))


def threads() -> int:
    """How many threads :func:`run` uses for a big array (the caller's own included): the
    last :func:`set_threads`, else the cores this process may run on, at most
    :data:`MAX_DEFAULT_THREADS`."""
    global _threads
    if _threads == 0:
        _threads = _default_threads()
    return _threads


def set_threads(n: int | None) -> int:
    """Use ``n`` threads (the caller's own included) from now on; 0 or None: the default
    (see :func:`threads`). Returns the number in use.

    Raises:
        ValueError: ``n`` is negative or not an integer.
    """
    global _threads, _pool
    if n is None:
        n = 0
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"the number of threads must be an integer >= 0, got {n!r}")
    with _lock:
        old_pool = _pool
        _threads = int(n) or _default_threads()
        _pool = None
    if old_pool is not None:
        old_pool.shutdown(wait=False)
    return _threads


def _executor() -> ThreadPoolExecutor:
    global _pool, _pool_pid
    with _lock:
        if _pool is None or _pool_pid != os.getpid():  # (after a fork: a pool of our own)
            _pool = ThreadPoolExecutor(
                max_workers=max(1, threads() - 1), thread_name_prefix="hetps-kernel"
            )
            _pool_pid = os.getpid()
        return _pool


def _scratch(count: int, dtype: np.dtype) -> list[np.ndarray]:
    """``count`` chunk-sized buffers of ``dtype`` owned by the calling thread (reused)."""
    cache = getattr(_local, "buffers", None)
    if cache is None:
        cache = _local.buffers = {}
    bufs = cache.get(dtype)
    if bufs is None or len(bufs) < count:
        bufs = cache[dtype] = [np.empty(CHUNK, dtype) for _ in range(count)]
    return bufs[:count]


def _span(
    body: Body,
    flat: Sequence[np.ndarray | None],
    lo: int,
    hi: int,
    nscratch: int,
    dtype,
    offset: bool = False,
) -> None:
    """Run ``body`` on the chunks of ``[lo, hi)``, on the calling thread."""
    scratch = _scratch(nscratch, dtype)
    for start in range(lo, hi, CHUNK):
        stop = min(start + CHUNK, hi)
        m = stop - start
        views = [None if a is None else a[start:stop] for a in flat]
        if offset:
            body(views, [s[:m] for s in scratch], start)
        else:
            body(views, [s[:m] for s in scratch])


def run(
    body: Body,
    arrays: Sequence[np.ndarray | None],
    *,
    scratch: int = 0,
    dtype: np.dtype | type = np.float32,
    parallel: bool = True,
    offset: bool = False,
) -> None:
    """Run ``body`` over ``arrays`` (all of one size; None entries stay None) chunk by chunk.

    Each chunk gets ``scratch`` buffers of ``dtype`` of its length. When every array is
    C-contiguous the chunks are flat slices, shared out in ``threads()`` contiguous spans
    (the caller's thread runs the first); otherwise (a strided view) ``body`` runs once on the
    arrays as they are, with whole-array scratch buffers, which is slower but the same
    arithmetic. With ``offset``, ``body`` gets a third argument: the index of the chunk's
    first element (0 for the whole-array call). An exception in any span is raised here,
    after every span has ended.
    """
    present = [a for a in arrays if a is not None]
    if not present:
        return
    size = present[0].size
    for a in present:
        if a.size != size:
            raise ValueError(f"arrays of {size} and {a.size} elements cannot run together")
    dtype = np.dtype(dtype)
    if size <= CHUNK:  # one chunk: the arrays as they are (any layout), no slicing
        shape = present[0].shape
        whole = [b[:size].reshape(shape) for b in _scratch(scratch, dtype)]
        body(list(arrays), whole, 0) if offset else body(list(arrays), whole)
        return
    if not all(a.flags.c_contiguous for a in present):
        shape = present[0].shape
        whole = [np.empty(shape, dtype) for _ in range(scratch)]
        body(list(arrays), whole, 0) if offset else body(list(arrays), whole)
        return
    flat = [None if a is None else a.reshape(-1) for a in arrays]
    n_threads = threads() if parallel and size >= MIN_PARALLEL else 1
    if n_threads == 1:
        _span(body, flat, 0, size, scratch, dtype, offset)
        return
    # spans of whole chunks, as even as chunks allow
    chunks = -(-size // CHUNK)
    bounds = [min(size, (chunks * i // n_threads) * CHUNK) for i in range(n_threads + 1)]
    pool = _executor()
    futures: list[Future] = [
        pool.submit(_span, body, flat, bounds[i], bounds[i + 1], scratch, dtype, offset)
        for i in range(1, n_threads)
        if bounds[i + 1] > bounds[i]
    ]
    error: BaseException | None = None
    try:
        _span(body, flat, bounds[0], bounds[1], scratch, dtype, offset)
    except BaseException as exc:  # noqa: BLE001 - raised below, once the others are done
        error = exc
    for f in futures:
        try:
            f.result()
        except BaseException as exc:  # noqa: BLE001
            error = error or exc
    if error is not None:
        raise error


def _add_body(views: list, scratch: list) -> None:
    out, a, b = views
    np.add(a, b, out=out)


def add_into(out: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``out = a + b`` element-wise (``out`` may be ``a``), chunked on the threads; returns
    ``out``. The arrays are 1-D of one size and dtype (as the server's merge buffers are)."""
    run(_add_body, [out, a, b])
    return out


def _sum_body(views: list, scratch: list) -> None:
    out, first, *rest = views
    if not rest:
        np.copyto(out, first)
        return
    np.add(first, rest[0], out=out)
    for r in rest[1:]:
        np.add(out, r, out=out)


def sum_into(out: np.ndarray, arrays: Sequence[np.ndarray]) -> np.ndarray:
    """``out = ((a0 + a1) + a2) + ...`` element-wise in one pass over memory (each chunk
    summed in the cache), on the threads; ``out`` may be ``a0``. The same sums, in the same
    order, as adding the arrays one after the other. Returns ``out``."""
    if not arrays:
        raise ValueError("sum_into needs at least one array")
    run(_sum_body, [out, *arrays])
    return out


# -- a step written once, for NumPy arrays and torch tensors ---------------------------------
class NumpyOps:
    """The element-wise operations a step is written in, on NumPy arrays of the compute
    ``dtype`` (float16 weights computed in float32). :class:`TorchOps` does each one the same
    way on torch tensors, so a step written in these runs on the host and on a device."""

    def __init__(self, dtype: Any) -> None:
        self.dtype = dtype

    def rescaled(self, grad: Any, rescale: float, clip: float | None, out: Any) -> Any:
        """``clip(rescale * grad)`` in the compute dtype: written into ``out`` and returned,
        or ``grad`` itself when that is the same values (``rescale`` 1, ``grad`` already in
        the dtype, no ``clip``: multiplying by 1 is exact), which saves a pass. Never writes
        to ``grad``."""
        if rescale == 1.0 and grad.dtype == self.dtype and clip is None:
            return grad
        out = self.scale(grad, rescale, out)  # (a float16 gradient widened exactly first)
        return out if clip is None else self.clip(out, clip, out)

    def scale(self, a: Any, s: float, out: Any) -> Any:
        return np.multiply(a, s, dtype=self.dtype, out=out)

    def add(self, a: Any, b: Any, out: Any) -> Any:
        return np.add(a, b, out=out, casting="same_kind")  # (out may be a float16 weight)

    def mul(self, a: Any, b: Any, out: Any) -> Any:
        return np.multiply(a, b, out=out)

    def div(self, a: Any, b: Any, out: Any) -> Any:
        return np.divide(a, b, out=out)

    def clip(self, a: Any, bound: float, out: Any) -> Any:
        return np.clip(a, -bound, bound, out=out)

    def sqrt(self, a: Any, out: Any) -> Any:
        return np.sqrt(a, out=out)

    def shift(self, a: Any, s: float) -> Any:
        a += s
        return a


class TorchOps(NumpyOps):
    """:class:`NumpyOps` on torch tensors (``torch`` handed in: this layer imports no torch),
    for a step on a server's device: one torch operation for each NumPy one, in the same
    dtypes, each scalar rounded to the compute dtype as NumPy rounds it. Adds, multiplies and
    clips are correctly rounded on the CPU and on CUDA, so the results are NumPy's bit for
    bit; a square root may differ in the last bit in some torch kernels."""

    def __init__(self, torch: Any, weight: Any) -> None:
        self.torch = torch
        super().__init__(torch.float32 if weight.dtype == torch.float16 else weight.dtype)
        self.round = {torch.float32: np.float32, torch.float64: np.float64}[self.dtype]

    def scale(self, a: Any, s: float, out: Any) -> Any:
        if a is not out:
            out.copy_(a)
        return out.mul_(float(self.round(s)))

    def add(self, a: Any, b: Any, out: Any) -> Any:
        return out.add_(b) if a is out else self.torch.add(a, b, out=out)

    def mul(self, a: Any, b: Any, out: Any) -> Any:
        return self.torch.mul(a, b, out=out)

    def div(self, a: Any, b: Any, out: Any) -> Any:
        return self.torch.div(a, b, out=out)

    def clip(self, a: Any, bound: float, out: Any) -> Any:
        c = float(self.round(bound))
        return self.torch.clamp(a, -c, c, out=out)

    def sqrt(self, a: Any, out: Any) -> Any:
        return self.torch.sqrt(a, out=out)

    def shift(self, a: Any, s: float) -> Any:
        return a.add_(float(self.round(s)))
