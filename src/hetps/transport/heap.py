"""glibc's malloc set for message buffers (``HETPS_KEEP_BUFFERS``).
(docs/MODULES.md, "hetps.transport.heap")"""

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
