"""The receiving side of the bulk channels (transport/bulk.py): a node's bulk listener, its
channels, and the messages that wait for their frames.
(docs/MODULES.md, "hetps.transport.bulk_in")"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from collections import deque
from typing import Any

import numpy as np
import zmq
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from hetps.transport.codec import FRAME_MAX, NotYet
from hetps.transport.handshakes import HandshakeGuard, RefusalLog
from hetps.transport.security import BULK_DOMAIN, hkdf_sha256

log = logging.getLogger("hetps.bulk")

TAG = 16
CTR = 8
#: a waiting message whose channel brought no frame for this long is dropped
BULK_WAIT_S = 20.0
#: decrypted frames kept for messages not yet read (their header is behind), all peers:
#: each peer has its own equal share of it (so one or two nodes of the job, whatever they
#: send, cannot take what the others need), but never less than :data:`PEER_PENDING_MIN`
PENDING_MAX = 1 << 30
#: the least share of a peer (two of the biggest frames, whatever the number of peers)
PEER_PENDING_MIN = 2 * (16 << 20)
#: ... and what one channel may hold at most
CHANNEL_PENDING_MAX = PENDING_MAX // 2
#: frames read from the bulk port at a time (the CURVE connection is read in between)
DRAIN_MAX = 64
#: what a frame kept for a header (or for its channel's hello) is charged at least against
#: those budgets: keeping one costs its Python and ZeroMQ objects whatever its bytes, so
#: empty or tiny frames (a mark is 24 bytes) cannot be kept without end
KEEP_COST = 1024
#: marks (the empty frames that lead a timed message's arrays) a channel keeps unread
MAX_MARKS = 64
_NOTHING = np.empty(0, np.uint8)
#: bytes of a connection's messages held behind its message that waits for its frames
#: (headers and small inline arrays: its big arrays come on the channel); over it, the
#: waiting message is dropped
WAITING_MAX = 16 << 20
#: ZMTP's PLAIN HELLO of a channel's sender (user name 16 bytes, proof 32): a connection that
#: sent less after its greeting has not begun its handshake (transport/handshakes.py)
PLAIN_HELLO_BYTES = 58
_INFO = b"hetps bulk aes-256-gcm v1 "


def nonce_of(counter: int) -> bytes:
    """The AES-GCM nonce of a channel's frame ``counter``."""
    return b"\0\0\0\0" + counter.to_bytes(8, "big")


def channel_key(salt: bytes, kb: bytes, ka: bytes, cid: bytes) -> AESGCM:
    """A channel's key in one direction, from both key shares, the salt and its id."""
    return AESGCM(hkdf_sha256(kb + ka, salt, _INFO + cid))


def proof_of(kb: bytes, cid: bytes) -> bytes:
    """What a sender shows at the bulk port's handshake (PLAIN's password, checked by ZAP
    before ZeroMQ reads a message): it holds the secret half of the channel it names."""
    return hmac.new(kb, b"hetps bulk connection v1 " + cid, hashlib.sha256).digest()


