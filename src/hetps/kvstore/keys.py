"""What a worker knows of each key, and where the values it pulls land."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hetps.cluster.errors import ClusterError
from hetps.cluster.requests import Future
from hetps.kvstore.placement import Part
from hetps.transport.codec import Message


@dataclass
class KeyMeta:
    """What a worker knows of one key."""

    shape: tuple[int, ...]
    dtype: np.dtype
    parts: list[Part]
    residual: np.ndarray | None = None
    # push capture: a buffer the values are copied into, free again once its push is answered
    stage: np.ndarray | None = None
    pushed: list[Future] = field(default_factory=list)  # the last push's requests
    # pull prefetch: a push of this key carries "answer with the value" when the worker pulls
    # what it pushed; the pull then takes that answer (futures, the flat buffer it lands in)
    prefetching: bool = False
    pushed_since_pull: bool = False
    prefetch: tuple[list[Future], np.ndarray] | None = None
    spare: np.ndarray | None = None  # a prefetch buffer a finished pull gave back

    @property
    def size(self) -> int:
        """Number of elements."""
        return int(np.prod(self.shape, dtype=np.int64))


def land_into(k: Any, dest: np.ndarray, a: int, b: int):
    """The callback that copies an answer's values into ``dest[a:b]``."""

    def land(reply: Message) -> None:
        if not reply.arrays or reply.arrays[0].size != b - a:
            raise ClusterError(f"pull of key {k!r}: server sent a wrong-sized reply")
        got = reply.arrays[0]
        if got.ctypes.data != dest[a:b].ctypes.data:  # (else the van copied it in place)
            dest[a:b] = got.reshape(-1)
        reply.arrays = []  # copied out: do not keep a second copy in the future

    return land


def fill_targets(meta: KeyMeta, dest: np.ndarray, targets: list[np.ndarray], direct: bool):
    """What a pull does once all its answers landed: fill the targets that were not ``dest``."""
    first = targets[0]

    def finish() -> None:
        if not direct:
            first[...] = dest.reshape(meta.shape)
        for t in targets[1:]:
            t[...] = first

    return finish
