"""Connections that do not finish their handshake, and floods of refused ones, against a
real van's ROUTER (real sockets, in this process): the refusals are counted and only a few
logged; connections mid-handshake are capped and timed out, and the van still takes a node
of the job afterwards."""

from __future__ import annotations

import logging
import select
import socket
import threading
import time

import zmq

from hetps.transport import handshakes
from hetps.transport.codec import Message, encode
from hetps.transport.van import Van

SECRET = b"s" * 64


class Receiving:
    """Calls ``van.recv`` in a thread (which also reads the van's handshake monitor)."""

    def __init__(self, van: Van) -> None:
        self.van = van
        self.got: list[Message] = []
        self.stop = threading.Event()
        self.t = threading.Thread(target=self._loop, daemon=True)
        self.t.start()

    def _loop(self) -> None:
        while not self.stop.is_set():
            msg = self.van.recv(timeout=0.05)
            if msg is not None:
                self.got.append(msg)

    def close(self) -> None:
        self.stop.set()
        self.t.join(5)
        self.van.close()


def _until(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)  # polls the van's counters


def test_refused_handshakes_are_counted_and_a_few_logged(monkeypatch, caplog):
    monkeypatch.setattr(handshakes, "LOG_WINDOW_S", 3600.0)  # one window for the whole test
    caplog.set_level(logging.WARNING, logger="hetps.security")
    rx = Receiving(Van(name="rx", secret=SECRET))
    ctx = zmq.Context()
    socks = []
    try:
        for i in range(40):  # half plain ZeroMQ, half CURVE with keys of their own
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            if i % 2:
                pub, sec = zmq.curve_keypair()
                s.setsockopt(zmq.CURVE_SERVERKEY, rx.van.keys.public_key)  # (it leaked)
                s.setsockopt(zmq.CURVE_PUBLICKEY, pub)
                s.setsockopt(zmq.CURVE_SECRETKEY, sec)
            s.connect(f"tcp://127.0.0.1:{rx.van.port}")
            socks.append(s)
        _until(lambda: rx.van.refusals.total >= 40, 30, "40 refusals")
        for s in socks:
            s.close(0)
        socks = []
        lines = [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]
        assert len(lines) == handshakes.LOG_BURST, lines  # the rest only counted
        total = rx.van.refusals.total
        monkeypatch.setattr(handshakes, "LOG_WINDOW_S", 0.0)  # the window ends now
        rx.van.refusals.tick()
        said = [r.getMessage() for r in caplog.records if "more connections" in r.getMessage()]
        assert len(said) == 1 and f"refused {total - handshakes.LOG_BURST} more" in said[0]
    finally:
        for s in socks:
            s.close(0)
        ctx.term()
        rx.close()


def _eof(sock: socket.socket) -> bool:
    """Whether the other end closed (what ZeroMQ sent before that is read and dropped)."""
    try:
        while select.select([sock], [], [], 0)[0]:
            if not sock.recv(4096):
                return True
    except ConnectionError:
        return True
    return False


def test_connections_that_never_finish_their_handshake_are_capped_and_timed_out(monkeypatch):
    monkeypatch.setattr(handshakes, "MAX_PENDING", 4)
    monkeypatch.setattr(handshakes, "HANDSHAKE_S", 8.0)
    monkeypatch.setattr(handshakes, "SILENT_S", 0.3)
    rx = Receiving(Van(name="rx"))
    silent = []
    ctx = zmq.Context()
    try:
        for _ in range(10):  # TCP connections that never say a word
            silent.append(socket.create_connection(("127.0.0.1", rx.van.port)))
        # a node of the job connects meanwhile: it speaks, so it is never cut
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(f"tcp://127.0.0.1:{rx.van.port}")
        d.send_multipart([bytes(f) for f in encode(Message("early"))])
        _until(lambda: any(m.cmd == "early" for m in rx.got), 10, "the node's first message")
        # over the cap, the silent ones go after SILENT_S, long before the handshake timeout:
        # at least all but MAX_PENDING of them (one that grows old only once those are cut,
        # and the cap is no longer exceeded, waits for the timeout, as within the cap)
        _until(lambda: sum(_eof(s) for s in silent) >= 6, 6, "the silent ones over the cap")
        _until(lambda: sum(_eof(s) for s in silent) == 10, 14, "the silent ones closed")
        cut = rx.van._guard.shut
        assert 6 <= cut <= 10, cut
        assert any(m.cmd == "early" for m in rx.got)
        # within the cap nothing is shut down: silent connections end at the timeout
        few = [socket.create_connection(("127.0.0.1", rx.van.port)) for _ in range(3)]
        silent += few
        _until(lambda: all(_eof(s) for s in few), 14, "the timeout")
        assert rx.van._guard.shut == cut  # (none of them by the cap)
        # the node's connection is still there and heard
        d.send_multipart([bytes(f) for f in encode(Message("hello"))])
        _until(lambda: any(m.cmd == "hello" for m in rx.got), 10, "the node's message")
        d.close(0)
    finally:
        for s in silent:
            s.close()
        ctx.destroy(linger=0)  # (closes the node's socket too when a check above failed)
        rx.close()


def test_a_greeting_that_stalls_is_no_handshake_under_way(monkeypatch):
    """Secured, over the cap: a peer that sends ZMTP's 64-byte greeting and then nothing is
    shut down like a silent one (a node sends its CURVE HELLO with the greeting)."""
    monkeypatch.setattr(handshakes, "MAX_PENDING", 4)
    monkeypatch.setattr(handshakes, "SILENT_S", 0.3)
    rx = Receiving(Van(name="rx", secret=SECRET))
    greeting = (
        b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"CURVE".ljust(20, b"\x00") + b"\x00" * 32
    )
    assert len(greeting) == 64
    stalled = []
    try:
        for _ in range(10):
            s = socket.create_connection(("127.0.0.1", rx.van.port))
            s.sendall(greeting)
            stalled.append(s)
        _until(lambda: sum(_eof(s) for s in stalled) == 10, 5, "the stalled ones closed")
        assert rx.van._guard.shut == 10
    finally:
        for s in stalled:
            s.close()
        rx.close()


def test_a_silent_connection_that_grew_old_under_the_cap_is_cut_once_it_is_exceeded(monkeypatch):
    """The cap is exceeded after a silent connection passed SILENT_S (its peers came later, or
    the monitor told of them late): it is cut with them, not left until the timeout."""
    monkeypatch.setattr(handshakes, "MAX_PENDING", 4)
    monkeypatch.setattr(handshakes, "HANDSHAKE_S", 8.0)
    monkeypatch.setattr(handshakes, "SILENT_S", 0.3)
    rx = Receiving(Van(name="rx"))
    silent = [socket.create_connection(("127.0.0.1", rx.van.port))]
    try:
        _until(lambda: rx.van._guard.pending == 1, 6, "the first connection accepted")
        t0 = time.monotonic()  # it grows past SILENT_S under the cap (swept meanwhile)
        _until(lambda: time.monotonic() - t0 > 3 * handshakes.SILENT_S, 5, "SILENT_S")
        assert not _eof(silent[0])  # under the cap nothing is cut
        silent += [socket.create_connection(("127.0.0.1", rx.van.port)) for _ in range(5)]
        _until(lambda: sum(_eof(s) for s in silent) == 6, 6, "the six silent ones closed")
        assert rx.van._guard.shut == 6
    finally:
        for s in silent:
            s.close()
        rx.close()
