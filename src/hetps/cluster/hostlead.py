"""One control message per host, a part of a worker's :class:`~hetps.cluster.node.Node`: the
workers of one host hand their barrier arrivals and their link reports to the host's leader
(its lowest live worker), which sends ONE message naming them all (``host``) and passes the
scheduler's one answer on (BytePS's local stage, for the control plane; docs/HOSTS.md).

On where the host is known and safe: a worker with a host group of more than one worker, a
cluster secret, ``HETPS_HOST_CONTROL`` on. The channel is a Unix socket in the abstract
namespace, named from the cluster secret, the host group and the leader's node id: the kernel
removes it with its process (a SIGKILL leaves nothing in /dev/shm), a peer's death is an EOF
at once (no polling of a mailbox), and the peer's uid is checked (``SO_PEERCRED``). Every
worker listens, so the next lowest takes over when the leader is let go. The leader sends a
round (a barrier's n, a report's round) once every connected local worker reached it (or was
sent at it already); a follower whose leader is gone (EOF, let go, a refused or failed relay,
half an answer or a hand left unread past 5 s: not asked again) sends its own, which the
scheduler counts once (a node's barrier is the highest it reached, a report is kept per
worker, a late one of a planned round answered)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import logging
import os
import select
import selectors
import socket
import struct
import termios
import threading
import time
from collections.abc import Callable
from typing import Annotated, Any, Protocol

import msgspec
import numpy as np
from msgspec import Meta

from hetps.cluster import protocol as P
from hetps.cluster.commands import BalanceAnswer, NodeId
from hetps.cluster.hostmerge import merge_host
from hetps.cluster.ports import MemberPort
from hetps.cluster.requests import Future, RequestTimeout
from hetps.transport.codec import Message


class LeadNode(MemberPort, Protocol):
    """What a host's lead uses of its worker's :class:`~hetps.cluster.node.Node`: what a
    Node's parts use, its requests to the scheduler and its check that it may go on."""

    def check(self) -> None: ...
    def request(
        self, peer: int, msg: Message, callback: Callable[[Message], None] | None = None
    ) -> Future: ...


log = logging.getLogger("hetps.worker")
_TICK = 0.2  # how often a wait looks at the node's failure and the let-go workers
_LEN = struct.Struct("<I")
_MAX_FRAME = 1 << 26  # a report's samples (the balance agent keeps at most 100,000: 4.8 MB)
_SEND_S = 1.0  # an answer a follower does not take within this drops it
_FRAME_S = 5.0  # a frame begun and not whole within this drops its sender (leader or follower)
REPORT = "r"  # the kind of a link report; a barrier's is "b:" and its group
AHEAD = 3  # a follower's rounds past this worker's own the leader keeps (sync: a round or two)


def _name(secret: bytes, group: int, leader: int) -> bytes:
    tag = hmac.new(secret, f"hostlead:{group}:{leader}".encode(), hashlib.sha256).hexdigest()
    return b"\0hetps-lead-" + tag[:32].encode()


# -- the frames of the host's channel: a follower's Hello (its node id), then its arrivals
# (Hand: kind, REPORT or "b:" and a barrier's group; n, its round or number; w, a report's
# body, samples and times); the leader's answers (Told: kind, n, ok: the scheduler answered,
# a: a barrier's live members or the planner's answer)
class Hello(msgspec.Struct, forbid_unknown_fields=True):
    id: NodeId


class Report(msgspec.Struct, forbid_unknown_fields=True):
    b: dict[str, Any]
    s: bytes  # float64 rows of 6
    t: bytes  # float64 rows of 3


class Hand(msgspec.Struct, forbid_unknown_fields=True):
    k: Annotated[str, Meta(max_length=16)]
    n: Annotated[int, Meta(ge=1)]
    w: Report | None = None


class Told(msgspec.Struct, forbid_unknown_fields=True):
    k: str
    n: int
    ok: bool
    a: BalanceAnswer | list[NodeId] | None = None


_DECODERS = {kind: msgspec.msgpack.Decoder(kind) for kind in (Hello, Hand, Told)}
_ENCODER = msgspec.msgpack.Encoder()


