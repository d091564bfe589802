"""Kernel pacing of the TCP connections ZeroMQ opens (Linux).

ZeroMQ hides its connections' file descriptors, but they live in this process's descriptor
table: a DEALER's connection is the TCP socket whose peer address is the endpoint it was
connected to. :func:`pace_connections` finds them (only descriptors whose inode
``/proc/self/net/tcp{,6}`` lists with that peer) and caps each one's sending rate with
``SO_MAX_PACING_RATE``, which TCP honours by its own pacing (any qdisc; no ``fq`` needed).
Each is opened as a duplicate, its flags kept, and the duplicate closed, so ZeroMQ's own
descriptor is never changed. :func:`connection_fds`, :func:`set_max_pacing_rate` and
:func:`get_max_pacing_rate` work on descriptor numbers (tests and diagnostics).

The idea: TCP splits a node's uplink among its flows by congestion feedback, not by how much
each has to move, and flows that finish early leave capacity the late ones cannot use;
pacing each flow to its share of the plan's round time would end them together. Measured on
the 8-node benchmark it made hetps slower, so it is opt-in (docs/BALANCE.md §7.4).
"""

from __future__ import annotations

import fcntl
import ipaddress
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
    """A socket object on a duplicate of ``fd`` (family and type read from the kernel).

    A duplicate shares the open file description, so the file status flags are saved and
    put back: wrapping can make the description non-blocking (``socket.setdefaulttimeout``),
    and that would change the owner's socket too."""
    dup = os.dup(fd)
    try:
        flags = fcntl.fcntl(dup, fcntl.F_GETFL)
        try:
            return socket.socket(fileno=dup)
        finally:
            fcntl.fcntl(dup, fcntl.F_SETFL, flags)
    except OSError:
        os.close(dup)
        raise


def _resolve(host: str) -> str:
    try:
        return socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)[0][4][0]
    except (OSError, IndexError):
        return host


def _inodes_to(host: str, port: int) -> set[str]:
    """Inodes of this network namespace's TCP sockets whose peer is ``host:port`` (from
    ``/proc/self/net/tcp`` and ``tcp6``), so that only those descriptors are ever touched."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return set()
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    wants = set()
    if isinstance(ip, ipaddress.IPv4Address):
        # little-endian 32-bit word, as the kernel prints it; in tcp6 as a v4-mapped address
        v4 = ip.packed[::-1].hex().upper()
        wants.add(f"{v4}:{port:04X}")
        mapped = ipaddress.IPv6Address(b"\0" * 10 + b"\xff\xff" + ip.packed).packed
    else:
        mapped = ip.packed
    words = [mapped[i : i + 4][::-1].hex().upper() for i in range(0, 16, 4)]
    wants.add(f"{''.join(words)}:{port:04X}")
    out: set[str] = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                next(f, None)
                for line in f:
                    cols = line.split()
                    if len(cols) > 9 and cols[2] in wants:
                        out.add(cols[9])
        except OSError:
            continue
    return out


def _candidates(host: str, port: int) -> Iterator[tuple[int, socket.socket]]:
    """(fd, socket on a duplicate) for this process's TCP sockets connected to
    ``host:port``; each socket object is closed when the caller moves on."""
    ip = _resolve(host)
    inodes = _inodes_to(ip, int(port))
    if not inodes:
        return
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return
    for name in names:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile
            continue
        if not (link.startswith("socket:[") and link[8:-1] in inodes):
            continue
        try:
            s = _open(int(name))
        except OSError:
            continue
        try:
            if s.type != socket.SOCK_STREAM or s.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                peer = s.getpeername()[:2]
            except OSError:  # not connected (any more)
                continue
            if (peer[0].removeprefix("::ffff:"), peer[1]) == (ip, int(port)):
                yield int(name), s
        finally:
            s.close()


def connection_fds(host: str, port: int, exclude_local_port: int | None = None) -> Iterator[int]:
    """Descriptors of this process's TCP sockets connected to ``host:port`` (not those
    whose own port is ``exclude_local_port``)."""
    for fd, s in _candidates(host, port):
        if exclude_local_port is None or s.getsockname()[1] != exclude_local_port:
            yield fd


def pace_connections(
    host: str, port: int, bytes_per_s: float, exclude_local_port: int | None = None
) -> int:
    """Cap every TCP socket of this process connected to ``host:port`` (see
    :func:`set_max_pacing_rate`); returns how many took it. The cap is set on the very
    duplicate whose peer was checked, so a descriptor number that was closed and reused in
    between cannot be hit."""
    done = 0
    for _fd, s in _candidates(host, port):
        try:
            if exclude_local_port is not None and s.getsockname()[1] == exclude_local_port:
                continue
        except OSError:
            continue
        done += _set_rate(s, bytes_per_s)
    return done


def _set_rate(s: socket.socket, bytes_per_s: float) -> bool:
    rate = float(bytes_per_s)
    value = int(rate) if 0 < rate < UNLIMITED else UNLIMITED
    value = max(1, value)
    try:
        s.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, struct.pack("=I", value))
        return True
    except OSError:  # no such option here, or the socket went away: not paced
        return False


def set_max_pacing_rate(fd: int, bytes_per_s: float) -> bool:
    """Cap the sending rate of socket ``fd`` (bytes/s; 0, negative, not finite or beyond the
    option's 32-bit range: no cap). Returns whether the kernel took it."""
    try:
        s = _open(fd)
    except OSError:
        return False
    try:
        return _set_rate(s, bytes_per_s)
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
