"""Kernel pacing of the TCP connections ZeroMQ opens (Linux).

ZeroMQ hides its connections' file descriptors, but they live in this process's descriptor
table: a DEALER's connection is the TCP socket whose peer address is the endpoint it was
connected to. :func:`connection_fds` finds them under ``/proc/self/fd``, and
:func:`set_max_pacing_rate` caps a socket's sending rate with ``SO_MAX_PACING_RATE``, which
TCP honours by its own pacing (any qdisc; no ``fq`` needed). The descriptor is duplicated for
the call and the duplicate closed, so ZeroMQ's own descriptor is never touched.

Why: a node's uplink is shared by its flows to every peer, and TCP splits it by congestion
feedback, not by how much each flow has to move; flows that finish early leave capacity idle
that the late ones cannot use. Pacing each flow to its share of the plan's iteration time
makes them all end together (docs/BALANCE.md §7.4).
"""

from __future__ import annotations

import errno
import os
import socket
import struct
from collections.abc import Iterator

SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)  # asm-generic/socket.h
#: the kernel's "no limit" for the 32-bit form of the option (~0U)
UNLIMITED = 0xFFFFFFFF


def supported() -> bool:
    """Whether this platform can pace sockets this way (Linux with /proc)."""
    return os.path.isdir("/proc/self/fd") and hasattr(socket, "SOL_SOCKET")


def _open(fd: int) -> socket.socket:
    """A socket object on a duplicate of ``fd`` (family and type read from the kernel)."""
    dup = os.dup(fd)
    try:
        return socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        raise


def _resolve(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


def connection_fds(host: str, port: int, exclude_local_port: int | None = None) -> Iterator[int]:
    """Descriptors of this process's TCP sockets connected to ``host:port``."""
    want = (_resolve(host), int(port))
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return
    for name in names:
        fd = int(name)
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            s = _open(fd)
        except OSError:  # closed meanwhile, or not ours to read
            continue
        try:
            if s.type != socket.SOCK_STREAM or s.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                peer = s.getpeername()[:2]
            except OSError:  # listening or not connected
                continue
            if exclude_local_port is not None and s.getsockname()[1] == exclude_local_port:
                continue
            if (peer[0].removeprefix("::ffff:"), peer[1]) == want:
                yield fd
        finally:
            s.close()


def set_max_pacing_rate(fd: int, bytes_per_s: float) -> bool:
    """Cap the sending rate of socket ``fd`` (bytes/s; 0, negative, not finite or beyond the
    option's 32-bit range: no cap). Returns whether the kernel took it."""
    rate = float(bytes_per_s)
    value = int(rate) if 0 < rate < UNLIMITED else UNLIMITED
    value = max(1, value)
    try:
        s = _open(fd)
    except OSError:
        return False
    try:
        s.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, struct.pack("=I", value))
        return True
    except OSError as exc:
        if exc.errno in (errno.ENOPROTOOPT, errno.EINVAL, errno.EBADF, errno.ENOTSOCK):
            return False
        raise
    finally:
        s.close()


def get_max_pacing_rate(fd: int) -> int | None:
    """The socket's current cap (bytes/s; :data:`UNLIMITED` when none), None if unreadable."""
    try:
        s = _open(fd)
    except OSError:
        return None
    try:
        raw = s.getsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, 8)
    except OSError:
        return None
    finally:
        s.close()
    if len(raw) >= 8:
        return min(struct.unpack("=Q", raw[:8])[0], UNLIMITED)
    return struct.unpack("=I", raw[:4])[0]
