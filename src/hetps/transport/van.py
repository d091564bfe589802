"""The van: ZeroMQ sockets that move :class:`~hetps.transport.codec.Message` objects.

Every node binds one ROUTER socket to receive and connects one DEALER socket to each peer it
sends to (ps-lite's layout). Sends are thread-safe (a lock per peer socket); receiving is done
by one thread that calls :meth:`Van.recv`. Every byte is counted per link in
:class:`~hetps.transport.counters.LinkCounters`, which later layers (metrics, load balancing) read.

Identity: every DEALER connects with a routing id of its own (random, or one the scheduler
handed out), and the ROUTER sees it on every message. The van maps routing ids to node ids
(:meth:`Van.admit`): a received message's ``sender`` is the node its connection belongs to,
0 for a connection that belongs to no known node. No header field names the sender.

With a cluster secret every socket speaks CurveZMQ with keys derived from it, and a ZAP
handler admits only peers holding the same secret (:mod:`hetps.transport.security`).
Big arrays to a peer with no shared-memory ring then travel on a bulk channel: a plain
connection of their own, each frame sealed with AES-256-GCM under keys agreed over the CURVE
connection (:mod:`hetps.transport.bulk`).
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from hetps.config import is_loopback
from hetps.transport import heap
from hetps.transport.bulk import BULK_OFFER, Bulk, OutChannel
from hetps.transport.codec import FRAME_MAX, Message, encode
from hetps.transport.counters import LinkCounters
from hetps.transport.handshakes import HandshakeGuard, RefusalLog
from hetps.transport.inbox import RING_OFFER, UNKNOWN, Inbox
from hetps.transport.security import HandshakeWatch, Keys, ZapHandler
from hetps.transport.shaper import TokenBucket
from hetps.transport.shm import RING_FLOOR_BYTES, OutRing, open_offered, ring_floor

log = logging.getLogger("hetps.van")

#: arrays at least this large are sent zero-copy and tracked; smaller ones are copied.
ZERO_COPY_BYTES = 1 << 16
SEND_RETRY_MS = 200
_SNDMORE = int(zmq.SNDMORE)


def send_frames(sock: zmq.Socket, frames: list, copy: bool, track: bool) -> Any:
    """``sock.send_multipart(frames, copy=copy, track=track)`` with a plain-int SNDMORE (its
    enum member ORed per frame makes an enum object each, a microsecond)."""
    last = len(frames) - 1
    for i in range(last):
        sock.send(frames[i], _SNDMORE, copy=copy, track=track)
    return sock.send(frames[last], 0, copy=copy, track=track)


#: arrays at least this large go through a shared-memory ring to a peer on this machine
#: (below ~2 MiB a round trip is bound by thread wake-ups and the ring measured no faster)
RING_MIN_BYTES = 2 << 20
#: the same with a cluster secret: frames on the connection are encrypted (CurveZMQ, by
#: ZeroMQ's I/O thread on both ends), the ring is not, so every array from RING_FLOOR_BYTES
#: takes it (a table round of 32 KB of rows per server: 12% less CPU than inline)
RING_MIN_BYTES_SECURE = RING_FLOOR_BYTES
#: arrays at least this large take a bulk channel (transport/bulk.py) to a peer with no ring:
#: below it the channel's second connection and its frames' hand-off cost more than CURVE's
#: encryption (a table round of 128 KiB rows per server over loopback: 3.9 ms with the
#: channel, 2.4 ms without; of 320 KiB alike; of 1.3 MiB faster with it)
BULK_MIN_BYTES = 512 << 10
#: a message whose arrays do not fit the ring's free space waits this long for room before
#: the ones that do not fit go inline (a 4 MiB frame over an encrypted connection takes
#: about 7 ms here; the receiver frees ring space at memory speed)
RING_WAIT_S = 0.02
#: big sends to a peer after which a ring it has not opened is closed (frames stay on TCP)
RING_GIVE_UP_SENDS = 64
#: what a frame may exceed FRAME_MAX by on the wire (CURVE's box around it)
FRAME_SLACK = 64 << 10
#: connections the listener queues before it accepts them (the kernel caps it at
#: net.core.somaxconn): a scheduler that thousands of nodes reach at once. ZeroMQ's default
#: of 100 drops the rest, which connect a TCP retry of 1, 3, 7... seconds later
LISTEN_BACKLOG = 8192


def new_routing_id() -> bytes:
    """A fresh routing id nobody can guess (16 bytes; ZeroMQ reserves a leading zero byte)."""
    return b"h" + secrets.token_bytes(15)


def is_local_host(host: str, own: str) -> bool:
    """Whether ``host`` (a peer's address) is this machine as seen from this node: a
    loopback address (as resolved, not as spelled) or this node's own address."""
    return is_loopback(host) or (host == own and own not in ("*", "0.0.0.0"))


class PeerGone(ConnectionError):
    """Sending to a peer that this van does not know (never connected or disconnected)."""


class Van:
    """Bind/connect/send/recv over ZeroMQ with per-link counters.

    ``host`` is the address to bind (``*`` for all interfaces); ``port`` 0 asks the kernel for
    an ephemeral port, read back from ZeroMQ's last endpoint.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        max_message_bytes: int = 1 << 31,
        verbose: int = 0,
        name: str = "node",
        shape_mbit: float = 0.0,
        chunk_bytes: int = 4 << 20,
        ring_bytes: int = 0,
        secret: bytes | None = None,
        io_threads: int = 1,
        bulk: bool = False,
        keep_buffers: bool = False,
        malloc_users: list[str] | tuple[str, ...] = (),
    ) -> None:
        if keep_buffers:  # (before ZeroMQ's I/O threads allocate: transport/heap.py)
            heap.keep_buffers(malloc_users)
        # 0: one I/O thread per 4 cores this process may use, 1 to 4
        auto = min(4, max(1, len(os.sched_getaffinity(0)) // 4))
        self.ctx = zmq.Context(io_threads=int(io_threads) or auto)
        # one DEALER per peer: ZeroMQ's default of 1023 sockets per context would stop a
        # scheduler (or a server) at about a thousand peers (benchmarks/scale_sim.py)
        self.ctx.set(zmq.MAX_SOCKETS, self.ctx.get(zmq.SOCKET_LIMIT))
        # with a secret: CURVE on every socket, and ZAP up before anything listens
        self.keys = Keys(secret) if secret is not None else None
        self.refusals = RefusalLog(name)  # refused connections: counted, a few lines logged
        self._zap = (
            ZapHandler(self.ctx, self.keys, name, self.refusals) if self.keys is not None else None
        )
        self.ring_min = RING_MIN_BYTES if self.keys is None else RING_MIN_BYTES_SECURE
        self.max_message_bytes = max_message_bytes
        self.verbose = verbose
        self.name = name
        self.counters = LinkCounters()
        self.my_id = 0
        self._router = self.ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        # bound what queues unread per sender (set before bind: the listener copies it)
        self._router.setsockopt(zmq.RCVHWM, max(4, (32 << 20) // max(1, chunk_bytes)))
        # no frame on the wire exceeds FRAME_MAX (the codec splits bigger arrays), so ZeroMQ
        # drops the connection of a peer announcing a bigger one before it allocates memory
        self._router.setsockopt(zmq.MAXMSGSIZE, min(max_message_bytes, FRAME_MAX) + FRAME_SLACK)
        self._router.setsockopt(zmq.BACKLOG, LISTEN_BACKLOG)
        if self.keys is not None:
            self.keys.server(self._router)
        # connections mid-handshake: timed out and capped; refused ones logged, rate-limited
        # (read by the receive thread)
        self._guard = HandshakeGuard(self._router, self.refusals, self.keys is not None)
        self._monitor = self._guard.monitor
        bind_host = "*" if host in ("0.0.0.0", "*") else host
        if port:
            self._router.bind(f"tcp://{bind_host}:{port}")
        else:
            self._router.bind(f"tcp://{bind_host}:*")
        endpoint = self._router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.port = self._guard.port = int(endpoint.rsplit(":", 1)[1])
        self.host = host
        self._peers: dict[Any, zmq.Socket] = {}
        self._endpoints: dict[Any, str] = {}  # peer -> host:port its DEALER connects to
        self._locks: dict[Any, threading.Lock] = {}
        self._peers_lock = threading.Lock()
        self._watches: dict[Any, HandshakeWatch] = {}
        self._origins: dict[bytes, int] = {}  # routing id of an incoming connection -> node
        self._poller = zmq.Poller()
        self._poller.register(self._router, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        # with a secret, big arrays to peers without a ring travel under AES-GCM on a plain
        # connection of their own (transport/bulk.py): offered by connect(bulk=True)
        self.bulk: Bulk | None = None
        self.offers_bulk = bulk  # (False: connect(bulk=True) offers nothing)
        self._bulk_lock = threading.Lock()
        self._bind_host = bind_host
        self._closed = False
        # (direction 'send'|'recv', peer, command, bytes, unix time): traffic timelines
        self.observer: Any = None
        self._dead: set[Any] = set()
        self.shaper = TokenBucket(shape_mbit * 1e6 / 8) if shape_mbit > 0 else None
        # shared-memory rings to peers on this machine (0 bytes: never); see transport/shm.py
        self.ring_bytes = int(ring_bytes)
        self.ring_wait_s = RING_WAIT_S
        self._local: set[Any] = set()  # peers whose address is this machine
        self._rings_out: dict[Any, OutRing | None] = {}  # None: creating one failed
        self._rings_in: dict[str, Any] = {}  # rings and bulk channels (transport/bulk.py)
        self._unopened: dict[Any, int] = {}  # peer -> big sends since its ring was offered
        # (sender, cmd, req, body, count) -> {array index: where a reply's ring-borne array
        # may be copied} (set by the node), and the lock held while such arrays are written
        # (a caller that gave up on its request takes it before it uses its array again)
        self.landing_of: Any = None
        self.landing_guard: Any = None
        # commands whose ring-borne arrays are lent, not copied (set by their handler, which
        # reads them before it returns): see recv and release
        self.borrow: frozenset[str] = frozenset()
        self._ring_lock = threading.Lock()
        # the receive thread's side (transport/inbox.py)
        self.inbox = Inbox(self, self._router, self._guard, self._poller, self._rings_in)

    @property
    def endpoint(self) -> str:
        """``host:port`` this van receives on."""
        return f"{self.host}:{self.port}"

    def connect(
        self,
        peer: Any,
        endpoint: str,
        routing_id: bytes | None = None,
        watch: bool = False,
        bulk: bool = False,
    ) -> bytes:
        """Open a DEALER to ``endpoint`` (``host:port``) and name it ``peer``. It identifies
        itself with ``routing_id`` (default: a fresh random one), which is returned: the
        receiver knows this connection by it. With ``watch``, its handshakes are watched from
        the start (:meth:`take_watch`). With ``bulk`` (and a secret), the peer is offered a
        bulk channel for its big arrays to this node, unless a ring serves (transport/bulk.py)."""
        rid = new_routing_id() if routing_id is None else routing_id
        if not (isinstance(rid, bytes) and 1 <= len(rid) <= 255 and rid[0] != 0):
            raise ValueError("a routing id is 1 to 255 bytes and does not start with a zero byte")
        sock = self.ctx.socket(zmq.DEALER)
        if self.keys is not None:
            self.keys.client(sock)
        sock.setsockopt(zmq.ROUTING_ID, rid)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.setsockopt(zmq.SNDHWM, 256)
        sock.setsockopt(zmq.IMMEDIATE, 0)
        # a full queue (slow or dead peer) blocks a send for at most this long before it
        # re-checks whether the van closed or the peer was declared dead
        sock.setsockopt(zmq.SNDTIMEO, SEND_RETRY_MS)
        # before connecting: a refused handshake is not retried, so its one event must be seen
        watcher = HandshakeWatch(sock) if watch else None
        try:
            sock.connect(f"tcp://{endpoint}")
        except zmq.ZMQError as exc:
            if watcher is not None:
                watcher.close()
            sock.close(linger=0)
            raise PeerGone(f"{self.name}: cannot connect to {endpoint!r}: {exc}") from None
        with self._peers_lock:
            old = self._peers.pop(peer, None)
            self._peers[peer] = sock
            self._endpoints[peer] = endpoint
            lock = self._locks.setdefault(peer, threading.Lock())
            if watcher is not None:
                watcher.lock = lock  # from now on others may send on the socket
                self._watches[peer] = watcher
            if self.ring_bytes > 0 and is_local_host(endpoint.rsplit(":", 1)[0], self.host):
                self._local.add(peer)
        if old is not None:
            old.close(linger=0)
            self._drop_ring(peer)  # a new connection may be a new process: offer afresh
        if bulk and self.offers_bulk and self.keys is not None and peer not in self._local:
            with self._ring_lock:  # (a fresh channel into this van, its listener started now)
                body = self._bulk().offer(peer)
            self.send(peer, Message(BULK_OFFER, body=body))
        if self.verbose >= 1:
            log.info("%s connected to %s at %s", self.name, peer, endpoint)
        return rid

    def admit(self, routing_id: bytes, node_id: int) -> None:
        """Messages on the connection with ``routing_id`` come from node ``node_id``."""
        self._origins[bytes(routing_id)] = node_id
        for m in self.inbox.unstash(bytes(routing_id)):
            m.sender = node_id
            self.take(m)

    def take(self, msg: Message) -> None:
        """A ring or bulk channel offer, or a bulk channel's hello, from a known peer."""
        if msg.cmd == RING_OFFER:
            self._open_ring(msg)
        elif self.keys is not None:
            self._bulk().on_message(msg, self._rings_in)

    def _bulk(self) -> Bulk:
        """The bulk channels, their listener started on first need (a secured van only: an
        offer may come before this node has offered its own)."""
        with self._bulk_lock:
            if self.bulk is None:
                salt, lock = self.keys.bulk_salt, self._ring_lock
                bulk = Bulk(self.ctx, salt, self._bind_host, self.name, self.refusals, lock)
                self._zap.bulk_check = bulk.rx.authorize
                self._poller.register(bulk.rx.sock, zmq.POLLIN)
                self._poller.register(bulk.rx.guard.monitor, zmq.POLLIN)
                self.bulk = bulk
        return self.bulk

    def _open_ring(self, msg: Message) -> None:
        open_offered(self._rings_in, msg, self.name, self.verbose)

    def forget(self, routing_id: bytes) -> None:
        """The connection with ``routing_id`` belongs to no node any more."""
        self._origins.pop(bytes(routing_id), None)

    def host_of(self, peer: Any) -> str:
        """The address ``peer``'s listener is at ('' if there is no connection to it)."""
        return self._endpoints.get(peer, "").rsplit(":", 1)[0]

    def node_of(self, routing_id: bytes) -> int:
        """The node a connection belongs to (:data:`UNKNOWN` if none)."""
        return self._origins.get(bytes(routing_id), UNKNOWN)

    def rename(self, old: Any, new: Any) -> None:
        """Re-key a peer socket (a node learns its peers' ids after registration)."""
        with self._peers_lock:
            if old in self._peers:
                self._peers[new] = self._peers.pop(old)
                self._locks[new] = self._locks.pop(old)
                if old in self._endpoints:
                    self._endpoints[new] = self._endpoints.pop(old)
                if old in self._local:
                    self._local.discard(old)
                    self._local.add(new)
            with self._ring_lock:
                if old in self._rings_out:
                    self._rings_out[new] = self._rings_out.pop(old)
                if self.bulk is not None:
                    self.bulk.rename(old, new)

    @property
    def secured(self) -> bool:
        """Whether this van speaks CurveZMQ (it holds a cluster secret)."""
        return self.keys is not None

    def take_watch(self, peer: Any) -> HandshakeWatch | None:
        """The handshake watch of the connection to ``peer`` made with ``connect(watch=True)``
        (None: none); the caller closes it."""
        with self._peers_lock:
            return self._watches.pop(peer, None)

    def has_peer(self, peer: Any) -> bool:
        """Whether a DEALER to ``peer`` is open."""
        with self._peers_lock:
            return peer in self._peers

    def disconnect(self, peer: Any, linger_ms: int = 0) -> None:
        """Close the DEALER to ``peer``; unsent messages get ``linger_ms`` to leave."""
        with self._peers_lock:
            sock = self._peers.pop(peer, None)
            self._endpoints.pop(peer, None)
        if sock is not None:
            with self._locks[peer]:
                sock.close(linger=linger_ms)
        self._drop_ring(peer)

    def _drop_ring(self, peer: Any) -> None:
        chan = None
        with self._ring_lock:
            ring = self._rings_out.pop(peer, None)
            self._unopened.pop(peer, None)
            if self.bulk is not None:  # (and the bulk channel: the peer offers a new one)
                self.bulk.offers.pop(peer, None)
                chan = self.bulk.out.pop(peer, None)
        for out in (ring, chan):
            if out is not None:
                self.close_out(peer, out)

    def mark_dead(self, peer: Any) -> None:
        """The peer is gone: sends to it fail at once instead of waiting on a full queue."""
        self._dead.add(peer)

    def revive(self, peer: Any) -> None:
        """The peer is back (a new process with its id): sends to it go again."""
        self._dead.discard(peer)

    def send(
        self,
        peer: Any,
        msg: Message,
        track: bool = False,
        give_up: Callable[[], str | None] | None = None,
    ) -> zmq.MessageTracker | None:
        """Send ``msg`` to ``peer``. Large arrays go zero-copy; with ``track`` the returned
        tracker tells when ZeroMQ no longer needs the arrays' memory. While the message cannot
        leave (a full queue, or no connection: a refused handshake leaves none), ``give_up()``
        is asked between tries: a reason ends the send with :class:`PeerGone`."""
        floor = None  # (the smallest array for the ring or channel: worked out once)
        if peer in self._local:
            floor = self._ring_floor(msg)
            ring = self._ring(peer) if floor is not None else None
        elif self.bulk is not None and peer in self.bulk.offers:
            ring = self.bulk.sender(self, peer, msg)
            if ring is not None:
                floor = self.bulk_floor(msg)
        else:
            ring = None
        frames = encode(msg) if ring is None else None
        with self._peers_lock:
            sock = self._peers.get(peer)
            lock = self._locks.get(peer)
        if sock is None or lock is None:
            raise PeerGone(f"{self.name}: no connection to peer {peer}")
        if self.shaper is not None:
            self.shaper.acquire(
                msg.nbytes if frames is not None else sum(a.nbytes for a in msg.arrays)
            )
        with lock:
            bulk = None if isinstance(ring, OutRing) else ring
            if frames is None:  # into the ring (or channel) in the order the messages leave
                floor = floor or 0
                sizes = [a.nbytes for a in msg.arrays if a.nbytes >= floor and a.nbytes]
                if bulk is None and not ring.fits(sizes):
                    # the receiver is behind: it empties the ring at memory speed, faster
                    # than these arrays would cross the connection (encrypted, with a secret)
                    ring.wait_room(sizes, self.ring_wait_s)
                try:
                    frames = encode(msg, ring, floor)
                except BaseException:  # (a dtype the wire does not carry: what it put, a
                    if bulk is not None:  # timed message's mark first, does not go out)
                        bulk.discard()
                    raise
            # zero-copy for big frames, unless they are the caller's memory (``borrowed``:
            # ZeroMQ would read them after this returns): then ZeroMQ copies them now
            big = False
            if not msg.borrowed:
                for f in frames[1:]:
                    if isinstance(f, memoryview) or getattr(f, "nbytes", 0) >= ZERO_COPY_BYTES:
                        big = True
                        break
            try:
                while True:
                    if self._closed or peer in self._dead:
                        self._check_send(peer, bulk, give_up)
                    try:
                        # ZeroMQ takes a multipart message whole or not at all (HWM is
                        # checked at the first frame), so a timed-out attempt sent nothing
                        tracker = send_frames(sock, frames, not big, track and big)
                        break
                    except zmq.Again:
                        self._check_send(peer, bulk, give_up)
                if bulk is not None:  # the header is out: its bulk frames follow it
                    bulk.flush(lambda: self._check_send(peer, bulk, give_up))
            finally:
                if bulk is not None:
                    bulk.discard()
        if isinstance(peer, int):
            self.counters.count(peer, msg.nbytes, sent=True)
        if self.observer is not None:
            self.observer("send", peer, msg.cmd, msg.nbytes, time.time())
        if self.verbose >= 2:
            self.trace("->", peer, msg)
        return tracker if (track and big) else None

    def _check_send(
        self, peer: Any, bulk: OutChannel | None, give_up: Callable[[], str | None] | None
    ) -> None:
        """Between tries while a send to ``peer`` cannot leave: :class:`PeerGone` when the van
        closed, the peer is dead, its bulk connection was lost or ``give_up()`` says why."""
        if self._closed:
            raise PeerGone(f"{self.name}: van is closed")
        if peer in self._dead:
            raise PeerGone(f"{self.name}: peer {peer} is dead")
        if bulk is not None and bulk.lost():
            raise PeerGone(f"{self.name}: the bulk connection to peer {peer} was lost")
        why = give_up() if give_up is not None else None
        if why is not None:
            raise PeerGone(f"{self.name}: {why}")

    def ring_open(self, peer: Any) -> bool:
        """Whether arrays to ``peer`` go through an open shared-memory ring (copied into it
        as they are sent) from now on."""
        if peer not in self._local:
            return False
        ring = self._rings_out.get(peer)
        return ring is not None and ring.ready

    def _ring_floor(self, msg: Message) -> int | None:
        """The smallest of ``msg``'s arrays that goes into a ring or channel (or None)."""
        return ring_floor(msg.arrays, self.ring_min)

    def bulk_floor(self, msg: Message) -> int | None:
        """The smallest of ``msg``'s arrays that goes into a bulk channel (or None)."""
        return ring_floor(msg.arrays, max(self.ring_min, BULK_MIN_BYTES))

    def _ring(self, peer: Any) -> OutRing | None:
        """The open ring to ``peer`` (for a message with arrays for it: the caller asks
        :meth:`_ring_floor`); offers one on first need."""
        stale = None
        with self._ring_lock:
            if peer in self._rings_out:
                ring = self._rings_out[peer]
                if ring is None or ring.ready:
                    return ring
                # never opened (another machine or container behind the same address):
                # give its memory back after a while and stay on TCP
                waited = self._unopened.get(peer, 0) + 1
                if waited < RING_GIVE_UP_SENDS:
                    self._unopened[peer] = waited
                    return None
                self._rings_out[peer], stale = None, ring
                self._unopened.pop(peer, None)
            else:
                try:
                    ring = OutRing(self.ring_bytes)
                except OSError as exc:
                    log.info("%s: no shared memory for peer %s (%s); TCP", self.name, peer, exc)
                    ring = None
                self._rings_out[peer] = ring
        if stale is not None:
            log.info("%s: peer %s never opened its ring; frames go over TCP", self.name, peer)
            self.close_out(peer, stale)
        elif ring is not None:  # frames go inline until the receiver has opened it
            self.send(peer, Message(RING_OFFER, body={"name": ring.name}))
        return None

    def close_out(self, peer: Any, ring: OutRing | OutChannel) -> None:
        """Close a sending ring (or bulk channel) while no send to ``peer`` writes into it."""
        with self._locks.get(peer) or threading.Lock():
            ring.close()

    def recv(self, timeout: float | None = None) -> Message | None:
        """Receive one message, or None after ``timeout`` seconds (:meth:`Inbox.recv`)."""
        return self.inbox.recv(timeout)

    def release(self, msg: Message) -> None:
        """Give the ring space of ``msg``'s lent arrays back (:meth:`Inbox.release`)."""
        self.inbox.release(msg)

    def trace(self, arrow: str, peer: Any, m: Message) -> None:
        """Log a message sent (``->``) to or received (``<-``) from ``peer``."""
        args = (self.name, arrow, peer, m.cmd, m.req, m.reply, m.nbytes)
        log.info("%s %s %s: %s req=%d reply=%s %d B", *args)

    def close(self) -> None:
        """Close every socket and the context."""
        if self._closed:
            return
        self._closed = True
        with self._peers_lock:
            peers = list(self._peers.items())
            self._peers.clear()
            watches = list(self._watches.values())
            self._watches.clear()
        for w in watches:
            w.close()
        for peer, sock in peers:
            with self._locks[peer]:  # a sender notices _closed within SEND_RETRY_MS
                sock.close(linger=0 if peer in self._dead else 2000)
        self._guard.close(self._router)
        self._router.close(linger=0)
        if self.bulk is not None:
            self.bulk.close(self._dead)
        if self._zap is not None:
            self._zap.close()
        self.ctx.term()
        with self._ring_lock:
            rings = [r for r in self._rings_out.values() if r is not None]
            self._rings_out.clear()
        for ring in [*rings, *self._rings_in.values()]:
            ring.close()
        self._rings_in.clear()
