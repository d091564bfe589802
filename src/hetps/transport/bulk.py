"""Bulk channels: big array frames between secured nodes under AES-256-GCM on a plain connection.

CurveZMQ encrypts every frame inside libzmq's I/O thread with xsalsa20-poly1305, about
0.6 GB/s per connection on this project's machines: a 256 MB push spent most of its time
there. With a cluster secret, a node therefore moves arrays of at least 64 KiB to a peer that
is not on this machine (or has no shared-memory ring) over a second, plain ZeroMQ connection,
each frame sealed with AES-256-GCM (OpenSSL through ``cryptography``: hardware AES, several
GB/s per core, and it releases the GIL). The message itself (its header, with the commands,
ids and array shapes) still goes over the CURVE connection, in order with everything else,
and names the counters of its frames on the bulk connection, as a message names the places of
its arrays in a shared-memory ring (transport/shm.py, codec's header field ``"m"``).

Keys, one per direction of each pair of nodes, agreed over the authenticated CURVE connection:

1. A receiver B, when it connects to a peer A, sends over that CURVE connection an offer
   (:data:`BULK_OFFER`): a fresh random channel id (16 bytes), 32 random bytes ``kb`` and the
   port of its bulk listener. Only A can read it.
2. A's first big send to B sends, on its CURVE connection to B and before the message, a
   hello (:data:`BULK_HELLO`) with the channel id and 32 random bytes ``ka`` of its own, and
   connects a plain DEALER to B's bulk port whose routing id is the channel id.
3. Both derive ``key = HKDF-SHA256(kb || ka, salt from the cluster secret, channel id)``. B
   accepts a hello only from the connection of the node it offered the channel to, and only
   once per channel; an offer or a hello replayed from an old connection cannot be (CURVE's
   boxes are bound to their session), and a fresh ``ka`` and ``kb`` make every key new.

Each frame on the bulk connection is ``counter (8 bytes, big-endian) || AES-GCM(plaintext) ||
tag (16 bytes)`` with nonce ``0^4 || counter`` and the channel id and counter as associated
data. The sender's counter starts at 0 and only grows, so a nonce is never used twice under a
key; the receiver refuses a counter at or below one it consumed (a replay), a frame whose
tag does not verify (forged or tampered), a frame from a connection that is no channel's (a
stranger), and takes for an array exactly the counters its header names (a frame cannot be
moved to another message). Each refusal is counted and logged, a few lines per window; none
stops the node, changes a value or blocks another peer: a message whose frames do not come
is dropped after :data:`BULK_WAIT_S` without one of its frames arriving.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import time
from typing import Any

import numpy as np
import zmq
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from hetps.transport.codec import FRAME_MAX, Message
from hetps.transport.handshakes import HandshakeGuard, RefusalLog
from hetps.transport.security import BULK_DOMAIN, hkdf_sha256

log = logging.getLogger("hetps.bulk")

#: the in-van command a receiver offers a bulk channel with (never reaches the application)
BULK_OFFER = "__bulk_offer"
#: the in-van command a sender opens an offered channel with, before its first frame
BULK_HELLO = "__bulk_hello"
TAG = 16
CTR = 8
#: a message whose next bulk frame has not come for this long (while no other peer's frame
#: came either) is dropped
BULK_WAIT_S = 20.0
#: decrypted frames kept for messages not yet read (their header is behind), all channels
PENDING_MAX = 1 << 30
#: ... and of one channel: one node of the job cannot take what the others need
CHANNEL_PENDING_MAX = PENDING_MAX // 2
#: sealed frames of at least this size go out of buffers used again once ZeroMQ sent them
POOL_MIN = 1 << 20
#: such buffers a sending channel keeps (its queue holds 8 frames, the kernel a few more)
POOL_SIZE = 12
#: channels a node keeps offered (one per peer it connects to) before the oldest goes
MAX_OFFERED = 4096
_INFO = b"hetps bulk aes-256-gcm v1 "


def _nonce(counter: int) -> bytes:
    return b"\0\0\0\0" + counter.to_bytes(8, "big")


def _key(salt: bytes, kb: bytes, ka: bytes, cid: bytes) -> AESGCM:
    return AESGCM(hkdf_sha256(kb + ka, salt, _INFO + cid))


def _proof(kb: bytes, cid: bytes) -> bytes:
    """What a sender shows at the bulk port's handshake (PLAIN's password, checked by ZAP
    before ZeroMQ reads a message): it holds the secret half of the channel it names."""
    return hmac.new(kb, b"hetps bulk connection v1 " + cid, hashlib.sha256).digest()


def _frames(n: int) -> int:
    return max(1, -(-n // FRAME_MAX))


class OutChannel:
    """The sending end of one channel: counters for the arrays of a message (``put``, while
    the codec encodes it), then their frames sealed and sent (``flush``) after its header."""

    def __init__(self, ctx: zmq.Context, salt: bytes, offer: dict, host: str) -> None:
        self.cid = offer["id"]
        self.name = "bulk-" + self.cid.hex()
        self.ka = secrets.token_bytes(32)
        self._aead = _key(salt, offer["k"], self.ka, self.cid)
        self.next = 0
        self._queue: list[tuple[int, np.ndarray]] = []
        # sealed-frame buffers, each with the tracker of its last send (None: never sent)
        self._pool: list[tuple[np.ndarray, Any]] = []
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.ROUTING_ID, self.cid)
        # the handshake proves this end holds the channel's key half (BulkReceiver.authorize)
        self.sock.setsockopt(zmq.PLAIN_USERNAME, self.cid)
        self.sock.setsockopt(zmq.PLAIN_PASSWORD, _proof(offer["k"], self.cid))
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.setsockopt(zmq.SNDHWM, 8)
        self.sock.setsockopt(zmq.SNDTIMEO, 200)
        self.sock.connect(f"tcp://{host}:{offer['port']}")
        self.ready = False  # set once the hello went out on the CURVE connection

    def put(self, raw: np.ndarray) -> int:
        """Reserve the counters of ``raw`` (uint8, contiguous) and return its first."""
        pos = self.next
        self.next += _frames(raw.nbytes)
        self._queue.append((pos, raw))
        return pos

    def discard(self) -> None:
        """Forget what ``put`` queued (the message did not leave: its counters stay unused)."""
        self._queue.clear()

    def _buffer(self, n: int) -> tuple[np.ndarray, int | None]:
        """Room for a sealed frame of ``n`` bytes: a pooled buffer ZeroMQ is done with (its
        pages are mapped already: a fresh 16 MiB one costs 4,096 page faults), or a new one;
        and its place in the pool (None: not pooled)."""
        if n < POOL_MIN:
            return np.empty(n, np.uint8), None
        for i, (buf, tracker) in enumerate(self._pool):
            if tracker is None or tracker.done:
                return buf[:n], i
        if len(self._pool) < POOL_SIZE:
            self._pool.append((np.empty(CTR + FRAME_MAX + TAG, np.uint8), None))
            return self._pool[-1][0][:n], len(self._pool) - 1
        return np.empty(n, np.uint8), None

    def flush(self, check: Any) -> None:
        """Seal and send every queued frame in counter order; ``check()`` raises to stop
        while the peer's queue stays full (a dead peer, a closed van)."""
        queue, self._queue = self._queue, []
        for pos, raw in queue:
            for j, lo in enumerate(range(0, max(1, raw.nbytes), FRAME_MAX)):
                part = raw[lo : lo + FRAME_MAX]
                ctr = pos + j
                out, slot = self._buffer(CTR + part.nbytes + TAG)
                out[:CTR] = np.frombuffer(ctr.to_bytes(8, "big"), np.uint8)
                self._aead.encrypt_into(
                    _nonce(ctr), part, self.cid + out[:CTR].tobytes(), out[CTR:]
                )
                while True:
                    try:
                        tracker = self.sock.send(out, copy=False, track=slot is not None)
                        break
                    except zmq.Again:
                        check()
                if slot is not None:
                    self._pool[slot] = (self._pool[slot][0], tracker)

    def close(self, linger_ms: int = 0) -> None:
        self._queue.clear()
        self.sock.close(linger=linger_ms)


