"""What a worker knows of each key, and where the values it pulls land."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hetps.cluster import bodies
from hetps.cluster.errors import ClusterError
from hetps.cluster.requests import Future
from hetps.kvstore.placement import Part
from hetps.transport.codec import Message

#: keys up to this size (bytes) have their pull answered by the push before it (one round
#: trip for both); bigger ones are pulled as their own requests, straight into ``out``
PREFETCH_MAX_BYTES = 1 << 20


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
    # dist_sync credit: the requests of this key's recent pushes, with the call that made them
    # (HETPS_ROUNDS_AHEAD of them at most; a further push waits for the oldest)
    recent: deque[tuple[int, list[Future]]] = field(default_factory=deque)
    rounds: int = 0  # pushes of this key since its init (dist_sync: its rounds)
    captures: int = 0  # pushes whose values were copied into a staging buffer (a statistic)
    #: number of elements (from ``shape``, once: every push asks for it)
    size: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.size = math.prod(self.shape)

    def free_stage(self) -> np.ndarray:
        """The staging buffer a new push may fill: the key's when its last push was
        answered, else a new one (which becomes the key's)."""
        stage = self.stage
        if stage is None or not all(f.done() for f in self.pushed):
            stage = self.stage = np.empty(self.shape, self.dtype)
        return stage

    def capture(self, arr: np.ndarray) -> np.ndarray:
        """A copy of ``arr`` that stays as it is until its push is sent: the key's staging
        buffer when its last push was answered, else a new one (which becomes the buffer)."""
        stage = self.free_stage()
        np.copyto(stage, arr.reshape(self.shape))
        self.captures += 1
        return stage

    def prefetch_into(self) -> np.ndarray | None:
        """Where this push's answer should bring the key's value (None: a plain push).

        A worker that pulls a key after pushing it gets the value with the push's answer
        from then on; a push whose value was never pulled turns that off again. The store
        asks only in dist_sync, where the pull after a push sees exactly that push's round
        (in dist_async a later pull sees the other workers' pushes made since)."""
        if self.size * self.dtype.itemsize > PREFETCH_MAX_BYTES:
            return None
        if self.prefetch is not None:  # pushed again before pulling: no pull follows pushes
            self.prefetch = None
            self.prefetching = False
        if not self.prefetching:
            return None
        buf, self.spare = self.spare, None
        return buf if buf is not None else np.empty(self.size, self.dtype)

    def take_prefetch(self, targets: list[np.ndarray]):
        """A pull answered by the last push: its futures, and what copies the value out once
        they are in (and gives the buffer back for the next push)."""
        assert self.prefetch is not None
        futs, buf = self.prefetch
        self.prefetch = None

        def finish() -> None:
            value = buf.reshape(self.shape)
            for t in targets:
                t[...] = value
            self.spare = buf

        return futs, finish


def land_into(k: Any, dest: np.ndarray, a: int, b: int, short: dict | None = None):
    """The callback that copies an answer's values into ``dest[a:b]``. ``short`` (key ->
    {(a, b): workers}) records the ranges whose value sums fewer workers than the job's (a
    worker left: HETPS_ELASTIC), as the answer says (``w``)."""

    def land(reply: Message) -> None:
        if not reply.arrays or reply.arrays[0].size != b - a:
            raise ClusterError(f"pull of key {k!r}: server sent a wrong-sized reply")
        if short is not None:
            w = bodies.answer(reply).workers
            if w is not None:
                short.setdefault(k, {})[(a, b)] = w
            elif k in short:
                short[k].pop((a, b), None)
        got = reply.arrays[0]
        # (else the van copied it in place; may_share_memory first: ctypes costs a microsecond)
        if not np.may_share_memory(got, dest) or got.ctypes.data != dest[a:b].ctypes.data:
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


class Borrowed:
    """The chunks of one push that send the caller's array (``Message.borrowed``, see
    ``KVStore._through_rings``): a chunk that must wait (queued behind other requests, or
    collected into a batch) is copied into the key's staging buffer as it starts to wait,
    the buffer taken once for the push."""

    def __init__(self, meta: KeyMeta) -> None:
        self.meta = meta
        self.stage: np.ndarray | None = None

    def owner(self, msg: Message, a: int, b: int):
        """What gives ``msg`` (the values ``[a, b)`` of the key) a copy of its own."""

        def own() -> None:
            if self.stage is None:
                self.stage = self.meta.free_stage().reshape(-1)
            dst = self.stage[a:b]
            np.copyto(dst, msg.arrays[0].reshape(-1))
            msg.arrays = [dst]
            msg.borrowed = False

        return own


def detach(msg: Message) -> None:
    """Give a request that reads the caller's memory (``borrowed``: a push that did not
    capture its values, see ``KVStore._through_rings``) copies of its own, before it is
    kept past the push call (queued, or collected into a batch)."""
    msg.arrays = [a.copy() for a in msg.arrays]
    msg.borrowed = False
