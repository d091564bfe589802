"""The bulk channels (transport/bulk.py) against an attacker on the wire and strangers at the
bulk port: two secured vans over real sockets, the sender's bulk connection through a TCP
relay that records every byte and can tamper with, drop or replay whole ZeroMQ frames."""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time

import numpy as np
import pytest
import zmq

from hetps.transport import bulk_in as bulk_mod
from hetps.transport.codec import FRAME_MAX, Message
from hetps.transport.van import BULK_MIN_BYTES, Van

from .zmtp import Peer, frame_header

SECRET = b"bulk-test-cluster-secret-0123456789"
N = 300_000  # float32: 1.2 MB, one frame


class Relay:
    """A TCP relay to ``port``: records what the client sends, and hands each of its
    message frames (not ZMTP commands) to ``edit(index, body) -> [bodies to forward]``."""

    def __init__(self, port: int, edit=None) -> None:
        self.target = port
        self.edit = edit or (lambda i, body: [body])
        self.seen = bytearray()
        self.frames: list[bytes] = []
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.port = self.lsock.getsockname()[1]
        self.threads: list[threading.Thread] = []
        self.socks: list[socket.socket] = [self.lsock]
        t = threading.Thread(target=self._accept, daemon=True)
        t.start()
        self.threads.append(t)

    def _accept(self) -> None:
        try:
            cli, _ = self.lsock.accept()
        except OSError:
            return
        srv = socket.create_connection(("127.0.0.1", self.target))
        self.socks += [cli, srv]
        for fn, args in ((self._up, (cli, srv)), (self._down, (srv, cli))):
            t = threading.Thread(target=fn, args=args, daemon=True)
            t.start()
            self.threads.append(t)

    @staticmethod
    def _read(s: socket.socket, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = s.recv(n - len(out))
            if not chunk:
                raise OSError("closed")
            out += chunk
        return out

    def _up(self, cli: socket.socket, srv: socket.socket) -> None:
        try:
            left = 64  # the greeting, passed on as it comes (each side waits for parts of it)
            while left:
                chunk = cli.recv(left)
                if not chunk:
                    return
                self.seen += chunk
                srv.sendall(chunk)
                left -= len(chunk)
            while True:
                flags = self._read(cli, 1)
                size_raw = self._read(cli, 8 if flags[0] & 0x02 else 1)
                size = struct.unpack(">Q", size_raw)[0] if flags[0] & 0x02 else size_raw[0]
                body = self._read(cli, size)
                self.seen += flags + size_raw + body
                if flags[0] & 0x04:  # a command (READY, PING): as it is
                    srv.sendall(flags + size_raw + body)
                    continue
                self.frames.append(body)
                for out in self.edit(len(self.frames) - 1, body):
                    srv.sendall(frame_header(len(out), bool(flags[0] & 0x01)) + out)
        except OSError:
            pass

    def _down(self, srv: socket.socket, cli: socket.socket) -> None:
        try:
            while True:
                data = srv.recv(65536)
                if not data:
                    return
                cli.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        for s in self.socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        for t in self.threads:
            t.join(timeout=5)


def _until(cond, what: str, van: Van, timeout: float = 10.0) -> None:
    """Let ``van``'s receive loop run (it takes in-van offers) until ``cond()``."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        van.recv(timeout=0.02)


@pytest.fixture
def pair():
    """(tx, rx): secured vans, each offered the other's bulk channel; tx is node 1, rx 2."""
    tx, rx = Van(name="tx", secret=SECRET, bulk=True), Van(name="rx", secret=SECRET, bulk=True)
    relays: list[Relay] = []
    try:
        rx.admit(tx.connect(2, rx.endpoint, bulk=True), 1)
        tx.admit(rx.connect(1, tx.endpoint, bulk=True), 2)
        _until(lambda: tx.bulk is not None and 2 in tx.bulk.offers, "no offer from rx", tx)

        def through(edit=None) -> Relay:
            """Send tx's bulk connection to rx through a relay."""
            relay = Relay(tx.bulk.offers[2].port, edit)
            relays.append(relay)
            tx.bulk.offers[2].port = relay.port
            return relay

        tx.through = through
        yield tx, rx
    finally:
        for v in (tx, rx):
            v.close()
        for r in relays:
            r.close()


def _push(tx: Van, k: float) -> np.ndarray:
    a = np.arange(N, dtype=np.float32) + np.float32(k)
    tx.send(2, Message("push", req=int(k), arrays=[a]))
    return a


def test_bulk_bytes_on_the_wire_are_sealed_and_values_exact(pair):
    """The array crosses the bulk connection (the relay sees all its bytes), but no run of
    its plaintext does; the receiver gets it exact, from node 1."""
    tx, rx = pair
    relay = tx.through()
    sent = [_push(tx, k) for k in range(3)]
    for k in range(3):
        got = rx.recv(timeout=10)
        assert got is not None and got.sender == 1 and got.req == k
        np.testing.assert_array_equal(got.arrays[0], sent[k])
    assert len(relay.frames) == 3 and len(relay.seen) >= 3 * 4 * N
    wire = bytes(relay.seen)
    for k in range(3):
        plain = sent[k].tobytes()
        for at in (0, 4096, 4 * N - 64):
            assert plain[at : at + 32] not in wire
    assert tx.bulk.out[2].next == 3  # one counter per frame, never reused


def test_a_tampered_frame_is_refused_and_the_node_keeps_serving(pair, caplog):
    """One bit flipped in the second push's frame: its tag fails, the push is dropped (not
    delivered with a wrong value), the node logs the refusal and takes the next push."""
    tx, rx = pair
    caplog.set_level(logging.WARNING)

    def flip(i: int, body: bytes) -> list[bytes]:
        if i == 1:
            body = body[:100] + bytes([body[100] ^ 0x01]) + body[101:]
        return [body]

    tx.through(flip)
    rx.bulk.rx.wait_s = 1.0  # (the genuine frame never comes)
    sent = [_push(tx, k) for k in range(3)]
    got = [rx.recv(timeout=10) for _ in range(2)]
    assert [m.req for m in got] == [0, 2], [m.req for m in got]
    np.testing.assert_array_equal(got[0].arrays[0], sent[0])
    np.testing.assert_array_equal(got[1].arrays[0], sent[2])
    assert "failed its tag (forged or tampered)" in caplog.text
    assert "dropped a bad message from node 1" in caplog.text
    assert rx.bulk.rx.refusals.total >= 1


def test_a_replayed_frame_is_refused(pair, caplog):
    """The first push's frame sent again after it (same connection, valid tag): refused as a
    replay; the next push arrives exact and nothing else is delivered."""
    tx, rx = pair
    caplog.set_level(logging.WARNING)
    tx.through(lambda i, body: [body, body] if i == 0 else [body])
    sent = [_push(tx, k) for k in range(2)]
    for k in range(2):
        m = rx.recv(timeout=10)
        assert m is not None and m.req == k
        np.testing.assert_array_equal(m.arrays[0], sent[k])
    assert rx.recv(timeout=0.3) is None
    assert "was used already (a replay)" in caplog.text


def test_a_stranger_at_the_bulk_port_is_refused_at_the_handshake(pair, caplog):
    """Plain ZeroMQ peers at the bulk port: with no credentials, with a made-up channel and
    proof, and under the genuine channel id read off the wire with a made-up proof. Each is
    refused by ZAP at the handshake (so not one of their frames is read: the frame refusals
    stay 0), logged, and the node keeps taking its peer's pushes exactly."""
    tx, rx = pair
    caplog.set_level(logging.WARNING)
    relay = tx.through()
    first = _push(tx, 0)
    m = rx.recv(timeout=10)
    np.testing.assert_array_equal(m.arrays[0], first)
    before = rx.refusals.total
    ctx = zmq.Context()
    strangers = []  # (kept: a socket collected is closed before its frames leave)
    genuine = tx.bulk.out[2].cid
    try:
        for user, password in ((None, None), (b"c" + bytes(15), bytes(32)), (genuine, bytes(32))):
            s = ctx.socket(zmq.DEALER)
            strangers.append(s)
            s.setsockopt(zmq.LINGER, 0)
            if user is not None:
                s.setsockopt(zmq.ROUTING_ID, user)
                s.setsockopt(zmq.PLAIN_USERNAME, user)
                s.setsockopt(zmq.PLAIN_PASSWORD, password)
            s.connect(f"tcp://127.0.0.1:{rx.bulk.rx.port}")
            for frame in (relay.frames[0], b"\x00" * 64):
                try:  # (its connection is refused: its queue may be gone)
                    s.send(frame, zmq.NOBLOCK)
                except zmq.Again:
                    pass
        _until(lambda: rx.refusals.total >= before + 2, "strangers not refused by ZAP", rx)
        second = _push(tx, 1)
        m = rx.recv(timeout=10)
        assert m is not None and m.req == 1
        np.testing.assert_array_equal(m.arrays[0], second)
    finally:
        ctx.destroy(linger=0)
    assert rx.recv(timeout=0.3) is None
    assert rx.bulk.rx.refusals.total == 0  # no stranger's frame was ever read
    assert "names no channel this node offered, or cannot prove it holds one" in caplog.text


def test_a_strangers_big_message_is_cut_off_at_the_handshake(pair):
    """A stranger speaking bare ZMTP (no credentials) that streams a 128 MiB multipart
    message at the bulk port: the node closes the connection at the handshake, so the kernel
    takes no more than its socket buffers of it (ZeroMQ would otherwise read and buffer the
    whole message before the node could tell it is no channel's)."""
    tx, rx = pair
    peer = Peer("127.0.0.1", rx.bulk.rx.port)
    part = b"\x00" * FRAME_MAX
    sent = 0
    try:
        peer.sock.settimeout(10)
        try:
            peer.handshake()
            for i in range(8):
                peer.send_raw(frame_header(len(part), more=i < 7))
                peer.send_raw(part)
                sent += len(part)
                rx.recv(timeout=0)  # (the node's receive loop runs as it would)
        except OSError:
            pass  # closed by the node
        assert sent < 48 << 20, f"{sent >> 20} MiB of a stranger's message were taken"
        assert peer.closed_by_peer()
    finally:
        peer.close()


def test_a_job_node_cannot_send_under_another_channels_id(pair, caplog):
    """A node proves the channel rx offered it at the handshake but names another channel's
    id as its routing id: its frames are its own channel's (kept for that channel's hello),
    since a frame's channel is the one its connection's handshake proved; nothing is kept
    for, or taken from, the channel it named."""
    tx, rx = pair
    caplog.set_level(logging.WARNING)
    mine = rx.bulk.offer(3)  # (rx's offers to a node 3 and a node 4, never sent)
    other = rx.bulk.offer(4)["id"]
    ctx = zmq.Context()
    try:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.ROUTING_ID, other)
        s.setsockopt(zmq.PLAIN_USERNAME, mine["id"])
        s.setsockopt(zmq.PLAIN_PASSWORD, bulk_mod.proof_of(mine["k"], mine["id"]))
        s.connect(f"tcp://127.0.0.1:{rx.bulk.rx.port}")
        s.send(b"\x00" * 64)
        own = rx.bulk.rx.channels[mine["id"]]
        _until(lambda: own.early, "the frame was not kept for its own channel", rx)
    finally:
        ctx.destroy(linger=0)
    assert rx.bulk.rx.channels[other].rid is None  # no connection of the channel it named
    assert not rx.bulk.rx.channels[other].early  # nothing kept for the channel it named


