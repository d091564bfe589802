"""The node side of membership: register, heartbeat, barrier, request/reply, shut down.
(docs/MODULES.md, "hetps.cluster.node")"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from hetps.cluster import allow, batch, commands
from hetps.cluster import protocol as P
from hetps.cluster.enrol import Enrolment
from hetps.cluster.errors import NodeClosed, NodeFailure
from hetps.cluster.hostlead import HostLead
from hetps.cluster.protocol import NodeInfo
from hetps.cluster.requests import Future, RequestTracker
from hetps.config import NodeConfig, check_exposure
from hetps.config.node import bulk_channels_on, user_malloc
from hetps.transport.codec import Message
from hetps.transport.links import PeerLinks
from hetps.transport.van import UNKNOWN, PeerGone, Van

log = logging.getLogger("hetps.node")

Handler = Callable[[Message], None]


class Node:
    """One server or worker's membership in a cluster. ``recovery`` makes its fault part from
    it (:class:`hetps.faults.recovery.Recovery`: failover, rejoin and readmit, a node's side
    of a death or a restart); the composition root gives it (:func:`hetps.roles.new_node`)."""

    def __init__(
        self,
        cfg: NodeConfig,
        handler: Handler | None = None,
        *,
        recovery: Callable[[Node, PeerLinks], Any],
    ) -> None:
        if cfg.role not in ("server", "worker"):
            raise ValueError(f"a Node is a server or a worker, not {cfg.role!r}")
        check_exposure(cfg.secret, cfg.insecure, [cfg.root_uri, cfg.node_host], cfg.role)
        self.cfg = cfg
        self.role = cfg.role
        self.handler = handler
        self.van = Van(
            host=cfg.node_host,
            port=cfg.port,
            max_message_bytes=cfg.max_message_bytes,
            verbose=cfg.verbose,
            name=cfg.role,
            shape_mbit=cfg.shape_mbit,
            chunk_bytes=cfg.chunk_bytes,
            ring_bytes=cfg.shm_bytes,
            secret=cfg.secret,
            io_threads=cfg.io_threads,
            bulk=bulk_channels_on(cfg),
            keep_buffers=bool(cfg.keep_buffers),
            malloc_users=user_malloc(),
        )
        if cfg.insecure:
            log.warning(
                "%s: HETPS_INSECURE=1: no cluster secret; connections on %s are neither "
                "authenticated nor encrypted, and anybody who can reach them can join this job",
                cfg.role,
                cfg.node_host,
            )
        self.requests = RequestTracker()
        self.van.landing_of = self._landings
        self.van.landing_guard = self.requests.landing_guard
        self.info: NodeInfo | None = None
        self.nodes: dict[int, NodeInfo] = {}
        self.metrics_interval = 0.0  # seconds between live metrics reports (0: none wanted)
        self.metrics_job = ""  # the live metrics' job id (the scheduler's, in the node table)
        # copies of each key (HETPS_REPLICAS, from the scheduler's node table)
        self.replicas = 1
        # dead servers -> the live server that took over their keys (a failover); a server
        # admitted again stays redirected (its keys stay where they went) but is up again
        self.redirect: dict[int, int] = {}
        self.down: set[int] = set()  # servers dead now
        self.recovery = False  # this node was admitted again (ps-lite's is_recovery)
        self.faults = recovery(self, self.van)  # failover, rejoin, readmit (faults/recovery.py)
        self.enrol = Enrolment(self, self.van)  # registration, the node table (cluster/enrol.py)
        # with copies: a failover re-sends the dead server's unanswered requests before any
        # newer request leaves (per-key order)
        self.route_lock = threading.Lock()
        self.on_failover: Callable[[int, int], None] | None = None
        self.on_rejoin: Callable[[int], None] | None = None
        # HETPS_ELASTIC (from the node table): workers that died and that the job went on
        # without (worker_left), and who is told of it here (a server's handler)
        self.elastic = 0
        self.left: set[int] = set()
        self.joining: set[int] = set()  # let-go workers started again that wait to join
        self.on_worker_left: Callable[[int], None] | None = None
        self.barrier_n: dict[str, int] = {}  # barriers asked for, per group
        self.barrier_passed: dict[str, int] = {}  # and passed (told to a restarted scheduler)
        self.hostlead: HostLead | None = None  # a host's one arrival (cluster/hostlead.py)
        self.back_id: str | None = None  # routing id the scheduler connects back with
        # what this node proves who it is with to a restarted scheduler (--recover): given
        # by the scheduler with the node table, never sent to anybody else
        self.cred: dict = {}
        self.done_workers: Callable[[], list[int]] | None = None  # (a server's handler sets it)
        self.exited = threading.Event()
        self.failure: BaseException | None = None
        self.on_failure: Callable[[BaseException], None] | None = None
        self._stop = threading.Event()
        self.last_ack = time.monotonic()
        self._busy_since: float | None = None  # when the handler running now started
        # seconds handlers have held the receive thread since the scheduler was last heard
        # from (its answers waited unread meanwhile: that silence is this node's own)
        self._busy_s = 0.0
        self._recv_thread: threading.Thread | None = None
        self._hb_thread: threading.Thread | None = None

    # -- identity ---------------------------------------------------------------------------
    @property
    def id(self) -> int:
        """This node's ps-lite id (after :meth:`start`)."""
        return self.info.id if self.info else 0

    @property
    def rank(self) -> int:
        """This node's rank within its role."""
        return self.info.rank if self.info else -1

    def servers(self) -> list[NodeInfo]:
        """Servers ordered by rank."""
        return sorted((n for n in self.nodes.values() if n.role == "server"), key=lambda n: n.rank)

    def workers(self) -> list[NodeInfo]:
        """Workers ordered by rank."""
        return sorted((n for n in self.nodes.values() if n.role == "worker"), key=lambda n: n.rank)

    def live_workers(self) -> list[NodeInfo]:
        """Workers ordered by rank, less those that died and were let go (HETPS_ELASTIC)."""
        return [n for n in self.workers() if n.id not in self.left]

    def live_servers(self) -> list[NodeInfo]:
        """Servers ordered by rank, less those that died and were taken over."""
        return [n for n in self.servers() if n.id not in self.down]

    def route(self, peer: int) -> int:
        """Where a worker's request to server ``peer`` goes: the server that took over its
        keys, if it died (a server's copies go to the replica they name)."""
        if self.role != "worker":
            return peer
        return self.redirect.get(peer, peer)

    def revive(self, peer: int) -> None:
        """Take ``peer`` as alive again (a let-go worker that joins: HETPS_ELASTIC)."""
        self.van.revive(peer)

    def lend(self, commands: frozenset[str]) -> None:
        """Requests of these commands come with their ring-borne arrays lent (valid only
        while the handler runs: see :meth:`hetps.transport.van.Van.recv`)."""
        self.van.borrow = frozenset(commands)

    @property
    def ring_min(self) -> int:
        """Arrays at least this big go through a shared-memory ring to a peer that has one."""
        return self.van.ring_min

    def ring_open(self, peer: int) -> bool:
        """Whether requests to server ``peer`` (routed) go through an open ring."""
        return self.van.ring_open(self.route(peer))

    def role_of(self, node_id: int) -> str | None:
        """Role of a node of this job (None for anybody else)."""
        if node_id == P.SCHEDULER_ID:
            return allow.SCHEDULER
        info = self.nodes.get(node_id)
        return info.role if info is not None else None

    def describe(self, node_id: int) -> str:
        """Human name of a node id."""
        if node_id == P.SCHEDULER_ID:
            return f"scheduler (node 1, {self.cfg.root_uri}:{self.cfg.root_port})"
        info = self.nodes.get(node_id)
        return info.describe() if info else f"node {node_id}"

    # -- start ------------------------------------------------------------------------------
    def start(self) -> Node:
        """Register with the scheduler and wait until the whole cluster is up
        (:meth:`hetps.cluster.enrol.Enrolment.register`).

        Raises :class:`ClusterError` when the scheduler cannot be reached or the cluster does
        not complete within ``HETPS_CONNECT_TIMEOUT``."""
        self.enrol.register()
        if not self.recovery:  # (one admitted again sends its own)
            self.hostlead = HostLead.plan(self)
        if self.cfg.heartbeat_interval > 0:
            self._hb_thread = threading.Thread(
                target=self._heartbeat_loop, name="hetps-heartbeat", daemon=True
            )
            self._hb_thread.start()
        return self

    def start_receiving(self) -> None:
        """Start the receive thread (once the scheduler's connection is made)."""
        self._recv_thread = threading.Thread(
            target=self._recv_loop, name=f"hetps-{self.role}-recv", daemon=True
        )
        self._recv_thread.start()

    # -- receiving --------------------------------------------------------------------------
    def _recv_loop(self) -> None:
        while not self._stop.is_set():
            try:
                msg = self.van.recv(timeout=0.1)
            except Exception:  # the context was closed under us
                if self._stop.is_set():
                    return
                raise
            if msg is None:
                continue
            self._busy_since = t0 = time.monotonic()
            try:
                self.dispatch(msg)
            except Exception:  # a handler bug must not kill the receive loop
                log.exception("%s: error handling %s from %d", self.role, msg.cmd, msg.sender)
            finally:
                self._busy_s += time.monotonic() - t0
                self._busy_since = None

    def dispatch(self, msg: Message) -> None:
        """Handle one received message: a reply resolves its request, the scheduler's
        control messages are handled here, anything else allowed goes to ``handler``."""
        if msg.sender == UNKNOWN:
            if self.info is None and self.enrol.keep_early(msg):
                return  # perhaps a peer that learned of us before we did
            log.warning(
                "%s: dropped %s from a connection of no node of this job", self.role, msg.cmd
            )
            return
        if msg.sender == P.SCHEDULER_ID:
            self.last_ack = time.monotonic()
            self._busy_s = 0.0
        why = commands.decode(msg)  # the body as its command's declared type, or why not
        if why is not None and not msg.reply:  # (a bad answer fails its request, below)
            who = self.describe(msg.sender)
            log.warning("%s: refused %s from %s: %s", self.role, msg.cmd, who, why)
            if msg.req:
                self.reply(msg, {"error": why})
            return
        if msg.sender == P.SCHEDULER_ID and self._from_scheduler(msg):
            return
        if self.info is None:
            if not self.enrol.keep_early(msg):
                log.warning("%s: dropped %s that came before the node table", self.role, msg.cmd)
            return
        if msg.reply:
            if msg.cmd == P.BATCH and msg.error is None:
                self._resolve_batch(msg)
                return
            self.requests.resolve(msg.req, msg, msg.error or why, sender=msg.sender)
            return
        sender_role = self.role_of(msg.sender)
        if not allow.permits(self.role, sender_role, msg.cmd):
            log.warning(
                "%s: refused %s from %s: only %s may send it",
                self.role,
                msg.cmd,
                self.describe(msg.sender),
                allow.senders(self.role, msg.cmd),
            )
            if msg.req and sender_role is not None:
                text = f"a {self.role} does not take {msg.cmd!r} from a {sender_role}"
                self.reply(msg, {"error": text})
            return
        if self.handler is not None:
            self.handler(msg)
        else:
            log.warning("%s: no handler for %s from %d", self.role, msg.cmd, msg.sender)

    def _landings(
        self, sender: int, cmd: str, req: int, body: Any, count: int
    ) -> dict[int, Any] | None:
        """Where the ring-borne arrays of an answer from ``sender`` (``count`` arrays) may
        land: :func:`batch.landings` over this node's requests to ``sender``."""
        return batch.landings(lambda r: self.requests.landing_of(r, sender), cmd, req, body, count)

    def _resolve_batch(self, msg: Message) -> None:
        """Answers that came together (:mod:`hetps.cluster.batch`): each resolves its own
        request, as if it had come alone."""
        try:
            items = batch.unpack(msg)
        except batch.BadBatch as exc:
            log.warning(
                "%s: dropped a bad batch of answers from %s: %s",
                self.role,
                self.describe(msg.sender),
                exc,
            )
            return
        for item in items:
            self.requests.resolve(item.req, item, item.error, sender=msg.sender)

    def _from_scheduler(self, msg: Message) -> bool:
        """Handle what only the scheduler sends; False: an ordinary reply or command, for the
        rest of the dispatch. The scheduler answers a request with the request's command, so
        a reply is never taken for the scheduler's own command of that name."""
        cmd = msg.cmd
        if msg.reply:
            if cmd == P.HEARTBEAT_ACK:
                return True
            if self.info is None and cmd in allow.REGISTRATION_ANSWERS:
                self.enrol.answer(msg)
                return True
            if cmd == P.EXIT and msg.error is None:  # the answer to this worker's finish
                self.requests.resolve(msg.req, msg, sender=P.SCHEDULER_ID)
                self.exited.set()
                return True
            return False
        if cmd == P.FAILOVER:
            self.faults.failover(msg)
            return True
        if cmd == P.REJOIN:
            self.faults.rejoin(msg)
            return True
        if cmd == P.WORKER_LEFT:
            self.faults.worker_left(msg)
            return True
        if cmd in (P.WORKER_JOINING, P.WORKER_BACK):
            self.faults.worker_joins(msg)
            return True
        if cmd == P.NODE_DEAD:
            self.van.mark_dead(msg.typed.node[0])  # (a NodeDead: its node's id, checked)
            self.fail(NodeFailure(msg.error or "a peer died"))
            return True
        if cmd == P.EXIT:
            self.exited.set()
            return True
        if self.handler is not None and self.info is not None:
            self.handler(msg)  # e.g. WORKER_DONE for servers
            return True
        return False

    def fail(self, error: BaseException) -> None:
        if self.failure is None:
            self.failure = error
            log.error("%s: %s", self.role, error)
        self.requests.fail_all(error)
        for nid in self.nodes:  # the job is over: no send may wait on a peer's full queue
            self.van.mark_dead(nid)
        if self.on_failure is not None:
            self.on_failure(error)
        self.exited.set()

    # -- heartbeats -------------------------------------------------------------------------
    def _heartbeat_loop(self) -> None:
        interval = self.cfg.heartbeat_interval
        self.last_ack = time.monotonic()
        while not self._stop.wait(interval):
            try:
                self.van.send(P.SCHEDULER_ID, Message(P.HEARTBEAT))
            except PeerGone:
                return
            # while a handler holds the receive thread, the scheduler's answers wait unread:
            # its silence counts only the time the thread was free to read them (up to the
            # start of the handler running now, less the handlers that ran since)
            busy = self._busy_since
            silent = (busy if busy is not None else time.monotonic()) - self.last_ack
            silent -= self._busy_s
            if silent > 2 * interval and not self.exited.is_set():
                self.faults.ask_readmit()  # the scheduler may have been started again
            if silent > self.cfg.heartbeat_timeout and not self.exited.is_set():
                self.van.mark_dead(P.SCHEDULER_ID)
                self.fail(
                    NodeFailure(
                        f"{self.describe(P.SCHEDULER_ID)} stopped answering heartbeats for "
                        f"{silent:.1f} s (PS_HEARTBEAT_TIMEOUT={self.cfg.heartbeat_timeout:g}); "
                        "the job cannot continue"
                    )
                )
                return

    # -- requests ---------------------------------------------------------------------------
    def check(self) -> None:
        """Raise the cluster failure, if one happened, or NodeClosed after :meth:`close`."""
        if self.failure is not None:
            raise self.failure
        if self._stop.is_set():
            raise NodeClosed(
                f"{self.role}: this node was closed (kv.close()); a closed KVStore takes no "
                "more requests: create a new one with hetps.kv.create() to go on"
            )

    def request(
        self,
        peer: int,
        msg: Message,
        callback: Callable[[Message], None] | None = None,
        what: str | Callable[[], str] | None = None,
        track: bool = False,
        landing: Any = None,
        send: bool = True,
    ) -> Future:
        """Send ``msg`` to ``peer`` as a request; the returned future gets the reply.

        ``callback(reply)`` runs in the receive thread before the future resolves (an
        exception there fails the future). ``landing`` (flat, contiguous, writable) is where
        the reply's first array may be written straight from a shared-memory ring. With
        ``send=False`` the request is only registered (``msg.req`` is set): send it later
        with :meth:`send_request`, e.g. from a priority queue."""
        peer = self.route(peer)
        fut = self.requests.new(peer, what or f"{msg.cmd} to {self.describe(peer)}", callback)
        if fut.done():
            return fut
        fut.landing = landing
        msg.req = fut.req
        if send:
            self.send_request(fut, msg, track=track)
        return fut

    def send_request(self, fut: Future, msg: Message, track: bool = False) -> bool:
        """Send the request ``msg`` registered as ``fut``; a send that fails fails the future
        (returns False) instead of raising, as does one over HETPS_MAX_MESSAGE_BYTES, at once."""
        if (why := batch.over(msg, self.cfg.max_message_bytes)) is not None:
            return self.requests.resolve(fut.req, None, why) and False
        if self.replicas > 1:
            return self.faults.send_kept(fut.peer, [fut], [msg], track)
        if fut.peer == P.SCHEDULER_ID:
            fut.sent = msg  # a scheduler started again gets it again
        try:
            self.van.send(fut.peer, msg, track=track)
            return True
        except Exception as exc:  # noqa: BLE001 - PeerGone, a closed socket: the caller's error
            self.requests.resolve(
                fut.req, None, f"{self.describe(fut.peer)} is not reachable: {exc}"
            )
            return False

    def send_batch(self, peer: int, futs: list[Future], msgs: list[Message]) -> bool:
        """Send the requests ``msgs`` (registered as ``futs``) to ``peer`` in one message, or
        several within HETPS_MAX_MESSAGE_BYTES (:mod:`hetps.cluster.batch`); a send that
        fails fails every future of it (returns False)."""
        runs, at, ok = batch.fitting(msgs, self.cfg.max_message_bytes), 0, True
        if len(runs) > 1:  # (each fits)
            for run in runs:
                ok = self.send_batch(peer, futs[at : at + len(run)], run) and ok
                at += len(run)
            return ok
        if len(msgs) == 1:
            return self.send_request(futs[0], msgs[0])
        if self.replicas > 1:
            return self.faults.send_kept(peer, futs, msgs)
        try:
            # the batch's own id is its first request's: an answer refusing the whole batch
            # fails that request (the others then time out, as if lost)
            self.van.send(peer, batch.pack(msgs, req=futs[0].req))
            return True
        except Exception as exc:  # noqa: BLE001 - PeerGone, a closed socket: the caller's error
            for fut in futs:
                self.requests.resolve(
                    fut.req, None, f"{self.describe(peer)} is not reachable: {exc}"
                )
            return False

    def send(self, peer: int, msg: Message) -> bool:
        """Send a one-way message (no reply expected); False if ``peer`` is gone."""
        try:
            self.van.send(peer, msg)
            return True
        except PeerGone:
            log.debug("%s: cannot send %s to node %d (gone)", self.role, msg.cmd, peer)
            return False

    @property
    def endpoint(self) -> str:
        """The address this node receives on."""
        return self.van.endpoint

    @property
    def links(self) -> PeerLinks:
        """This node's connections to its peers: the port a part that talks to a peer of
        its own (ESync's state client) is given, instead of the van behind it."""
        return self.van

    @property
    def counters(self) -> Any:
        """Per-link byte counters of this node's traffic (:class:`~hetps.transport.van.Van`)."""
        return self.van.counters

    def observe_traffic(self, observer: Callable | None) -> None:
        """Call ``observer`` for every message sent or received (None: stop)."""
        self.van.observer = observer

    def reply(
        self,
        request: Message,
        body: dict | None = None,
        arrays: list | None = None,
        track: bool = False,
        timed: bool = False,
    ):
        """Answer ``request``; returns a ZeroMQ tracker for zero-copy arrays when ``track``
        (``timed``: see Message.timed)."""
        try:
            return self.van.send(
                request.sender,
                Message(
                    request.cmd,
                    req=request.req,
                    reply=True,
                    body=body or {},
                    arrays=arrays or [],
                    timed=timed,
                ),
                track=track,
            )
        except PeerGone:
            log.warning("%s: cannot answer node %d (gone)", self.role, request.sender)
            return None

    def send_replies(self, peer: int, replies: list[Message], track: bool = False):
        """Send the answers ``replies`` to ``peer`` in one message, or several within
        HETPS_MAX_MESSAGE_BYTES (:func:`hetps.cluster.batch.answers`); returns a tracker of
        their zero-copy arrays when ``track``."""
        sent = []
        for msg in batch.answers(replies, self.cfg.max_message_bytes):
            try:
                sent.append(self.van.send(peer, msg, track=track))
            except PeerGone:
                log.warning("%s: cannot answer node %d (gone)", self.role, peer)
                return None
        return sent[0] if len(sent) == 1 else batch.Trackers(sent)

    def barrier(self, group: str = "worker", timeout: float | None = None) -> list[int] | None:
        """Wait until every live node of ``group`` (worker, server, all) reaches this barrier.
        Returns the ids of the members it waited for under HETPS_ELASTIC (the same list on
        every node it released), else None."""
        timeout = self.cfg.request_timeout if timeout is None else timeout
        self.check()
        n = self.barrier_n.get(group, 0) + 1
        self.barrier_n[group] = n
        if self.hostlead is not None:
            relayed, members = self.hostlead.barrier(group, n, timeout)
            if relayed:
                self.barrier_passed[group] = n
                return members
        fut = self.request(
            P.SCHEDULER_ID,
            Message(P.BARRIER, body={"group": group, "n": n}),
            what=f"barrier({group})",
        )
        reply = fut.wait(timeout)
        self.barrier_passed[group] = n
        return reply.typed.members if reply is not None and reply.typed is not None else None

    def finish(self, timeout: float | None = None) -> None:
        """Tell the scheduler this worker is done (acknowledged at once; the servers stay up
        until every worker is done)."""
        timeout = self.cfg.request_timeout if timeout is None else timeout
        self.check()
        fut = self.request(P.SCHEDULER_ID, Message(P.FINISH), what="finish")
        fut.wait(timeout)

    def leave(self, reason: str) -> None:
        """Tell the scheduler this node is failing, so the others learn it at once."""
        with contextlib.suppress(PeerGone):
            self.van.send(P.SCHEDULER_ID, Message(P.LEAVE, body={"reason": reason[:2000]}))

    def close(self) -> None:
        """Stop the threads and close the sockets (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self.hostlead is not None:
            self.hostlead.close()
        me = threading.current_thread()
        for t in (self._recv_thread, self._hb_thread):
            if t is not None and t is not me:
                t.join(timeout=5)
        if (
            self._recv_thread is not None
            and self._recv_thread.is_alive()
            and self._recv_thread is not me
        ):
            log.warning(
                "%s: receive thread still busy at close; leaving its socket open", self.role
            )
            return
        self.van.close()
