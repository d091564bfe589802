"""Kernel pacing of ZeroMQ's connections: finding their sockets and capping their rate."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from hetps.transport import pacing
from hetps.transport.codec import Message
from hetps.transport.van import Van

pytestmark = pytest.mark.skipif(not pacing.supported(), reason="needs Linux /proc")


@pytest.fixture
def pair():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    port = srv.getsockname()[1]
    c = socket.create_connection(("127.0.0.1", port))
    a, _ = srv.accept()
    yield c, a, port
    for s in (c, a, srv):
        s.close()


def test_finds_only_the_connection_to_that_endpoint(pair):
    c, a, port = pair
    assert list(pacing.connection_fds("127.0.0.1", port)) == [c.fileno()]
    assert list(pacing.connection_fds("localhost", port)) == [c.fileno()]  # resolved
    assert list(pacing.connection_fds("127.0.0.2", port)) == []  # another address
    # the accepted side's peer is the client's ephemeral port, not the listener
    assert list(pacing.connection_fds("127.0.0.1", c.getsockname()[1])) == [a.fileno()]


def test_cap_is_set_read_back_and_lifted(pair):
    c, a, _port = pair
    assert pacing.get_max_pacing_rate(c.fileno()) == pacing.UNLIMITED
    assert pacing.set_max_pacing_rate(c.fileno(), 1_000_000.7)
    assert pacing.get_max_pacing_rate(c.fileno()) == 1_000_000
    for none in (0, -5, float("inf"), float("nan"), 1e12):
        assert pacing.set_max_pacing_rate(c.fileno(), none)
        assert pacing.get_max_pacing_rate(c.fileno()) == pacing.UNLIMITED, none
    # the caller's descriptor is untouched (only a duplicate was used and closed)
    c.sendall(b"x")
    assert a.recv(1) == b"x"


def test_looking_does_not_change_the_owners_socket(pair):
    """The descriptor is wrapped in a socket object to read its peer; with a default
    timeout set, wrapping would make the shared file description non-blocking."""
    import fcntl
    import os

    c, _a, port = pair
    before = fcntl.fcntl(c.fileno(), fcntl.F_GETFL)
    assert not before & os.O_NONBLOCK
    socket.setdefaulttimeout(5.0)
    try:
        assert list(pacing.connection_fds("127.0.0.1", port)) == [c.fileno()]
        assert pacing.pace_connections("127.0.0.1", port, 1e6) == 1
    finally:
        socket.setdefaulttimeout(None)
    assert fcntl.fcntl(c.fileno(), fcntl.F_GETFL) == before
    assert pacing.get_max_pacing_rate(c.fileno()) == 1_000_000


def test_a_capped_socket_sends_slower(pair):
    """The kernel really paces: 1 MB at 2 MB/s takes a measurable part of half a second,
    unpaced it takes a few milliseconds (loopback)."""
    c, a, _port = pair
    nbytes = 1_000_000

    def move() -> float:
        t0 = time.perf_counter()
        got = 0

        def read():
            nonlocal got
            while got < nbytes:
                chunk = a.recv(1 << 20)
                if not chunk:  # closed (the test failed): do not spin
                    return
                got += len(chunk)

        th = threading.Thread(target=read, daemon=True)
        th.start()
        c.sendall(bytes(nbytes))
        th.join()
        return time.perf_counter() - t0

    free = move()
    pacing.set_max_pacing_rate(c.fileno(), 2_000_000)
    paced = move()
    assert paced > 0.2 and paced > 5 * free, (paced, free)


def test_van_paces_its_dealer_to_a_peer():
    a, b = Van(name="a"), Van(name="b")
    try:
        a.connect(1, b.endpoint)
        a.send(1, Message("hello"))
        assert b.recv(timeout=5) is not None  # the connection is up
        assert a.pace(1, 3_000_000) == 1
        (fd,) = pacing.connection_fds("127.0.0.1", b.port, exclude_local_port=a.port)
        assert pacing.get_max_pacing_rate(fd) == 3_000_000
        a.rename(1, 7)  # peers are re-keyed after registration; the endpoint follows
        assert a.pace(7, 0) == 1
        assert pacing.get_max_pacing_rate(fd) == pacing.UNLIMITED
        assert a.pace(99, 1e6) == 0  # no such peer: nothing to pace
        a.disconnect(7)
        assert a.pace(7, 1e6) == 0
    finally:
        a.close()
        b.close()