class InChannel:
    """The receiving end of one channel, in the van's ring table under its name: the codec
    takes an array's frames from it as it takes them from a shared-memory ring."""

    broken = False  # (what drop_broken looks at in the ring table)

    def __init__(self, rx: BulkReceiver, cid: bytes, kb: bytes, peer: Any) -> None:
        self.rx = rx
        self.cid = cid
        self.name = "bulk-" + cid.hex()
        self.kb = kb
        self.peer = peer  # the node it was offered to: only its connection may open it
        self.proof = _proof(kb, cid)  # what its sender's connection shows at the handshake
        self.user = cid.hex().encode()  # ZAP's user id of that connection, on its frames
        self.held = 0  # bytes of this channel's frames kept for headers not yet read
        self.owner: bytes | None = None  # that connection's routing id, once opened
        self.aead: AESGCM | None = None
        self.next = 0  # counters below this were consumed or skipped: refused from now on
        self.pending: dict[int, np.ndarray] = {}  # counter -> plaintext that came early
        # frames that came before the hello (the two connections race): checked at the hello
        self.early: list[Any] = []

    def open(self, salt: bytes, ka: bytes, origin: bytes) -> None:
        self.aead = _key(salt, self.kb, ka, self.cid)
        self.owner = origin

    def take(self, pos: int, n: int, out: np.ndarray | None = None, view: bool = False):
        """The ``n`` bytes whose frames have counters from ``pos`` on (into ``out`` when
        given); ValueError when they are refused or do not come."""
        if not (isinstance(pos, int) and pos >= self.next and n > 0):
            raise ValueError(f"bulk counter {pos!r} was consumed already or is bad (a replay)")
        k = _frames(n)
        try:
            if k == 1 and out is None and pos in self.pending:
                got = self.pending[pos]
                if got.nbytes != n:
                    raise ValueError(f"bulk frame {pos} holds {got.nbytes} bytes, not {n}")
                self.rx.forget(self, pos)
                return got
            # the caller's memory (a pull's answer landing in place) gets only checked bytes:
            # AES-GCM writes a frame out before its tag is checked, so into a scratch first
            landing = out is not None
            if out is None:
                out = np.empty(n, np.uint8)
            for j in range(k):
                lo = j * FRAME_MAX
                self.rx.fill(self, pos + j, out[lo : min(n, lo + FRAME_MAX)], landing)
            return out
        finally:
            self.next = max(self.next, pos + k)
            for c in [c for c in self.pending if c < self.next]:
                self.rx.forget(self, c)

    def commit(self) -> None:
        """(Nothing to give back: a frame's bytes are the receiver's own once decrypted.)"""

    def holds(self, arr: np.ndarray) -> bool:
        return False

    def close(self) -> None:
        for c in list(self.pending):
            self.rx.forget(self, c)
        self.rx.release(self, sum(len(f.buffer) for f in self.early))
        self.early.clear()