def test_a_peer_without_curve_cannot_open_a_channel(pair, caplog):
    """A plain peer (no secret) that says hello with a channel id of rx's: its connection is
    refused at the handshake, so the channel stays unopened and nothing is delivered."""
    tx, rx = pair
    plain = Van(name="plain")
    try:
        cid = next(iter(rx.bulk.offered))  # (rx offered tx a channel; tx has not opened it)
        plain.connect(2, rx.endpoint)
        plain.send(2, Message("__bulk_hello", body={"id": cid, "k": bytes(32)}))
        plain.send(2, Message("push", arrays=[np.ones(N, np.float32)]))
        _until(lambda: rx.refusals.total >= 1, "no handshake refused", rx)
        assert rx.recv(timeout=0.3) is None
        assert cid in rx.bulk.offered  # still unopened: nobody's hello was taken
    finally:
        plain.close()


def test_a_tampered_answer_writes_nothing_into_the_callers_array(pair):
    """An answer whose array lands in the caller's array (a pull with ``out=``) with one bit
    flipped: nothing is written there (AES-GCM puts a frame's bytes out before its tag is
    checked, so a landing frame is checked in a scratch first); the next answer lands exact."""
    tx, rx = pair
    target = np.full(N, 7, np.float32)
    rx.landing_of = lambda sender, cmd, req, body, count: {0: target}
    tx.through(
        lambda i, body: [body[:50] + bytes([body[50] ^ 0x80]) + body[51:]] if i == 0 else [body]
    )
    rx.bulk.rx.wait_s = 1.0
    a = np.arange(N, dtype=np.float32)
    tx.send(2, Message("pull", req=1, reply=True, arrays=[a]))
    assert rx.recv(timeout=3) is None
    np.testing.assert_array_equal(target, np.full(N, 7, np.float32))
    tx.send(2, Message("pull", req=2, reply=True, arrays=[a + 1]))
    got = rx.recv(timeout=10)
    assert got is not None and got.req == 2 and np.shares_memory(got.arrays[0], target)
    np.testing.assert_array_equal(target, a + 1)


