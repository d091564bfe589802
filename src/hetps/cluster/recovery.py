"""How a node lives through the death of a peer or of the scheduler, as a part of
:class:`hetps.cluster.node.Node`.

* ``failover`` (HETPS_REPLICAS): a dead server's keys are served by the next live server;
  requests to it are re-routed and its unanswered ones sent again, in order.
* ``rejoin``: a dead server started again is back at a new address (a replica only).
* ``readmit``: a scheduler started again at the same address (``--recover``) takes the
  running nodes back; what the dead one never answered is sent again.

docs/FAULTS.md says what a user sees; docs/ARCHITECTURE.md how it fits.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from hetps.cluster import batch
from hetps.cluster import protocol as P
from hetps.cluster.errors import NodeFailure
from hetps.cluster.protocol import NodeInfo
from hetps.cluster.requests import Future
from hetps.transport.codec import Message
from hetps.transport.van import PeerGone

log = logging.getLogger("hetps.node")


def _routing_id(value: object) -> bytes:
    """A routing id from the scheduler's table, checked (bytes, 1-255, not starting at 0)."""
    if not isinstance(value, bytes) or not 1 <= len(value) <= 255 or value[0] == 0:
        raise ValueError(f"bad routing id {value!r}")
    return value


class Recovery:
    """Failover, rejoin and readmit (mixed into Node, which holds what is used here)."""

    role: str
    cfg: Any
    van: Any
    requests: Any
    info: NodeInfo | None
    nodes: dict[int, NodeInfo]
    replicas: int
    redirect: dict[int, int]
    down: set[int]
    _route_lock: threading.Lock
    on_failover: Callable[[int, int], None] | None
    on_rejoin: Callable[[int], None] | None
    on_worker_left: Callable[[int], None] | None
    left: set[int]
    joining: set[int]
    _barrier_passed: dict[str, int]
    _back: Any
    _cred: dict
    _readmit: Future | None
    done_workers: Callable[[], list[int]] | None
    _last_ack: float

    def _failover(self, msg: Message) -> None:
        """A server died and ``to`` holds copies of its keys: from now on its requests go
        there. Its unanswered ones go again, in the order they were made, before any newer
        request leaves (pushes carry their round: a round ``to`` applied already is only
        acknowledged); a set_optimizer counts as done (``to`` got its own); anything else
        to it fails with the cause."""
        dead_info, to = msg.body.get("node"), msg.body.get("to")
        if not (isinstance(dead_info, list) and dead_info and isinstance(dead_info[0], int)):
            log.warning("%s: dropped a failover that names no node", self.role)
            return
        dead = dead_info[0]
        if (
            self.role_of(dead) != "server"
            or not isinstance(to, int)
            or self.role_of(to) != "server"
            or to == dead
            or self.replicas <= 1
        ):
            log.warning("%s: dropped a failover from %r to %r", self.role, dead, to)
            return
        text = msg.error or f"{self.describe(dead)} died"
        # first: a send to it blocked on a full queue (holding the route lock) gives up
        self.van.mark_dead(dead)
        with self._route_lock:
            self.down.add(dead)
            for k, v in list(self.redirect.items()):
                if v == dead:
                    self.redirect[k] = to
            self.redirect[dead] = to
            again = 0
            for fut in self.requests.retarget(dead, to):
                sent = fut.sent
                if sent is None:
                    continue  # not sent yet: it leaves later, to ``to``
                # reads, and writes that are the same when done twice (a plan's moves:
                # states set again, a drop that the heir skips for what it serves)
                if sent.cmd in (P.PUSH, P.PULL, P.INIT, P.GET_STATES, P.SET_STATES, P.DROP):
                    try:
                        self.van.send(to, sent)
                        again += 1
                    except Exception as exc:  # noqa: BLE001 - PeerGone, a closed socket
                        self.requests.resolve(fut.req, None, f"{self.describe(to)}: {exc}")
                elif sent.cmd == P.SET_OPTIMIZER:
                    self.requests.resolve(
                        fut.req, Message(sent.cmd, req=fut.req, reply=True), sender=to
                    )
                else:
                    self.requests.resolve(
                        fut.req, None, f"{sent.cmd} to a server that died: {text}", sender=to
                    )
        log.warning(
            "%s: %s; %d unanswered requests went again to %s",
            self.role,
            text,
            again,
            self.describe(to),
        )
        if self.on_failover is not None:
            self.on_failover(dead, to)

    def _worker_left(self, msg: Message) -> None:
        """A worker died and the job goes on without it (HETPS_ELASTIC). If it names this
        node (declared dead while alive, say after a long stall), this node is out: fail."""
        info, text = msg.body.get("node"), msg.error or msg.body.get("error")
        if not (isinstance(info, list) and info and isinstance(info[0], int)):
            log.warning("%s: dropped a worker_left that names no node", self.role)
            return
        gone = info[0]
        text = text if isinstance(text, str) else f"{self.describe(gone)} died"
        if gone == self.id:
            self._fail(NodeFailure(f"the scheduler let this worker go: {text}"))
            return
        self.joining.discard(gone)  # (started again, it died before it joined)
        if self.role_of(gone) != "worker" or gone in self.left:
            return
        self.left.add(gone)
        if self.role == "server":
            self.van.mark_dead(gone)  # answers to it are dropped, not queued
        log.warning(
            "%s: %s; the job goes on with %d workers",
            self.role,
            text,
            sum(1 for n in self.nodes.values() if n.role == "worker") - len(self.left),
        )
        if self.on_worker_left is not None:
            self.on_worker_left(gone)

    def _worker_joins(self, msg: Message) -> None:
        """``worker_joining``: a let-go worker started again waits to join (the live workers
        let it in at their next round boundary: :meth:`KVStore.admit`); ``worker_back``: it
        joined, and counts in every round from now on."""
        info = msg.body.get("node")
        if not (isinstance(info, list) and info and isinstance(info[0], int)):
            log.warning("%s: dropped a %s that names no node", self.role, msg.cmd)
            return
        nid = info[0]
        if self.role_of(nid) != "worker" or nid == self.id:
            return
        if msg.cmd == P.WORKER_JOINING:
            if nid in self.left:
                self.joining.add(nid)
            return
        self.joining.discard(nid)
        try:
            self.nodes[nid] = NodeInfo.from_wire(info)  # (its new address)
        except (TypeError, ValueError):
            pass
        if nid in self.left:
            self.left.discard(nid)
            self.van.revive(nid)
            log.warning(
                "%s: %s joined; the job goes on with %d workers",
                self.role,
                self.describe(nid),
                sum(1 for n in self.nodes.values() if n.role == "worker") - len(self.left),
            )

    def _rejoin(self, msg: Message) -> None:
        """A dead server that was taken over is back with its old id at a new address:
        connect to it; it is a live server again (a replica: its keys stay redirected)."""
        try:
            info = NodeInfo.from_wire(msg.body["node"])
            out, into = _routing_id(msg.body["out"]), _routing_id(msg.body["in"])
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("%s: dropped a malformed rejoin (%s)", self.role, exc)
            return
        old = self.nodes.get(info.id)
        worker = info.role == "worker" and self.role == "server"  # (HETPS_ELASTIC: it joins)
        if (
            old is None
            or old.role != info.role
            or (info.role != "server" and not worker)
            or info.id == self.id
        ):
            log.warning("%s: dropped a rejoin of node %r", self.role, info.id)
            return
        if self.role == "server" and self.replicas <= 1 and not worker:
            return
        with self._route_lock:
            self.nodes[info.id] = info
            self.van.admit(into, info.id)
            self.van.revive(info.id)
            self.van.connect(info.id, f"{info.host}:{info.port}", routing_id=out, bulk=True)
            self.down.discard(info.id)
        log.warning("%s: %s is back (is_recovery=1)", self.role, info.describe())
        if self.on_rejoin is not None and not worker:
            self.on_rejoin(info.id)

    def _ask_readmit(self) -> None:
        """Ask the scheduler at our scheduler's address to take this node back: a scheduler
        started again (--recover) does once every node came back; the one we knew answers
        at once. One request at a time, sent again while unanswered: one sent to a hung
        scheduler is lost when the launcher stops it and starts it again."""
        if self.info is None:
            return
        pending = self._readmit
        if pending is not None and not pending.done():
            if pending.sent is not None:
                try:
                    self.van.send(P.SCHEDULER_ID, pending.sent)
                except PeerGone:
                    pass
            return
        view = {
            "nodes": [n.to_wire() for n in self.nodes.values()],
            "down": sorted(self.down),
            "redirect": [[a, b] for a, b in self.redirect.items()],
            "done": self.done_workers() if self.done_workers is not None else [],
            "barriers": dict(self._barrier_passed),
            "replicas": self.replicas,
        }
        msg = Message(
            P.READMIT,
            body={
                "id": self.info.id,
                "role": self.role,
                "rank": self.info.rank,
                "host": self.cfg.node_host,
                "port": self.van.port,
                "back": self._back,
                "view": view,
                **self._cred,  # the proof that it is this node (cluster/credentials.py)
            },
        )
        fut = self.requests.new(P.SCHEDULER_ID, "readmit", self._readmitted)
        if fut.done():
            return
        msg.req = fut.req
        fut.sent = msg
        self._readmit = fut
        try:
            self.van.send(P.SCHEDULER_ID, msg)
        except PeerGone:
            self.requests.discard(fut.req)

    def _readmitted(self, reply: Message) -> None:
        """A scheduler took us back: if it was started again, what we asked the one before
        and got no answer to goes again (barriers, finish, reports), in order."""
        self._last_ack = time.monotonic()
        if reply.body.get("restarted") is not True:
            return
        log.warning("%s: the scheduler was started again and took this node back", self.role)
        for fut in self.requests.retarget(P.SCHEDULER_ID, P.SCHEDULER_ID):
            if fut.sent is not None and fut is not self._readmit:
                try:
                    self.van.send(P.SCHEDULER_ID, fut.sent)
                except PeerGone:
                    pass

    def _send_kept(
        self, peer: int, futs: list[Future], msgs: list[Message], track: bool = False
    ) -> bool:
        """Send requests to a server that has copies (HETPS_REPLICAS), keeping each until
        answered: if the server dies, :meth:`_failover` sends them again to the one that
        takes over. Under the route lock, so none leaves between a failover's re-sends."""
        with self._route_lock:
            peer = self.route(peer)
            for fut, msg in zip(futs, msgs, strict=True):
                fut.peer = peer  # (made before a failover: its answer comes from the heir)
                fut.sent = msg
            try:
                if len(msgs) == 1:
                    self.van.send(peer, msgs[0], track=track)
                else:
                    self.van.send(peer, batch.pack(msgs, req=futs[0].req))
                return True
            except Exception as exc:  # noqa: BLE001 - PeerGone, a closed socket
                for fut in futs:
                    self.requests.resolve(
                        fut.req, None, f"{self.describe(peer)} is not reachable: {exc}"
                    )
                return False
