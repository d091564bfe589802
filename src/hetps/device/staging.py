"""Tensors on an accelerator in the KVStore: host staging and the order of copies
(docs/ESYNC.md, "Worker tensors on a device: host staging")."""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np


def as_numpy(value: Any, what: str = "value") -> np.ndarray:
    """A NumPy view of a NumPy array or CPU torch tensor (no copy when possible). Device
    tensors go through :class:`Staging` instead (reduce_values, out_arrays)."""
    if isinstance(value, np.ndarray):
        return value
    mod = type(value).__module__
    if mod.startswith("torch"):
        if value.device.type != "cpu":
            raise TypeError(
                f"{what}: hetps takes CPU and CUDA tensors; move a tensor on "
                f"{value.device} to one of them first (.cpu())"
            )
        return value.detach().numpy()
    raise TypeError(
        f"{what} must be a numpy.ndarray or a torch.Tensor (or a list of them), "
        f"got {type(value).__name__}"
    )


class Backend(Protocol):
    """What staging needs of an accelerator (an "event" marks the end of a queued copy)."""

    def owns(self, value: Any) -> bool:
        """Whether ``value`` is a tensor on this backend's devices."""

    def describe(self, value: Any) -> tuple[tuple[int, ...], np.dtype, Any]:
        """(shape, NumPy dtype, device) of a device tensor."""

    def host_buffer(self, device: Any, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A new host array for copies to and from ``device`` (page-locked where it can)."""

    def to_host(self, value: Any, host: np.ndarray) -> Any:
        """Queue the copy of ``value`` into ``host`` after the caller's queued work; an event."""

    def mark(self, value: Any) -> Any:
        """An event after the work the caller's stream of ``value``'s device queued so far
        (what may still read ``value`` before a pull overwrites it)."""

    def to_device(self, host: np.ndarray, value: Any, after: Any) -> Any:
        """Queue the copy of ``host`` into ``value`` once ``after`` (a :meth:`mark`) is done,
        not after everything queued since; an event."""

    def wait_host(self, event: Any) -> None:
        """Block this thread until ``event``'s copy is done."""

    def done(self, event: Any) -> bool:
        """Whether ``event``'s copy is done (without waiting)."""

    def stream_wait(self, value: Any, event: Any) -> None:
        """Make the caller's stream of ``value``'s device wait for ``event`` (not the host)."""

    def reduce(self, values: Sequence[Any]) -> Any:
        """A new device tensor: the sum of ``values`` (same shape and dtype), on the first's
        device."""


_BACKENDS: list[Backend] = []
_LOCK = threading.Lock()
_probed_cuda = False


def register_backend(backend: Backend) -> None:
    """Let the KVStore take tensors ``backend`` owns (tests register their own)."""
    with _LOCK:
        if backend not in _BACKENDS:
            _BACKENDS.append(backend)


def unregister_backend(backend: Backend) -> None:
    """Undo :func:`register_backend`."""
    with _LOCK:
        if backend in _BACKENDS:
            _BACKENDS.remove(backend)


def backend_for(value: Any) -> Backend | None:
    """The backend of a device tensor, or None for host values (NumPy, CPU tensors)."""
    global _probed_cuda
    if isinstance(value, np.ndarray):
        return None
    if not _probed_cuda:
        torch = sys.modules.get("torch")
        # probed on the first CUDA tensor, not on the first tensor: a CPU tensor first (a
        # broadcast staged on the host) must not turn CUDA off for the process
        if torch is not None and isinstance(value, torch.Tensor) and value.device.type == "cuda":
            with _LOCK:
                if not _probed_cuda:
                    _BACKENDS.append(CudaBackend())
                    _probed_cuda = True
    for b in _BACKENDS:
        if b.owns(value):
            return b
    return None


def graph_capture() -> bool:
    """Whether a registered backend's caller stream is capturing a CUDA graph."""
    return any(getattr(b, "capturing", lambda: False)() for b in list(_BACKENDS))


def on_device(entry: Any) -> bool:
    """Whether an argument (a value, or a list of them) holds a device tensor."""
    if isinstance(entry, np.ndarray):
        return False
    if isinstance(entry, Staged):
        return True
    if isinstance(entry, (list, tuple)):
        return any(isinstance(v, Staged) or backend_for(v) is not None for v in entry)
    return backend_for(entry) is not None


@dataclass(slots=True, eq=False)
class Staged:
    """A device tensor whose copy to the host was queued already (:func:`stage`): a push of
    it waits only for that copy. The DistributedOptimizer stages each gradient in its hook,
    on the stream backward produced it on, and its launcher thread pushes it meanwhile."""

    buffer: _Buffer
    event: Any
    shape: tuple[int, ...]
    dtype: Any


def stage(value: Any) -> Staged:
    """Queue the copy of a device tensor to a host buffer now, after the work the calling
    thread's stream has queued (the tensor's producer); push, pushpull or init the result
    later from any thread. The copy may run until that push returns: the tensor must not be
    written before (copy it first if it may be, as the DistributedOptimizer does)."""
    backend = backend_for(value)
    if backend is None:
        raise TypeError(f"stage() takes a device tensor, got {type(value).__name__}")
    shape, dtype, device = backend.describe(value)
    _check_dtype(dtype, "stage")
    buf = STAGING.take(backend, device, shape, dtype, lend=False)
    return Staged(buf, backend.to_host(value, buf.array), shape, dtype)


@dataclass(slots=True, eq=False)
class _Buffer:
    """A host buffer and what still reads it: requests in flight, the copies to the devices
    a pull owes until its finisher queued them, and those queued copies."""

    array: np.ndarray
    backend: Backend
    futures: list[Any] = field(default_factory=list)
    events: list[Any] = field(default_factory=list)
    owed: bool = False  # a pull landed here and has not queued its device copies yet

    def free(self) -> bool:
        if not all(f.done() for f in self.futures):
            return False
        # a pull's copies are queued when its handle is waited for; one whose requests
        # failed never queues them (its caller got the error)
        if self.owed and not any(_failed(f) for f in self.futures):
            return False
        return all(self.backend.done(ev) for ev in self.events)


def _failed(future: Any) -> bool:
    return getattr(future, "error", None) is not None  # (a Future's: None unless it failed)


class Staging:
    """Host buffers for device tensors, reused across calls (one per process is enough)."""

    def __init__(self) -> None:
        self._pool: dict[tuple[int, Any, tuple[int, ...], str], list[_Buffer]] = {}
        self._lock = threading.Lock()
        self._tl = threading.local()  # this thread's call: buffers lent, device copies owed

    # -- buffers ------------------------------------------------------------------------------
    def take(
        self, backend: Backend, device: Any, shape: tuple[int, ...], dtype, lend: bool = True
    ) -> _Buffer:
        """A free pooled host buffer of this shape for ``device`` (or a new one); ``lend``:
        this thread's call holds it until it settles."""
        key = (id(backend), device, tuple(shape), np.dtype(dtype).str)
        with self._lock:
            bufs = self._pool.setdefault(key, [])
            for b in bufs:
                if b.free():
                    b.futures, b.events, b.owed = [], [], False
                    break
            else:
                b = _Buffer(backend.host_buffer(device, tuple(shape), np.dtype(dtype)), backend)
                bufs.append(b)
            # lent: not free until this call settles it (a future that is never done)
            b.futures = [_LENT]
        if lend:
            self._lent().append(b)
        return b

    def _lent(self) -> list[_Buffer]:
        lent = getattr(self._tl, "lent", None)
        if lent is None:
            lent = self._tl.lent = []
            self._tl.owed = []
        return lent

    def release(self, staged: Staged) -> None:
        """Give back the buffer of a staged value that will not be pushed (its push failed
        to start): once its copy is done, the pool lends it again."""
        with self._lock:
            staged.buffer.futures, staged.buffer.events = [], [staged.event]

    def buffers(self, taken: bool = False) -> int:
        """How many host buffers the pool holds (``taken``: of them, those a call or a copy
        still holds), for tests and metrics."""
        with self._lock:
            return sum(not taken or not b.free() for v in self._pool.values() for b in v)

    # -- the calls ------------------------------------------------------------------------------
    def push_value(self, entry: Any, what: str) -> np.ndarray:
        """The host array a push (init, pushpull) sends for ``entry``: a device tensor, or a
        list of values summed first (device values on the first one's device)."""
        if isinstance(entry, Staged):  # its copy is queued: wait for it alone
            entry.buffer.backend.wait_host(entry.event)
            self._lent().append(entry.buffer)
            return entry.buffer.array
        values = list(entry) if isinstance(entry, (list, tuple)) else [entry]
        if not values:
            raise ValueError(f"{what}: empty list of values")
        if any(isinstance(v, Staged) for v in values):
            raise ValueError(f"{what}: a staged value goes alone, not in a list")
        host = [v for v in values if backend_for(v) is None]
        dev, backend, shape, dtype, device = _alike(values, what, "values to sum")
        src = dev[0] if len(dev) == 1 else backend.reduce(dev)
        buf = self.take(backend, device, shape, dtype)
        backend.wait_host(backend.to_host(src, buf.array))
        if not host:
            return buf.array
        total = buf.array
        for v in host:
            a = as_numpy(v, what)
            if a.shape != shape or a.dtype != dtype:
                raise ValueError(
                    f"{what}: values to sum differ: {shape} {dtype} vs {a.shape} {a.dtype}"
                )
            total += a
        return total

    def pull_targets(self, entry: Any, what: str) -> list[np.ndarray]:
        """Host arrays to land a pull's value in for ``entry`` (an out, or a list of outs):
        host outs as they are, and one host buffer for all the device ones, whose copies are
        owed until :meth:`settle`'s finisher runs."""
        values = list(entry) if isinstance(entry, (list, tuple)) else [entry]
        if any(isinstance(v, Staged) for v in values):
            raise ValueError(f"{what}: a staged value cannot be an out; give out= a tensor")
        targets = [as_numpy(v, what) for v in values if backend_for(v) is None]
        dev, backend, shape, dtype, device = _alike(values, what, "outs")
        buf = self.take(backend, device, shape, dtype)
        self._lent()
        # what each out's device queued before this call may still read the out: its copy
        # waits for that, and not for what the caller queues after (the next layers' work)
        self._tl.owed.append((buf, [(v, backend.mark(v)) for v in dev]))
        # the device outs come last: the pull fills host outs from the first target
        return [*targets, buf.array] if targets else [buf.array]

    def settle(self, futures: Sequence[Any]) -> Callable[..., None] | None:
        """End this thread's call: the buffers it lent stay taken until ``futures`` are
        answered; returns what queues the owed device copies (run it once the answers
        landed; ``land(False)`` gives their buffers back uncopied), or None when the call
        owes none."""
        lent = self._lent()
        if not lent:
            return None
        owed = self._tl.owed
        self._tl.lent, self._tl.owed = [], []
        futs = list(futures)
        with self._lock:
            for b in lent:
                b.futures = futs
            for b, _ in owed:
                b.owed = True  # not free until land() queued its copies

        def land(copy: bool = True) -> None:
            for buf, outs in owed:
                events = []
                for out, after in outs if copy else ():  # (not copied: the caller got an error)
                    ev = buf.backend.to_device(buf.array, out, after)
                    buf.backend.stream_wait(out, ev)
                    events.append(ev)
                with self._lock:  # free again once every device's copy is done
                    buf.events, buf.owed = events, False

        return land if owed else None

    def abandon(self, futures: Sequence[Any] = ()) -> None:
        """Forget this thread's call, which raised after it made the requests ``futures``
        (a multi-key call whose later key failed: the earlier keys' requests were sent and
        may still read their buffers). Its buffers come back once those are answered; the
        copies to the devices it owed are never queued (the caller got the error)."""
        lent = self._lent()
        self._tl.lent, self._tl.owed = [], []
        futs = list(futures)
        with self._lock:
            for b in lent:
                b.futures, b.owed = futs, False


class _Lent:
    """A stand-in future that is never done: the buffer is lent to a call still being made."""

    @staticmethod
    def done() -> bool:
        return False


_LENT = _Lent()

#: the process's staging (every store of the process shares the buffers)
STAGING = Staging()

_SUPPORTED = (np.dtype("float16"), np.dtype("float32"), np.dtype("float64"))


def _alike(values: list, what: str, they: str) -> tuple:
    """The device values of ``values`` (one at least), their backend, shape, dtype and
    device; ValueError when they differ (``they``: what the error calls them)."""
    dev = [v for v in values if backend_for(v) is not None]
    backend = backend_for(dev[0])
    assert backend is not None
    shape, dtype, device = backend.describe(dev[0])
    _check_dtype(dtype, what)
    for v in dev[1:]:
        if backend_for(v) is not backend:
            raise ValueError(f"{what}: {they} are on different kinds of device")
        s, d, _ = backend.describe(v)
        if s != shape or d != dtype:
            raise ValueError(f"{what}: {they} differ: {shape} {dtype} vs {s} {d}")
    return dev, backend, shape, dtype, device


def _check_dtype(dtype: np.dtype, what: str) -> None:
    if dtype not in _SUPPORTED:
        raise TypeError(f"{what}: dtype {dtype} is not supported; use float16, float32 or float64")


# -- CUDA ------------------------------------------------------------------------------------


class TorchCuda:
    """The calls :class:`CudaBackend` and the device server make of ``torch.cuda`` (the
    tests give them a stand-in with the same contract: tests/cuda_standin.py)."""

    def __init__(self) -> None:
        import torch

        self.torch = torch

    def owns(self, value: Any) -> bool:
        """Whether ``value`` is a CUDA tensor."""
        return isinstance(value, self.torch.Tensor) and value.device.type == "cuda"

    def device_of(self, value: Any) -> Any:
        """The device ``value`` is on."""
        return value.device

    def new_stream(self, device: Any) -> Any:
        """A new stream on ``device``."""
        return self.torch.cuda.Stream(device=device)

    def current_stream(self, device: Any) -> Any:
        """The calling thread's current stream on ``device``."""
        return self.torch.cuda.current_stream(device)

    def event(self, stream: Any) -> Any:
        """An event recorded on ``stream`` now; a host that waits for it sleeps (blocking
        sync) instead of spinning a core."""
        ev = self.torch.cuda.Event(blocking=True)
        ev.record(stream)
        return ev

    def copy(self, dst: Any, src: Any, stream: Any) -> None:
        """Queue ``dst.copy_(src)`` on ``stream`` (asynchronous: one side is page-locked)."""
        with self.torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def keep(self, tensor: Any, stream: Any) -> None:
        """``tensor``'s memory is not reused before ``stream``'s queued work is done."""
        tensor.record_stream(stream)

    def wait_stream(self, stream: Any, other: Any) -> None:
        """``stream``'s later work waits for what ``other`` queued so far."""
        stream.wait_stream(other)

    def wait_event(self, stream: Any, event: Any) -> None:
        """``stream``'s later work waits for ``event``."""
        stream.wait_event(event)

    def synchronize(self, event: Any) -> None:
        """Block the calling thread until ``event`` is done."""
        event.synchronize()

    def query(self, event: Any) -> bool:
        """Whether ``event`` is done (without waiting)."""
        return bool(event.query())

    def pinned(self, shape: tuple[int, ...], dtype: Any, device: Any = None) -> Any:
        """A new page-locked host tensor (made in ``device``'s context when given)."""
        with self.torch.cuda.device(device) if device is not None else contextlib.nullcontext():
            return self.torch.empty(shape, dtype=dtype, pin_memory=True)

    def capturing(self) -> bool:
        """Whether the current stream is capturing a CUDA graph."""
        return bool(self.torch.cuda.is_current_stream_capturing())


class CudaBackend:
    """CUDA tensors: page-locked host buffers, one side stream per device, events. Every
    call to CUDA goes through ``driver`` (:class:`TorchCuda`, or the tests' stand-in)."""

    def __init__(self, driver: Any = None) -> None:
        import torch

        self.torch = torch
        self.driver = driver if driver is not None else TorchCuda()
        self._streams: dict[Any, Any] = {}
        self._pinned: dict[int, Any] = {}  # a host buffer's address -> its pinned tensor
        self._np = {
            torch.float16: np.dtype("float16"),
            torch.float32: np.dtype("float32"),
            torch.float64: np.dtype("float64"),
        }

    def owns(self, value: Any) -> bool:
        return self.driver.owns(value)

    def describe(self, value: Any) -> tuple[tuple[int, ...], np.dtype, Any]:
        dtype = self._np.get(value.dtype)
        if dtype is None:
            raise TypeError(
                f"dtype {value.dtype} is not supported; use float16, float32 or float64"
            )
        if not value.is_contiguous():
            raise ValueError("a CUDA tensor given to the KVStore must be contiguous")
        return tuple(value.shape), dtype, self.driver.device_of(value)

    def _side(self, device: Any) -> Any:
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = self.driver.new_stream(device)
        return s

    def host_buffer(self, device: Any, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        dt = self.torch.from_numpy(np.empty(0, dtype)).dtype
        t = self.driver.pinned(shape, dt)
        self._pinned[t.data_ptr()] = t  # kept for the pool's life: copies use the tensor
        return t.numpy()

    def _host(self, host: np.ndarray) -> Any:
        t = self._pinned.get(host.ctypes.data)
        if t is None:  # (every buffer comes from host_buffer: a copy from pageable memory
            # would not be asynchronous, and its event would say nothing)
            raise RuntimeError("a host buffer given to a CUDA copy is not a staging buffer")
        return t

    def to_host(self, value: Any, host: np.ndarray) -> Any:
        d = self.driver
        device = d.device_of(value)
        side = self._side(device)
        d.wait_stream(side, d.current_stream(device))  # (the producer of value: backward)
        d.copy(self._host(host), value.detach(), side)
        d.keep(value, side)  # (the caller may free value before the copy ran)
        return d.event(side)

    def mark(self, value: Any) -> Any:
        d = self.driver
        return d.event(d.current_stream(d.device_of(value)))

    def to_device(self, host: np.ndarray, value: Any, after: Any) -> Any:
        d = self.driver
        side = self._side(d.device_of(value))
        if after is not None:
            d.wait_event(side, after)
        d.copy(value.detach(), self._host(host).view(value.shape), side)
        d.keep(value, side)
        return d.event(side)

    def wait_host(self, event: Any) -> None:
        self.driver.synchronize(event)

    def done(self, event: Any) -> bool:
        return self.driver.query(event)

    def stream_wait(self, value: Any, event: Any) -> None:
        d = self.driver
        d.wait_event(d.current_stream(d.device_of(value)), event)

    def capturing(self) -> bool:
        """Whether the current stream is capturing a CUDA graph."""
        return self.driver.capturing()

    def reduce(self, values: Sequence[Any]) -> Any:
        total = values[0].detach().clone()
        for v in values[1:]:
            total.add_(v.detach().to(total.device, non_blocking=True))
        return total