def test_another_node_of_the_job_cannot_open_a_channel_offered_to_its_peer(pair, caplog):
    """A node holding the secret (node 3) says hello with the channel rx offered node 1:
    refused, logged, and the channel stays node 1's to open."""
    tx, rx = pair
    caplog.set_level(logging.WARNING)
    other = Van(name="other", secret=SECRET, bulk=True)
    try:
        rx.admit(other.connect(2, rx.endpoint), 3)
        cid = next(iter(rx.bulk.offered))
        other.send(2, Message("__bulk_hello", body={"id": cid, "k": bytes(32)}))
        other.send(2, Message("ping"))  # after the hello, on the same connection
        m = rx.recv(timeout=10)
        assert m is not None and m.cmd == "ping" and m.sender == 3
        assert cid in rx.bulk.offered and rx.bulk.rx.channels[cid].aead is None
        assert "refused a bulk hello from node 3: the channel was offered to node 1" in caplog.text
    finally:
        other.close()


def test_frames_that_overtake_their_hello_are_kept_and_checked_at_the_hello(pair):
    """The two connections race: a channel's first frames may reach the bulk port before the
    hello that opens it has been read from the CURVE connection. They are held (the channel
    id was offered), checked once the hello comes, and the message is exact."""
    tx, rx = pair
    a = np.arange(3 * N, dtype=np.float32)
    tx.send(2, Message("push", req=7, arrays=[a[:N], a[N:]]))
    cid = tx.bulk.out[2].cid
    chan = rx.bulk.rx.channels[cid]
    deadline = time.monotonic() + 10
    while len(chan.early) < 2:  # the receive loop reaching the bulk port first
        assert time.monotonic() < deadline, "the frames did not come"
        rx.bulk.rx.drain()
        rx.bulk.rx.sock.poll(10)
    assert chan.aead is None and rx.bulk.rx.pending_bytes > 4 * N
    got = rx.recv(timeout=10)
    assert got is not None and got.req == 7, got
    np.testing.assert_array_equal(got.arrays[0], a[:N])
    np.testing.assert_array_equal(got.arrays[1], a[N:])
    assert rx.bulk.rx.refusals.total == 0 and rx.bulk.rx.pending_bytes == 0


