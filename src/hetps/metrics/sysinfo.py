"""What a node's reports say of its machine and its output: CPU and memory of the process
(its CPU time and ``/proc``), the machine's GPUs through NVML when the NVIDIA driver's library
is there (or why not), and the last lines the process wrote to its standard output and error
(:class:`LogTail`). (docs/MODULES.md, "hetps.metrics.sysinfo")"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import sys
import threading
import time
from collections import deque
from typing import Any

import msgspec

from hetps.metrics.bounds import LOG_KEEP, LOG_WIDTH, MAX_GPUS, Report, names, printable

__all__ = ["LOG_KEEP", "LOG_WIDTH", "LogTail", "Sampler", "extras", "gpus", "scrub"]
#: seconds between two samples at least (a closer one is the last one again)
MIN_GAP_S = 0.5

_ADDR = re.compile(
    r"\[[0-9A-Fa-f:.]+\](?::\d+)?"  # [v6]:port
    r"|\b(?:\d{1,3}\.){3}\d{1,3}(?::\d+)?\b"  # v4[:port]
    r"|\b(?:localhost|(?=[\w.-]*[A-Za-z])[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+):\d{1,5}\b"  # name:port
    r"|\b(?:tcp|ipc|inproc)://\S+"  # ZeroMQ endpoints
)


def scrub(text: str) -> str:
    """``text`` with every host:port, IP address and ZeroMQ endpoint replaced by
    ``<address>``."""
    return _ADDR.sub("<address>", text)


# -- CPU and memory -------------------------------------------------------------------------
class Sampler:
    """The process' CPU use (percent of one core, since the last sample) and resident memory
    (bytes); the machine's GPUs (:func:`gpus`)."""

    def __init__(self) -> None:
        self._last: tuple[float, float] | None = None
        self._cached: tuple[float, dict] | None = None
        self._lock = threading.Lock()
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

    def sample(self) -> dict:
        """``{"cpu": percent (from the second sample on), "rss": bytes, "gpu": [...]}`` or, with
        no GPU to read, ``"nogpu": why``. Samples closer than :data:`MIN_GAP_S` (several
        pages polling the scheduler at once) share one."""
        now = time.monotonic()
        with self._lock:
            if self._cached is not None and now - self._cached[0] < MIN_GAP_S:
                return dict(self._cached[1])
            out = self._sample(now)
            self._cached = (now, out)
            return dict(out)

    def _sample(self, now: float) -> dict:
        try:
            with open("/proc/self/statm", "rb") as f:  # (every thread's CPU seconds)
                cpu_s, rss = time.process_time(), int(f.read().split()[1]) * self._page
        except (OSError, ValueError, IndexError):
            return {}
        out: dict[str, Any] = {"rss": int(rss)}
        if self._last is not None and now > self._last[0]:
            out["cpu"] = round(max(0.0, 100.0 * (cpu_s - self._last[1]) / (now - self._last[0])), 1)
        self._last = (now, cpu_s)
        rows, why = gpus()
        out["gpu" if rows else "nogpu"] = rows or why
        return out


# -- GPUs through NVML ----------------------------------------------------------------------
class _Util(ctypes.Structure):
    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


class _Mem(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong),
                ("used", ctypes.c_ulonglong)]  # fmt: skip


_nvml: list = []  # [library or None, why not]
_nvml_lock = threading.Lock()


def _library() -> tuple[Any, str]:
    with _nvml_lock:
        if not _nvml:
            try:
                lib = ctypes.CDLL("libnvidia-ml.so.1")
                rc = lib.nvmlInit_v2()
                _nvml[:] = [lib, ""] if rc == 0 else [None, f"NVML did not start (error {rc})"]
            except OSError:
                _nvml[:] = [None, "no NVIDIA driver here (libnvidia-ml.so.1 not found)"]
            except AttributeError:
                _nvml[:] = [None, "libnvidia-ml.so.1 has no nvmlInit_v2"]
        return _nvml[0], _nvml[1]


def gpus() -> tuple[list[list], str]:
    """The machine's GPUs as NVML sees them: ``[[utilisation %, memory used, memory total],
    ...]`` (bytes), and why the list is empty when it is."""
    lib, why = _library()
    if lib is None:
        return [], why
    count = ctypes.c_uint(0)
    if lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
        return [], "NVML cannot count the GPUs"
    rows = []
    for i in range(min(count.value, MAX_GPUS)):
        handle = ctypes.c_void_p()
        util, mem = _Util(), _Mem()
        if lib.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(handle)) != 0:
            continue
        u = util.gpu if lib.nvmlDeviceGetUtilizationRates(handle, ctypes.byref(util)) == 0 else 0
        if lib.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(mem)) != 0:
            continue
        rows.append([int(u), int(mem.used), int(mem.total)])
    return rows, ("" if rows else "NVML lists no GPU")


