"""Bulk channels: big array frames between secured nodes under AES-256-GCM on a plain connection.
(docs/MODULES.md, "hetps.transport.bulk")"""

from __future__ import annotations

import logging
import secrets
import threading
from typing import Annotated, Any, Protocol

import msgspec
import numpy as np
import zmq
from msgspec import Meta, field

from hetps.transport.bulk_in import (
    CTR,
    TAG,
    BulkReceiver,
    InChannel,
    channel_key,
    frame_cost,
    frame_count,
    nonce_of,
    proof_of,
)
from hetps.transport.codec import FRAME_MAX, Message
from hetps.transport.handshakes import RefusalLog

log = logging.getLogger("hetps.bulk")

#: the in-van command a receiver offers a bulk channel with (never reaches the application)
BULK_OFFER = "__bulk_offer"
#: the in-van command a sender opens an offered channel with, before its first frame
BULK_HELLO = "__bulk_hello"
#: sealed frames of at least this size go out of buffers used again once ZeroMQ sent them
POOL_MIN = 1 << 20
#: such buffers a sending channel keeps (its queue holds 8 frames, the kernel a few more)
POOL_SIZE = 12
#: channels a node keeps offered (one per peer it connects to) before the oldest goes
MAX_OFFERED = 4096
_EMPTY = np.empty(0, np.uint8)