def test_a_new_offer_replaces_the_channel_at_the_next_send(pair):
    """rx connects to tx again (as a restarted process would) and offers a new channel: tx's
    next big send opens it and closes the old one; values exact on both."""
    tx, rx = pair
    first = _push(tx, 0)
    np.testing.assert_array_equal(rx.recv(timeout=10).arrays[0], first)
    old = tx.bulk.out[2]
    tx.admit(rx.connect(1, tx.endpoint, bulk=True), 2)
    _until(lambda: tx.bulk.offers[2].cid != old.cid, "no new offer", tx)
    second = _push(tx, 1)
    m = rx.recv(timeout=10)
    assert m is not None and m.req == 1
    np.testing.assert_array_equal(m.arrays[0], second)
    assert tx.bulk.out[2] is not old and old.sock.closed
    assert sum(1 for c in rx._rings_in.values() if hasattr(c, "cid")) == 1


def test_without_bulk_channels_a_secured_van_opens_no_bulk_port():
    """HETPS_BULK_CHANNELS=0 (a van made with ``bulk=False``): no bulk port is opened and
    big arrays cross the CURVE connection, exact."""
    tx, rx = Van(name="tx", secret=SECRET), Van(name="rx", secret=SECRET)
    try:
        rx.admit(tx.connect(2, rx.endpoint, bulk=True), 1)
        tx.admit(rx.connect(1, tx.endpoint, bulk=True), 2)
        sent = _push(tx, 0)
        got = rx.recv(timeout=10)
        assert got is not None and got.sender == 1
        np.testing.assert_array_equal(got.arrays[0], sent)
        assert tx.bulk is None and rx.bulk is None  # no channel offered, none opened
    finally:
        tx.close()
        rx.close()


