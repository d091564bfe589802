"""Shared-memory rings offered by a peer of the job that misbehaves: an offer naming another
connection's ring, and a ring truncated by its sender. Two vans over real sockets (and, for
the truncation, in a child process: without the check it dies of SIGBUS)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import numpy as np

from hetps.transport import shm
from hetps.transport.codec import Message
from hetps.transport.inbox import MAX_STASHED_OFFERS
from hetps.transport.van import RING_MIN_BYTES, RING_OFFER, Van

MiB = 1 << 20


def _mine() -> list[str]:
    return [n for n in os.listdir(shm.SHM_DIR) if n.startswith(f"hetps-shm-{os.getpid()}-")]


def test_a_ring_offer_cannot_take_over_another_connections_ring(caplog):
    rx = Van(name="rx", ring_bytes=8 * MiB)
    tx, other = Van(name="tx", ring_bytes=8 * MiB), Van(name="other")
    caplog.set_level(logging.WARNING, logger="hetps.van")
    try:
        rx.admit(tx.connect(1, rx.endpoint), 5)
        rx.admit(other.connect(1, rx.endpoint), 7)  # another node of the job
        n = RING_MIN_BYTES // 4 + 1024
        tx.send(1, Message("push", arrays=[np.full(n, 1, np.float32)]))
        first = rx.recv(timeout=10)
        assert first is not None and first.sender == 5
        name = tx._rings_out[1].name  # opened by rx; its name not unlinked yet
        assert name in rx._rings_in and os.path.exists(os.path.join(shm.SHM_DIR, name))
        other.send(1, Message(RING_OFFER, body={"name": name}))
        other.send(1, Message("ping"))  # after its offer, on the same connection
        ping = rx.recv(timeout=10)
        assert ping is not None and ping.cmd == "ping" and ping.sender == 7
        second = np.full(n, 2, np.float32)
        tx.send(1, Message("push", arrays=[second]))  # through the ring now
        assert tx._rings_out[1].head > 0
        got = rx.recv(timeout=10)
        assert got is not None and got.sender == 5, caplog.text
        np.testing.assert_array_equal(got.arrays[0], second)
        assert f"ring {name} is another connection's" in caplog.text
    finally:
        for v in (tx, other, rx):
            v.close()
    assert not _mine()


def test_a_malformed_ring_offer_is_refused_naming_its_field(caplog):
    """A ring offer that is no RingOffer (a name that is no text, an unknown field) is
    refused with a warning that says what is wrong; the peer's next message still arrives
    and the ring in place still carries the arrays, exact."""
    rx = Van(name="rx", ring_bytes=8 * MiB)
    tx = Van(name="tx", ring_bytes=8 * MiB)
    caplog.set_level(logging.WARNING, logger="hetps.shm")
    try:
        rx.admit(tx.connect(1, rx.endpoint), 5)
        n = RING_MIN_BYTES // 4 + 1024
        tx.send(1, Message("push", arrays=[np.full(n, 1, np.float32)]))
        assert rx.recv(timeout=10) is not None
        rings = dict(rx._rings_in)
        for bad, says in [({"name": 7}, "Expected `str`, got `int` - at `$.name`"),
                          ({"name": "x", "y": 1}, "Object contains unknown field `y`")]:  # fmt: skip
            tx.send(1, Message(RING_OFFER, body=bad))
            tx.send(1, Message("ping"))
            ping = rx.recv(timeout=10)
            assert ping is not None and ping.cmd == "ping" and ping.sender == 5
            assert f"refused a ring offer from node 5: {says}" in caplog.text
        assert rx._rings_in == rings
        second = np.full(n, 2, np.float32)
        tx.send(1, Message("push", arrays=[second]))
        assert tx._rings_out[1].head > 0
        got = rx.recv(timeout=10)
        assert got is not None and got.sender == 5
        np.testing.assert_array_equal(got.arrays[0], second)
    finally:
        for v in (tx, rx):
            v.close()
    assert not _mine()


def test_offers_of_connections_never_admitted_do_not_crowd_out_an_honest_early_offer(caplog):
    """A full stash of ring offers from a connection that is never admitted (its node table
    never comes) gives way: a peer whose offer comes before its admission still gets its
    ring once admitted, every array exact; the stale offers never open a ring."""
    rx = Van(name="rx", ring_bytes=8 * MiB)
    stale, tx = Van(name="stale"), Van(name="tx", ring_bytes=8 * MiB)
    caplog.set_level(logging.WARNING, logger="hetps.van")
    try:
        stale.connect(1, rx.endpoint)  # never admitted
        for i in range(MAX_STASHED_OFFERS):
            stale.send(1, Message(RING_OFFER, body={"name": f"hetps-shm-stale-{i}"}))
        stale.send(1, Message("ping"))  # after its offers, on the same connection
        ping = rx.recv(timeout=10)
        assert ping is not None and ping.cmd == "ping" and ping.sender == 0
        assert len(rx.inbox.stashed) == MAX_STASHED_OFFERS  # full
        rid = tx.connect(1, rx.endpoint)
        n = RING_MIN_BYTES // 4 + 1024
        first = np.full(n, 1, np.float32)
        tx.send(1, Message("push", arrays=[first]))  # inline; its ring offered before it
        got = rx.recv(timeout=10)
        assert got is not None and got.sender == 0  # not admitted yet
        np.testing.assert_array_equal(got.arrays[0], first)
        rx.admit(rid, 5)  # its node table came: the offer kept is applied
        assert tx._rings_out[1].name in rx._rings_in, caplog.text
        second = np.full(n, 2, np.float32)
        tx.send(1, Message("push", arrays=[second]))
        assert tx._rings_out[1].head > 0  # through the ring
        got = rx.recv(timeout=10)
        assert got is not None and got.sender == 5
        np.testing.assert_array_equal(got.arrays[0], second)
        assert not any("stale" in name for name in rx._rings_in)
        assert "dropped the oldest offer of an unknown connection" in caplog.text
    finally:
        for v in (tx, stale, rx):
            v.close()
    assert not _mine()


TRUNCATE = """
import logging, os, sys
import numpy as np
from hetps.transport import shm
from hetps.transport.codec import Message
from hetps.transport.van import RING_MIN_BYTES, Van
logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format="%(message)s")
rx, tx = Van(name="rx", ring_bytes=8 << 20), Van(name="tx", ring_bytes=8 << 20)
rx.admit(tx.connect(1, rx.endpoint), 5)
n = RING_MIN_BYTES // 4 + 1024
tx.send(1, Message("push", arrays=[np.full(n, 1, np.float32)]))
assert rx.recv(timeout=10) is not None
fd = os.open(os.path.join(shm.SHM_DIR, tx._rings_out[1].name), os.O_RDWR)
tx.send(1, Message("push", arrays=[np.full(n, 2, np.float32)]))  # into the ring
assert tx._rings_out[1].head > 0
os.ftruncate(fd, 0)  # the sender takes the ring's pages away
os.close(fd)
print("GOT", rx.recv(timeout=1), flush=True)  # dropped: nothing comes
tx.send(1, Message("ping"))
print("THEN", rx.recv(timeout=10).cmd, flush=True)  # the receiver lives on
tx.close()
rx.close()
"""


def test_a_ring_truncated_by_its_sender_is_refused_not_a_crash(tmp_path):
    script = tmp_path / "truncate.py"
    script.write_text(textwrap.dedent(TRUNCATE))
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    out = res.stdout + res.stderr
    assert res.returncode == 0, f"code {res.returncode} (SIGBUS is -7):\n{out}"
    assert "was truncated by its sender (0 of" in out, out
    assert "closed ring hetps-shm-" in out and "GOT None" in out and "THEN ping" in out, out
