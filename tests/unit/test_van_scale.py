"""The van at scale: a scheduler holds one DEALER per node (benchmarks/scale_sim.py)."""

from __future__ import annotations

import resource
import time
from dataclasses import replace

import numpy as np
import pytest

from hetps.transport import codec
from hetps.transport.codec import Message, encode
from hetps.transport.van import Van, _alike

PEERS = 1100  # above ZeroMQ's default limit of 1023 sockets per context


def test_van_connects_to_more_than_a_thousand_peers():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 4 * PEERS + 256  # a mailbox per socket, both ends of each loopback connection
    if soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {need}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    van = Van()
    try:
        for peer in range(PEERS):
            van.connect(peer, f"127.0.0.1:{van.port}")
        assert van.has_peer(PEERS - 1)
    finally:
        van.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _received(van: Van, count: int) -> list:
    got: list = []
    deadline = time.monotonic() + 10
    while len(got) < count and time.monotonic() < deadline:
        got += van.inbox.recv_many(timeout=0.5)
    return got


def test_an_answer_sent_alike_is_each_peers_own_and_encoded_as_one_by_one(monkeypatch):
    # a plan every host's leader gets (the scheduler's Van.send_alike): each header the bytes
    # encode() gives with the peer's request number, numbers of every packed length
    monkeypatch.setattr(codec.time, "time", lambda: 1.5)
    msg = Message("balance_report", reply=True, body={"plan": bytes(range(200)) * 9})
    heads, rest = _alike(msg)
    assert heads is not None and rest == []
    for req in (0, 5, 127, 128, 255, 256, 70_000, 1 << 33):
        assert heads(req) == encode(replace(msg, req=req))[0]
    a, b = Van(name="a"), Van(name="b")
    try:
        reqs = {p: 1000 + 97 * p for p in range(6)}
        for p in reqs:
            a.connect(p, b.endpoint, routing_id=bytes([1, p]))
        a.mark_dead(4)  # (a dead peer is named, not sent to; so is one never connected)
        gone = a.send_alike(msg, [*reqs.items(), (99, 7)])
        assert sorted(gone) == [4, 99]
        got = _received(b, 5)
        assert sorted((m.origin[1], m.req) for m in got) == [(p, reqs[p]) for p in (0, 1, 2, 3, 5)]
        assert all(m.body == msg.body and m.reply and m.cmd == msg.cmd for m in got)
        assert a.counters.snapshot()[0].bytes_sent == len(heads(reqs[0]))
        # with arrays (a ring or bulk channel may take them): sent one by one, each its own
        arr = np.arange(6, dtype=np.float64)
        assert a.send_alike(replace(msg, arrays=[arr]), [(0, 3), (1, 4)]) == []
        got = _received(b, 2)
        assert sorted((m.origin[1], m.req) for m in got) == [(0, 3), (1, 4)]
        assert all(np.array_equal(m.arrays[0], arr) for m in got)
    finally:
        a.close()
        b.close()
