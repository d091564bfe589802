"""Connections to a node's ROUTER before their handshake is done: bounded, timed out, and
their refusals logged without letting a stranger fill the disk.
(docs/MODULES.md, "hetps.transport.handshakes")"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time

import zmq

log = logging.getLogger("hetps.security")

#: a connection whose handshake is not done after this long is closed by ZeroMQ
HANDSHAKE_S = 10.0
#: connections mid-handshake a ROUTER keeps; one more is shut down as soon as it is accepted
MAX_PENDING = 256
#: over the cap, a connection whose peer sent nothing for this long is shut down
SILENT_S = 1.0
#: bytes of ZeroMQ's greeting: a connection that sent fewer has not begun its handshake
GREETING_BYTES = 64
#: ... and, secured, its CURVE HELLO (a 200-byte command): a peer that sends a greeting and
#: stalls is no node either (a node sends both at once when it connects)
HELLO_BYTES = 200
_TCPI_BYTES_RECEIVED = 128  # offset of tcpi_bytes_received in Linux's struct tcp_info
#: refused handshakes logged one line each per window; the rest are counted
LOG_BURST = 5
LOG_WINDOW_S = 10.0

_ACCEPTED = int(zmq.EVENT_ACCEPTED)
_DONE = int(zmq.EVENT_HANDSHAKE_SUCCEEDED)
_FAILED_AUTH = int(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_FAILED = int(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL) | int(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
_GONE = int(zmq.EVENT_DISCONNECTED)
EVENTS = _ACCEPTED | _DONE | _FAILED_AUTH | _FAILED | _GONE


class RefusalLog:
    """Log lines for refused connections, at most :data:`LOG_BURST` per window; the others
    counted and said in one line when their window ends (at the next refusal or
    :meth:`tick`). Thread-safe: the ZAP thread and the receive thread share one."""

    def __init__(self, name: str, what: str = "connections", burst: int | None = None) -> None:
        self.name = name
        self.what = what  # what is refused, for the summing-up line
        self.burst = burst  # lines a window (None: LOG_BURST; 0: every refusal its line)
        self.total = 0  # every refusal, logged or not
        self._lock = threading.Lock()
        self._start = time.monotonic()
        self._logged = 0
        self._quiet = 0  # refusals of this window not logged one by one

    def refused(self, text: str, *args: object) -> None:
        """One refusal; ``text % args`` is its line, if this window still has room."""
        with self._lock:
            self.total += 1
            self._roll(time.monotonic())
            burst = LOG_BURST if self.burst is None else self.burst
            if burst == 0 or self._logged < burst:
                self._logged += 1
                log.warning(text, *args)
            else:
                self._quiet += 1

    def tick(self) -> None:
        """End the window if its time is over (says what it did not log)."""
        with self._lock:
            self._roll(time.monotonic())

    def flush(self) -> None:
        """Say now what this window did not log (at the end of a node's run)."""
        with self._lock:
            self._roll(time.monotonic(), force=True)

    def _roll(self, now: float, force: bool = False) -> None:
        if now - self._start < LOG_WINDOW_S and not force:
            return
        if self._quiet:
            log.warning(
                "%s refused %d more %s in the last %.0f s, not logged one by one "
                "(%d refused in all)",
                self.name,
                self._quiet,
                self.what,
                now - self._start,
                self.total,
            )
        self._start, self._logged, self._quiet = now, 0, 0


class HandshakeGuard:
    """Times out and caps the connections of one ROUTER that are mid-handshake, and logs
    (through ``refusals``) the handshakes refused before ZAP is asked. Made before the
    ROUTER binds; :meth:`drain` is called by the thread that receives on it whenever
    :attr:`monitor` is readable, and :meth:`sweep` when it waited for messages in vain."""

    def __init__(
        self, router: zmq.Socket, refusals: RefusalLog, secured: bool, hello: int | None = None
    ) -> None:
        router.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))
        self.monitor = router.get_monitor_socket(EVENTS)
        self.refusals = refusals
        self.secured = secured
        # bytes a peer sends after its greeting as it connects (CURVE's HELLO with a secret;
        # ``hello``: another mechanism's, e.g. a bulk port's PLAIN)
        self.hello = hello if hello is not None else HELLO_BYTES if secured else 0
        self.port = 0  # the ROUTER's (set once it is bound): a shut descriptor must be one
        self.pending = 0  # connections accepted whose handshake has not ended
        self.shut = 0  # connections shut down for the cap
        self._young: dict[int, float] = {}  # descriptor -> when accepted (the last second)

    def drain(self) -> None:
        """Read the monitor's events; then :meth:`sweep`."""
        from zmq.utils.monitor import recv_monitor_message

        while self.monitor.poll(0):
            try:
                ev = recv_monitor_message(self.monitor)
            except zmq.ZMQError:
                return
            event = ev["event"]
            if event == _ACCEPTED:
                self.pending += 1
                self._young.pop(ev["value"], None)  # (a number used again goes last)
                self._young[ev["value"]] = time.monotonic()
            elif event == _GONE:
                self._young.pop(ev["value"], None)
            else:  # a handshake ended
                self.pending = max(0, self.pending - 1)
                if event & _FAILED and self.secured:  # (ZAP logs its own refusals)
                    self.refusals.refused(
                        "%s refused a connection at its handshake: the peer does not hold "
                        "this job's cluster secret (or speaks plain ZeroMQ, or took longer "
                        "than %.0f s)",
                        self.refusals.name,
                        HANDSHAKE_S,
                    )
        self.sweep()

    def sweep(self) -> None:
        """Over the cap: shut down the connections accepted at least :data:`SILENT_S` ago
        whose peer has not sent a greeting yet. Each is looked at once while over the cap;
        under it, one waits (until the handshake timeout would end it anyway), so one that
        grew old before the monitor reported the connections after it is still cut."""
        young = self._young
        now = time.monotonic()
        while young:  # (in order of acceptance: the oldest first)
            fd, t = next(iter(young.items()))
            if now - t < HANDSHAKE_S:
                break
            del young[fd]
        if not young or self.pending <= MAX_PENDING:
            self.refusals.tick()
            return
        for fd, t in list(young.items()):
            if now - t < SILENT_S:
                break
            del young[fd]
            if self._shut_down(fd):
                self.shut += 1
                self.refusals.refused(
                    "%s closed a connection that sent nothing for %.0f s: %d connections "
                    "have not finished their handshake (at most %d wait, each for %.0f s)",
                    self.refusals.name,
                    now - t,
                    self.pending,
                    MAX_PENDING,
                    HANDSHAKE_S,
                )
        self.refusals.tick()

    def _shut_down(self, fd: int) -> bool:
        """Shut the accepted connection ``fd`` down if its peer has not sent a greeting yet
        (never closing ZeroMQ's descriptor). False: it was left alone."""
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            return False  # gone already
        try:
            if sock.type != socket.SOCK_STREAM or sock.getsockname()[1] != self.port:
                return False  # (the number was reused by something else meanwhile)
            info = sock.getsockopt(socket.IPPROTO_TCP, getattr(socket, "TCP_INFO", 11), 256)
            if len(info) < _TCPI_BYTES_RECEIVED + 8:
                return False  # (a kernel that does not say: never cut a peer that may speak)
            spoken = GREETING_BYTES + self.hello
            if struct.unpack_from("Q", info, _TCPI_BYTES_RECEIVED)[0] >= spoken:
                return False  # it speaks: its handshake is under way
            sock.shutdown(socket.SHUT_RDWR)
            return True
        except OSError:
            return False
        finally:
            sock.close()

    def close(self, router: zmq.Socket) -> None:
        try:
            router.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(linger=0)
