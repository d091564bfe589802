"""One barrier arrival per host, a part of a worker's :class:`~hetps.cluster.node.Node`: the
workers of one host hand their arrival to the host's leader (its lowest live worker), which
sends ONE arrival naming them all (``host``) and passes the scheduler's one release on
(BytePS's local stage, for the control plane; docs/HOSTS.md).

On where the host is known and safe: a worker with a host group of more than one worker, a
cluster secret, ``HETPS_HOST_CONTROL`` on. The channel is a Unix socket in the abstract
namespace, named from the cluster secret, the host group and the leader's node id: the kernel
removes it with its process (a SIGKILL leaves nothing in /dev/shm), a peer's death is an EOF
at once (no polling of a mailbox), and the peer's uid is checked (``SO_PEERCRED``). Every
worker listens, so the next lowest takes over when the leader is let go. The leader sends a
barrier's arrivals once every connected local worker reached it (or was sent at it already);
a follower whose leader is gone (EOF, let go, a refused or failed relay) sends its own
arrival, which the scheduler counts once (a node's barrier is the highest it reached)."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import selectors
import socket
import struct
import threading
import time
from typing import TYPE_CHECKING, Any

import msgpack

from hetps.cluster import protocol as P
from hetps.cluster.requests import RequestTimeout

if TYPE_CHECKING:
    from hetps.cluster.node import Node

log = logging.getLogger("hetps.worker")
_LEN = struct.Struct("<I")
_MAX_FRAME = 1 << 16
_TICK = 0.2  # how often a wait looks at the node's failure and the let-go workers


def _name(secret: bytes, group: int, leader: int) -> bytes:
    tag = hmac.new(secret, f"hostlead:{group}:{leader}".encode(), hashlib.sha256).hexdigest()
    return b"\0hetps-lead-" + tag[:32].encode()


def _send(sock: socket.socket, body: dict) -> None:
    data = msgpack.packb(body)
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv(sock: socket.socket) -> dict | None:
    """One frame (None: the peer closed or sent garbage)."""
    try:
        head = sock.recv(_LEN.size, socket.MSG_WAITALL)
        if len(head) < _LEN.size:
            return None
        (size,) = _LEN.unpack(head)
        data = sock.recv(size, socket.MSG_WAITALL) if size <= _MAX_FRAME else b""
        if len(data) != size or not size:
            return None
        body = msgpack.unpackb(data)
        return body if isinstance(body, dict) else None
    except (OSError, ValueError, msgpack.UnpackException):
        return None


def _same_user(sock: socket.socket) -> bool:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1] == os.geteuid()


class HostLead:
    """A worker's side of its host's one arrival per barrier (leader and follower)."""

    @classmethod
    def plan(cls, node: Node) -> HostLead | None:
        """The host part of worker ``node``, or None: it sends its own arrivals."""
        cfg, me = node.cfg, node.info
        if me is None or me.role != "worker" or me.group < 0 or cfg.secret is None:
            return None
        if not cfg.host_control or len(cls._host(node, me.group)) < 2:
            return None
        return cls(node)

    @staticmethod
    def _host(node: Node, group: int) -> list[int]:
        return sorted(n.id for n in node.nodes.values() if n.role == "worker" and n.group == group)

    def __init__(self, node: Node) -> None:
        assert node.info is not None and node.cfg.secret is not None
        self.node = node
        self.me = node.info.id
        self.group = node.info.group
        self.secret = node.cfg.secret
        self.lock = threading.RLock()  # (a relay's failure may be answered at once)
        # leader: followers' connections, arrivals waiting per group, the last n sent
        self.conns: dict[int, socket.socket] = {}
        self.pending: dict[str, dict[int, int]] = {}
        self.sent: dict[str, dict[int, int]] = {}
        self.mine: dict[str, list[Any]] = {}  # group -> [n, Event, answer] of my own wait
        # follower: the connection to the leader it hands arrivals to
        self.up: socket.socket | None = None
        self.up_id = 0
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(_name(self.secret, self.group, self.me))
        self.listener.listen(64)
        self._stop = threading.Event()
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.listener, selectors.EVENT_READ)
        self.thread = threading.Thread(target=self._serve, name="hetps-hostlead", daemon=True)
        self.thread.start()

    def leader(self) -> int:
        """The host's lowest live worker."""
        gone = self.node.left
        return min(i for i in self._host(self.node, self.group) if i not in gone or i == self.me)

    # -- a worker's barrier -----------------------------------------------------------------
    def barrier(self, group: str, n: int, timeout: float) -> tuple[bool, Any]:
        """Arrive at barrier ``n`` of ``group`` through the host; (False, None): it was not
        relayed, send it directly; (True, members) once released."""
        lead = self.leader()
        if lead == self.me:
            return self._lead(group, n, timeout)
        return self._follow(lead, group, n, timeout)

    def _deadline_passed(self, deadline: float, group: str) -> None:
        self.node.check()
        if time.monotonic() > deadline:
            raise RequestTimeout(
                f"barrier({group}) through the host's leader: no release within "
                f"{self.node.cfg.request_timeout:.1f} s (raise HETPS_REQUEST_TIMEOUT if the "
                "job is just slow)"
            )

    def _lead(self, group: str, n: int, timeout: float) -> tuple[bool, Any]:
        slot: list[Any] = [n, threading.Event(), None]
        with self.lock:
            self.mine[group] = slot
            self.pending.setdefault(group, {})[self.me] = n
            self._pump(group)
        deadline = time.monotonic() + timeout
        while not slot[1].wait(_TICK):
            self._deadline_passed(deadline, group)
        return slot[2]

    def _follow(self, lead: int, group: str, n: int, timeout: float) -> tuple[bool, Any]:
        deadline = time.monotonic() + timeout
        if self.up is None or self.up_id != lead:
            self._drop_up()
            self.up = self._connect(lead, deadline, group)
            self.up_id = lead
        if self.up is None:
            return False, None
        try:
            _send(self.up, {"g": group, "n": n})
        except OSError:
            self._drop_up()
            return False, None
        while True:
            ready = selectors.DefaultSelector()
            ready.register(self.up, selectors.EVENT_READ)
            got = ready.select(_TICK)
            ready.close()
            if got:
                body = _recv(self.up)
                if body is None:  # the leader is gone
                    self._drop_up()
                    return False, None
                if body.get("g") == group and body.get("n") == n:  # (else: an old answer)
                    return not body.get("direct"), body.get("m")
                continue
            if lead in self.node.left:  # let go (HETPS_ELASTIC): on without it
                self._drop_up()
                return False, None
            self._deadline_passed(deadline, group)

    def _connect(self, lead: int, deadline: float, group: str) -> socket.socket | None:
        """A connection to ``lead`` (it listens from its start, which may still run)."""
        until = min(deadline, time.monotonic() + 5.0)
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(_name(self.secret, self.group, lead))
                if _same_user(sock):
                    _send(sock, {"id": self.me})
                    return sock
                log.warning("host leader %d's socket belongs to another user: not used", lead)
                sock.close()
                return None
            except OSError:
                sock.close()
            if time.monotonic() > until or lead in self.node.left:
                return None
            self._deadline_passed(deadline, group)
            time.sleep(0.05)  # a retry of the connection, not a wait for another's state

    def _drop_up(self) -> None:
        if self.up is not None:
            self.up.close()
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
                    self._read(key.data, key.fileobj)  # type: ignore[arg-type]
            with self.lock:  # a worker let go may be the last one waited for
                for group in list(self.pending):
                    self._pump(group)

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except OSError:
            return
        sock.settimeout(1.0)  # a peer that sends half a frame is dropped, not waited for
        hello = _recv(sock) if _same_user(sock) else None
        nid = hello.get("id") if hello else None
        if nid not in self._host(self.node, self.group) or nid == self.me:
            log.warning("host leader: refused a local connection that is no worker of its host")
            sock.close()
            return
        with self.lock:
            old = self.conns.pop(nid, None)
            if old is not None:
                self.sel.unregister(old)
                old.close()
            self.conns[nid] = sock
            self.sel.register(sock, selectors.EVENT_READ, nid)

    def _read(self, nid: int, sock: socket.socket) -> None:
        body = _recv(sock)
        group, n = (body or {}).get("g"), (body or {}).get("n")
        with self.lock:
            if group not in P.GROUPS or not isinstance(n, int) or n < 1:
                self._close(nid)  # gone (EOF) or broken: it sends its own from now on
                for g in list(self.pending):
                    self._pump(g)
                return
            self.pending.setdefault(group, {})[nid] = n
            self._pump(group)

    def _close(self, nid: int) -> None:
        sock = self.conns.pop(nid, None)
        if sock is not None:
            self.sel.unregister(sock)
            sock.close()
        for waiting in self.pending.values():
            waiting.pop(nid, None)

    def _pump(self, group: str) -> None:
        """Send ``group``'s arrivals at n once every local worker is at n or was sent there
        (under the lock)."""
        waiting = self.pending.get(group)
        if not waiting:
            return
        sent = self.sent.setdefault(group, {})
        expected = [i for i in (self.me, *self.conns) if i not in self.node.left]
        for n in sorted(set(waiting.values())):
            if all(waiting.get(i) == n or sent.get(i, 0) >= n for i in expected):
                batch = [i for i, m in waiting.items() if m == n]
                for i in batch:
                    del waiting[i]
                    sent[i] = n
                self._relay(group, n, batch)

    def _relay(self, group: str, n: int, batch: list[int]) -> None:
        from hetps.transport.codec import Message

        def done(reply: Any) -> None:
            typed = getattr(reply, "typed", None)
            self._answer(group, n, batch, True, getattr(typed, "members", None))

        body = {"group": group, "n": n, "host": batch}
        fut = self.node.request(
            P.SCHEDULER_ID, Message(P.BARRIER, body=body), callback=done, what=f"barrier({group})"
        )
        told: list[bool] = []

        def failed(_error: object = None) -> None:
            with self.lock:
                if not told:
                    told.append(True)
                    self._answer(group, n, batch, False, None)

        fut.errback = failed
        if fut.done() and fut.error is not None:
            failed()

    def _answer(self, group: str, n: int, batch: list[int], ok: bool, members: Any) -> None:
        """The release (``ok``) or the failure of a relayed arrival, to each of its workers."""
        with self.lock:
            for nid in batch:
                if nid == self.me:
                    slot = self.mine.get(group)
                    if slot is not None and slot[0] == n and not slot[1].is_set():
                        slot[2] = (ok, members)
                        slot[1].set()
                    continue
                sock = self.conns.get(nid)
                if sock is None:
                    continue
                try:
                    _send(sock, {"g": group, "n": n, "m": members, "direct": not ok})
                except OSError:
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
