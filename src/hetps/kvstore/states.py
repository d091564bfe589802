"""Saving and loading the servers' optimizer states, for
:class:`~hetps.kvstore.client.DistKVStore` (MXNet's ``save_optimizer_states`` and
``load_optimizer_states``), which it takes as its port, :class:`~hetps.kvstore.ports.StorePort`."""

from __future__ import annotations

import os

import numpy as np

from hetps import optim
from hetps.cluster import protocol as P
from hetps.cluster.requests import wait_all
from hetps.kvstore.ports import StorePort
from hetps.transport.codec import Message


def save(kv: StorePort, fname: str) -> None:
    """Write every server's optimizer state to ``fname`` (after ``kv``'s pushes)."""
    kv.wait_outstanding()
    futs = [kv.request(None, 0, s, Message(P.GET_STATES)) for s in serving_ranks(kv)]
    replies = wait_all(futs, kv.timeout, "save_optimizer_states")
    merged: dict = {}
    for r in replies:
        merged.update(optim.load_states(r.arrays[0].tobytes()))
    tmp = f"{fname}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(optim.dump_states(merged))
    os.replace(tmp, fname)


def serving_ranks(kv: StorePort) -> list[int]:
    """One server rank per live server that serves keys (a dead server's requests go to
    the one that took over: asking both would ask that one twice)."""
    seen: set[int] = set()
    out = []
    for rank, sid in enumerate(kv.server_ids):
        peer = kv.node.route(sid)
        if peer not in seen:
            seen.add(peer)
            out.append(rank)
    return out


def load(kv: StorePort, fname: str) -> None:
    """Load optimizer states written by :func:`save` onto the servers (after ``kv``'s
    pushes took effect)."""
    kv.wait_outstanding()
    with open(fname, "rb") as f:
        blob = np.frombuffer(f.read(), dtype=np.uint8)
    futs = [
        kv.request(None, 0, s, Message(P.SET_STATES, arrays=[blob])) for s in range(kv.num_servers)
    ]
    wait_all(futs, kv.timeout, "load_optimizer_states")