class BulkHello(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A sender opens an offered channel: its ``id`` and its key share ``k``."""

    cid: Annotated[bytes, Meta(min_length=16, max_length=16)] = field(name="id")
    key: Annotated[bytes, Meta(min_length=32, max_length=32)] = field(name="k")


class BulkOffer(BulkHello, kw_only=True):
    """A receiver offers a channel: its ``id``, key share ``k`` and bulk listener's ``port``."""

    port: Annotated[int, Meta(gt=0, lt=65536)]


def _typed(body: Any, kind: type[BulkHello]) -> Any:
    try:  # (None: not a ``kind``)
        return msgspec.convert(body, kind)
    except msgspec.ValidationError:
        return None


#: what ends a sending channel's one connection
_LOST = int(
    zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


class OutChannel:
    """The sending end of one channel: counters for the arrays of a message (``put``, while
    the codec encodes it), then their frames sealed and sent (``flush``) after its header."""

    def __init__(self, ctx: zmq.Context, salt: bytes, offer: BulkOffer, host: str) -> None:
        self.cid = offer.cid
        self.name = "bulk-" + self.cid.hex()
        self.ka = secrets.token_bytes(32)
        self._aead = channel_key(salt, offer.key, self.ka, self.cid)
        self.next = 0
        self._queue: list[tuple[int, np.ndarray]] = []
        # sealed-frame buffers, each with the tracker of its last send (None: never sent)
        self._pool: list[tuple[np.ndarray, Any]] = []
        self.sock = ctx.socket(zmq.DEALER)
        # (no routing id of its own: the receiver names it, and knows the channel by the
        # handshake's proof, so a channel id someone learned names no connection)
        # the handshake proves this end holds the channel's key half (BulkReceiver.authorize)
        self.sock.setsockopt(zmq.PLAIN_USERNAME, self.cid)
        self.sock.setsockopt(zmq.PLAIN_PASSWORD, proof_of(offer.key, self.cid))
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.setsockopt(zmq.SNDHWM, 8)
        self.sock.setsockopt(zmq.SNDTIMEO, 200)
        # one connection: the receiver lets a channel's proof in once (a proof read off the
        # wire opens nothing), so a dropped connection is not made again; the channel is
        # given up instead (:meth:`lost`) and big arrays to that peer take the CURVE one
        self.sock.setsockopt(zmq.RECONNECT_IVL, -1)
        self.monitor = self.sock.get_monitor_socket(_LOST)
        self.gone = False
        self.sock.connect(f"tcp://{host}:{offer.port}")
        self.ready = False  # set once the hello went out on the CURVE connection

    def lost(self) -> bool:
        """Whether the connection failed its handshake or dropped (for good: see above)."""
        while not self.gone and self.monitor.poll(0):
            try:
                event = self.monitor.recv_multipart()[0]
            except zmq.ZMQError:
                break
            self.gone = int.from_bytes(event[:2], "little") & _LOST != 0
        return self.gone

    def put(self, raw: np.ndarray) -> int:
        """Reserve the counters of ``raw`` (uint8, contiguous) and return its first."""
        pos = self.next
        self.next += frame_count(raw.nbytes)
        self._queue.append((pos, raw))
        return pos

    def put_mark(self) -> int:
        """Reserve the counter of a mark: an empty frame sent ahead of a timed message's
        arrays, so the receiver's clock starts when they start to come (the forecast on the
        CURVE connection does not queue behind this connection's bytes)."""
        return self.put(_EMPTY)

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
                    nonce_of(ctr), part, self.cid + out[:CTR].tobytes(), out[CTR:]
                )
                while True:
                    try:
                        tracker = self.sock.send(out, copy=False, track=slot is not None)
                        break
                    except zmq.Again:
                        check()
                if slot is not None:
                    self._pool[slot] = (self._pool[slot][0], tracker)

    def close(self, linger_ms: int = 5000) -> None:
        """Close; frames still queued get ``linger_ms`` to leave (a channel replaced by a
        new offer may still carry a message the caller was told had left)."""
        self._queue.clear()
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(linger=0)
        self.sock.close(linger=linger_ms)


class BulkVan(Protocol):
    """What the bulk channels use of their van (a :class:`~hetps.transport.van.Van`) when it
    sends: the smallest array that leaves its connection, its peers' addresses, and its ways
    to send and to close a sending ring or channel."""

    def send(self, peer: Any, msg: Message) -> Any: ...
    def bulk_floor(self, msg: Message) -> int | None: ...
    def host_of(self, peer: Any) -> str: ...
    def close_out(self, peer: Any, ring: Any) -> None: ...


class Bulk:
    """A van's bulk channels: the ones it offered (receiving) and the ones offered to it
    (sending), keyed by peer."""

    def __init__(
        self,
        ctx: zmq.Context,
        salt: bytes,
        host: str,
        name: str,
        refusals: RefusalLog,
        lock: threading.Lock,
    ) -> None:
        self.ctx = ctx
        self.salt = salt
        self.name = name
        self.lock = lock  # the van's, held while channels are offered, opened or dropped
        self.rx = BulkReceiver(ctx, host, name, refusals)
        self.offered: dict[bytes, InChannel] = {}  # not opened yet, by channel id
        self.offers: dict[Any, BulkOffer] = {}  # peer -> its latest offer to this node
        self.out: dict[Any, OutChannel] = {}

    def sender(self, van: BulkVan, peer: Any, msg: Any) -> OutChannel | None:
        """The open channel to ``peer`` if ``msg`` has arrays for it, else None. Opened on
        first need: its hello goes ahead of the message on the CURVE connection."""
        if van.bulk_floor(msg) is None:
            return None
        with self.lock:
            chan, new, stale = self.channel(peer, van.host_of(peer))
            if chan is not None and not new and chan.lost():
                log.warning(
                    "%s: the bulk connection to node %s is lost; its big arrays take the CURVE "
                    "connection until it offers a new channel",
                    self.name,
                    peer,
                )
                del self.out[peer]
                if getattr(self.offers.get(peer), "cid", None) == chan.cid:
                    del self.offers[peer]
                stale, chan = chan, None
        if stale is not None:
            van.close_out(peer, stale)  # under the peer's send lock: no flush is using it
        if new:
            try:
                van.send(peer, Message(BULK_HELLO, body={"id": chan.cid, "k": chan.ka}))
            except BaseException:
                with self.lock:
                    if self.out.get(peer) is chan:
                        del self.out[peer]
                van.close_out(peer, chan)
                raise
            chan.ready = True
        return chan if chan is not None and chan.ready else None

    def on_message(self, msg: Any, rings: dict) -> None:
        """An offer or a hello from a known peer's CURVE connection (refusals are logged)."""
        if msg.cmd == BULK_OFFER:
            with self.lock:
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

    def on_offer(self, peer: Any, body: Any) -> bool:
        """Keep a peer's offer (used at the next big send to it); False if it is no
        :class:`BulkOffer` (decoded here, the one place it is read)."""
        offer = _typed(body, BulkOffer)
        if offer is not None:  # (the channel it replaces is closed by the next send to the peer)
            self.offers[peer] = offer
        return offer is not None

    def on_hello(self, peer: Any, origin: bytes, body: Any, rings: dict) -> str | None:
        """Open the channel a hello names (a :class:`BulkHello`, decoded here); why it was
        refused, or None."""
        hello = _typed(body, BulkHello)
        cid, ka = (hello.cid, hello.key) if hello is not None else (None, None)
        chan = self.offered.get(cid)
        if chan is None:
            return "it names no channel this node offered (or is malformed)"
        if chan.peer != peer:
            return f"the channel was offered to node {chan.peer}, not to this connection's"
        del self.offered[cid]
        chan.open(self.salt, ka, origin)
        for name, old in list(rings.items()):  # the channel it replaces (the same process's,
            # or the one an earlier process of that node opened: it sends on this one now)
            if isinstance(old, InChannel) and (old.owner == origin or old.peer == peer):
                old.close()
                del rings[name]
                self.rx.channels.pop(old.cid, None)
        rings[chan.name] = chan
        self.rx.channels[cid] = chan
        early, chan.early = chan.early, []
        for frame in early:  # the frames that came before the hello, checked now
            buf = frame.buffer
            self.rx.release(chan, frame_cost(len(buf)))
            ctr = int.from_bytes(buf[:CTR], "big") if len(buf) >= CTR + TAG else -1
            if ctr < 0 or ctr in chan.pending or ctr in chan.marks:  # (a replay)
                self.rx.refuse("a bad frame on node %s's channel before its hello", peer)
            else:
                self.rx.place(chan, ctr, buf)
        return None

    def channel(self, peer: Any, host: str) -> tuple[OutChannel | None, bool, OutChannel | None]:
        """The channel to ``peer``, whether it is new (its hello is still to be sent), and
        the one it replaces (the peer offered a new one: a new process, or it reconnected),
        which the caller closes once no send uses it."""
        chan, offer = self.out.get(peer), self.offers.get(peer)
        if chan is not None and offer is not None and chan.cid == offer.cid:
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