# -- the last lines of the output -----------------------------------------------------------
class _Tee:
    """A text stream that writes through to ``stream`` and hands whole lines to ``tail``."""

    def __init__(self, stream: Any, tail: LogTail) -> None:
        self._stream = stream
        self._tail = tail
        self._part = ""

    def write(self, text: str) -> int:
        n = self._stream.write(text)
        with contextlib.suppress(Exception):  # the output itself always goes through
            self._part += text
            if "\n" in self._part:
                *lines, self._part = self._part.split("\n")
                self._tail.add(lines)
            if len(self._part) > 4 * LOG_WIDTH:
                self._part = self._part[-LOG_WIDTH:]
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class LogTail:
    """The last :data:`LOG_KEEP` lines the process wrote to ``sys.stdout`` and ``sys.stderr``
    (print, logging, tracebacks), scrubbed of addresses; :meth:`take` gives the lines not
    taken before. :meth:`install` puts the tee in place; :meth:`uninstall` takes it away."""

    def __init__(self) -> None:
        self.raw: deque[str] = deque(maxlen=LOG_KEEP)
        self._new: deque[str] = deque(maxlen=LOG_KEEP)
        self._lock = threading.Lock()
        self._saved: tuple[Any, Any, _Tee, _Tee] | None = None

    def add(self, lines: list[str]) -> None:
        """Keep ``lines`` (the newest :data:`LOG_KEEP`; cleaned when read)."""
        lines = [line for line in lines if line and not line.isspace()]
        with self._lock:
            self.raw.extend(lines)
            self._new.extend(lines)

    @staticmethod
    def _clean(lines: list[str]) -> list[str]:
        """Blank lines dropped, each cut to :data:`LOG_WIDTH` characters, control characters
        made spaces, addresses replaced."""
        return [
            scrub("".join(c if c.isprintable() else " " for c in line[:LOG_WIDTH])).rstrip()
            for line in lines
            if line.strip()
        ]

    def take(self) -> list[str]:
        """The lines kept since the last call."""
        with self._lock:
            out, self._new = list(self._new), deque(maxlen=LOG_KEEP)
        return self._clean(out)

    def last(self) -> list[str]:
        """The last lines kept."""
        with self._lock:
            out = list(self.raw)
        return self._clean(out)

    def install(self) -> LogTail:
        """Tee ``sys.stdout`` and ``sys.stderr`` (and logging's handlers that write to them)."""
        if self._saved is None:
            out, err = sys.stdout, sys.stderr
            self._saved = (out, err, _Tee(out, self), _Tee(err, self))
            self._swap({id(out): self._saved[2], id(err): self._saved[3]})
        return self

    def uninstall(self) -> None:
        """Put the streams back (where nothing replaced the tee since)."""
        if self._saved is not None:
            out, err, tee_out, tee_err = self._saved
            self._saved = None
            self._swap({id(tee_out): out, id(tee_err): err})

    @staticmethod
    def _swap(swap: dict[int, Any]) -> None:
        """``sys.stdout``, ``sys.stderr`` and each of logging's handlers that writes to a
        stream of ``swap`` (by its id) write to the stream it maps to instead."""
        import logging

        sys.stdout = swap.get(id(sys.stdout), sys.stdout)
        sys.stderr = swap.get(id(sys.stderr), sys.stderr)
        for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
            for h in getattr(logger, "handlers", []):
                if isinstance(h, logging.StreamHandler) and id(h.stream) in swap:
                    h.setStream(swap[id(h.stream)])


# -- what a report says of them ------------------------------------------------------------
def extras(rep: Report) -> dict:
    """The parts of a worker's or server's decoded report about its machine and output:
    ``sys`` (CPU %, resident bytes, GPUs or why none) and ``log`` (its last lines, printable,
    addresses replaced: a node's own scrub is not trusted)."""
    named = names("", 0)
    printable(rep.sys.nogpu if rep.sys else None, named["$.sys.nogpu"])
    for line in rep.log:
        printable(line, named["$.log[]"])
    sysinfo = msgspec.to_builtins(rep.sys) if rep.sys is not None else None
    return {"sys": sysinfo, "log": [scrub(line) for line in rep.log]}
