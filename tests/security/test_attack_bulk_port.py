"""Attacks at a node's bulk port by a stranger (no cluster secret) that watches the wire."""

from __future__ import annotations

import socket
import time

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from hetps.transport import bulk_in as bulk_mod

from . import test_bulk
from .test_bulk import _push

pair = test_bulk.pair  # (the fixture: two secured vans, tx node 1, rx node 2)


def test_attack_a_proof_read_off_the_wire_opens_more_connections(pair):
    """The PLAIN proof is a fixed bearer token per channel, sent in the clear at every
    (re)connection. A stranger that saw it once opens connections of its own under the
    channel id while the genuine one is up: ZAP lets each in (``authorize`` accepts a
    channel's proof any number of times), and ZeroMQ does not "turn a second one away" as
    SECURITY.md says: it parks the connection with its routing id unclaimed and queues what
    it sends (RCVHWM 4 frames of 16 MiB, plus socket buffers), which the node never reads
    or frees. Connections past the handshake are not capped. Measured: 4 such connections,
    each sending 8 frames of 16 MiB, grew the node's memory from 63 to 317 MiB, with not
    one frame refused (none was read)."""
    tx, rx = pair
    sent = _push(tx, 0)
    np.testing.assert_array_equal(rx.recv(timeout=10).arrays[0], sent)
    cid = tx.bulk.out[2].cid  # what the observer read off the wire:
    proof = bulk_mod.proof_of(tx.bulk.offers[2].key, cid)  # (the PLAIN password, in clear)
    ctx = zmq.Context()
    try:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.ROUTING_ID, cid)
        s.setsockopt(zmq.PLAIN_USERNAME, cid)
        s.setsockopt(zmq.PLAIN_PASSWORD, proof)
        mon = s.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_DISCONNECTED
        )
        s.connect(f"tcp://127.0.0.1:{rx.bulk.rx.port}")
        event = None
        deadline = time.monotonic() + 10
        while event is None:
            assert time.monotonic() < deadline, "no handshake outcome"
            rx.recv(timeout=0.02)  # (the node's loop runs: its guard sees the handshake)
            if mon.poll(0):
                event = recv_monitor_message(mon)["event"]
        assert event != zmq.EVENT_HANDSHAKE_SUCCEEDED, (
            "a stranger replaying the channel's proof got a second connection in"
        )
    finally:
        ctx.destroy(linger=0)


def test_attack_greeting_only_connections_escape_the_bulk_ports_cap(pair, monkeypatch):
    """SECURITY.md: the bulk port's handshakes are "capped (256 waiting; silent ones go
    after 1 s) as at the CURVE port". The guard is made with ``secured=False``, so a
    connection that sent ZMTP's 64-byte greeting counts as speaking and is never shut: a
    stranger that greets and stalls holds a descriptor for the full 10 s handshake timeout,
    as many as it opens (400 such stayed pending, 0 shut; the CURVE port shut 271 of
    them). The PLAIN HELLO follows the greeting at once, as CURVE's does."""
    from hetps.transport import handshakes

    from .test_handshakes import _eof
    from .zmtp import greeting

    monkeypatch.setattr(handshakes, "MAX_PENDING", 4)
    monkeypatch.setattr(handshakes, "SILENT_S", 0.3)
    tx, rx = pair
    stalled = []
    try:
        for _ in range(10):
            s = socket.create_connection(("127.0.0.1", rx.bulk.rx.port))
            s.sendall(greeting(b"PLAIN"))
            stalled.append(s)
        deadline = time.monotonic() + 3  # (ten times SILENT_S; the timeout is 10 s)
        while time.monotonic() < deadline and sum(_eof(s) for s in stalled) < 10:
            rx.recv(timeout=0.05)
        assert rx.bulk.rx.guard.shut == 10, (
            f"{rx.bulk.rx.guard.pending} greeting-only connections wait, "
            f"{rx.bulk.rx.guard.shut} shut"
        )
    finally:
        for s in stalled:
            s.close()
