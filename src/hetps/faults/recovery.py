"""How a node lives through the death of a peer or of the scheduler, as a part of
:class:`hetps.cluster.node.Node`, which takes it as an argument (``Node(cfg,
recovery=Recovery)``: :func:`hetps.roles.new_node`), with the node's links to its peers.
(docs/MODULES.md, "hetps.faults.recovery")"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import replace

from hetps.cluster import batch
from hetps.cluster import protocol as P
from hetps.cluster.enrol import routing_id
from hetps.cluster.errors import NodeFailure
from hetps.cluster.ports import MemberPort
from hetps.cluster.protocol import NodeInfo
from hetps.cluster.requests import Future
from hetps.transport.codec import Message
from hetps.transport.links import PeerLinks
from hetps.transport.van import PeerGone

log = logging.getLogger("hetps.node")


class Recovery:
    """Failover, rejoin and readmit (a part of Node: ``node``, whose tables it reads and changes)."""

    def __init__(self, node: MemberPort, links: PeerLinks) -> None:
        self.node = node
        self.links = links  # the node's connections to its peers
        self.readmit: Future | None = None  # asking a restarted scheduler to take us back

    def failover(self, msg: Message) -> None:
        """A server died and ``to`` holds copies of its keys: from now on its requests go
        there. Its unanswered ones go again, in the order they were made, before any newer
        request leaves (pushes carry their round: a round ``to`` applied already is only
        acknowledged); a set_optimizer counts as done (``to`` got its own); anything else
        to it fails with the cause."""
        dead, to = msg.typed.node[0], msg.typed.to  # (a Failover: node ids, checked)
        if (
            self.node.role_of(dead) != "server"
            or self.node.role_of(to) != "server"
            or to == dead
            or self.node.replicas <= 1
        ):
            log.warning("%s: dropped a failover from %r to %r", self.node.role, dead, to)
            return
        text = msg.typed.error or f"{self.node.describe(dead)} died"
        # first: a send to it blocked on a full queue (holding the route lock) gives up
        self.links.mark_dead(dead)
        with self.node.route_lock:
            self.node.down.add(dead)
            for k, v in list(self.node.redirect.items()):
                if v == dead:
                    self.node.redirect[k] = to
            self.node.redirect[dead] = to
            again = 0
            for fut in self.node.requests.retarget(dead, to):
                sent = fut.sent
                if sent is None:
                    continue  # not sent yet: it leaves later, to ``to``
                # reads, and writes that are the same when done twice (a plan's moves:
                # states set again, a drop that the heir skips for what it serves; a
                # table's requests: its pushes carry their round, as a dense key's)
                if sent.cmd in (P.PUSH, P.PULL, P.INIT, P.GET_STATES, P.SET_STATES, P.DROP) or (
                    sent.cmd in P.SPARSE_COMMANDS
                ):
                    try:
                        self.links.send(to, sent)
                        again += 1
                    except Exception as exc:  # noqa: BLE001 - PeerGone, a closed socket
                        self.node.requests.resolve(
                            fut.req, None, f"{self.node.describe(to)}: {exc}"
                        )
                elif sent.cmd == P.SET_OPTIMIZER:
                    self.node.requests.resolve(
                        fut.req, Message(sent.cmd, req=fut.req, reply=True), sender=to
                    )
                else:
                    self.node.requests.resolve(
                        fut.req, None, f"{sent.cmd} to a server that died: {text}", sender=to
                    )
        log.warning(
            "%s: %s; %d unanswered requests went again to %s",
            self.node.role,
            text,
            again,
            self.node.describe(to),
        )
        if self.node.on_failover is not None:
            self.node.on_failover(dead, to)

    def worker_left(self, msg: Message) -> None:
        """A worker died and the job goes on without it (HETPS_ELASTIC). If it names this
        node (declared dead while alive, say after a long stall), this node is out: fail."""
        gone = msg.typed.node[0]  # (a WorkerLeft)
        text = msg.typed.error or f"{self.node.describe(gone)} died"
        if gone == self.node.id:
            self.node.fail(NodeFailure(f"the scheduler let this worker go: {text}"))
            return
        self.node.joining.discard(gone)  # (started again, it died before it joined)
        if self.node.role_of(gone) != "worker" or gone in self.node.left:
            return
        self.node.left.add(gone)
        if self.node.role == "server":
            self.links.mark_dead(gone)  # answers to it are dropped, not queued
        log.warning(
            "%s: %s; the job goes on with %d workers",
            self.node.role,
            text,
            sum(1 for n in self.node.nodes.values() if n.role == "worker") - len(self.node.left),
        )
        if self.node.on_worker_left is not None:
            self.node.on_worker_left(gone)

    def worker_joins(self, msg: Message) -> None:
        """``worker_joining``: a let-go worker started again waits to join (the live workers
        let it in at their next round boundary: :meth:`KVStore.admit`); ``worker_back``: it
        joined, and counts in every round from now on."""
        info = msg.typed.node  # (a NodeNotice or a WorkerBack)
        nid = info[0]
        if self.node.role_of(nid) != "worker" or nid == self.node.id:
            return
        if msg.cmd == P.WORKER_JOINING:
            if nid in self.node.left:
                self.node.joining.add(nid)
            return
        self.node.joining.discard(nid)
        old = self.node.nodes.get(nid)
        try:  # its new address; its host group is the one it had (a notice carries none)
            self.node.nodes[nid] = NodeInfo.from_wire(info, {nid: old.group} if old else None)
        except (TypeError, ValueError):
            pass
        if nid in self.node.left:
            self.node.left.discard(nid)
            self.links.revive(nid)
            log.warning(
                "%s: %s joined; the job goes on with %d workers",
                self.node.role,
                self.node.describe(nid),
                sum(1 for n in self.node.nodes.values() if n.role == "worker")
                - len(self.node.left),
            )

    def rejoin(self, msg: Message) -> None:
        """A dead server that was taken over is back with its old id at a new address:
        connect to it; it is a live server again (a replica: its keys stay redirected)."""
        info, b = NodeInfo.from_wire(msg.typed.node), msg.typed  # (a Rejoin)
        try:
            out, into = routing_id(b.outbound), routing_id(b.inbound)
        except ValueError as exc:  # (a routing id starting with a zero byte)
            log.warning("%s: dropped a malformed rejoin (%s)", self.node.role, exc)
            return
        old = self.node.nodes.get(info.id)
        worker = info.role == "worker" and self.node.role == "server"  # (HETPS_ELASTIC: it joins)
        if (
            old is None
            or old.role != info.role
            or (info.role != "server" and not worker)
            or info.id == self.node.id
        ):
            log.warning("%s: dropped a rejoin of node %r", self.node.role, info.id)
            return
        if self.node.role == "server" and self.node.replicas <= 1 and not worker:
            return
        with self.node.route_lock:
            self.node.nodes[info.id] = replace(info, group=old.group)  # (a rejoin carries none)
            self.links.admit(into, info.id)
            self.links.revive(info.id)
            self.links.connect(info.id, f"{info.host}:{info.port}", routing_id=out, bulk=True)
            self.node.down.discard(info.id)
        log.warning("%s: %s is back (is_recovery=1)", self.node.role, info.describe())
        if self.node.on_rejoin is not None and not worker:
            self.node.on_rejoin(info.id)

    def ask_readmit(self) -> None:
        """Ask the scheduler at our scheduler's address to take this node back: a scheduler
        started again (--recover) does once every node came back; the one we knew answers
        at once. One request at a time, sent again while unanswered: one sent to a hung
        scheduler is lost when the launcher stops it and starts it again."""
        if self.node.info is None:
            return
        pending = self.readmit
        if pending is not None and not pending.done():
            if pending.sent is not None:
                with contextlib.suppress(PeerGone):
                    self.links.send(P.SCHEDULER_ID, pending.sent)
            return
        view = {
            "nodes": [n.to_wire() for n in self.node.nodes.values()],
            "down": sorted(self.node.down),
            "redirect": [[a, b] for a, b in self.node.redirect.items()],
            "done": self.node.done_workers() if self.node.done_workers is not None else [],
            "barriers": dict(self.node.barrier_passed),
            "replicas": self.node.replicas,
        }
        msg = Message(
            P.READMIT,
            body={
                "id": self.node.info.id,
                "role": self.node.role,
                "rank": self.node.info.rank,
                "host": self.node.cfg.node_host,
                "port": self.links.port,
                "back": self.node.back_id,
                "view": view,
                **self.node.cred,  # the proof that it is this node (cluster/credentials.py)
            },
        )
        fut = self.node.requests.new(P.SCHEDULER_ID, "readmit", self.readmitted)
        if fut.done():
            return
        msg.req = fut.req
        fut.sent = msg
        self.readmit = fut
        try:
            self.links.send(P.SCHEDULER_ID, msg)
        except PeerGone:
            self.node.requests.discard(fut.req)

    def readmitted(self, reply: Message) -> None:
        """A scheduler took us back: if it was started again, what we asked the one before
        and got no answer to goes again (barriers, finish, reports), in order."""
        self.node.last_ack = time.monotonic()
        if not reply.typed.restarted:  # (a ReadmitAnswer)
            return
        log.warning("%s: the scheduler was started again and took this node back", self.node.role)
        for fut in self.node.requests.retarget(P.SCHEDULER_ID, P.SCHEDULER_ID):
            if fut.sent is not None and fut is not self.readmit:
                with contextlib.suppress(PeerGone):
                    self.links.send(P.SCHEDULER_ID, fut.sent)

    def heir(self, peer: int) -> int:
        """The server that answers for ``peer`` now: itself while it is alive (even one
        started again: it serves what it took over, not its old keys), its heir while it
        is dead (a failover made between a request's routing and its send). A server's
        requests (copies to its replicas) go where they are sent, as ``Node.route`` has it."""
        if self.node.role == "worker" and peer in self.node.down:
            return self.node.redirect.get(peer, peer)
        return peer

    def send_kept(
        self, peer: int, futs: list[Future], msgs: list[Message], track: bool = False
    ) -> bool:
        """Send requests to a server that has copies (HETPS_REPLICAS), keeping each until
        answered: if the server dies, :meth:`_failover` sends them again to the one that
        takes over. Under the route lock, so none leaves between a failover's re-sends."""
        with self.node.route_lock:
            # each future names the server its request goes to: routed once, when it was
            # made (Node.request), and moved to the heir by a failover since (retarget).
            # Routing it again would follow a second hop: a server started again after its
            # keys were taken over may serve another dead server's keys now, and its own
            # id still maps to the server that took its keys (a chain no request may follow)
            peer = self.heir(futs[0].peer if futs and futs[0].peer is not None else peer)
            for fut, msg in zip(futs, msgs, strict=True):
                fut.peer = peer  # (made before a failover: its answer comes from the heir)
                fut.sent = msg
            try:
                if len(msgs) == 1:
                    self.links.send(peer, msgs[0], track=track)
                else:
                    self.links.send(peer, batch.pack(msgs, req=futs[0].req))
                return True
            except Exception as exc:  # noqa: BLE001 - PeerGone, a closed socket
                for fut in futs:
                    self.node.requests.resolve(
                        fut.req, None, f"{self.node.describe(peer)} is not reachable: {exc}"
                    )
                return False