def test_a_malformed_offer_is_refused_and_the_peer_keeps_its_channel(pair):
    """An offer whose port is not a port number (a bool is an int to Python) is refused: the
    offer in place stays, and big sends to that peer still take its channel, exact."""
    tx, rx = pair
    good = tx.bulk.offers[2]
    for port in (True, 0, 70000, "4000", None):
        bad = {"id": b"x" * 16, "k": b"k" * 32, "port": port}
        assert tx.bulk.on_offer(2, bad) is False, port
        assert tx.bulk.offers[2] is good
    sent = _push(tx, 7)
    got = rx.recv(timeout=10)
    assert got is not None and got.sender == 1
    np.testing.assert_array_equal(got.arrays[0], sent)
    assert tx.bulk.out[2].next == 1  # it went on the channel the good offer opened


def test_one_channel_cannot_hold_more_than_its_share(pair, monkeypatch, caplog):
    """A node of the job that sends frames no header will ever name (far ahead of its
    messages) fills only its own channel's budget: the frames over it are refused and
    logged, and another node's push still arrives exact."""
    tx, rx = pair
    caplog.set_level(logging.WARNING)
    monkeypatch.setattr(bulk_mod, "CHANNEL_PENDING_MAX", 3 << 20)  # (2 frames of N floats)
    other = Van(name="other", secret=SECRET, bulk=True)
    try:
        rx.admit(other.connect(2, rx.endpoint, bulk=True), 3)
        other.admit(rx.connect(3, other.endpoint, bulk=True), 2)
        _until(lambda: other.bulk is not None and 2 in other.bulk.offers, "no offer", other)
        _push(tx, 0)
        assert rx.recv(timeout=10) is not None
        chan = tx.bulk.out[2]
        for k in range(4):  # frames with no header: kept for a header that never comes
            chan.put(np.full(N * 4, k, np.uint8))
        chan.flush(lambda: None)
        _until(lambda: rx.bulk.rx.refusals.total >= 2, "no frame over the budget refused", rx)
        held = rx.bulk.rx.channels[chan.cid].held
        assert 0 < held <= 3 << 20 and rx.bulk.rx.pending_bytes == held
        assert "bytes of its channel's" in caplog.text
        sent = np.arange(N, dtype=np.float32) * 3
        other.send(2, Message("push", req=9, arrays=[sent]))
        got = rx.recv(timeout=10)
        assert got is not None and got.req == 9 and got.sender == 3
        np.testing.assert_array_equal(got.arrays[0], sent)
        assert other.bulk.out[2].next == 1  # (it came on other's channel)
    finally:
        other.close()


