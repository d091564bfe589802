"""Host side of the network emulator: errors, tool lookup, root checks, running ``ip``/``tc``,
the TBF parameters, subnet choice, and the runs (namespace sets) found on this machine.

Everything here works without a :class:`~hetps.netem.emulator.Netem`; the emulator and the
``hetps netem`` CLI build on it. See docs/NETEM.md.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from hetps.netem import reap

__all__ = [
    "BRIDGE",
    "DEFAULT_PREFIX",
    "GOODPUT_FACTOR",
    "NODE_IF",
    "NetemError",
    "NetemPermissionError",
    "NetemUnsupportedError",
    "RunInfo",
    "cleanup_stale",
    "find_tool",
    "goodput_mbit",
    "list_runs",
    "require_root",
]

log = logging.getLogger("hetps.netem")

#: Prefix of every namespace hetps creates (followed by the owner's pid and a random token).
DEFAULT_PREFIX = "hps"
#: Interface name of a node inside its namespace.
NODE_IF = "eth0"
#: Bridge name inside the hub namespace.
BRIDGE = reap.HUB_BRIDGE
#: MTU-sized Ethernet frame (bytes), the unit of HTB's burst and quantum.
FRAME = 1514
#: Token bucket depth in seconds of traffic at the shaped rate (floored at two frames).
BURST_S = 0.001
#: Queue (TBF limit) in seconds of traffic at the shaped rate, within the bounds below.
QUEUE_S = 0.5
QUEUE_MIN_FRAMES = 100
QUEUE_MAX_BYTES = 16 << 20
#: TCP goodput per byte of Ethernet frame at MTU 1500 with timestamps: 1448 / 1514.
GOODPUT_FACTOR = 1448 / 1514

_SEARCH_DIRS = ("/usr/sbin", "/sbin", "/usr/bin", "/bin", "/usr/local/sbin")
_CAP_NET_ADMIN = 12
_CAP_SYS_ADMIN = 21

_NO_ROOT_HINT = (
    "hetps netem needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) to create network namespaces, "
    "veth pairs and tc qdiscs; run it as root (e.g. sudo), or use the in-process shaper "
    "instead: set HETPS_SHAPE_MBIT=<rate> to rate-limit the transport with a token bucket "
    "(no root needed, but less exact: it paces messages in user space, so it sees no kernel "
    "queues, no TCP dynamics and no per-packet timing)"
)


class NetemError(RuntimeError):
    """The emulator could not be set up, changed or torn down."""


class NetemPermissionError(NetemError, PermissionError):
    """Not root (or missing capabilities / tools) — the message points to the alternative."""


class NetemUnsupportedError(NetemError):
    """The kernel lacks a feature the scenario needs (e.g. sch_netem for ``delay_ms``)."""


def goodput_mbit(rate_mbit: float) -> float:
    """TCP payload throughput expected on a link shaped to ``rate_mbit`` (frames incl. headers)."""
    return rate_mbit * GOODPUT_FACTOR


def find_tool(name: str) -> str | None:
    """Absolute path of ``name`` (``ip``, ``tc``) on ``PATH`` or in the usual sbin dirs."""
    found = (c for c in (os.path.join(d, name) for d in _SEARCH_DIRS) if os.access(c, os.X_OK))
    return shutil.which(name) or next(found, None)


def _has_caps() -> bool:
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("CapEff:"):
                caps = int(line.split()[1], 16)
                return bool(caps >> _CAP_NET_ADMIN & 1) and bool(caps >> _CAP_SYS_ADMIN & 1)
    return False


def require_root() -> tuple[str, str]:
    """Check that namespaces can be created here; return the paths of ``ip`` and ``tc``.

    Raises:
        NetemPermissionError: not root / missing capabilities, not Linux, or ``ip``/``tc``
            missing. The message says what is missing and points to the in-process shaper.
    """
    if not sys.platform.startswith("linux"):
        raise NetemPermissionError(f"hetps netem needs Linux network namespaces. {_NO_ROOT_HINT}")
    if not _has_caps():
        who = (
            "not running as root"
            if os.geteuid() != 0
            else "running as root but without CAP_NET_ADMIN and CAP_SYS_ADMIN "
            "(a restricted container?)"
        )
        raise NetemPermissionError(f"{who}. {_NO_ROOT_HINT}")
    ip, tc = find_tool("ip"), find_tool("tc")
    missing = [n for n, p in (("ip", ip), ("tc", tc)) if p is None]
    if missing:
        raise NetemPermissionError(
            f"{' and '.join(missing)} not found (install iproute2). {_NO_ROOT_HINT}"
        )
    if not os.path.isdir("/proc/self/ns") or not os.path.exists("/proc/self/ns/net"):
        raise NetemPermissionError(f"this kernel has no network namespaces. {_NO_ROOT_HINT}")
    assert ip is not None and tc is not None
    return ip, tc


def run_tool(argv: Sequence[str], *, input: str | None = None, what: str = "") -> str:
    r = reap.quiet(list(argv), input)
    if r.returncode != 0:
        msg = (r.stderr or r.stdout).strip()
        if "qdisc kind is unknown" in msg and "netem" in (input or " ".join(argv)):
            raise NetemUnsupportedError(
                "delay_ms needs the kernel's netem qdisc (CONFIG_NET_SCH_NETEM / module "
                "sch_netem), which this kernel lacks; fix: load sch_netem, or remove delay_ms "
                "from the scenario"
            )
        if "Operation not permitted" in msg or "Permission denied" in msg:
            raise NetemPermissionError(f"{what or 'command'}: {msg}. {_NO_ROOT_HINT}")
        detail = f"\n--- commands ---\n{input}" if input else ""
        raise NetemError(f"{what or 'command'} failed: {' '.join(argv)}: {msg}{detail}")
    return r.stdout


TCP_CC_FILE = "/proc/sys/net/ipv4/tcp_congestion_control"


def read_sysctl(name: str) -> str:
    try:
        with open(f"/proc/sys/net/ipv4/{name}") as f:
            return f.read().strip() or "none"
    except OSError:
        return "unknown"


def bits(rate_mbit: float) -> int:
    return max(8000, int(round(rate_mbit * 1e6)))


def tbf_params(rate_bit: int) -> str:
    """``rate … burst … limit …`` for a TBF shaper (see docs/NETEM.md, "Limits")."""
    rate_bps = rate_bit / 8
    burst = max(2 * FRAME, int(rate_bps * BURST_S))
    limit = int(min(max(rate_bps * QUEUE_S, QUEUE_MIN_FRAMES * FRAME), QUEUE_MAX_BYTES))
    return f"rate {rate_bit}bit burst {burst} limit {limit}"


# The per-destination classifier: HTB classes so fast they never throttle (TBFs shape).
CLASSIFY = "rate 100gbit ceil 100gbit burst 1m cburst 1m quantum 60000"


def pick_subnet(ip: str) -> ipaddress.IPv4Network:
    """First ``10.77.k.0/24`` (then ``172.30.k``, ``192.168.k``) that overlaps no address or
    route of the caller's namespace. The nodes' namespaces are isolated, so this only keeps
    their addresses from being confused with the host's in logs and configs."""
    used: list[ipaddress.IPv4Network] = []
    for argv in ([ip, "-o", "-4", "addr", "show"], [ip, "-4", "route", "show", "table", "all"]):
        for tok in reap.quiet(argv).stdout.split():
            if tok[:1].isdigit() and ("/" in tok or tok.count(".") == 3):
                with contextlib.suppress(ValueError):
                    used.append(ipaddress.IPv4Network(tok, strict=False))
    for base in ("10.77", "172.30", "192.168"):
        for k in range(256):
            cand = ipaddress.IPv4Network(f"{base}.{k}.0/24")
            if not any(cand.overlaps(u) for u in used if u.prefixlen > 0):
                return cand
    raise NetemError("no free private /24 subnet; fix: pass subnet='10.x.y.0/24' to Netem")