def frame_count(n: int) -> int:
    """The frames (counters) an array of ``n`` bytes takes."""
    return max(1, -(-n // FRAME_MAX))


def frame_cost(n: int) -> int:
    """What keeping a frame of ``n`` bytes is charged against the budgets."""
    return max(n, KEEP_COST)


class InChannel:
    """The receiving end of one channel, in the van's ring table under its name: the codec
    takes an array's frames from it as it takes them from a shared-memory ring."""

    broken = False  # (what drop_broken looks at in the ring table)
    lends = False  # (its arrays are the receiver's own: never lent, see codec.decode)

    def __init__(self, rx: BulkReceiver, cid: bytes, kb: bytes, peer: Any) -> None:
        self.rx = rx
        self.cid = cid
        self.name = "bulk-" + cid.hex()
        self.kb = kb
        self.peer = peer  # the node it was offered to: only its connection may open it
        self.proof = proof_of(kb, cid)  # what its sender's connection shows at the handshake
        self.user = cid.hex().encode()  # ZAP's user id of that connection, on its frames
        self.held = 0  # bytes of this channel's frames kept for headers not yet read
        self.owner: bytes | None = None  # the CURVE connection that opened it (its hello)
        self.rid: bytes | None = None  # the routing id of its one bulk connection
        self.aead: AESGCM | None = None
        self.next = 0  # counters below this were consumed or skipped: refused from now on
        self.pending: dict[int, np.ndarray] = {}  # counter -> plaintext that came early
        # frames that came before the hello (the two connections race): checked at the hello
        self.early: list[Any] = []
        # the message being decoded: first counter -> [its array, the counters still due]
        self.made: dict[int, list] = {}
        self.landing: dict[int, tuple[np.ndarray, set]] = {}  # due counter -> (where, its set)
        self.placed: set[int] = set()  # counters that message took already (again: a replay)
        # marks (empty frames ahead of a timed message's arrays): counter -> (when, late)
        self.marks: dict[int, tuple[float, bool]] = {}
        self.stamped = -1  # the mark the message being decoded took
        self.failed: str | None = None  # why the message being decoded cannot be completed
        self.heard = time.monotonic()  # when a frame of this channel last passed its tag
        self.admitted = False  # its sender's one connection passed the handshake

    def open(self, salt: bytes, ka: bytes, origin: bytes) -> None:
        self.aead = channel_key(salt, self.kb, ka, self.cid)
        self.owner = origin

    def take(self, pos: int, n: int, out: np.ndarray | None = None, view: bool = False):
        """The ``n`` bytes whose frames have counters from ``pos`` on (into ``out`` when
        given); ValueError when they are refused or cannot come, NotYet while they may."""
        if not (isinstance(pos, int) and pos >= self.next and n > 0):
            raise ValueError(f"bulk counter {pos!r} was consumed already or is bad (a replay)")
        entry = self.made.get(pos)
        if entry is None:
            k = frame_count(n)
            if k == 1 and out is None and pos in self.pending:
                entry = [self.pending[pos], set()]
                self.rx.forget(self, pos)
                self.placed.add(pos)
            else:
                arr, due = np.empty(n, np.uint8), set()
                for j in range(k):
                    dest = arr[j * FRAME_MAX : min(n, (j + 1) * FRAME_MAX)]
                    got = self.pending.get(pos + j)
                    if got is None:
                        due.add(pos + j)
                        self.landing[pos + j] = (dest, due)
                    elif got.nbytes != dest.nbytes:
                        raise ValueError(
                            f"bulk frame {pos + j} holds {got.nbytes} bytes, not {dest.nbytes}"
                        )
                    else:
                        dest[:] = got
                        self.rx.forget(self, pos + j)
                        self.placed.add(pos + j)
                entry = [arr, due]
            self.made[pos] = entry
        if entry[1]:
            self.rx.drain()  # (what is here already lands now)
        if self.failed is not None:
            raise ValueError(self.failed)
        if entry[1]:
            raise NotYet(self)
        if entry[0].nbytes != n:
            raise ValueError(f"bulk frame {pos} holds {entry[0].nbytes} bytes, not {n}")
        if out is None:
            return entry[0]
        out[:] = entry[0]  # (every frame passed its tag: now the caller's array)
        return out

    def stamp(self, pos: int) -> tuple[float, bool, float] | None:
        """For the message being decoded, whose arrays are all here now: when its mark
        ``pos`` came, whether that stamp may be late (the receive thread was behind), and
        now (when the message is whole); None if no such mark came (a message is never
        refused for its timing). Both times are the receive thread's."""
        got = self.marks.pop(pos, None) if pos >= self.next else None
        if got is None:
            return None
        self.stamped = max(self.stamped, pos)
        return got[0], got[1], time.time()

    def due(self) -> bool:
        """Whether a frame the message being decoded needs is still to come."""
        return self.failed is None and bool(self.landing)

    def commit(self) -> None:
        """The message being decoded is done (delivered, or dropped): its counters are used."""
        for pos, (arr, _due) in self.made.items():
            self.next = max(self.next, pos + frame_count(arr.nbytes))
        self.next = max(self.next, self.stamped + 1)
        self.stamped = -1
        for c in [c for c in self.marks if c < self.next]:
            del self.marks[c]
        self.made.clear()
        self.landing.clear()
        self.placed.clear()
        self.failed = None
        for c in [c for c in self.pending if c < self.next]:
            self.rx.forget(self, c)

    def holds(self, arr: np.ndarray) -> bool:
        return False

    def close(self) -> None:
        for c in list(self.pending):
            self.rx.forget(self, c)
        self.rx.release(self, sum(frame_cost(len(f.buffer)) for f in self.early))
        self.early.clear()
        self.made.clear()
        self.landing.clear()
        self.marks.clear()


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
        self.guard = HandshakeGuard(self.sock, refusals, secured=False, hello=PLAIN_HELLO_BYTES)
        self.sock.bind(f"tcp://{host}:*")
        self.port = self.guard.port = int(
            self.sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1]
        )
        # channel id -> its receiving end; a connection's frames are its channel's by the
        # channel its handshake proved (ZAP's user id), never by a routing id it chose
        self.channels: dict[bytes, InChannel] = {}
        self.pending_bytes = 0
        self.peer_held: dict[Any, int] = {}  # bytes kept per peer (its share's use)
        self._peers = (-1, 1)  # (len(channels) when counted, peers with a channel)
        self.wait_s = BULK_WAIT_S
        # whether the frame being placed waited behind others read just before it (a mark's
        # stamp is then later than its arrival); frames kept for a hello waited too
        self.late = True

    def refuse(self, why: str, *args: object) -> None:
        """Log (rate-limited) that a frame was refused and why."""
        self.refusals.refused("%s refused a bulk frame: " + why, self.name, *args)

    def authorize(self, user: bytes, password: bytes) -> bytes | None:
        """(The ZAP thread's check of a connection.) The user id its frames will carry if
        ``user`` is a channel this node offered or opened and ``password`` its proof."""
        chan = self.channels.get(user)
        if chan is None or not hmac.compare_digest(password, chan.proof):
            return None
        if chan.admitted:  # (a proof is good for one connection: one read off the wire is spent)
            self.refusals.refused(
                "%s refused a second connection for node %s's bulk channel %s (its channel "
                "id and proof used again: a replay, or a copy of that node)",
                self.name,
                chan.peer,
                chan.name,
            )
            return None
        chan.admitted = True
        return chan.user

    def share(self) -> int:
        """What one peer may keep for headers not yet read: an equal share of
        :data:`PENDING_MAX` among the peers with a channel (at least
        :data:`PEER_PENDING_MIN`, at most :data:`CHANNEL_PENDING_MAX`)."""
        if self._peers[0] != len(self.channels):
            self._peers = (len(self.channels), len({c.peer for c in self.channels.values()}))
        per = max(PENDING_MAX // max(1, self._peers[1]), PEER_PENDING_MIN)
        return min(per, CHANNEL_PENDING_MAX)

    def hold(self, chan: InChannel, n: int, ctr: int) -> bool:
        """Count ``n`` more bytes kept for ``chan``; False (and a refusal) over its peer's
        share or its channel's budget."""
        used = self.peer_held.get(chan.peer, 0)
        share = self.share()
        if used + n > share or chan.held + n > CHANNEL_PENDING_MAX:
            self.refuse(
                "node %s's frame %d: %d bytes of its channel's (%d of that node's share of "
                "%d) are held for headers not yet read",
                chan.peer,
                ctr,
                chan.held,
                used,
                share,
            )
            return False
        chan.held += n
        self.peer_held[chan.peer] = used + n
        self.pending_bytes += n
        return True

    def release(self, chan: InChannel, n: int) -> None:
        chan.held -= n
        self.pending_bytes -= n
        left = self.peer_held.get(chan.peer, 0) - n
        if left > 0:
            self.peer_held[chan.peer] = left
        else:
            self.peer_held.pop(chan.peer, None)

    def forget(self, chan: InChannel, ctr: int) -> None:
        got = chan.pending.pop(ctr, None)
        if got is not None:
            self.release(chan, frame_cost(got.nbytes))

    def drain(self) -> bool:
        """Read what the bulk port holds now (at most :data:`DRAIN_MAX` frames): each frame
        lands where a message waits for it, or is kept, or is refused. Whether one came."""
        came = False
        for i in range(DRAIN_MAX):
            try:
                parts = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            came = True
            self.late = i > 0
            self._on_frame(parts)
        self.late = True
        return came

    def _on_frame(self, parts: list) -> None:
        if len(parts) != 2:
            self.refuse("%d parts from one connection", len(parts))
            return
        user = parts[1].get("User-Id")
        try:
            chan = self.channels.get(bytes.fromhex(user)) if user else None
        except ValueError:
            chan = None
        if chan is None:  # (ZAP let it in for a channel closed since)
            self.refuse("a connection that is no peer's channel (a stranger)")
            return
        rid = parts[0].bytes
        if chan.rid is None:
            chan.rid = rid  # (the connection its handshake proved: one per channel)
        elif rid != chan.rid:
            self.refuse(
                "a frame of node %s's channel under another routing id (a routing id reused)",
                chan.peer,
            )
            return
        buf = parts[1].buffer
        if chan.aead is None:  # offered, and its hello is still on its way: kept till then
            if self.hold(chan, frame_cost(len(buf)), -1):
                chan.early.append(parts[1])
            return
        if len(buf) < CTR + TAG:
            self.refuse("%d bytes from node %s's channel, too short", len(buf), chan.peer)
            return
        ctr = int.from_bytes(buf[:CTR], "big")
        if ctr < chan.next or ctr in chan.pending or ctr in chan.placed or ctr in chan.marks:
            self.refuse(
                "counter %d from node %s's channel was used already (a replay)", ctr, chan.peer
            )
            return
        self.place(chan, ctr, buf)

    def place(self, chan: InChannel, ctr: int, buf: memoryview) -> None:
        """A frame that passed the connection checks: into the array waiting for it, or
        kept for a header not yet read (decrypted, so a bad one is refused now)."""
        spot = chan.landing.get(ctr)
        if spot is not None:
            dest, due = spot
            if self._open(chan, ctr, buf, dest):  # (a frame without the key changes nothing)
                due.discard(ctr)
                chan.placed.add(ctr)
                chan.landing.pop(ctr)
                chan.heard = time.monotonic()
            return
        n = len(buf) - CTR - TAG
        if n == 0:  # a mark: when it came is all it says
            if self._open(chan, ctr, buf, _NOTHING):
                if len(chan.marks) >= MAX_MARKS:  # (the oldest goes: a newer one is wanted)
                    del chan.marks[min(chan.marks)]
                    self.refuse("node %s's channel sent %d marks ahead", chan.peer, MAX_MARKS)
                chan.marks[ctr] = (time.time(), self.late)
                chan.heard = time.monotonic()
            return
        if not self.hold(chan, frame_cost(n), ctr):
            return
        plain = np.empty(n, np.uint8)
        if not self._open(chan, ctr, buf, plain):
            self.release(chan, frame_cost(n))
            return
        chan.heard = time.monotonic()
        chan.pending[ctr] = plain
        if chan.landing and min(chan.landing) < ctr:  # one connection keeps its order
            chan.failed = f"bulk frame {min(chan.landing)} was skipped by its sender"

    def _open(self, chan: InChannel, ctr: int, buf: memoryview, dest: np.ndarray) -> bool:
        """Decrypt into ``dest``; False (and a refusal) if the frame fails its tag."""
        if len(buf) != CTR + dest.nbytes + TAG:
            self.refuse(
                "frame %d of node %s's channel is %d bytes, not %d",
                ctr,
                chan.peer,
                len(buf),
                CTR + dest.nbytes + TAG,
            )
            return False
        try:
            chan.aead.decrypt_into(nonce_of(ctr), buf[CTR:], chan.cid + bytes(buf[:CTR]), dest)
        except InvalidTag:
            self.refuse(
                "frame %d of node %s's channel failed its tag (forged or tampered)", ctr, chan.peer
            )
            return False
        return True

    def close(self) -> None:
        self.guard.close(self.sock)
        self.sock.close(linger=0)


class Waiting:
    """Messages that wait for their bulk frames, per connection, in the order they came: a
    connection's later messages wait behind its first (a pull behind its push). At most
    :data:`WAITING_MAX` bytes wait behind a connection's first; its wait (:data:`BULK_WAIT_S`
    without a frame of its channel that passed its tag) starts when it comes to the head."""

    def __init__(self) -> None:
        # origin -> [[frames, sender, channel, since]], and the bytes held behind each head
        self.queues: dict[bytes, deque] = {}
        self.held: dict[bytes, int] = {}

    def __bool__(self) -> bool:
        return bool(self.queues)

    def holds(self, origin: bytes) -> bool:
        return origin in self.queues

    def add(self, origin: bytes, frames: list, sender: Any, chan: InChannel | None) -> None:
        queue = self.queues.setdefault(origin, deque())
        if queue:
            self.held[origin] = self.held.get(origin, 0) + sum(len(f.buffer) for f in frames)
        queue.append([frames, sender, chan, time.monotonic()])

    def ready(self, decode: Any, dropped: Any, stop: Any) -> list:
        """The messages that can be decoded now, in order (``decode(frames, origin, sender)``
        returns a message, None when it was bad, or raises NotYet), up to the first for which
        ``stop(msg)`` (an in-van command, which the caller applies before the next is read);
        a head whose wait ran out, or with too much behind it, is dropped
        (``dropped(sender, why)``)."""
        out = []
        for origin in list(self.queues):
            queue = self.queues[origin]
            while queue:
                frames, sender, chan, since = queue[0]
                if chan is not None and chan.due():
                    chan.rx.drain()  # (what came meanwhile first)
                if chan is not None and chan.due():
                    why = self._why(origin, chan, since)
                    if why is None:
                        break
                    chan.commit()  # (its counters are skipped: the message is dropped)
                    dropped(sender, why)
                    self._pop(origin, queue)
                    continue
                try:
                    msg = decode(frames, origin, sender)
                except NotYet as wait:
                    queue[0][2], queue[0][3] = wait.ring, time.monotonic()
                    break
                self._pop(origin, queue)
                if msg is not None:
                    out.append(msg)
                    if stop(msg):
                        break
            if not queue:
                del self.queues[origin]
                self.held.pop(origin, None)
            if out and stop(out[-1]):
                break
        return out

    def _why(self, origin: bytes, chan: InChannel, since: float) -> str | None:
        """Why the head waits no more, or None."""
        if self.held.get(origin, 0) > WAITING_MAX:
            return (
                f"{self.held[origin]} bytes of its connection's later messages wait behind it "
                f"(at most {WAITING_MAX})"
            )
        quiet = time.monotonic() - max(chan.heard, since)
        if quiet >= chan.rx.wait_s:
            return f"bulk frames did not come within {chan.rx.wait_s:g} s of the last one"
        return None

    def _pop(self, origin: bytes, queue: deque) -> None:
        queue.popleft()
        if queue:  # the next head's bytes no longer wait behind one
            self.held[origin] -= sum(len(f.buffer) for f in queue[0][0])
