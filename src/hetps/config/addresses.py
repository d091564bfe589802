"""Addresses: a network interface's IPv4 address, this machine's address on the route to a
host, and whether a host is loopback (the rule for running without a cluster secret)."""

from __future__ import annotations

import functools
import ipaddress
import socket

from hetps.config.rows import ConfigError


def interface_address(name: str) -> str:
    """Return the IPv4 address of network interface ``name`` (Linux), or raise ConfigError."""
    import fcntl
    import socket
    import struct

    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        packed = fcntl.ioctl(
            sock.fileno(),
            0x8915,
            struct.pack("256s", name[:15].encode()),  # SIOCGIFADDR
        )
    except OSError as exc:
        raise ConfigError(
            f"DMLC_INTERFACE={name!r}: no IPv4 address on that interface ({exc}); "
            "set DMLC_INTERFACE to an interface listed by `ip -4 addr`, or set DMLC_NODE_HOST"
        ) from None
    finally:
        sock.close()
    return socket.inet_ntoa(packed[20:24])


def route_address(host: str, port: int = 9) -> str:
    """This machine's IPv4 address on the route to ``host``: the source address the kernel
    picks for it (a UDP connect sends nothing). The address a flat network (a Kubernetes
    pod network, a Slurm or MPI cluster) reaches this machine at, as the scheduler's peers
    see it. Raises ConfigError when ``host`` does not resolve or has no route."""
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port or 9))
            return s.getsockname()[0]
    except OSError as exc:
        raise ConfigError(
            f"cannot find this node's address on the route to the scheduler "
            f"DMLC_PS_ROOT_URI={host!r} ({exc}): set DMLC_NODE_HOST to this node's IP address "
            "(in Kubernetes: env DMLC_NODE_HOST with valueFrom.fieldRef.fieldPath "
            "status.podIP)"
        ) from None


def resolved(host: str) -> list:
    """``host``'s addresses (``ipaddress`` objects): itself when it is one, else those its
    name resolves to; none when it does not resolve (or is blank or ``*``)."""
    text = host.strip().strip("[]")
    if text in ("", "*"):
        return []
    try:
        return [ipaddress.ip_address(text)]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(text, None, proto=socket.IPPROTO_TCP)
        return [ipaddress.ip_address(i[4][0].split("%", 1)[0]) for i in infos]
    except (OSError, UnicodeError, ValueError):
        return []


@functools.lru_cache(maxsize=256)
def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (127.0.0.0/8, ::1), or a name every address
    of which is one (``localhost``, as resolved). Decided by the address, never by how a name
    is spelled: ``127.example.com`` is whatever it resolves to; a name that does not resolve
    is not loopback."""
    addrs = resolved(host)
    return bool(addrs) and all(a.is_loopback for a in addrs)