def _send(sock: socket.socket, frame: Any, out: list[int] | None = None) -> None:
    view = memoryview(_LEN.pack(len(data := _ENCODER.encode(frame))) + data)
    while out is not None and view:  # (a follower counts what went, to see its leader read)
        view = view[(n := sock.send(view)) :]
        out[0] += n
    sock.sendall(view)  # (a leader's answer: whole within the socket's timeout, or it fails)


def _same_user(sock: socket.socket) -> bool:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1] == os.geteuid()


class _Peer:
    """A local connection: what came of its next frame, its worker's id once it said it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.nid: int | None = None
        self.since = 0.0  # when its buffered part of a frame began

    def frames(self, data: bytes) -> list[bytes]:
        """The whole frames of the buffer and ``data`` (a half one stays); ValueError: a bad size."""
        if not self.buf:
            self.since = time.monotonic()
        self.buf += data
        out = []
        while len(self.buf) >= _LEN.size:
            (size,) = _LEN.unpack_from(self.buf)
            if not 0 < size <= _MAX_FRAME:
                raise ValueError(f"a frame of {size} bytes (at most {_MAX_FRAME})")
            if len(self.buf) < _LEN.size + size:
                break
            out.append(bytes(self.buf[_LEN.size : _LEN.size + size]))
            del self.buf[: _LEN.size + size]
            self.since = time.monotonic()
        return out

    def stalled(self) -> str | None:
        """Why to drop it if a frame begun is not whole within :data:`_FRAME_S` (else None)."""
        late = self.buf and time.monotonic() - self.since > _FRAME_S
        return f"part of a frame, not whole within {_FRAME_S:g} s" if late else None


class Slot:
    """One wait of this worker: its answer (None: not relayed, send it directly)."""

    def __init__(self) -> None:
        self.event, self.answer = threading.Event(), None

    def set(self, answer: Any) -> None:
        if not self.event.is_set():
            self.answer = answer
            self.event.set()


class Relayed:
    """A link report handed to the host's leader: :meth:`wait` gives the scheduler's answer as
    a node's request would, or sends the report directly when the leader did not relay it."""

    def __init__(self, lead: HostLead, slot: Slot, msg: Message, leader: int) -> None:
        self.lead, self.slot, self.msg, self.leader = lead, slot, msg, leader

    def wait(self, timeout: float | None = None) -> Message:
        """The answer (a reply to ``balance_report``)."""
        timeout = self.lead.node.cfg.request_timeout if timeout is None else timeout
        answer = self.lead.wait(self.slot, timeout, "balance report", self.leader)
        return answer or self.lead.node.request(P.SCHEDULER_ID, self.msg).wait(timeout)


