"""What a server holds of each key (a :class:`Slice` per part) and how it refuses a request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hetps.cluster.errors import BadRequest, short  # noqa: F401 (the server's parts name them here)
from hetps.kvstore.compression import TwoBitCompressor
from hetps.optim import kernels
from hetps.transport.codec import Message


@dataclass
class Slice:
    """One part of one key as held by this server."""

    key: Any
    part: int
    shape: tuple[int, ...]  # the whole key's shape (for error messages)
    value: np.ndarray  # 1-D, this part only
    state: Any = None
    has_state: bool = False
    # the round's sum (a torch tensor on the device of a device server: device.aggregator)
    merge: np.ndarray | None = None
    spare: np.ndarray | None = None  # a buffer to merge the next round into
    written: set[int] = field(default_factory=set)  # chunk offsets merged this round
    # chunk offset -> this round's pushes of it held as received (not ring memory), summed
    # with the chunk's last push in one pass (each byte of the sum written once)
    pending: dict[int, list[np.ndarray]] = field(default_factory=dict)
    chunk: Any = None  # chunk size of this round's pushes (all workers must agree)
    got: dict[int, int] = field(default_factory=dict)  # worker -> elements pushed this round
    seen: dict[int, set[int]] = field(default_factory=dict)  # worker -> chunk offsets this round
    acks: list[Message] = field(default_factory=list)
    deferred: list[Message] = field(default_factory=list)
    backlog: list[Message] = field(default_factory=list)
    inflight: list[Any] = field(default_factory=list)  # zmq trackers of zero-copy replies
    partial: dict[int, tuple[np.ndarray, int, list[Message]]] = field(default_factory=dict)
    rounds: int = 0  # dist_sync rounds applied (a resent push of an earlier one is only acked)
    # HETPS_REPLICAS: the last round is being copied to the replicas; its answers, and every
    # request of the slice that came since, wait for their acknowledgements
    copying: bool = False
    primary: bool = False  # workers send it here (else it is a copy of another server's)
    # HETPS_ELASTIC: this round's pushes, kept apart per worker until the round is complete
    # (a worker that dies leaves without a trace in it): worker -> [(offset, data), ...]
    held: dict[int, list[tuple[int, np.ndarray]]] = field(default_factory=dict)
    # workers summed into the value by its last round, when fewer than the job's (a worker
    # left, and there is no optimizer: the value is their sum); None: every worker
    short: int | None = None
    origin: int | None = None  # the server whose copy it is
    # dist_sync with host groups known: sender -> (host group, local rank, workers) of this
    # round's pushes, kept apart in ``held`` and summed per host (kvstore/hostrounds.py)
    hosts: dict[int, tuple[int, int, int]] = field(default_factory=dict)

    @property
    def skey(self) -> tuple[Any, int]:
        """The optimizer's key for this slice."""
        return (self.key, self.part)


def slice_key(item: Any) -> bool:
    """Whether ``item`` names a slice: ``[key, part]``, key an int or str, part an int."""
    return (
        isinstance(item, list)
        and len(item) == 2
        and isinstance(item[0], (int, str))
        and isinstance(item[1], int)
        and not isinstance(item[1], bool)
    )


def put(dst: np.ndarray, data: np.ndarray, comp: Any, add: bool) -> None:
    """Write (with ``add``: add) a push's values into ``dst``, in one pass over each byte on
    the kernel threads (:mod:`hetps.optim.kernels`); ``comp`` not None: ``data`` is the 2-bit
    words of that threshold, decoded on the way, with no decoded copy."""
    if comp is not None:
        TwoBitCompressor(float(comp)).decompress(data, dst.size, dst.dtype, out=dst, add=add)
    elif add:
        kernels.add_into(dst, dst, data)
    else:
        np.copyto(dst, data)
