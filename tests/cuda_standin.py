"""A stand-in for ``torch.cuda`` with the CUDA branch's contract, so that
:class:`hetps.device.staging.CudaBackend`, the device server's CUDA branch
(:class:`hetps.device.aggregator.Device`) and the DistributedOptimizer's hook -> stage -> launch
path run on a machine without a GPU (it replaces :class:`hetps.device.staging.TorchCuda`).

"Device" tensors are CPU tensors (every float CPU tensor that is not one of its page-locked
buffers, or the ones :meth:`StandInCuda.place` names). What a real GPU may do, it does:

* the caller's (current) stream runs torch's kernels at once; a copy queued on a side
  stream runs as late as it may: when an event after it is waited for by the host, or by
  the caller's stream, or by a stream that needs it. A side-stream copy from a device
  tensor reads it when it runs, so a kernel of the caller's stream that wrote it in between
  (with no wait for the copy's event) shows as a wrong value;
* a copy into a host buffer lands when the copy is known to be done (an event after it was
  waited for): a host that reads it before sees NaN or an older value;
* misuse raises: a copy between memory that is not one page-locked buffer and one device
  tensor, a host write into a page-locked buffer while a copy that reads or writes it is
  not known to be done, a side-stream copy from a tensor nobody kept (``record_stream``),
  an event waited for or queried that was never recorded, a host wait, query or pinned
  allocation while a graph is being captured (:meth:`capture`).

Threads: the hosts waits of the threads named in ``gate_threads`` block while :attr:`gate`
is clear (a launcher thread that has not pushed yet); :attr:`held` says one is blocked.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch


class Misuse(RuntimeError):
    """Something a real GPU would not forgive (it is raised where the stand-in sees it)."""


class Stream:
    def __init__(self, device: int, current: bool, name: str) -> None:
        self.device = device
        self.current = current
        self.name = name
        self.ops: list[Callable[[], None]] = []
        self.done = 0  # ops[:done] ran

    def __repr__(self) -> str:
        return f"Stream({self.name})"


class Event:
    def __init__(self, stream: Stream | None = None, at: int = 0) -> None:
        self.stream = stream
        self.at = at


class StandInCuda:
    """The driver :class:`hetps.device.staging.CudaBackend` and
    :class:`hetps.device.aggregator.Device` call; counts copies for the tests."""

    def __init__(self, claim_all: bool = True) -> None:
        self.claim_all = claim_all
        self._lock = threading.RLock()
        self._placed: dict[int, int] = {}  # storage address -> device index
        self._pinned: dict[int, torch.Tensor] = {}  # storage address -> pinned tensor
        self._busy: dict[int, list[tuple[Stream, int, torch.Tensor]]] = {}
        self._kept: set[tuple[int, int]] = set()  # (storage address, id(stream))
        self._current: dict[int, Stream] = {}
        self.capturing_now = False
        self.gate = threading.Event()
        self.gate.set()
        self.gate_threads = {"hetps-launcher"}
        self.held = threading.Event()
        self.copies = {"to_host": 0, "to_device": 0}
        self.log: list[torch.Tensor] | None = None  # (when a list) what each copy to the host
        # brought there, in the order the copies ran
        self.host_waits = 0

    # -- what is on the device --------------------------------------------------------------
    @staticmethod
    def _addr(t: torch.Tensor) -> int:
        return t.untyped_storage().data_ptr()

    def place(self, t: torch.Tensor, device: int) -> torch.Tensor:
        """Say ``t`` is on device ``device`` (default: every tensor is on device 0)."""
        self._placed[self._addr(t)] = device
        return t

    def is_pinned(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and self._addr(t) in self._pinned

    def owns(self, value: Any) -> bool:
        if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
            return False
        if not value.is_floating_point() or self.is_pinned(value):
            return False
        return self.claim_all or self._addr(value) in self._placed

    def device_of(self, value: Any) -> int:
        return self._placed.get(self._addr(value), 0)

    # -- streams and events -------------------------------------------------------------------
    def new_stream(self, device: Any) -> Stream:
        return Stream(device, False, f"side:{device}")

    def current_stream(self, device: Any) -> Stream:
        with self._lock:
            s = self._current.get(device)
            if s is None:
                s = self._current[device] = Stream(device, True, f"current:{device}")
            return s

    def event(self, stream: Stream) -> Event:
        with self._lock:
            return Event(stream, len(stream.ops))

    def _run(self, stream: Stream, upto: int) -> None:
        with self._lock:
            while stream.done < upto:
                op = stream.ops[stream.done]
                stream.done += 1
                op()

    def _run_event(self, ev: Event, what: str) -> None:
        if ev.stream is None:
            raise Misuse(f"{what} of an event that was never recorded (it waits for nothing)")
        self._run(ev.stream, ev.at)

    def wait_stream(self, stream: Stream, other: Stream) -> None:
        with self._lock:
            at = len(other.ops)
            if stream.current:
                self._run(other, at)
            else:
                stream.ops.append(lambda: self._run(other, at))

    def wait_event(self, stream: Stream, ev: Event) -> None:
        with self._lock:
            if ev.stream is None:
                raise Misuse("a stream waits for an event that was never recorded")
            if stream.current:  # its later kernels run now: what they wait for runs first
                self._run_event(ev, "a stream's wait")
            else:
                stream.ops.append(lambda: self._run_event(ev, "a stream's wait"))

    def synchronize(self, ev: Event) -> None:
        if self.capturing_now:
            raise Misuse("operation not permitted when stream is capturing (event sync)")
        if threading.current_thread().name in self.gate_threads and not self.gate.is_set():
            self.held.set()
            if not self.gate.wait(timeout=60):
                raise Misuse("the test never opened the gate")
        with self._lock:
            self.host_waits += 1
            self._run_event(ev, "a host wait")

    def query(self, ev: Event) -> bool:
        if self.capturing_now:
            raise Misuse("operation not permitted when stream is capturing (event query)")
        with self._lock:
            if ev.stream is None:
                raise Misuse("a query of an event that was never recorded")
            return ev.stream.done >= ev.at

    def capturing(self) -> bool:
        return self.capturing_now

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """As ``torch.cuda.graph``: the caller's stream captures within."""
        self.capturing_now = True
        try:
            yield
        finally:
            self.capturing_now = False

    # -- memory ------------------------------------------------------------------------------
    def pinned(self, shape: tuple[int, ...], dtype: Any, device: Any = None) -> torch.Tensor:
        if self.capturing_now:
            raise Misuse("operation not permitted when stream is capturing (pinned alloc)")
        t = torch.empty(shape, dtype=dtype)
        if t.is_floating_point():
            t.fill_(float("nan"))  # a buffer no copy filled shows as NaN
        else:
            t.fill_(0xAB)
        with self._lock:
            self._pinned[self._addr(t)] = t
        return t

    def keep(self, tensor: torch.Tensor, stream: Stream) -> None:
        with self._lock:
            self._kept.add((self._addr(tensor), id(stream)))

    def _check_host(self, host: torch.Tensor) -> None:
        """No copy that uses page-locked buffer ``host`` is pending with different bytes
        than the host had when it was queued (the host wrote it too early)."""
        for stream, at, snap in self._busy.get(self._addr(host), []):
            if stream.done < at and not torch.equal(
                snap.view(torch.uint8), self._pinned[self._addr(host)].view(torch.uint8)
            ):
                raise Misuse(
                    f"the host wrote a page-locked buffer while a copy on {stream} that uses "
                    "it was not known to be done (wait for its event first)"
                )

    def _busy_until(self, host: torch.Tensor, stream: Stream, at: int) -> torch.Tensor:
        """``host``'s buffer is used by the copy ``stream`` runs as its op ``at``; returns
        the buffer's bytes now, which the host must leave as they are until then."""
        whole = self._pinned[self._addr(host)]
        lst = self._busy.setdefault(self._addr(host), [])
        lst[:] = [b for b in lst if b[0].done < b[1]]
        snap = whole.clone()
        lst.append((stream, at, snap))
        return snap

    def _unchanged(self, host: torch.Tensor, snap: torch.Tensor, stream: Stream) -> None:
        if not torch.equal(
            snap.view(torch.uint8), self._pinned[self._addr(host)].view(torch.uint8)
        ):
            raise Misuse(
                f"the host wrote a page-locked buffer while a copy on {stream} that uses it "
                "was not known to be done (wait for its event first)"
            )

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> None:
        """Queue ``dst.copy_(src)`` on ``stream`` (one side page-locked, the other a device
        tensor)."""
        with self._lock:
            if self.is_pinned(src) and not self.is_pinned(dst):
                self._to_device(dst, src, stream)
            elif self.is_pinned(dst) and not self.is_pinned(src):
                self._to_host(dst, src, stream)
            else:
                raise Misuse(
                    "an asynchronous copy needs one page-locked staging buffer and one device "
                    f"tensor (pinned: src {self.is_pinned(src)}, dst {self.is_pinned(dst)})"
                )

    def _to_device(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> None:
        self.copies["to_device"] += 1
        self._check_host(src)
        at = len(stream.ops) + 1
        snap = src.clone()
        whole = self._busy_until(src, stream, at)

        def run() -> None:
            self._unchanged(src, whole, stream)
            if not stream.current:
                dst.copy_(snap)

        if stream.current:  # the caller's later kernels read dst: it holds the value now
            dst.copy_(snap)
        stream.ops.append(run)

    def _to_host(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> None:
        self.copies["to_host"] += 1
        self._check_host(dst)
        at = len(stream.ops) + 1
        # the caller's stream is in order: the copy sees src as its kernels left it so far;
        # a side stream's copy reads src when it runs
        snap = src.detach().clone() if stream.current else None
        key = (self._addr(src), id(stream))
        whole = self._busy_until(dst, stream, at)

        def run() -> None:
            self._unchanged(dst, whole, stream)
            if snap is None and key not in self._kept:
                raise Misuse(
                    f"a copy on {stream} reads a tensor that was not kept for it "
                    "(record_stream): its memory may be reused before the copy runs"
                )
            dst.copy_((snap if snap is not None else src).reshape(dst.shape))
            if self.log is not None:
                self.log.append(dst.clone().reshape(-1))
            whole.copy_(self._pinned[self._addr(dst)])  # (what a later check compares with)

        stream.ops.append(run)

    def open_gate(self) -> None:
        self.gate.set()