class BulkReceiver:
    """A node's bulk listener: one plain ROUTER every peer's bulk DEALER connects to."""

    def __init__(self, ctx: zmq.Context, host: str, name: str, refusals: RefusalLog) -> None:
        self.name = name
        self.refusals = RefusalLog(name, "bulk frames")
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 4)  # per connection: 64 MiB queued at most
        self.sock.setsockopt(zmq.MAXMSGSIZE, FRAME_MAX + CTR + TAG)
        # a connection is checked by the van's ZAP handler (transport/security.py) before
        # libzmq reads one message of it: it must name an offered channel and prove it holds
        # that channel's key half (:meth:`authorize`); handshakes are timed out and capped
        # as at the van's own port (transport/handshakes.py)
        self.sock.setsockopt(zmq.ZAP_DOMAIN, BULK_DOMAIN)
        self.sock.setsockopt(zmq.PLAIN_SERVER, 1)
        self.guard = HandshakeGuard(self.sock, refusals, secured=False)
        self.sock.bind(f"tcp://{host}:*")
        self.port = self.guard.port = int(
            self.sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1]
        )
        self.channels: dict[bytes, InChannel] = {}  # channel id (the DEALER's routing id)
        self.pending_bytes = 0
        self.wait_s = BULK_WAIT_S
        self._scratch: np.ndarray | None = None  # where a landing frame is checked first

    def _refuse(self, why: str, *args: object) -> None:
        self.refusals.refused("%s refused a bulk frame: " + why, self.name, *args)

    def authorize(self, user: bytes, password: bytes) -> bytes | None:
        """(The ZAP thread's check of a connection.) The user id its frames will carry if
        ``user`` is a channel this node offered or opened and ``password`` its proof."""
        chan = self.channels.get(user)
        if chan is None or not hmac.compare_digest(password, chan.proof):
            return None
        return chan.user

    def hold(self, chan: InChannel, n: int, ctr: int) -> bool:
        """Count ``n`` more bytes kept for ``chan``; False (and a refusal) over a budget."""
        if self.pending_bytes + n > PENDING_MAX or chan.held + n > CHANNEL_PENDING_MAX:
            self._refuse(
                "node %s's frame %d: %d bytes of its channel's (%d of all) are held for "
                "headers not yet read",
                chan.peer,
                ctr,
                chan.held,
                self.pending_bytes,
            )
            return False
        chan.held += n
        self.pending_bytes += n
        return True

    def release(self, chan: InChannel, n: int) -> None:
        chan.held -= n
        self.pending_bytes -= n

    def forget(self, chan: InChannel, ctr: int) -> None:
        got = chan.pending.pop(ctr, None)
        if got is not None:
            self.release(chan, got.nbytes)

    def read_one(self, timeout_ms: int) -> tuple[InChannel, int, memoryview] | None:
        """One authentic-looking frame (its channel, counter, sealed bytes), None if nothing
        came in ``timeout_ms``; frames of strangers and replays are refused here."""
        if not self.sock.poll(timeout_ms):
            return None
        parts = self.sock.recv_multipart(copy=False)
        if len(parts) != 2:
            self._refuse("%d parts from one connection", len(parts))
            return None
        chan = self.channels.get(parts[0].bytes)
        if chan is None or parts[1].get("User-Id").encode() != chan.user:
            # (ZAP let it in for another channel: its routing id names one it has no key of)
            self._refuse("a connection that is no peer's channel (a stranger)")
            return None
        buf = parts[1].buffer
        if chan.aead is None:  # offered, and its hello is still on its way: kept till then
            if self.hold(chan, len(buf), -1):
                chan.early.append(parts[1])
            return None
        if len(buf) < CTR + TAG:
            self._refuse("%d bytes from node %s's channel, too short", len(buf), chan.peer)
            return None
        ctr = int.from_bytes(buf[:CTR], "big")
        if ctr < chan.next or ctr in chan.pending:
            self._refuse(
                "counter %d from node %s's channel was used already (a replay)", ctr, chan.peer
            )
            return None
        return chan, ctr, buf

    def _open(self, chan: InChannel, ctr: int, buf: memoryview, dest: np.ndarray) -> bool:
        """Decrypt into ``dest``; False (and a refusal) if the frame fails its tag."""
        if len(buf) != CTR + dest.nbytes + TAG:
            self._refuse(
                "frame %d of node %s's channel is %d bytes, not %d",
                ctr,
                chan.peer,
                len(buf),
                CTR + dest.nbytes + TAG,
            )
            return False
        try:
            chan.aead.decrypt_into(_nonce(ctr), buf[CTR:], chan.cid + bytes(buf[:CTR]), dest)
        except InvalidTag:
            self._refuse(
                "frame %d of node %s's channel failed its tag (forged or tampered)", ctr, chan.peer
            )
            return False
        return True

    def stash(self, chan: InChannel, ctr: int, buf: memoryview) -> None:
        """Keep a frame that came before its message's header (decrypted, so a bad one is
        refused now)."""
        n = len(buf) - CTR - TAG
        if not self.hold(chan, n, ctr):
            return
        plain = np.empty(n, np.uint8)
        if self._open(chan, ctr, buf, plain):
            chan.pending[ctr] = plain
        else:
            self.release(chan, n)

    def poll_once(self) -> None:
        """Read one frame that came while no header waited (stashed or refused)."""
        got = self.read_one(0)
        if got is not None:
            self.stash(*got)

    def fill(self, chan: InChannel, ctr: int, dest: np.ndarray, landing: bool = False) -> None:
        """Put frame ``ctr`` of ``chan`` into ``dest``, reading the listener (and keeping
        other channels' frames) until it comes; ValueError when it cannot come. With
        ``landing``, ``dest`` is written only once the frame's tag checked."""
        got = chan.pending.get(ctr)
        if got is not None:
            self.forget(chan, ctr)
            if got.nbytes != dest.nbytes:
                raise ValueError(f"bulk frame {ctr} holds {got.nbytes} bytes, not {dest.nbytes}")
            dest[:] = got
            return
        deadline = time.monotonic() + self.wait_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ValueError(
                    f"bulk frame {ctr} did not come within {self.wait_s:.0f} s of the last frame"
                )
            got = self.read_one(int(left * 1000) + 1)
            if got is None:
                continue
            c, n, buf = got
            if c is chan and n == ctr:
                if not landing:
                    if self._open(chan, ctr, buf, dest):
                        return
                    continue
                if self._scratch is None:
                    self._scratch = np.empty(FRAME_MAX, np.uint8)
                if self._open(chan, ctr, buf, self._scratch[: dest.nbytes]):
                    dest[:] = self._scratch[: dest.nbytes]
                    return
                continue
            kept = self.pending_bytes
            self.stash(c, n, buf)
            if c is chan and n > ctr:  # one connection keeps its order: ctr never left
                raise ValueError(f"bulk frame {ctr} was skipped by its sender")
            if self.pending_bytes > kept:  # other peers' frames flow: a slow link, not a loss
                deadline = time.monotonic() + self.wait_s

    def close(self) -> None:
        self.guard.close(self.sock)
        self.sock.close(linger=0)


