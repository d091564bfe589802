"""CurveZMQ for a cluster that holds a secret: keys, the ZAP handler, handshake monitoring.
(docs/MODULES.md, "hetps.transport.security")"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
from typing import Any

import zmq
from zmq.utils import z85

log = logging.getLogger("hetps.security")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = b"hetps"
#: the ZAP domain of a node's bulk listener (transport/bulk.py): PLAIN, a channel's proof
BULK_DOMAIN = b"hetps-bulk"
_SALT = b"hetps cluster secret"
_INFO = b"hetps curve keypair v1"


def hkdf_sha256(secret: bytes, salt: bytes, info: bytes, length: int = 32) -> bytes:
    """HKDF (RFC 5869) with SHA-256."""
    prk = hmac.new(salt, secret, hashlib.sha256).digest()
    out, block, i = b"", b"", 1
    while len(out) < length:
        block = hmac.new(prk, block + info + bytes([i]), hashlib.sha256).digest()
        out += block
        i += 1
    return out[:length]


class Keys:
    """The job's CURVE keypair, derived from the cluster secret (z85 text, as libzmq takes)."""

    def __init__(self, secret: bytes) -> None:
        if not isinstance(secret, bytes) or not secret:
            raise ValueError("a cluster secret is a non-empty bytes string")
        if not zmq.has("curve"):
            raise RuntimeError(
                "this pyzmq's libzmq has no CURVE support, so a cluster secret cannot be used: "
                "install a pyzmq wheel (they bundle libzmq with libsodium)"
            )
        raw = hkdf_sha256(secret, _SALT, _INFO)
        self.secret_key = z85.encode(raw)
        self.public_key = zmq.curve_public(self.secret_key)
        self.public_raw = z85.decode(self.public_key)
        # HKDF salt of the bulk channels' keys (transport/bulk.py): only holders of the secret
        self.bulk_salt = hkdf_sha256(secret, _SALT, b"hetps bulk channel salt v1")

    def __repr__(self) -> str:  # never the secret key
        return f"Keys(public={self.public_key.decode()})"

    def server(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (a ROUTER, before it binds) a CURVE server checked by ZAP."""
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret_key)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public_key)

    def client(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (a DEALER, before it connects) a CURVE client with the job's keys."""
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.public_key)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public_key)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret_key)


class ZapHandler:
    """ZeroMQ's authentication hook for one context: accepts CURVE clients holding the job's
    key, refuses everything else (and logs each refusal)."""

    def __init__(
        self, ctx: zmq.Context, keys: Keys, name: str = "node", refusals: Any = None
    ) -> None:
        from hetps.transport.handshakes import RefusalLog

        self.keys = keys
        self.name = name
        self.refused = 0
        # one line per refusal, rate-limited and counted (shared with the van's monitor)
        self.refusals = refusals if refusals is not None else RefusalLog(name)
        #: the bulk listener's check of a connection's PLAIN credentials (transport/bulk.py):
        #: ``(username, password) -> user id or None``; None: no bulk listener, all refused
        self.bulk_check: Any = None
        self._sock = ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(ZAP_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hetps-zap", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(100):
                    self.refusals.tick()  # says what a flood of refusals did not log
                    continue
                frames = self._sock.recv_multipart()
            except zmq.ZMQError:
                return
            try:
                self._sock.send_multipart(self._answer(frames))
            except zmq.ZMQError:
                return

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        # version, request id, domain, address, routing id, mechanism, credentials...
        if len(frames) < 6:
            return [b"1.0", b"", b"500", b"malformed ZAP request", b"", b""]
        version, req_id, domain, address, _rid, mechanism = frames[:6]
        creds = frames[6:]
        if domain == BULK_DOMAIN:
            return self._answer_bulk(version, req_id, address, mechanism, creds)
        ok = (
            version == b"1.0"
            and domain == ZAP_DOMAIN
            and mechanism == b"CURVE"
            and len(creds) == 1
            and hmac.compare_digest(creds[0], self.keys.public_raw)
        )
        if ok:
            return [b"1.0", req_id, b"200", b"OK", b"hetps", b""]
        self.refused += 1
        self.refusals.refused(
            "%s refused a connection from %s: it does not hold this job's cluster secret",
            self.name,
            address.decode("ascii", "replace")[:64] or "?",
        )
        return [b"1.0", req_id, b"400", b"not this job's key", b"", b""]

    def _answer_bulk(
        self, version: bytes, req_id: bytes, address: bytes, mechanism: bytes, creds: list
    ) -> list[bytes]:
        """A connection to the bulk listener: it must name a channel this node offered and
        prove it holds that channel's secret half (transport/bulk.py), before libzmq reads
        a single message from it."""
        check = self.bulk_check
        user = None
        if version == b"1.0" and mechanism == b"PLAIN" and len(creds) == 2 and check:
            user = check(creds[0], creds[1])
        if user is not None:
            return [b"1.0", req_id, b"200", b"OK", user, b""]
        self.refused += 1
        self.refusals.refused(
            "%s refused a connection to its bulk port from %s: it names no channel this node "
            "offered, or cannot prove it holds one",
            self.name,
            address.decode("ascii", "replace")[:64] or "?",
        )
        return [b"1.0", req_id, b"400", b"no channel of this node", b"", b""]

    def close(self) -> None:
        """Stop answering (before the context is terminated)."""
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(linger=0)


HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
)


class HandshakeWatch:
    """Watches one DEALER's handshakes (``zmq_socket_monitor``): tells when the other side
    refused this node's credentials, so a node with the wrong secret (or none, facing a
    secured scheduler) fails at once with an error saying so, not after a timeout."""

    def __init__(self, sock: zmq.Socket, lock: threading.Lock | None = None) -> None:
        self._owner = sock
        self.lock = lock or threading.Lock()  # the lock senders on ``sock`` hold
        with self.lock:
            self._mon = sock.get_monitor_socket(HANDSHAKE_EVENTS)
        self.succeeded = False

    def failure(self) -> str | None:
        """A description of the last handshake failure seen (None: none, or it succeeded)."""
        from zmq.utils.monitor import recv_monitor_message

        failed = None
        while self._mon.poll(0):
            try:
                ev = recv_monitor_message(self._mon)
            except zmq.ZMQError:
                break
            event = ev["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.succeeded, failed = True, None
            elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                failed = "the other side refused this node's credentials (not its cluster secret)"
            else:
                failed = "the handshake failed (security mechanism or keys do not match)"
        return failed

    def close(self) -> None:
        with self.lock:
            try:
                self._owner.disable_monitor()
            except zmq.ZMQError:
                pass
        self._mon.close(linger=0)
