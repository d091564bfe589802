"""The receive half of a van (:class:`Inbox`): the one thread that reads its ROUTER (and
its bulk listener) decodes each message, hands in-van offers and hellos to the van, keeps a
message whose bulk frames are still to come waiting with its connection's later messages
(transport/bulk_in.py), and lends ring-borne arrays to the handlers that borrow them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

import zmq

from hetps.transport.bulk import BULK_HELLO, BULK_OFFER, Bulk
from hetps.transport.bulk_in import Waiting
from hetps.transport.codec import BadMessage, Message, NotYet, decode
from hetps.transport.counters import LinkCounters
from hetps.transport.handshakes import HandshakeGuard
from hetps.transport.shm import drop_broken

log = logging.getLogger("hetps.van")

#: sender id of a message whose connection belongs to no known node
UNKNOWN = 0
#: the in-van command that offers a ring to its receiver (never reaches the application)
RING_OFFER = "__ring_offer"
#: in-van offers kept from connections not known yet (the node table is on its way); when full,
#: the oldest goes (likeliest one never admitted; an age limit would guess a table's delay)
MAX_STASHED_OFFERS = 64
#: messages one turn of the receive loop reads off its socket while more are queued, without
#: polling again (a scheduler's 512 host reports of a round come together)
DRAIN_MOST = 64
# plain ints: pyzmq's enum members make a new enum object on every `&` (a microsecond each)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)


def _in_van(msg: Message) -> bool:
    """Whether ``msg`` is for the van itself (a ring or bulk offer, a bulk hello)."""
    return msg.cmd in (RING_OFFER, BULK_OFFER, BULK_HELLO)


class InboxVan(Protocol):
    """What the inbox uses of its van (a :class:`~hetps.transport.van.Van`): its name and
    limits, its bulk channels, where arrays land and who borrows them, its counters and
    observer, which node a connection is, and its ways to take an in-van message and to trace."""

    name: str
    verbose: int
    max_message_bytes: int
    bulk: Bulk | None
    counters: LinkCounters
    observer: Callable[[str, int | str, str, int, float], None] | None
    borrow: frozenset[str]
    landing_of: Callable[[int, str, int, object, int], dict[int, object] | None] | None
    landing_guard: threading.Lock | None

    def node_of(self, routing_id: bytes) -> int: ...
    def take(self, msg: Message) -> None: ...
    def trace(self, arrow: str, peer: Any, m: Message) -> None: ...


class Inbox:
    """What the receive thread of ``van`` holds: the van's ROUTER, its handshake guard, its
    poller and the rings (and bulk channels) arrays come in through, handed by the van;
    messages waiting for their bulk frames, messages decoded and not handed out yet, the one
    message whose arrays are lent, and in-van offers from connections not admitted yet."""

    def __init__(
        self,
        van: InboxVan,
        router: zmq.Socket,
        guard: HandshakeGuard,
        poller: zmq.Poller,
        rings: dict[str, Any],
    ) -> None:
        self.van = van
        self.router, self.guard, self.poller, self.rings = router, guard, poller, rings
        self.stashed: deque[Message] = deque(maxlen=MAX_STASHED_OFFERS)  # (not admitted yet)
        self.stash_lock = threading.Lock()
        self.waiting = Waiting()  # messages whose bulk frames are still to come
        self.ready: deque[Message] = deque()  # decoded, not handed out yet
        self.lent: Message | None = None
        self._landings: dict[int, partial] = {}  # sender -> van.landing_of bound to it

    def recv(self, timeout: float | None = None) -> Message | None:
        """Receive one message, or None after ``timeout`` seconds. Bad messages are logged and
        dropped (never raised), so a malformed peer cannot stop the receive loop.

        A request whose command is in :attr:`borrow` comes with its ring-borne arrays lent:
        read-only views of the shared-memory ring, valid until the message is released
        (:meth:`release`), at the latest when this thread calls ``recv`` again. A message
        whose bulk frames are not all here waits (with its connection's later messages) in
        :attr:`waiting` while this thread reads on (transport/bulk_in.py)."""
        van = self.van
        lent = self.lent
        if lent is not None and not any(m is lent for m in self.ready):  # (handed out)
            self.release(lent)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.ready:
                return self.next_ready()
            wait_ms = (
                None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            )
            if self.waiting and (wait_ms is None or wait_ms > 100):
                wait_ms = 100  # (a waiting message's frames may stop coming: it is dropped)
            # a message that is already waiting before we poll arrived while this thread was
            # busy elsewhere: the time we take it is later than its arrival
            waited = bool(self.router.getsockopt(_EVENTS) & _POLLIN)
            events = dict(self.poller.poll(wait_ms))
            if self.guard.monitor in events:
                self.guard.drain()
            bulk = van.bulk
            if bulk is not None:
                if bulk.rx.guard.monitor in events:
                    bulk.rx.guard.drain()  # (the bulk port's handshakes: capped, timed out)
                if bulk.rx.sock in events and self.router not in events:
                    bulk.rx.drain()  # frames: where their message waits, or kept for it
                while self.waiting:  # (an offer or hello among them is applied before the
                    msgs = self.waiting.ready(self.decode, self.dropped, _in_van)  # next is read)
                    for msg in msgs:
                        self.deliver(msg, True)
                    if not msgs or not _in_van(msgs[-1]):
                        break
            if self.router not in events:
                self.guard.sweep()  # (connections that never speak, while nothing comes)
                if bulk is not None:
                    bulk.rx.guard.sweep()
                if not self.ready and deadline is not None and time.monotonic() >= deadline:
                    return None
                continue
            self.drain(waited)

    def drain(self, waited: bool) -> None:
        """Read the messages queued on the ROUTER, one at least, into :attr:`ready`: up to
        :data:`DRAIN_MOST` without polling again, and no further than a message whose arrays
        are lent or one that waits for its bulk frames."""
        van = self.van
        router = self.router
        for _ in range(DRAIN_MOST):
            # recv_multipart less its getsockopt(RCVMORE) per frame: each frame says itself
            frames = [router.recv(copy=False)]
            while frames[-1].more:
                frames.append(router.recv(copy=False))
            origin = frames[0].bytes
            sender = van.node_of(origin)
            if self.waiting.holds(origin):  # behind that connection's waiting message
                self.waiting.add(origin, frames, sender, None)
                return
            try:
                msg = self.decode(frames, origin, sender)
            except NotYet as wait:
                self.waiting.add(origin, frames, sender, wait.ring)
                return
            if msg is not None:
                self.deliver(msg, waited)
                if msg.lease is not None:
                    return
            if not router.getsockopt(_EVENTS) & _POLLIN:
                return
            waited = True  # (queued while this thread read the one before)

    def queued(self) -> bool:
        """Whether a message is ready or waits on the socket (no read, no wait)."""
        return bool(self.ready) or bool(self.router.getsockopt(_EVENTS) & _POLLIN)

    def recv_many(self, timeout: float | None = None) -> list[Message]:
        """Every message received by one turn of :meth:`recv` (empty after ``timeout``
        seconds): the first, and those read with it off the socket. Only the last may have
        lent arrays (it is released at the next call)."""
        first = self.recv(timeout)
        if first is None:
            return []
        out = [first]
        while self.ready and out[-1].lease is None and out[-1].sender != UNKNOWN:
            out.append(self.next_ready())  # (one from an unknown connection may admit it)
        return out

    def next_ready(self) -> Message:
        """The first message of :attr:`ready`. One read with others from a connection not
        known then takes its sender now: the message handed out before it may have admitted
        that connection (a node table, a registration, a takeover)."""
        msg = self.ready.popleft()
        if msg.sender == UNKNOWN:
            msg.sender = self.van.node_of(msg.origin)
        return msg

    def decode(self, frames: list, origin: bytes, sender: int) -> Message | None:
        """A message of ``frames``, or None if it was bad (logged); NotYet: its bulk frames
        are still to come."""
        van = self.van
        guard = van.landing_guard
        if guard is not None:
            guard.acquire()
        try:
            msg = decode(
                frames[1:],
                van.max_message_bytes,
                self.rings,
                self.landing_for(sender),
                origin,
                van.borrow,
            )
        except BadMessage as exc:
            self.dropped(sender, str(exc))
            for name in drop_broken(self.rings):  # truncated by its sender
                log.warning("%s closed ring %s: its sender truncated it", van.name, name)
            return None
        finally:
            if guard is not None:
                guard.release()
        msg.sender, msg.origin = sender, origin
        return msg

    def dropped(self, sender: int, why: str) -> None:
        van = self.van
        log.warning("%s dropped a bad message from %s: %s", van.name, self.who(sender), why)

    def deliver(self, msg: Message, waited: bool) -> None:
        """Into :attr:`ready` (or, for an in-van command, taken here)."""
        van = self.van
        if msg.lease is not None:
            if self.lent is None:
                self.lent = msg
            else:  # (two lent at once: this one's arrays are copied out of its ring now)
                self.release(msg)
        if _in_van(msg):
            if msg.sender != UNKNOWN:
                van.take(msg)
            else:  # perhaps a peer whose node table is on its way: keep a few
                with self.stash_lock:
                    full = len(self.stashed) == MAX_STASHED_OFFERS
                    self.stashed.append(msg)  # (full: the oldest goes)
                if full:
                    log.warning("%s dropped the oldest offer of an unknown connection", van.name)
            return
        msg.backlogged = waited
        van.counters.count(msg.sender, msg.nbytes, sent=False)
        if van.observer is not None:
            van.observer("recv", msg.sender, msg.cmd, msg.nbytes, time.time())
        if van.verbose >= 2:
            van.trace("<-", msg.sender, msg)
        self.ready.append(msg)

    def landing_for(self, sender: int) -> Any:
        """The codec's ``landing_of`` for a message from ``sender``: only the node a request
        went to may land its answer in the caller's array."""
        van = self.van
        landing_of = van.landing_of
        if landing_of is None or sender == UNKNOWN:
            return None
        made = self._landings.get(sender)  # (one per sender, not one per message)
        if made is None or made.func is not landing_of:
            made = self._landings[sender] = partial(landing_of, sender)
        return made

    def release(self, msg: Message) -> None:
        """Give the ring space of ``msg``'s lent arrays back to its sender. The arrays it still
        holds (a request kept for later) are copied first, so it owns them from now on; what
        was read straight from the ring must not be kept past this point."""
        ring, msg.lease = msg.lease, None
        if self.lent is msg:
            self.lent = None
        if ring is None:
            return
        msg.arrays = [a.copy() if ring.holds(a) else a for a in msg.arrays]
        ring.commit()

    def unstash(self, origin: bytes) -> list[Message]:
        """The offers kept from the connection ``origin``, which belongs to a node now."""
        with self.stash_lock:
            mine = [m for m in self.stashed if m.origin == origin]
            others = (m for m in self.stashed if m.origin != origin)
            self.stashed = deque(others, MAX_STASHED_OFFERS)
        return mine

    @staticmethod
    def who(sender: int) -> str:
        return f"node {sender}" if sender != UNKNOWN else "an unknown connection"