def test_a_header_whose_frames_never_come_holds_up_only_its_own_connection(pair, caplog):
    """tx's push loses its bulk frame on the wire and tx then sends a small message: the
    receive thread does not wait for the frame (it would, for the whole hour of its frame
    wait, if it did). Another node's message is delivered at once; tx's later message waits
    behind its push, in order, and comes once the push is dropped for its missing frame."""
    tx, rx = pair
    caplog.set_level(logging.WARNING)
    tx.through(lambda i, body: [] if i == 0 else [body])
    rx.bulk.rx.wait_s = 3600.0
    other = Van(name="other", secret=SECRET)
    try:
        rx.admit(other.connect(2, rx.endpoint), 3)
        _push(tx, 1)  # (its frame is lost)
        tx.send(2, Message("ping", req=2))
        other.send(2, Message("ping", req=3))
        got = rx.recv(timeout=10)
        assert got is not None and got.sender == 3 and got.req == 3
        assert rx.recv(timeout=0.5) is None  # tx's ping waits behind its push
        rx.bulk.rx.wait_s = 0.2
        got = rx.recv(timeout=10)
        assert got is not None and got.sender == 1 and got.req == 2 and got.cmd == "ping"
        assert "bulk frames did not come within 0.2 s of the last one" in caplog.text
        sent = _push(tx, 4)  # the channel goes on
        got = rx.recv(timeout=10)
        assert got is not None and got.req == 4
        np.testing.assert_array_equal(got.arrays[0], sent)
    finally:
        other.close()


def test_a_restarted_peer_s_new_channel_replaces_its_old_one(pair):
    """Node 1 restarts (a new process, a new connection): rx offers it a fresh channel, and
    its hello closes the one the old process had opened, so channels do not pile up."""
    tx, rx = pair
    _push(tx, 0)
    assert rx.recv(timeout=10) is not None
    old = tx.bulk.out[2].cid
    tx.close()
    tx2 = Van(name="tx2", secret=SECRET, bulk=True)
    try:
        rx.admit(tx2.connect(2, rx.endpoint, bulk=True), 1)
        tx2.admit(rx.connect(1, tx2.endpoint, bulk=True), 2)
        _until(lambda: tx2.bulk is not None and 2 in tx2.bulk.offers, "no offer", tx2)
        sent = _push(tx2, 5)
        got = rx.recv(timeout=10)
        assert got is not None and got.req == 5
        np.testing.assert_array_equal(got.arrays[0], sent)
        chans = [c for c in rx._rings_in.values() if hasattr(c, "cid")]
        assert [c.cid for c in chans] == [tx2.bulk.out[2].cid]
        assert old not in rx.bulk.rx.channels
    finally:
        tx2.close()


def test_a_malformed_hello_is_refused_and_its_channel_stays_offered(pair):
    """A hello that is no BulkHello (an id or key share of the wrong length, an unknown
    field, no map) opens nothing: the channel stays offered, and the sender's own hello
    opens it at its first big send, exact."""
    tx, rx = pair
    (cid,) = [c for c, chan in rx.bulk.offered.items() if chan.peer == 1]
    ka = b"a" * 32
    for bad in (
        {"id": cid[:15], "k": ka},
        {"id": cid, "k": ka[:31]},
        {"id": cid, "k": ka, "x": 1},
        5,
    ):
        why = rx.bulk.on_hello(1, b"o", bad, {})
        assert why == "it names no channel this node offered (or is malformed)", bad
        assert cid in rx.bulk.offered
    sent = _push(tx, 3)
    got = rx.recv(timeout=10)
    assert got is not None and got.sender == 1
    np.testing.assert_array_equal(got.arrays[0], sent)
    assert cid not in rx.bulk.offered and tx.bulk.out[2].next == 1


def test_arrays_under_the_bulk_bound_stay_on_the_curve_connection(pair):
    """Below BULK_MIN_BYTES (a table round's rows between hosts, 128-320 KiB) an array
    crosses on the CURVE connection, where the channel's second connection cost more; from
    the bound on it takes the channel. Both arrive exact."""
    tx, rx = pair

    def frames() -> int:
        return sum(c.next for c in tx.bulk.out.values())

    mid = np.arange(BULK_MIN_BYTES // 8, dtype=np.float32)  # half the bound
    big = np.arange(BULK_MIN_BYTES // 4, dtype=np.float32)  # the bound
    tx.send(2, Message("push", req=1, arrays=[mid]))
    got = rx.recv(timeout=10)
    assert got is not None and got.req == 1 and frames() == 0
    np.testing.assert_array_equal(got.arrays[0], mid)
    tx.send(2, Message("push", req=2, arrays=[big]))
    got = rx.recv(timeout=10)
    assert got is not None and got.req == 2 and frames() == 1
    np.testing.assert_array_equal(got.arrays[0], big)
