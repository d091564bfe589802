"""What every KVStore shares: argument normalisation (keys, values, outs) and the handle type."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hetps.cluster.protocol import check_key, normalize_keys  # noqa: F401 (the stores name them here)
from hetps.cluster.requests import Future, wait_all
from hetps.device.staging import STAGING, as_numpy, on_device

SUPPORTED_DTYPES = (np.dtype("float16"), np.dtype("float32"), np.dtype("float64"))


def per_key(values: Any, nkeys: int, is_list: bool, what: str) -> list[Any]:
    """Split a value argument into one entry per key (each entry an array or list of arrays)."""
    if not is_list:
        return [values]
    if not isinstance(values, (list, tuple)) or len(values) != nkeys:
        raise ValueError(f"{what}: give one entry per key ({nkeys} keys)")
    return list(values)


def reduce_values(entry: Any, what: str) -> tuple[np.ndarray, bool]:
    """One array from an entry that is an array or a list of arrays (summed, as MXNet does),
    and whether it is a staging buffer: device tensors are copied to one (summed on the device
    first), a copy held for the push, and the call must end with :func:`settle` (or raise
    inside :func:`staged_call`)."""
    if on_device(entry):
        return STAGING.push_value(entry, what), True
    if isinstance(entry, (list, tuple)):
        if not entry:
            raise ValueError(f"{what}: empty list of values")
        arrays = [as_numpy(v, what) for v in entry]
        first = arrays[0]
        for a in arrays[1:]:
            if a.shape != first.shape or a.dtype != first.dtype:
                raise ValueError(
                    f"{what}: values to sum differ: {first.shape} {first.dtype} vs {a.shape} {a.dtype}"
                )
        if len(arrays) == 1:
            return first, False
        total = arrays[0].copy()
        for a in arrays[1:]:
            total += a
        return total, False
    return as_numpy(entry, what), False


def check_like(key: Any, like: Any, arr: np.ndarray, what: str) -> None:
    """Raise unless ``arr`` has the shape and dtype of ``like`` (the key's value or meta)."""
    if arr.shape != like.shape or arr.dtype != like.dtype:
        raise ValueError(
            f"{what} of key {key!r}: shape {arr.shape} dtype {arr.dtype} does not match the "
            f"key's shape {like.shape} dtype {like.dtype}"
        )


def out_arrays(entry: Any, what: str) -> list[np.ndarray]:
    """The list of NumPy views an ``out`` entry names (one or several). Device tensors get a
    host buffer whose copies to them :func:`settle`'s finisher queues."""
    if on_device(entry):
        return STAGING.pull_targets(entry, what)
    if isinstance(entry, (list, tuple)):
        return [as_numpy(v, what) for v in entry]
    return [as_numpy(entry, what)]


def settle(futures: Sequence[Future]) -> Callable[..., None] | None:
    """End a call that may have staged device tensors: their host buffers stay taken until
    ``futures`` are answered; returns what copies pulled values to the device tensors (run
    it once the answers landed), or None."""
    return STAGING.settle(futures)


def settle_after(
    futures: Sequence[Future], finishers: Sequence[Callable[[], None]] = ()
) -> Callable[[], None]:
    """:func:`settle` ``futures``; returns what runs ``finishers`` and then the copies to the
    device tensors (run it once the answers landed)."""
    to_device = settle(futures)

    def finish() -> None:
        try:
            for fin in finishers:
                fin()
        except BaseException:  # (a host round's error: its pull's buffers come back)
            if to_device is not None:
                to_device(False)
            raise
        if to_device is not None:
            to_device()

    return finish


class staged_call:  # noqa: N801 - (used as the function it was: ``with staged_call(futs):``)
    """Around the part of a call that stages values, ``futures`` the list its requests are
    added to: if it raises, its buffers come back once the requests it made were answered
    (never while one that was sent may still read them). (A class, not a generator's
    context manager: that costs a microsecond more per call, and every push makes one.)"""

    __slots__ = ("futures",)

    def __init__(self, futures: Sequence[Future] = ()) -> None:
        self.futures = futures

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> bool:
        if kind is not None:
            STAGING.abandon(self.futures)
        return False


def check_dtype(dtype: np.dtype, key: Any) -> None:
    """Raise TypeError unless ``dtype`` is float16/32/64."""
    if np.dtype(dtype) not in SUPPORTED_DTYPES:
        raise TypeError(
            f"key {key!r}: dtype {np.dtype(dtype)} is not supported; use float16, float32 or float64"
        )


@dataclass
class Handle:
    """The result of a non-blocking KVStore call; ``wait()`` blocks until it completed."""

    futures: Sequence[Future]
    timeout: float
    what: str
    finish: Callable[[], Any] | None = None
    _done: bool = False
    _result: Any = None

    def wait(self) -> Any:
        """Block until every request of the call is answered; raise the first error."""
        if not self._done:
            wait_all(list(self.futures), self.timeout, self.what)
            if self.finish is not None:
                self._result = self.finish()
            self._done = True
        return self._result

    def done(self) -> bool:
        """Whether every request was answered (without raising)."""
        return self._done or all(f.done() for f in self.futures)


def completed(result: Any = None) -> Handle:
    """A handle that is already done."""
    return Handle([], 0.0, "done", None, True, result)