@dataclass
class RunInfo:
    """A set of namespaces that belong to one emulator run (for ``show`` and ``cleanup``)."""

    run_id: str
    pid: int
    alive: bool
    namespaces: list[str] = field(default_factory=list)


def list_runs(prefix: str = DEFAULT_PREFIX, *, ip: str | None = None) -> list[RunInfo]:
    """Emulator runs whose namespaces exist now, grouped by run id, with owner liveness."""
    ip = ip or find_tool("ip")
    if ip is None:
        return []
    runs: dict[str, RunInfo] = {}
    for name in reap.list_namespaces(ip):
        m = reap.NAME_RE.match(name)
        if not m or m.group("prefix") != prefix:
            continue
        run_id = name.rsplit("-", 1)[0]
        pid = int(m.group("pid"))
        info = runs.setdefault(run_id, RunInfo(run_id, pid, reap.pid_alive(pid)))
        info.namespaces.append(name)
    for info in runs.values():
        info.namespaces.sort(key=lambda s: (s.endswith("-hub"), len(s), s))
    return sorted(runs.values(), key=lambda r: r.run_id)


def cleanup_stale(prefix: str = DEFAULT_PREFIX, *, force: bool = False) -> list[str]:
    """Remove namespaces left behind by crashed runs with ``prefix``; return their names.

    A run is stale when its owner process (the pid in the namespace names) is gone. With
    ``force=True`` live runs are removed too (their processes inside are killed).
    """
    ip, _ = require_root()
    removed: list[str] = []
    for info in list_runs(prefix, ip=ip):
        if info.alive and not force:
            log.info("netem: keeping live run %s (owner pid %d)", info.run_id, info.pid)
            continue
        removed += reap.remove_run(ip, info.run_id, names=info.namespaces)
    return removed
