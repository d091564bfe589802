"""glibc's malloc set for message buffers (``HETPS_KEEP_BUFFERS``).

A node allocates a buffer for every big frame it receives (ZeroMQ's I/O thread, one per
message; the bulk channels and the codec, one per array) and frees it when the message is
handled. glibc serves blocks of more than its mmap threshold (128 KiB at first) with a fresh
mmap, returned to the kernel on free, and trims the heap's free top back to the kernel: so a
16 MiB frame costs 4,096 page faults, each clearing a page, every time one comes. On this
project's 2-core machines that was a third of a secured 16 MB round's CPU (perf, a 2-worker
2-server round with shared memory off), more than the cipher's.

:func:`keep_buffers` raises the mmap threshold to glibc's largest (32 MiB on 64-bit: every
bulk frame and ZeroMQ frame, at most 16 MiB, comes from the heap) and keeps up to
:data:`TRIM_THRESHOLD` of freed heap top in the process. The pages a round used are used by
the next one again, already mapped. A process's resident memory then stays at its peak
instead of shrinking between rounds. Arrays above 32 MiB still get their own mmap.

Only glibc has ``mallopt`` with these parameters; elsewhere (musl, macOS) nothing changes.
A process whose environment sets any of glibc's own malloc variables (``MALLOC_*``, such as
``MALLOC_ARENA_MAX`` set to keep memory down, or a ``glibc.malloc`` tunable) keeps malloc as
it is.
"""

from __future__ import annotations

import ctypes
import logging
import threading

log = logging.getLogger("hetps.transport")

#: glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: glibc's largest mmap threshold on 64-bit (HEAP_MAX_SIZE / 2)
MMAP_THRESHOLD = 32 << 20
#: freed heap top kept in the process before it goes back to the kernel
TRIM_THRESHOLD = 256 << 20
_lock = threading.Lock()
_kept = False


def keep_buffers(users: list[str] | tuple[str, ...] = ()) -> bool:
    """Set this process's malloc as the module says (once); whether it is set so.
    ``users``: the variables by which the process's environment sets glibc's malloc itself
    (:func:`hetps.config.node.user_malloc`): then it is left as they say."""
    global _kept
    with _lock:
        if _kept:
            return True
        if users:
            log.info(
                "malloc left as this process's environment sets it (%s): message buffers "
                "are not kept (HETPS_KEEP_BUFFERS)",
                ", ".join(users),
            )
            return False
        try:
            mallopt = ctypes.CDLL(None).mallopt
        except (OSError, AttributeError):
            return False  # (not glibc)
        mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        mallopt.restype = ctypes.c_int
        _kept = (
            mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
            and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
        )
        return _kept
