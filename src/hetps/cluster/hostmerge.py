"""The host channel's frames (cluster/hostlead.py) and a host's link samples merged per
(src, dst, kind) by its leader before it sends the host's one report."""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import os
import socket
import struct
import termios
from collections.abc import Sequence
from typing import Annotated, Any

import msgspec
import numpy as np
from msgspec import Meta

from hetps.cluster.commands import BalanceAnswer, NodeId

_LEN = struct.Struct("<I")
_MAX_FRAME = 1 << 26  # a report's samples (the balance agent keeps at most 100,000: 4.8 MB)
REPORT = "r"  # the kind of a link report; a barrier's is "b:" and its group


def _name(secret: bytes, group: int, leader: int) -> bytes:
    tag = hmac.new(secret, f"hostlead:{group}:{leader}".encode(), hashlib.sha256).hexdigest()
    return b"\0hetps-lead-" + tag[:32].encode()


# -- the frames of the host's channel: a follower's Hello (its node id), then its arrivals
# (Hand: kind, REPORT or "b:" and a barrier's group; n, its round or number; w, a report's
# body, samples and times); the leader's answers (Told: kind, n, ok: the scheduler answered,
# a: a barrier's live members or the planner's answer)
class Hello(msgspec.Struct, forbid_unknown_fields=True):
    id: NodeId


class Report(msgspec.Struct, forbid_unknown_fields=True):
    b: dict[str, Any]
    s: bytes  # float64 rows of 6
    t: bytes  # float64 rows of 3


class Hand(msgspec.Struct, forbid_unknown_fields=True):
    k: Annotated[str, Meta(max_length=16)]
    n: Annotated[int, Meta(ge=1)]
    w: Report | None = None


class Told(msgspec.Struct, forbid_unknown_fields=True):
    k: str
    n: int
    ok: bool
    a: BalanceAnswer | list[NodeId] | None = None


_DECODERS = {kind: msgspec.msgpack.Decoder(kind) for kind in (Hello, Hand, Told)}
_ENCODER = msgspec.msgpack.Encoder()


def _send(sock: socket.socket, frame: Any) -> None:
    data = _ENCODER.encode(frame)
    sock.sendall(_LEN.pack(len(data)) + data)


def _same_user(sock: socket.socket) -> bool:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1] == os.geteuid()


def _unread(sock: socket.socket) -> int:
    """Bytes sent on ``sock`` that its peer has not read yet (the kernel's queue: SIOCOUTQ)."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, bytes(4)))[0]


def _rows(data: bytes, cols: int) -> np.ndarray:
    return np.frombuffer(data, np.float64).reshape(-1, cols)


def merge_host(samples: np.ndarray, host: Sequence[int]) -> np.ndarray:
    """A host's data samples merged per (src, dst, kind) before its leader sends them, the
    host's workers named by ``host[0]`` (the planner gives them one row: their link): each
    pair's overlapping or touching transfers become one row (their bytes summed, the first
    start, the last end). Every node's bytes and busy-time union, all the planner's node
    rates read, stay exact; a pair's per-message rates (the small link matrix of reports and
    plots) become the rates of its merged transfers. Probes, spread flows and rows the
    planner drops pass unchanged, in their order."""
    t0, t1, nbytes, kind = samples[:, 3], samples[:, 4], samples[:, 2], samples[:, 5]
    with np.errstate(invalid="ignore"):
        data = (t1 > t0) & (nbytes > 0) & np.isfinite(samples).all(1) & ~np.isin(kind, (1, 2, 3))
    d = samples[data].copy()
    if not len(d) or not len(host):
        return samples
    for col in (0, 1):
        d[np.isin(d[:, col], np.asarray(host, dtype=np.float64)), col] = host[0]
    d = d[np.lexsort((d[:, 3], d[:, 5], d[:, 1], d[:, 0]))]
    first = np.r_[True, (np.diff(d[:, [0, 1, 5]], axis=0) != 0).any(1)]
    # a new transfer where a pair's start is past every earlier end of the pair: a running
    # maximum of the ends per pair, on the ranks of the times (exact; groups kept apart)
    times = np.unique(np.r_[d[:, 3], d[:, 4]])
    span = len(times) + 1
    group = np.cumsum(first) * span
    ends = np.maximum.accumulate(group + np.searchsorted(times, d[:, 4]))
    start = group + np.searchsorted(times, d[:, 3])
    new = first | (start > np.r_[-1, ends[:-1]])
    at = np.flatnonzero(new)
    out = d[at]
    out[:, 2] = np.add.reduceat(d[:, 2], at)
    out[:, 4] = np.maximum.reduceat(d[:, 4], at)
    return np.concatenate([out, samples[~data]])