class Bulk:
    """A van's bulk channels: the ones it offered (receiving) and the ones offered to it
    (sending), keyed by peer."""

    def __init__(
        self, ctx: zmq.Context, salt: bytes, host: str, name: str, refusals: RefusalLog
    ) -> None:
        self.ctx = ctx
        self.salt = salt
        self.name = name
        self.rx = BulkReceiver(ctx, host, name, refusals)
        self.offered: dict[bytes, InChannel] = {}  # not opened yet, by channel id
        self.offers: dict[Any, dict] = {}  # peer -> its latest offer to this node
        self.out: dict[Any, OutChannel] = {}

    @staticmethod
    def offer_to(van: Any, peer: Any) -> None:
        """Offer ``peer`` a fresh channel into ``van`` (whose bulk listener starts now if
        it has none yet), on the CURVE connection ``van`` just opened to it."""
        with van._ring_lock:
            body = Bulk.of(van).offer(peer)
        van.send(peer, Message(BULK_OFFER, body=body))

    @staticmethod
    def of(van: Any) -> Bulk:
        """``van``'s bulk channels, its listener started on first need (a secured van only:
        an offer may come before this node has offered its own)."""
        with van._bulk_lock:
            if van.bulk is None:
                bulk = Bulk(van.ctx, van.keys.bulk_salt, van._bind_host, van.name, van.refusals)
                van._zap.bulk_check = bulk.rx.authorize
                van._poller.register(bulk.rx.sock, zmq.POLLIN)
                van._poller.register(bulk.rx.guard.monitor, zmq.POLLIN)
                van.bulk = bulk
        return van.bulk

    def sender(self, van: Any, peer: Any, msg: Any) -> OutChannel | None:
        """The open channel to ``peer`` if ``msg`` has arrays for it, else None. Opened on
        first need: its hello goes ahead of the message on the CURVE connection."""
        if van._ring_floor(msg) is None:
            return None
        with van._ring_lock:
            chan, new, stale = self.channel(peer, van._endpoints.get(peer, "").rsplit(":", 1)[0])
        if stale is not None:
            van._close_out(peer, stale)  # under the peer's send lock: no flush is using it
        if new:
            try:
                van.send(peer, Message(BULK_HELLO, body={"id": chan.cid, "k": chan.ka}))
            except BaseException:
                with van._ring_lock:
                    if self.out.get(peer) is chan:
                        del self.out[peer]
                van._close_out(peer, chan)
                raise
            chan.ready = True
        return chan if chan is not None and chan.ready else None

    def on_message(self, msg: Any, rings: dict, lock: Any) -> None:
        """An offer or a hello from a known peer's CURVE connection (refusals are logged)."""
        if msg.cmd == BULK_OFFER:
            with lock:
                ok = self.on_offer(msg.sender, msg.body)
            if not ok:
                log.warning("%s refused a bad bulk offer from node %s", self.name, msg.sender)
        elif msg.cmd == BULK_HELLO:
            why = self.on_hello(msg.sender, msg.origin, msg.body, rings)
            if why is not None:
                log.warning("%s refused a bulk hello from node %s: %s", self.name, msg.sender, why)

    def offer(self, peer: Any) -> dict:
        """A fresh channel for ``peer`` to send on; the body of its offer."""
        cid = b"c" + secrets.token_bytes(15)
        chan = InChannel(self.rx, cid, secrets.token_bytes(32), peer)
        for old in [c for c in self.offered.values() if c.peer == peer]:
            self._unoffer(old)
        while len(self.offered) >= MAX_OFFERED:
            self._unoffer(next(iter(self.offered.values())))
        self.offered[cid] = chan
        self.rx.channels[cid] = chan  # (its frames may come before its hello)
        return {"id": cid, "k": chan.kb, "port": self.rx.port}

    def _unoffer(self, chan: InChannel) -> None:
        del self.offered[chan.cid]
        self.rx.channels.pop(chan.cid, None)
        chan.close()

    def on_offer(self, peer: Any, body: dict) -> bool:
        """Keep a peer's offer (used at the next big send to it); False if malformed."""
        ok = (
            isinstance(body.get("id"), bytes)
            and len(body["id"]) == 16
            and isinstance(body.get("k"), bytes)
            and len(body["k"]) == 32
            and type(body.get("port")) is int  # (not a bool, which is an int too)
            and 0 < body["port"] < 65536
        )
        if ok:  # (the channel it replaces is closed by the next send to the peer)
            self.offers[peer] = body
        return ok

    def on_hello(self, peer: Any, origin: bytes, body: dict, rings: dict) -> str | None:
        """Open the channel a hello names; why it was refused, or None."""
        cid, ka = body.get("id"), body.get("k")
        chan = self.offered.get(cid) if isinstance(cid, bytes) else None
        if chan is None or not isinstance(ka, bytes) or len(ka) != 32:
            return "it names no channel this node offered (or is malformed)"
        if chan.peer != peer:
            return f"the channel was offered to node {chan.peer}, not to this connection's"
        del self.offered[cid]
        chan.open(self.salt, ka, origin)
        for name, old in list(rings.items()):  # the channel it replaces
            if isinstance(old, InChannel) and old.owner == origin:
                old.close()
                del rings[name]
                self.rx.channels.pop(old.cid, None)
        rings[chan.name] = chan
        self.rx.channels[cid] = chan
        early, chan.early = chan.early, []
        for frame in early:  # the frames that came before the hello, checked now
            buf = frame.buffer
            self.rx.release(chan, len(buf))
            ctr = int.from_bytes(buf[:CTR], "big") if len(buf) >= CTR + TAG else -1
            if ctr < 0 or ctr in chan.pending:
                self.rx._refuse("a bad frame on node %s's channel before its hello", peer)
            else:
                self.rx.stash(chan, ctr, buf)
        return None

    def channel(self, peer: Any, host: str) -> tuple[OutChannel | None, bool, OutChannel | None]:
        """The channel to ``peer``, whether it is new (its hello is still to be sent), and
        the one it replaces (the peer offered a new one: a new process, or it reconnected),
        which the caller closes once no send uses it."""
        chan, offer = self.out.get(peer), self.offers.get(peer)
        if chan is not None and offer is not None and chan.cid == offer["id"]:
            return chan, False, None
        stale = self.out.pop(peer, None)
        if offer is None or not host:
            return None, False, stale
        chan = self.out[peer] = OutChannel(self.ctx, self.salt, offer, host)
        return chan, True, stale

    def rename(self, old: Any, new: Any) -> None:
        for table in (self.offers, self.out):
            if old in table:
                table[new] = table.pop(old)

    def close(self, dead: Any = ()) -> None:
        """Close every channel: what is still queued to a live peer gets 2 s to leave, as on
        the CURVE connections (a last answer at shutdown)."""
        for peer, chan in self.out.items():
            chan.close(0 if peer in dead else 2000)
        self.out.clear()
        self.rx.close()