class HostLead:
    """A worker's side of its host's one control message (leader and follower)."""

    @classmethod
    def plan(cls, node: LeadNode) -> HostLead | None:
        """The host part of worker ``node``, or None: it sends its own."""
        cfg, me = node.cfg, node.info
        if me is None or me.role != "worker" or me.group < 0 or cfg.secret is None:
            return None
        if not cfg.host_control or len(cls._host(node, me.group)) < 2:
            return None
        try:
            return cls(node)
        except OSError as exc:  # (its name taken: another process of this job's worker)
            log.warning("worker: sends its own barrier arrivals and reports: %s", exc)
            return None

    @staticmethod
    def _host(node: LeadNode, group: int) -> list[int]:
        return sorted(n.id for n in node.nodes.values() if n.role == "worker" and n.group == group)

    def __init__(self, node: LeadNode) -> None:
        assert node.info is not None and node.cfg.secret is not None
        self.node = node
        self.me = node.info.id
        self.group = node.info.group
        self.secret = node.cfg.secret
        self.lock = threading.RLock()  # (a relay's failure may be answered at once)
        # leader: followers' connections; per kind, what waits (node -> (n, what it sent))
        # and the last n sent of each node
        self.conns: dict[int, socket.socket] = {}
        self.pending: dict[str, dict[int, tuple[int, Any]]] = {}
        self.sent: dict[str, dict[int, int]] = {}
        self.mine: dict[str, int] = {}  # per kind, the last n this worker handed
        self.warned: set[int | None] = set()  # followers dropped with a warning already
        # this worker's own waits: (kind, n) -> Slot
        self.slots: dict[tuple[str, int], Slot] = {}
        # what a leader keeps of each worker's server times (set by the balance agent, which
        # knows what its plan reads; None: all of them)
        self.shrink_times: Callable[[np.ndarray], np.ndarray] | None = None
        # follower: the connection to the leader it hands its messages to
        self.up: socket.socket | None = None
        self.up_id, self.handed = 0, [0]  # (and the bytes it sent that leader)
        self.shunned: set[int] = set()  # leaders that did not read a hand: it sends its own
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.listener.bind(_name(self.secret, self.group, self.me))
        except OSError:
            self.listener.close()
            raise
        self.listener.listen(64)
        self._stop, self.sel = threading.Event(), selectors.DefaultSelector()
        self.sel.register(self.listener, selectors.EVENT_READ)
        self.thread = threading.Thread(target=self._serve, name="hetps-hostlead", daemon=True)
        self.thread.start()

    def leader(self) -> int:
        """The host's lowest live worker."""
        gone = self.node.left
        return min(i for i in self._host(self.node, self.group) if i not in gone or i == self.me)

    # -- a worker's side --------------------------------------------------------------------
    def barrier(self, group: str, n: int, timeout: float) -> tuple[bool, Any]:
        """Arrive at barrier ``n`` of ``group`` through the host; (False, None): it was not
        relayed, send it directly; (True, members) once released."""
        lead, slot = self._hand(f"b:{group}", n, None)
        answer = self.wait(slot, timeout, f"barrier({group})", lead)
        return (False, None) if answer is None else (True, answer[0])

    def report(self, rnd: int, msg: Message) -> Relayed:
        """Hand link report ``msg`` of round ``rnd`` to the host's leader."""
        samples, times = (np.ascontiguousarray(a, np.float64) for a in msg.arrays[:2])
        lead, slot = self._hand(REPORT, rnd, Report(msg.body, samples.tobytes(), times.tobytes()))
        return Relayed(self, slot, msg, lead)

    def _hand(self, kind: str, n: int, what: Any) -> tuple[int, Slot]:
        lead, slot = self.leader(), Slot()
        with self.lock:
            self.slots[(kind, n)] = slot
            self.mine[kind] = n
            if lead == self.me:
                self._arrive(kind, self.me, n, what)
                return lead, slot
        if (self.up is None or self.up_id != lead) and lead not in self.shunned:
            self._drop_up()
            self._connect(lead)
        try:
            if (up := self.up) is None or lead in self.shunned:  # (its reader may end it now)
                raise OSError("no leader")
            _send(up, Hand(kind, n, what), self.handed)
        except OSError:  # (gone, or not reading: its reader drops it, naming it, first)
            self._drop_up()
            with self.lock:
                self.slots.pop((kind, n), None)
            slot.set(None)
        return lead, slot

    def wait(self, slot: Slot, timeout: float, what: str, lead: int) -> Any:
        """``slot``'s answer (None: send it directly); raises the node's failure, or
        RequestTimeout after ``timeout``."""
        deadline = time.monotonic() + timeout
        while not slot.event.wait(_TICK):
            self.node.check()
            if lead != self.me and lead in self.node.left:  # let go (HETPS_ELASTIC)
                self._drop_up()
                return None
            if time.monotonic() > deadline:
                raise RequestTimeout(
                    f"{what} through the host's leader: no answer within {timeout:.1f} s "
                    "(raise HETPS_REQUEST_TIMEOUT if the job is just slow)"
                )
        return slot.answer

    def _connect(self, lead: int) -> None:
        """A connection to ``lead`` (it listens from its start, which may still run) and
        the thread that reads its answers."""
        until = time.monotonic() + 5.0
        while self.up is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(2 * _FRAME_S)  # (a hand not read: the reader drops the leader first)
            try:
                sock.connect(_name(self.secret, self.group, lead))
                if not _same_user(sock):
                    log.warning("host leader %d's socket belongs to another user: not used", lead)
                    sock.close()
                    return
                _send(sock, Hello(self.me), handed := [0])
            except OSError:
                sock.close()
                if time.monotonic() > until or lead in self.node.left:
                    return
                self.node.check()
                time.sleep(0.05)  # a retry of the connection, not a wait for another's state
                continue
            self.up, self.up_id, self.handed = sock, lead, handed
            threading.Thread(target=self._read_up, args=(sock, lead), daemon=True).start()

    def _read_up(self, sock: socket.socket, lead: int) -> None:
        """The leader's answers to this follower, each to its slot; at the end (the leader
        gone, or dropped: what is no answer, half a frame not whole, or a hand it did not read,
        within :data:`_FRAME_S`) every slot still open is told to send directly."""
        up, why, since, taken = _Peer(sock), None, time.monotonic(), 0
        (poll := select.poll()).register(sock, select.POLLIN)  # (select: no fd past 1024)
        while why is None:
            try:
                data = sock.recv(1 << 20) if poll.poll(_TICK * 1000) else None
                if data == b"":
                    break  # the leader is gone
                for told in map(_DECODERS[Told].decode, up.frames(data) if data else []):
                    self._told(told)
                # a silent leader: what it was sent lies in the kernel (SIOCOUTQ), none taken
                (q,) = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, bytes(4)))
                if not q or self.handed[0] - q > taken:
                    since, taken = time.monotonic(), self.handed[0] - q
            except OSError:
                break
            except (ValueError, msgspec.DecodeError) as exc:
                why = f"sent what is no answer ({exc})"
            if time.monotonic() - since > _FRAME_S:
                why = f"did not take a hand within {_FRAME_S:g} s"
                self.shunned.add(lead)  # (a leader that does not read is not asked again)
            why = why or (f"sent {s}" if (s := up.stalled()) else None)
        if why is not None:
            log.warning("worker %d: dropped host leader %d, which %s; sends its own",
                        self.me, lead, why)  # fmt: skip
            with contextlib.suppress(OSError):  # (a hand it sends meanwhile fails at once)
                sock.shutdown(socket.SHUT_RDWR)
        with self.lock:
            if self.up is sock:
                self.up = None
            for key in list(self.slots):
                self.slots.pop(key).set(None)
        sock.close()

    def _told(self, told: Told) -> None:
        with self.lock:
            slot = self.slots.pop((told.k, told.n), None)
        if slot is not None:
            report = told.k == REPORT and isinstance(told.a, BalanceAnswer)  # (else: (members,))
            answer = Message(P.BALANCE_REPORT, reply=True, typed=told.a) if report else (told.a,)
            slot.set(answer if told.ok else None)

    def _drop_up(self) -> None:
        if self.up is not None:
            with contextlib.suppress(OSError):
                self.up.shutdown(socket.SHUT_RDWR)  # (its reader ends and closes it)
        self.up = None

    # -- the leader's relay -----------------------------------------------------------------
    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                events = self.sel.select(_TICK)
            except (OSError, ValueError):
                return
            for key, _ in events:
                if key.fileobj is self.listener:
                    self._accept()
                else:
                    self._read(key.data)
            with self.lock:  # a worker let go may be the last one waited for
                for key in list(self.sel.get_map().values()):
                    if isinstance(key.data, _Peer) and (why := key.data.stalled()):
                        self._drop(key.data, why)
                for kind in list(self.pending):
                    self._pump(kind)

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except OSError:
            return
        if not _same_user(sock):
            log.warning("host leader: refused a local connection of another user")
            sock.close()
            return
        sock.settimeout(_SEND_S)  # (read when readable; an answer not taken drops it)
        self.sel.register(sock, selectors.EVENT_READ, _Peer(sock))

    def _read(self, peer: _Peer) -> None:
        """What ``peer`` sent since: each whole frame taken (its Hello, then its hands); a
        half frame waits in its buffer, and the other followers go on meanwhile."""
        try:
            data, why = peer.sock.recv(1 << 20), None
            frames = peer.frames(data) if data else []
        except OSError:
            data, why = b"", None
        except ValueError as exc:  # (a bad size)
            data, why = b"", str(exc)
        if not data:  # gone, or dropped: it sends its own from now on
            self._drop(peer, why)
            return
        for frame in frames:
            if not (self._hello(peer, frame) if peer.nid is None else self._take(peer, frame)):
                return

    def _hello(self, peer: _Peer, frame: bytes) -> bool:
        try:
            nid = _DECODERS[Hello].decode(frame).id
        except (ValueError, msgspec.DecodeError):
            nid = None
        if nid not in self._host(self.node, self.group) or nid == self.me:
            self._drop(peer, "its first frame names no other worker of this host")
            return False
        with self.lock:
            self._close(nid)
            peer.nid = nid
            self.conns[nid] = peer.sock
        return True

    def _take(self, peer: _Peer, frame: bytes) -> bool:
        """One hand of follower ``peer``: relayed with the host's others, or it is dropped."""
        try:
            hand = _DECODERS[Hand].decode(frame)
        except (ValueError, msgspec.DecodeError) as exc:
            return self._drop(peer, f"a frame that is no hand ({exc})")
        w = hand.w  # (a report: whole rows, else it sends its own)
        ok = (hand.k == REPORT and w is not None and not len(w.s) % 48 and not len(w.t) % 24) or (
            hand.k in [f"b:{g}" for g in P.GROUPS]
        )
        if not ok:
            return self._drop(peer, f"a hand of kind {hand.k!r} that is no barrier or report")
        with self.lock:
            wrong = self._off_round(hand.k, peer.nid, hand.n)
            if wrong is None:
                self._arrive(hand.k, peer.nid, hand.n, hand.w)
                return True
        return self._drop(peer, wrong)

    def _off_round(self, kind: str, nid: Any, n: int) -> str | None:
        """Why round ``n`` of ``kind`` from follower ``nid`` is not one the host awaits from it
        (None: it is), under the lock. A follower holding a hand here goes on to its next
        (pipelined: that one is relayed on its own, :meth:`_arrive`). Else: this worker's own
        round while it waits there, or the next; and any earlier one not yet sent for it (this
        worker went on: it is relayed once the host's others are there or past it). Another
        round would hold the host's rounds, or never come."""
        step = self.node.cfg.replan_every if kind == REPORT else 1
        held, mine = self.pending.get(kind, {}).get(nid), self.mine.get(kind, 0)
        if held is not None:  # (at most AHEAD rounds past this worker's: each is kept)
            allowed = [held[0] + step] if held[0] + step <= mine + AHEAD * step else []
        else:
            sent = self.sent.get(kind, {}).get(nid, 0)
            if self.me in self.pending.get(kind, {}):
                allowed = [mine]
            else:
                allowed = [mine + step if mine else 1]
                if sent < mine:
                    allowed.insert(0, mine)
            if sent < n < allowed[0]:
                return None
        if n in allowed:
            return None
        want = " or ".join(map(str, allowed)) or f"none past {mine + AHEAD * step} yet"
        return f"round {n} of {kind!r}, not the current or next ({want})"

    def _drop(self, peer: _Peer, why: str | None) -> bool:
        """Close ``peer`` (``why``: logged, naming it); it sends its own from now on."""
        if why is not None:  # (a follower dropped again, reconnecting each round: quieter)
            who = f"worker {peer.nid}" if peer.nid is not None else "a local connection"
            level = logging.DEBUG if peer.nid in self.warned else logging.WARNING
            log.log(level, "host leader %d: dropped %s, which sent %s", self.me, who, why)
            self.warned.add(peer.nid)
        with self.lock:
            if peer.nid is not None and self.conns.get(peer.nid) is peer.sock:
                self._close(peer.nid)
                for k in list(self.pending):
                    self._pump(k)
            else:
                self._unregister(peer.sock)
        return False

    def _unregister(self, sock: socket.socket) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(sock)
        sock.close()

    def _close(self, nid: int) -> None:
        sock = self.conns.pop(nid, None)
        if sock is not None:
            self._unregister(sock)
        for waiting in self.pending.values():
            waiting.pop(nid, None)

    def _arrive(self, kind: str, nid: int, n: int, what: Any) -> None:
        """Worker ``nid`` is at ``n`` of ``kind`` (under the lock). A report it left waiting
        at an earlier round (pipelined: it went on before a local worker's report of that
        round was read here) goes now on its own, not overwritten and lost."""
        waiting = self.pending.setdefault(kind, {})
        old = waiting.pop(nid, None)
        if old is not None and old[0] < n:
            self.sent.setdefault(kind, {})[nid] = old[0]
            self._relay(kind, old[0], {nid: old[1]})
        waiting[nid] = (n, what)
        self._pump(kind)

    def _pump(self, kind: str) -> None:
        """Send ``kind``'s messages at n once every local worker is at n or was sent there
        (under the lock)."""
        waiting = self.pending.get(kind)
        if not waiting:
            return
        sent = self.sent.setdefault(kind, {})
        expected = [i for i in (self.me, *self.conns) if i not in self.node.left]
        for n in sorted({m for m, _ in waiting.values()}):
            if all(waiting.get(i, (0,))[0] == n or sent.get(i, 0) >= n for i in expected):
                batch = {i: w for i, (m, w) in waiting.items() if m == n}
                for i in batch:
                    del waiting[i]
                    sent[i] = n
                self._relay(kind, n, batch)

    def _relay(self, kind: str, n: int, batch: dict[int, Any]) -> None:
        ids = sorted(batch)
        if kind == REPORT:
            msg = self._merged(n, ids, batch)
        else:
            msg = Message(P.BARRIER, body={"group": kind[2:], "n": n, "host": ids})
        told: list[bool] = []

        def answer(ok: bool, reply: Any) -> None:
            with self.lock:
                if not told:
                    told.append(True)
                    self._answer(kind, n, ids, ok, reply)

        fut = self.node.request(P.SCHEDULER_ID, msg, callback=lambda r: answer(True, r))
        fut.errback = lambda _e: answer(False, None)
        if fut.done() and fut.error is not None:
            answer(False, None)

    def _merged(self, rnd: int, ids: list[int], batch: dict[int, Any]) -> Message:
        """The host's one report: its workers' samples merged per (host, server) pair
        (:func:`merge_host`), their times in one array (with those: each worker's longest,
        all that the planner reads of them unless its plan fits a line per server), the rows of
        each worker (``host_rows``: the merged samples all the first's), the layout and the
        flags of the first that has them (every worker reports the same ones)."""
        bodies = [batch[i].b for i in ids]
        samples = [np.frombuffer(batch[i].s, np.float64).reshape(-1, 6) for i in ids]
        times = [np.frombuffer(batch[i].t, np.float64).reshape(-1, 3) for i in ids]
        joined = np.concatenate(samples)
        if not self.node.cfg.colocate:  # (colocated: every worker is a row of its own)
            joined = merge_host(joined, ids)  # the host's, merged per (host, server) pair
            samples = [joined] + [joined[:0]] * (len(ids) - 1)
            if self.shrink_times is not None:
                times = [self.shrink_times(t) for t in times]
        rows = [[len(s), len(t)] for s, t in zip(samples, times, strict=True)]
        body: dict[str, Any] = {"round": rnd, "host": ids, "host_rows": rows}
        for field in ("sizes", "assign", "calibration", "spread_done"):
            body[field] = next((b[field] for b in bodies if b.get(field)), None)
        body["one_push"] = all(b.get("one_push") for b in bodies) or None  # (all say it)
        arrays = [joined, np.concatenate(times)]
        return Message(P.BALANCE_REPORT, body={k: v for k, v in body.items() if v is not None},
                       arrays=arrays)  # fmt: skip

    def _answer(self, kind: str, n: int, ids: list[int], ok: bool, reply: Any) -> None:
        """The scheduler's answer (``ok``) or a relay's failure, to each of its workers."""
        if kind == REPORT:  # (a BalanceAnswer, decoded by the dispatch; None: an error answer)
            local = BalanceAnswer(plan=getattr(reply.typed, "plan", msgspec.UNSET)) if ok else None
        else:
            local = getattr(getattr(reply, "typed", None), "members", None)
            reply = (local,)
        with self.lock:
            for nid in ids:
                if nid == self.me:  # (its wait, if it still waits)
                    self.slots.pop((kind, n), Slot()).set(reply if ok else None)
                    continue
                sock = self.conns.get(nid)
                try:
                    if sock is not None:
                        _send(sock, Told(kind, n, ok, local))
                except OSError as exc:
                    log.warning("host leader %d: dropped worker %d: an answer did not go (%s)",
                                self.me, nid, exc)  # fmt: skip
                    self._close(nid)

    def close(self) -> None:
        """Stop relaying; the followers see the EOF and send their own."""
        self._stop.set()
        self.thread.join(timeout=2)
        with self.lock:
            for nid in list(self.conns):
                self._close(nid)
            self._drop_up()
            self.sel.close()
            self.listener.close()
