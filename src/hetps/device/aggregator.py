"""A server that sums and updates on a device (``HETPS_SERVER_DEVICE=cuda:N``): the round
aggregator of :mod:`hetps.kvstore.aggregate` with the float keys' arithmetic in torch.

Float keys' sums, and the weights and state of an optimizer with a ``device_step``, live on
the device; everything else stays on the host as on a CPU server (docs/ESYNC.md, "Servers on
a GPU"). :func:`hetps.roles.run_server` plugs these rounds in only when the variable names a
device; ``torch:cpu`` runs this code on the CPU (the tests')."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from hetps.optim import registered
from hetps.optim.base import device_step_of
from hetps.optim.kernels import TorchOps

if TYPE_CHECKING:
    import torch

#: NumPy dtype -> torch dtype name, for the values a device server holds on the device
FLOATS = {np.dtype("<f2"): "float16", np.dtype("<f4"): "float32", np.dtype("<f8"): "float64"}

#: what HETPS_SERVER_DEVICE may say (the testing stand-in included)
FORMS = "cpu, cuda, cuda:N (N a device index) or torch:cpu (the device code on the CPU, tests)"


def parse(spec: str) -> tuple[str, int | None] | None:
    """``spec`` as (kind, index): ("cuda", N or None), ("torch:cpu", None); None for ``cpu``
    (the NumPy server). Raises ValueError naming the forms it takes."""
    text = spec.strip().lower()
    if text in ("cpu", "torch:cpu", "cuda"):
        return (text, None) if text != "cpu" else None
    if text.startswith("cuda:") and text[5:].isdigit():
        return ("cuda", int(text[5:]))
    raise ValueError(f"HETPS_SERVER_DEVICE={spec!r} is not a device: set it to one of {FORMS}")


def cuda_index(spec_index: int | None, local_rank: int, count: int) -> int:
    """The GPU a process takes: ``cuda:N`` names it; plain ``cuda`` takes the process's
    local rank (``LOCAL_RANK``: its index among the processes its launcher started on this
    host) modulo the host's GPUs, so the processes of one host spread over its GPUs; with no
    local rank, GPU 0."""
    if spec_index is not None:
        return spec_index
    return local_rank % count if local_rank >= 0 and count > 0 else 0


def open_device(spec: str, local_rank: int = -1) -> Device:
    """The device ``spec`` names, checked now (at a server's start): torch must be there and,
    for ``cuda:N``, see that device; each problem is one error naming the fix. Plain ``cuda``
    picks the GPU from ``local_rank`` (:func:`cuda_index`)."""
    kind, index = parse(spec) or ("cpu", None)
    if kind == "cpu":
        raise ValueError("HETPS_SERVER_DEVICE=cpu is the NumPy server: it needs no device")
    try:
        import torch
    except ImportError:
        raise RuntimeError(
            f"HETPS_SERVER_DEVICE={spec} needs torch on the server machine, and it is not "
            "installed: install torch there (pip install torch), or set "
            "HETPS_SERVER_DEVICE=cpu"
        ) from None
    if kind == "torch:cpu":
        return Device(torch, torch.device("cpu"), spec)
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"HETPS_SERVER_DEVICE={spec} but torch sees no CUDA device on this server "
            f"(torch {torch.__version__}, torch.cuda.is_available() is False): use "
            "HETPS_SERVER_DEVICE=cpu (or leave --server-device out), or start the servers on "
            "a machine with a GPU and a CUDA build of torch"
        )
    count = torch.cuda.device_count()
    index = cuda_index(index, local_rank, count)
    if index >= count:
        raise RuntimeError(
            f"HETPS_SERVER_DEVICE={spec} but torch sees {count} CUDA device(s) here "
            f"(cuda:0 to cuda:{count - 1}): pick one of them, or cpu"
        )
    torch.cuda.set_device(index)
    return Device(torch, torch.device("cuda", index), spec)


class Device:
    """One torch device and the host side of its copies: two host buffers, used in turn, for
    what goes to the device (page-locked on CUDA; before one is written again the copy that
    read it has finished, while the other one's copy may still run), the device buffers
    they land in, scratch buffers for the steps. On CUDA every call goes through ``driver``
    (:class:`hetps.device.staging.TorchCuda`, or the tests' stand-in of it)."""

    def __init__(self, torch: Any, device: Any, spec: str = "", driver: Any = None) -> None:
        self.torch = torch
        self.device = device
        self.spec = spec or str(device)  # as HETPS_SERVER_DEVICE named it
        if driver is None and device.type == "cuda":
            from hetps.device.staging import TorchCuda

            driver = TorchCuda()
        self.gpu = driver
        self.cuda = driver is not None
        # the staging slots, used in turn: [host bytes (pinned), their NumPy view, device
        # bytes the copy lands in, the event of the last copy that read the host bytes]
        self._slots: list[list[Any]] = [[None, None, None, None], [None, None, None, None]]
        self._turn = 0
        self._scratch: dict[Any, list] = {}

    def __repr__(self) -> str:
        return f"Device({self.device})"

    def dtype(self, np_dtype: np.dtype) -> Any:
        return getattr(self.torch, FLOATS[np.dtype(np_dtype)])

    def empty(self, n: int, np_dtype: np.dtype) -> Any:
        return self.torch.empty(n, dtype=self.dtype(np_dtype), device=self.device)

    def host_empty(self, n: int, dtype: Any) -> Any:
        """A host tensor the device copies into (page-locked on CUDA, made in this device's
        context: requests are handled on the node's receive thread, not the one that opened
        the device)."""
        if self.cuda:
            return self.gpu.pinned((n,), dtype, self.device)
        return self.torch.empty(n, dtype=dtype)

    def _stream(self) -> Any:
        # (this device's stream: the handling thread's current device may be another one,
        # torch.cuda.set_device holds for the thread that called it)
        return self.gpu.current_stream(self.device)

    def upload(self, arr: np.ndarray) -> Any:
        """``arr`` (host, any layout) on the device: a view of a landing buffer, valid until
        the upload after next (what reads it is queued on the same stream before that)."""
        nbytes = arr.nbytes
        slot = self._slots[self._turn]
        self._turn ^= 1
        if slot[3] is not None:  # this slot's last copy has read its host bytes (the other
            self.gpu.synchronize(slot[3])  # slot's copy may still run meanwhile)
            slot[3] = None
        if slot[0] is None or slot[0].numel() < nbytes:
            size = max(nbytes, 1 << 16)
            slot[0] = self.host_empty(size, self.torch.uint8)
            slot[1] = slot[0].numpy()
            slot[2] = self.torch.empty(size, dtype=self.torch.uint8, device=self.device)
        np.copyto(slot[1][:nbytes].view(arr.dtype), arr.reshape(-1))
        dst = slot[2][:nbytes]
        if self.cuda:
            stream = self._stream()
            self.gpu.copy(dst, slot[0][:nbytes], stream)
            slot[3] = self.gpu.event(stream)
        else:
            dst.copy_(slot[0][:nbytes])
        return dst.view(self.dtype(arr.dtype))

    def new_copy(self, arr: np.ndarray) -> Any:
        """A device tensor of its own holding ``arr`` (a weight or a state taken to the
        device: not through the landing buffer, whose last upload may not be read yet)."""
        host = self.torch.from_numpy(np.array(arr, copy=True).reshape(-1))
        return host.to(self.device, copy=True)

    def download(self, src: Any, dst: Any) -> None:
        """``dst`` (a host tensor, page-locked on CUDA) = ``src``, finished when this
        returns (one copy and one wait for it, which sleeps rather than spins)."""
        if not self.cuda:
            dst.copy_(src)
            return
        stream = self._stream()
        self.gpu.copy(dst, src, stream)
        self.gpu.synchronize(self.gpu.event(stream))

    def scratch(self, n: int, dtype: Any, count: int) -> list:
        """``count`` device buffers of ``n`` values of ``dtype``, reused (the steps using
        them are queued one after the other)."""
        have = self._scratch.get(dtype, [])
        if len(have) < count or have[0].numel() < n:
            size = max(n, have[0].numel() if have else 0)
            have = [self.torch.empty(size, dtype=dtype, device=self.device) for _ in range(count)]
            self._scratch[dtype] = have
        return [b[:n] for b in have[:count]]


@dataclass
class DeviceSlot:
    """What a device server keeps of one slice beside the Slice itself."""

    weight: Any = None  # the weight on the device
    weight_of: Any = None  # the host value it equals (None: upload it again before a step)
    state: Any = None  # the optimizer state on the device
    state_of: Any = None  # the host state object it was made from (or copied back into)
    spare: Any = None  # a device buffer for the next round's sum
    #: the host tensor sl.value is a view of, when it is one of ours
    host: torch.Tensor | None = None
    host_np: Any = None  # that view
    host_spare: Any = None  # a host tensor for the next round's value
    grad_host: Any = None  # the round's sum copied back, for an optimizer run on the host


def fits(buf: Any, n: int, dtype: Any) -> bool:
    """Whether the tensor ``buf`` (or None) can be reused for ``n`` values of ``dtype``."""
    return buf is not None and buf.numel() == n and buf.dtype == dtype


class DeviceRounds:
    """The round aggregator's float keys summed and updated on ``device``: mixed in ahead of
    :class:`hetps.kvstore.aggregate.Aggregator` by the composition root
    (:class:`hetps.roles.DeviceAggregator`), whose methods it calls for every other key, so
    this wing imports nothing of kvstore. ``sl`` is a kvstore Slice, ``msg`` a Message."""

    def __init__(self, workers: Any, optimizer: Any, device: Device) -> None:
        super().__init__(workers, optimizer)
        self.device = device
        self.torch = device.torch
        self.slots: dict[tuple[Any, int], DeviceSlot] = {}
        self.told: set[str] = set()  # what tell() said already

    def tell(self, optimizer: Any) -> None:
        """Say once per optimizer class, where a launcher shows it, where its rounds run:
        the line a job's log keeps of what ran on the device (gpu_goals.py checks it)."""
        name = type(optimizer).__name__ if optimizer is not None else "none"
        if name in self.told:
            return
        self.told.add(name)
        if optimizer is None:
            what = "no optimizer: the sum is the value"
        elif device_step_of(optimizer) is not None:
            what = f"{name} steps on the device"
        else:
            has = [c.__name__ for c in registered().values() if device_step_of(c) is not None]
            what = f"{name} steps on the host (only {' and '.join(has)} have a device step)"
        print(
            f"hetps server: summing on {self.device.device} "
            f"(HETPS_SERVER_DEVICE={self.device.spec}), {what}",
            file=sys.stderr,
            flush=True,
        )

    def here(self, sl: Any) -> bool:
        """Whether ``sl``'s arithmetic runs on the device (float values)."""
        return sl.value.dtype in FLOATS

    def slot(self, sl: Any) -> DeviceSlot:
        got = self.slots.get(sl.skey)
        if got is None:  # (not setdefault: a DeviceSlot made on every call costs ~0.1 us)
            got = self.slots[sl.skey] = DeviceSlot()
        return got

    # -- hooks the server calls -------------------------------------------------------------
    def value_changed(self, sl: Any) -> None:
        got = self.slots.get(sl.skey)
        if got is not None:
            got.weight_of = None

    def host_state(self, sl: Any) -> Any:
        got = self.slots.get(sl.skey)
        if got is not None and got.state is not None and got.state_of is sl.state:
            # as the host optimizer keeps it (what get_states pickles: a checkpoint reads the
            # same from a CPU or a device server): NumPy arrays, numbers (Adam's t) kept
            host = {
                k: v.to("cpu", copy=True).numpy() if hasattr(v, "numpy") else v
                for k, v in got.state.items()
            }
            sl.state = got.state_of = host
        return sl.state

    # -- a dist_sync round ------------------------------------------------------------------
    def first_whole(
        self, sl: Any, msg: Any, data: np.ndarray, comp: Any, off: int, n: int, ce: int
    ) -> bool:
        if self.here(sl):
            return False  # every push is copied to the device at once
        return super().first_whole(sl, msg, data, comp, off, n, ce)

    def take_spare(self, sl: Any) -> Any:  # (overrides the base's static method)
        if not self.here(sl):
            return super().take_spare(sl)
        got = self.slot(sl)
        buf = (
            got.spare if fits(got.spare, sl.value.size, self.device.dtype(sl.value.dtype)) else None
        )
        got.spare = None
        return buf if buf is not None else self.device.empty(sl.value.size, sl.value.dtype)

    def add_chunk(self, sl: Any, msg: Any, data: np.ndarray, comp: Any, off: int, n: int) -> None:
        """Add a chunk to the round's sum on the device, in arrival order: the first push of
        a chunk is copied in, the next ones added (the CPU server's sums, in its order)."""
        if not self.here(sl):
            super().add_chunk(sl, msg, data, comp, off, n)
            return
        data = self.decoded(sl, data, comp, n)  # on the host (the values the CPU server adds)
        pushed = self.device.upload(data)
        dst = sl.merge[off : off + n]
        if off in sl.written:
            dst.add_(pushed)
        else:
            dst.copy_(pushed)
        sl.written.add(off)

    def merge_held(self, sl: Any, job: int) -> None:
        if self.here(sl):
            raise self.Refused(
                "HETPS_ELASTIC rounds are not built on a device server: set "
                "HETPS_SERVER_DEVICE=cpu to let workers go"
            )
        super().merge_held(sl, job)

    def finish(self, sl: Any) -> Any:
        if not self.here(sl):
            return super().finish(sl)
        merged = sl.merge
        assert merged is not None
        optimizer = self.optimizer()
        self.tell(optimizer)
        got = self.slot(sl)
        if optimizer is None:
            self._publish(sl, got, merged)  # the sum is the value
            got.weight_of = None
        elif device_step_of(optimizer) is not None:
            self._step(sl, got, optimizer, merged)
        else:
            self._host_apply(sl, got, merged, -1)
        got.spare = merged
        sl.merge = None
        sl.got = {}
        sl.seen, sl.pending = {}, {}
        sl.rounds += 1
        return merged

    # -- the update -------------------------------------------------------------------------
    def apply(self, sl: Any, grad: Any, worker: int) -> None:
        """One optimizer step of ``sl`` with the host gradient ``grad`` (``dist_async``)."""
        optimizer = self.optimizer()
        if self.here(sl):
            self.tell(optimizer)
        if not self.here(sl) or device_step_of(optimizer) is None:
            super().apply(sl, grad, worker)
            self.value_changed(sl)
            return
        self._step(sl, self.slot(sl), optimizer, self.device.upload(np.asarray(grad)), worker)

    def _step(self, sl: Any, got: DeviceSlot, optimizer: Any, grad: Any, worker: int = -1):
        if got.weight is None or got.weight_of is not sl.value:
            got.weight = self.device.new_copy(sl.value)
        if not sl.has_state:
            sl.state = optimizer.create_state(sl.skey, sl.value)
            sl.has_state = True
        if got.state is None or got.state_of is not sl.state:
            if sl.state is not None and not isinstance(sl.state, dict):
                raise TypeError(f"a device step takes a dict state, got {type(sl.state).__name__}")
            up = self.device.new_copy  # each array of the state a device tensor, numbers kept
            got.state = sl.state and {
                k: up(v) if isinstance(v, np.ndarray) else v for k, v in sl.state.items()
            }
            got.state_of = sl.state
        t0 = time.perf_counter()
        w = got.weight
        scratch = self.device.scratch(
            w.numel(), TorchOps(self.torch, w).dtype, optimizer.scratch_buffers()
        )
        optimizer.device_step(self.torch, w, grad, got.state, scratch)
        self._publish(sl, got, w)
        got.weight_of = sl.value
        self.opt_s += time.perf_counter() - t0  # (the copy back included)

    def _host_apply(self, sl: Any, got: DeviceSlot, grad: Any, worker: int) -> None:
        """An optimizer with no device step: on the host, on the gradient copied back (into
        a host buffer of the slice's, reused: the optimizer reads it only while it steps)."""
        if not fits(got.grad_host, grad.numel(), grad.dtype):
            got.grad_host = self.device.host_empty(grad.numel(), grad.dtype)
        self.device.download(grad, got.grad_host)
        super().apply(sl, got.grad_host.numpy(), worker)
        got.weight_of = None

    def _publish(self, sl: Any, got: DeviceSlot, src: Any) -> None:
        """Copy ``src`` (the round's result, on the device) to a host buffer that becomes
        ``sl.value``, which every pull is answered from until the next round. The last
        round's buffer is reused unless a zero-copy reply still reads it."""
        busy = any(not t.done for t in sl.inflight)
        buf = got.host_spare
        if not fits(buf, src.numel(), src.dtype):
            buf = self.device.host_empty(src.numel(), src.dtype)
        got.host_spare = None
        self.device.download(src, buf)
        old = got.host if got.host is not None and got.host_np is sl.value else None
        sl.value = got.host_np = buf.numpy()
        got.host = buf
        sl.inflight = []
        got.host_spare = None if busy else old
