"""A simulated accelerator for the KVStore's device staging (hetps.device.staging).

Its copies run as late as a real device may run them: a copy to the host runs only when a
thread waits for its event; a copy to a device tensor runs only when the caller's stream of
that device waited for its event and the caller then reads the tensor. A staging step that
forgets a wait, or reuses a host buffer whose copy has not run, shows as a stale value.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


class Event:
    def __init__(self, run: Callable[[], None]) -> None:
        self._run: Callable[[], None] | None = run

    def execute(self) -> None:
        if self._run is not None:
            run, self._run = self._run, None
            run()

    @property
    def done(self) -> bool:
        return self._run is None


class DeviceArray:
    """A tensor on simulated device ``device``. ``read()`` is what a kernel on the caller's
    stream sees; ``write()`` is a kernel that writes it."""

    def __init__(self, backend: DeferredBackend, values: Any, device: int = 0, dtype=None):
        self.backend = backend
        self.data = np.array(values, dtype=dtype)
        self.device = device

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    def read(self) -> np.ndarray:
        self.backend.run_stream(self.device)
        return self.data.copy()

    def write(self, values: Any) -> None:
        self.backend.run_stream(self.device)
        self.data[...] = values


class DeferredBackend:
    """The backend of :class:`DeviceArray`; counts what it did for the tests."""

    def __init__(self) -> None:
        self.waits: dict[int, list[Event]] = {}  # device -> events its caller stream waits for
        self.to_host_copies = 0
        self.to_device_copies = 0
        self.reductions = 0

    def array(self, values: Any, device: int = 0, dtype=None) -> DeviceArray:
        return DeviceArray(self, values, device, dtype)

    def run_stream(self, device: int) -> None:
        for ev in self.waits.pop(device, []):
            ev.execute()

    # -- the Backend protocol ----------------------------------------------------------------
    def owns(self, value: Any) -> bool:
        return isinstance(value, DeviceArray) and value.backend is self

    def describe(self, value: DeviceArray):
        return value.data.shape, value.data.dtype, value.device

    def host_buffer(self, device: Any, shape, dtype) -> np.ndarray:
        return np.full(shape, np.nan, dtype)  # a buffer nobody filled shows as NaN

    def to_host(self, value: DeviceArray, host: np.ndarray) -> Event:
        self.to_host_copies += 1
        self.run_stream(value.device)  # the side stream waits for the caller's queued work
        return Event(lambda: np.copyto(host, value.data.reshape(host.shape)))

    def mark(self, value: DeviceArray) -> None:
        return None  # (the caller's stream runs its kernels at once: nothing to wait for)

    def to_device(self, host: np.ndarray, value: DeviceArray, after: Any) -> Event:
        self.to_device_copies += 1
        return Event(lambda: np.copyto(value.data, host.reshape(value.data.shape)))

    def wait_host(self, event: Event) -> None:
        event.execute()

    def done(self, event: Event) -> bool:
        return event.done

    def stream_wait(self, value: DeviceArray, event: Event) -> None:
        self.waits.setdefault(value.device, []).append(event)

    def reduce(self, values: Sequence[DeviceArray]) -> DeviceArray:
        self.reductions += 1
        total = values[0].data.copy()
        for v in values[1:]:
            total += v.data
        return DeviceArray(self, total, values[0].device)
