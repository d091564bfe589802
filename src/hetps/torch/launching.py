"""Launching a group's push and pull (request bookkeeping, encoding, the socket send: ~0.2 ms
of Python) off the training thread, and handing a tensor on a device to the KVStore.
(docs/MODULES.md, "hetps.torch.launching")"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from hetps.device import staging
from hetps.torch.fusion import FusionGroup, StepTiming


class _Failed:
    """A launch that raised: waiting on it raises the error in the training thread."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def wait(self) -> None:
        raise self.exc


class GroupLauncher:
    """Launches groups with ``launch(g, data)``, never two at once: from a thread of its own
    while backward, which runs without the GIL, goes on (``background``), or at once in the
    caller's thread for a group marked ``inline``. A launch that raises leaves, in
    ``handles``, a handle whose ``wait`` raises the error in the training thread; every
    launch's times go to ``timing.pushes``."""

    def __init__(
        self,
        launch: Callable[[FusionGroup, torch.Tensor], None],
        handles: dict[int, Any],
        timing: StepTiming,
        background: bool,
    ) -> None:
        self._launch = launch
        self._handles = handles
        self._timing = timing
        self._todo: collections.deque = collections.deque()
        self._todo_cv = threading.Condition()
        self._lock = threading.Lock()
        self._closing = False
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._loop, name="hetps-launcher", daemon=True)
            self._thread.start()

    def send(self, g: FusionGroup, data: torch.Tensor) -> None:
        """Launch group ``g`` now, or hand it to the launcher thread (backward goes on). The
        first parameters' group is the last one backward finishes, and once steps were timed
        so are groups ready near its end (``g.inline``): nothing is left to overlap them
        with, so they go from here, without waking the launcher."""
        if self._thread is None or g.inline:
            with self._lock:
                self._launch_safely(g, data)
            return
        with self._todo_cv:
            g.queued = True
            self._todo.append((g, data))
            self._todo_cv.notify()

    def next(self) -> bool:
        """Launch the oldest queued group (False: none queued). Launches never overlap."""
        with self._lock:
            with self._todo_cv:
                if not self._todo:
                    return False
                g, data = self._todo.popleft()
                g.queued = False
            self._launch_safely(g, data)
            return True

    def flush(self) -> None:
        """Launch what is still queued, here; return once no launch is under way."""
        while self.next():
            pass

    def _launch_safely(self, g: FusionGroup, data: torch.Tensor) -> None:
        t0 = time.perf_counter()
        try:
            self._launch(g, data)
        except Exception as exc:  # raised in the training thread by synchronize()
            self._handles[g.index] = _Failed(exc)
            if isinstance(data, staging.Staged):
                staging.STAGING.release(data)  # (never pushed: its buffer goes back to the pool)
        self._timing.pushes.append((t0, time.perf_counter()))

    def _loop(self) -> None:
        while True:
            with self._todo_cv:
                while not self._todo and not self._closing:
                    self._todo_cv.wait()
                if self._closing:
                    return
            self.next()

    def close(self) -> None:
        """Stop the launcher thread (what it had not launched yet is dropped)."""
        with self._todo_cv:
            self._closing = True
            self._todo_cv.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None


def kv_takes(t: torch.Tensor) -> bool:
    """Whether the KVStore takes ``t`` as it is (a CPU tensor, or one on a device it stages)."""
    return t.device.type == "cpu" or staging.backend_for(t) is not None


def staged(t: torch.Tensor) -> Any:
    """``t`` for a push: on a device, its copy to the host starts now, on the stream that
    produced it (backward's), and the launcher thread that pushes it waits for that alone."""
    return t if staging.backend_for(t) is None else staging.stage(t)


def write_after(st: Any, t: torch.Tensor) -> None:
    """Before the caller's stream writes ``t`` again: make it wait for the staged copy ``st``
    that reads ``t`` (a Staged; None or a host tensor: nothing to wait for). The stream
    waits, not the host: the launcher thread may not have pushed ``st`` yet, and a kernel
    queued after this waits for the copy on the device."""
    if isinstance(st, staging.Staged):
        backend = st.buffer.backend
        if not backend.done(st.event):
            backend.stream_wait(t, st.event)


def refuse_graph_capture(what: str) -> None:
    """Raise if the caller's stream is capturing a CUDA graph: ``what`` (a hook of hetps)
    would be captured once and not run at replay, and it waits on events and allocates
    page-locked memory, which a capture does not allow."""
    if staging.graph_capture():
        raise RuntimeError(
            f"{what} runs while a CUDA graph is being captured: hetps's hooks wait for the "
            "host and are not replayed with the graph. Capture only the forward and backward "
            "of a model that hetps does not wrap, or train without CUDA graphs (the "
            "DistributedOptimizer and overlap_forward run eagerly)"
        )
