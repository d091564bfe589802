"""The scheduler: membership, ranks, barriers, heartbeats and failure detection.

One control loop handles every message in one visible dispatch (:meth:`Scheduler._dispatch`).
Services (the ESync state server, the load planner) are plug-ins: the role setup
(:func:`hetps.roles.make_scheduler`) registers each with :meth:`Scheduler.register`,
a command name and a callable ``(scheduler, msg) -> None`` that may answer with
:meth:`Scheduler.reply`. The scheduler itself knows none of them.

Identity: a message's sender is its connection. A registration binds the connection it came
on to the node it becomes; every other message is checked against the allow-list
(:mod:`hetps.cluster.allow`) with the role of the node its connection belongs to. The node
table hands each node a routing id per peer and direction, derived from a key only the
scheduler holds, so no node can speak as another.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import queue
import re
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

from hetps.cluster import allow
from hetps.cluster import protocol as P
from hetps.cluster.credentials import Credentials
from hetps.cluster.elastic import Elastic
from hetps.cluster.launcher_link import LauncherLink
from hetps.cluster.protocol import NodeInfo
from hetps.cluster.takeover import Takeover
from hetps.config import NodeConfig, check_exposure, is_loopback
from hetps.transport.codec import Message
from hetps.transport.van import PeerGone, Van

log = logging.getLogger("hetps.scheduler")
#: what a node may give as its address: a host name or an IPv4/IPv6 address, nothing else
_HOST = re.compile(r"[A-Za-z0-9._:%\[\]-]+")

Service = Callable[["Scheduler", Message], None]

#: refusals (each opens a connection back) answered per second at most; beyond, dropped
MAX_REFUSALS_PER_S = 32


@dataclass
class _Pending:
    origin: bytes  # routing id of the connection the registration came on
    role: str
    host: str
    port: int
    req: int
    want_rank: int = -1


@dataclass
class _Barrier:
    arrived: dict[int, tuple[int, int]] = field(default_factory=dict)  # node -> (request, n)
    # node -> the highest barrier of the group it reached (its n: each node counts its own)
    reached: dict[int, int] = field(default_factory=dict)


class Scheduler(Takeover, Elastic, LauncherLink):
    """Runs the scheduler role for one cluster. ``run()`` returns the process exit code."""

    def __init__(
        self,
        cfg: NodeConfig,
        services: dict[str, Service] | None = None,
        bind_host: str | None = None,
        recover: bool = False,
    ) -> None:
        self.cfg = cfg
        loopback = is_loopback(cfg.root_uri)
        if bind_host is None:
            bind_host = cfg.root_uri if loopback and cfg.root_uri != "localhost" else "127.0.0.1"
            bind_host = bind_host if loopback else "*"
        check_exposure(cfg.secret, cfg.insecure, [bind_host], "scheduler")
        self.van = Van(
            host=bind_host,
            port=cfg.root_port,
            max_message_bytes=1 << 24,
            verbose=cfg.verbose,
            name="scheduler",
            secret=cfg.secret,
        )
        if cfg.secret is None:
            if cfg.insecure and not is_loopback(bind_host):
                log.warning(
                    "scheduler: HETPS_INSECURE=1: no cluster secret; it listens on every "
                    "interface, unauthenticated and unencrypted: anybody who can reach port %d "
                    "can join, push to or stop this job",
                    self.van.port,
                )
            else:
                log.warning(
                    "scheduler: no cluster secret: plain mode on loopback (%s:%d); any local "
                    "user can connect. `hetps launch` makes a secret for every job; for roles "
                    "started by hand set HETPS_SECRET_FILE (see `hetps secret`)",
                    bind_host,
                    self.van.port,
                )
        self.van.my_id = P.SCHEDULER_ID
        self.services: dict[str, Service] = dict(services or {})
        self._on_worker_finished: list[Callable[[Scheduler], None]] = []
        self._on_worker_back: list[Callable[[Scheduler, NodeInfo], None]] = []
        self.nodes: dict[int, NodeInfo] = {}
        self.pending: list[_Pending] = []
        self.barriers: dict[str, _Barrier] = {g: _Barrier() for g in P.GROUPS}
        self.last_seen: dict[int, float] = {}
        self.finished: dict[int, int] = {}
        self.dead: dict[int, str] = {}
        # copies of every key (HETPS_REPLICAS): a server's death is survived while fewer than
        # this many servers died (each key lives on that many consecutive servers)
        self.replicas = min(cfg.replicas, cfg.num_server)
        self.failovers: list[tuple[int, int]] = []  # (dead server, the server that took over)
        # HETPS_ELASTIC: a dead worker leaves while at least this many workers remain
        self.elastic = cfg.elastic
        self.left: dict[int, str] = {}  # workers that died and were let go -> how
        # a let-go worker started again that waits to join (its join request), and the live
        # workers that reached the round boundary where it may (their admit requests)
        self.joining: dict[int, int] = {}
        self.admitting: dict[int, Message] = {}
        self.entering: dict[int, dict[str, int]] = {}  # joiner -> the barriers it starts at
        self.rejoined: dict[int, int] = {}  # server id -> times it was admitted again
        # live metrics: a node silent longer than this (3 heartbeats) is late; heard again, it
        # counts one recovery
        self.late_after = 3 * cfg.heartbeat_interval if cfg.heartbeat_interval > 0 else 0.0
        self.recoveries: dict[int, int] = {}
        self.metrics = None  # live metrics (hetps.metrics.live.LiveMetrics) when served
        self.exit_code: int | None = None
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.ready = threading.Event()  # set once every node is registered
        self._pair_key = secrets.token_bytes(32)  # derives the routing id of each peer pair
        # started again at the same address (--recover): the running nodes come back with
        # readmit, and the job goes on once they all did (or PS_HEARTBEAT_TIMEOUT passed)
        self.recovering = recover
        self._back: dict[int, int] = {}  # node id -> its readmit request
        self._view: dict | None = None  # the job as the first node back described it
        # each node's credential, proven to a scheduler started again (cluster/credentials.py)
        self.creds = Credentials(self.van.port, recover)
        self._refusals: deque[float] = deque()
        self._notices: queue.SimpleQueue[tuple[str, int, str]] = queue.SimpleQueue()
        self._failed_start: str | None = None  # why the start failed (a node died first)
        self._late_refused = 0  # nodes told so
        self._dead_before_start = 0
        # plug-in services (and their worker-finished hooks) run in order on a thread of their
        # own, so a long one (a big plan) never holds up heartbeats, barriers or registration
        self._service_q: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._service_thread: threading.Thread | None = None
        self.to_launcher: Callable[[str], None] | None = None  # --launcher-notices: stdout

    def register(
        self,
        cmd: str,
        handler: Service,
        on_worker_finished: Callable[[Scheduler], None] | None = None,
        on_worker_back: Callable[[Scheduler, NodeInfo], None] | None = None,
    ) -> None:
        """Plug in a service: ``handler(scheduler, msg)`` gets every ``cmd`` message (and may
        answer with :meth:`reply`); ``on_worker_finished(scheduler)`` runs when a worker
        finishes or is let go (a service that waits for every worker must stop waiting for
        it); ``on_worker_back(scheduler, node)`` when a let-go worker joined again
        (HETPS_ELASTIC), before the live workers go on from their round boundary, so before
        any message of theirs from the next round. Handlers and hooks run in order on one
        thread of their own."""
        if cmd in self.services:
            raise ValueError(f"the scheduler already has a service for {cmd!r}")
        self.services[cmd] = handler
        if on_worker_finished is not None:
            self._on_worker_finished.append(on_worker_finished)
        if on_worker_back is not None:
            self._on_worker_back.append(on_worker_back)

    # -- lifecycle --------------------------------------------------------------------------
    def node_info(self, nid: int) -> NodeInfo | None:
        """The registered node ``nid`` (None for a connection that is no node of the job)."""
        return self.nodes.get(nid)

    def membership(self) -> dict[str, Any]:
        """The job's members as plain values, for live metrics (read on another thread: the
        scheduler's loop changes these dicts; copies of builtin dicts with int keys are taken
        without a thread switch in between)."""
        now = time.monotonic()
        return {
            "nodes": dict(self.nodes),
            "dead": dict(self.dead),
            "finished": dict(self.finished),
            "last_seen": dict(self.last_seen),
            "recoveries": dict(self.recoveries),
            "failovers": list(self.failovers),
            "left": dict(self.left),
            "rejoined": dict(self.rejoined),
            "late_after": self.late_after,
            "uptime": now - self.started,
            "expected": {"server": self.cfg.num_server, "worker": self.cfg.num_worker},
        }

    @property
    def expected(self) -> int:
        """Number of servers plus workers the cluster waits for."""
        return self.cfg.num_server + self.cfg.num_worker

    def start(self) -> Scheduler:
        """Run the loop in a background thread (for in-process clusters and tests)."""
        self._thread = threading.Thread(target=self.run, name="hetps-scheduler", daemon=True)
        self._thread.start()
        return self

    def join(self, timeout: float | None = None) -> int | None:
        """Wait for a background loop; returns its exit code (None if still running)."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self.exit_code

    def stop(self) -> None:
        """Ask the loop to end."""
        self._stop.set()

    def _serve_services(self) -> None:
        while True:
            job = self._service_q.get()
            if job is None:
                return
            try:
                job()
            except Exception:  # a service's bug must not stop the others
                log.exception("scheduler: a service failed")

    def notice_dead(self, role: str, rank: int, how: str) -> None:
        """The launcher saw the process of ``role`` ``rank`` end (``how``, e.g. "was killed by
        signal 9 (code 137)"): declare it dead now instead of after the heartbeat timeout.
        Safe from any thread; the loop acts on it within one tick."""
        self._notices.put((role, int(rank), how))

    def follow_notices(self, stream: IO[str]) -> threading.Thread:
        """Read the launcher's notices from ``stream`` (the scheduler's stdin, a pipe only the
        launcher holds), one per line: ``dead ROLE RANK HOW...``. Lines of another form are
        logged and ignored; the end of the stream ends the thread."""

        def read() -> None:
            for line in stream:
                parts = line.split(maxsplit=3)
                if (
                    len(parts) >= 3
                    and parts[0] == "dead"
                    and parts[1] in ("server", "worker")
                    and parts[2].isdigit()
                ):
                    self.notice_dead(
                        parts[1],
                        int(parts[2]),
                        _printable(parts[3].strip() if len(parts) > 3 else "ended"),
                    )
                elif line.strip():
                    log.warning(
                        "scheduler: ignored a launcher notice it cannot read: %r", line[:200]
                    )

        t = threading.Thread(target=read, name="hetps-launcher-notices", daemon=True)
        t.start()
        return t

    def run(self) -> int:
        """Serve until the job ends (0), a node dies or registration times out (1)."""
        if self.cfg.verbose >= 1:
            log.info("scheduler listening on %s", self.van.endpoint)
        tick = max(0.05, min(0.5, (self.cfg.heartbeat_interval or 1.0) / 2))
        next_check = 0.0
        self._service_thread = threading.Thread(
            target=self._serve_services, name="hetps-scheduler-services", daemon=True
        )
        self._service_thread.start()
        try:
            while not self._stop.is_set() and self.exit_code is None:
                msg = self.van.recv(timeout=tick)
                while not self._notices.empty():
                    self._apply_notice(*self._notices.get())
                if msg is not None:
                    try:
                        self._dispatch(msg)
                    except Exception:  # a bad control message must not stop the scheduler
                        log.exception("scheduler: error handling %s from %d", msg.cmd, msg.sender)
                # once per tick, not per message: the check walks every node, so per message
                # it cost O(N) per heartbeat, O(N^2) per heartbeat period (scale_sim.py)
                now = time.monotonic()
                if now >= next_check:
                    next_check = now + tick
                    self._check_timeouts()
                    self._say_alive()
        finally:
            self._service_q.put(None)  # what was asked before the end is still answered
            self._service_thread.join(timeout=10)
            self.van.close()
            self.creds.close()
        if self.exit_code is None:
            self.exit_code = 0
        return self.exit_code

    # -- dispatch ---------------------------------------------------------------------------
    def _dispatch(self, msg: Message) -> None:
        cmd = msg.cmd
        info = self.nodes.get(msg.sender)
        role = info.role if info is not None else None
        if self.recovering and info is None and cmd != P.READMIT:
            return  # the nodes of the running job say who they are first (readmit)
        if msg.reply or not allow.permits("scheduler", role, cmd, cmd in self.services):
            who = info.describe() if info is not None else "a connection of no node of this job"
            log.warning(
                "scheduler: refused %s%s from %s: only %s may send it",
                cmd,
                " (a reply)" if msg.reply else "",
                who,
                allow.senders("scheduler", cmd) if cmd not in self.services else "a node",
            )
            if info is not None and msg.req and not msg.reply:
                self.reply(msg, {"error": f"the scheduler does not take {cmd!r} from a {role}"})
            return
        if info is not None and msg.sender not in self.finished:
            now = time.monotonic()
            gap = now - self.last_seen.get(msg.sender, now)
            if self.late_after and gap > self.late_after and msg.sender not in self.dead:
                self.recoveries[msg.sender] = self.recoveries.get(msg.sender, 0) + 1
                log.warning("scheduler: %s is back after %.1f s of silence", info.describe(), gap)
            self.last_seen[msg.sender] = now
        if cmd == P.HEARTBEAT:
            self._send(msg.sender, Message(P.HEARTBEAT_ACK, req=msg.req, reply=True))
        elif cmd == P.READMIT:
            self._readmit_node(msg)
        elif cmd == P.ADD_NODE:
            self._add_node(msg)
        elif cmd == P.BARRIER:
            self._barrier(msg)
        elif cmd == P.FINISH:
            self._finish(msg)
        elif cmd in (P.JOIN, P.ADMIT, P.ENTERED):
            self._join_step(msg)
        elif cmd == P.LEAVE:
            reason = _printable(msg.body.get("reason", "left"))
            self._declare_dead(msg.sender, f"exited with an error: {reason}")
        elif cmd in self.services:
            handler = self.services[cmd]
            self._service_q.put(lambda: handler(self, msg))
        else:  # a command of a service this job does not run (e.g. no load balancing)
            self._refuse_request(msg, f"this job's scheduler runs no service for {cmd!r}")

    def _refuse_request(self, msg: Message, text: str) -> None:
        """Answer a request with an error, and log it (one line)."""
        log.warning("scheduler: refused %s from node %d: %s", msg.cmd, msg.sender, text)
        if msg.req:
            self.reply(msg, {"error": text})

    def reply(self, request: Message, body: dict | None = None, arrays: list | None = None) -> None:
        """Answer ``request`` (used by services too)."""
        self._send(
            request.sender,
            Message(request.cmd, req=request.req, reply=True, body=body or {}, arrays=arrays or []),
        )

    def send(self, node_id: int, msg: Message) -> None:
        """Send a message to a registered node (services use this for pushes of state)."""
        self._send(node_id, msg)

    def _send(self, peer: int | str, msg: Message) -> None:
        try:
            self.van.send(peer, msg)
        except PeerGone:
            log.debug("scheduler: cannot reach %s for %s", peer, msg.cmd)

    # -- registration -----------------------------------------------------------------------
    def _add_node(self, msg: Message) -> None:
        b = msg.body
        role = b.get("role")
        host, port, back = b.get("host"), b.get("port"), b.get("back")
        if (
            role not in ("server", "worker")
            or not isinstance(host, str)
            or not 0 < len(host) <= 255
            or not _HOST.fullmatch(host)  # (it is logged and written to the launcher)
            or not isinstance(port, int)
            or isinstance(port, bool)
            or not 0 < port < 65536
            or not isinstance(back, bytes)
            or not 0 < len(back) <= 255
            or back[0] == 0
        ):
            log.warning("scheduler: refused a malformed registration %r", b)
            return
        origin = msg.origin
        if any(p.origin == origin for p in self.pending):
            log.warning("scheduler: refused a second registration on one connection")
            return
        want = b.get("want_rank", -1)
        want = want if isinstance(want, int) and not isinstance(want, bool) else -1
        limit = self.cfg.num_server if role == "server" else self.cfg.num_worker
        refusal = None
        if self.recovering:
            self._refuse(
                origin, host, port, back, msg.req,
                "the scheduler was started again and is taking back the running job's nodes; "
                "a new node can join once it did",
            )  # fmt: skip
            return
        if self._failed_start is not None:
            # a node died before the cluster was complete: every late one is told why
            self._refuse(origin, host, port, back, msg.req, self._failed_start)
            self._late_refused += 1
            self._end_failed_start()
            return
        slot = self._rejoin_slot(role, want) if self.nodes else None
        if slot is not None:
            self._readmit(msg, slot, host, port, back)
            return
        slot = self._join_slot(role, want) if self.nodes else None
        if slot is not None:
            self._admit_worker(msg, slot, host, port, back)
            return
        if self.nodes or len(self.pending) >= self.expected:
            refusal = (
                f"the cluster is already complete ({self.cfg.num_server} "
                f"servers, {self.cfg.num_worker} workers): check DMLC_NUM_SERVER/"
                "DMLC_NUM_WORKER and that no old job uses this scheduler port"
            )
        elif sum(1 for p in self.pending if p.role == role) >= limit:
            refusal = (
                f"too many {role}s: the scheduler expects {limit} "
                f"(DMLC_NUM_{role.upper()}={limit} on the scheduler)"
            )
        elif want >= limit:
            refusal = f"{role} rank {want} (HETPS_LAUNCH_RANK) is not below {limit}"
        elif want >= 0:
            rival = next((p for p in self.pending if p.role == role and p.want_rank == want), None)
            if rival is not None:
                refusal = (
                    f"{role} rank {want} (HETPS_LAUNCH_RANK) is already claimed by "
                    f"{rival.host}:{rival.port}: a rank is given once; is another job using "
                    "this scheduler port?"
                )
                log.error("scheduler: a second claim of %s rank %d (%s:%s)", role, want, host, port)
        if refusal is not None:
            self._refuse(origin, host, port, back, msg.req, refusal)
            return
        try:
            self.van.connect(origin, f"{host}:{port}", routing_id=back)
        except PeerGone as exc:
            log.warning("scheduler: registration with a bad address: %s", exc)
            return
        self.pending.append(_Pending(origin, role, host, port, msg.req, want))
        self._send(
            origin,
            Message(
                P.ADD_NODE,
                req=0,
                reply=True,
                body={"registered": len(self.pending), "expected": self.expected},
            ),
        )
        if len(self.pending) == self.expected:
            self._assign()

    def _refuse(self, origin: bytes, host: str, port: int, back: bytes, req: int, text: str):
        """Answer a registration with a refusal (over a connection of its own, closed after)."""
        now = time.monotonic()
        while self._refusals and now - self._refusals[0] > 1.0:
            self._refusals.popleft()
        if len(self._refusals) >= MAX_REFUSALS_PER_S:
            log.warning("scheduler: dropped a registration (too many refusals): %s", text)
            return
        self._refusals.append(now)
        log.warning("scheduler: refused a registration from %s:%s: %s", host, port, text)
        key = ("refusal", origin)
        try:
            self.van.connect(key, f"{host}:{port}", routing_id=back)
        except PeerGone as exc:
            log.warning("scheduler: registration with a bad address: %s", exc)
            return
        self._send(key, Message(P.REFUSED, req=req, reply=True, body={"error": text}))
        self.van.disconnect(key, linger_ms=1000)  # let the refusal leave first

    def _pair(self, src: int, dst: int) -> bytes:
        """The routing id node ``src`` connects to node ``dst`` with (known to both alone; a
        node admitted again gets new ones)."""
        a, b = self.rejoined.get(src, 0), self.rejoined.get(dst, 0)
        mac = hmac.new(self._pair_key, f"{src}.{a}>{dst}.{b}".encode(), hashlib.sha256).digest()
        return b"h" + mac[:15]

    def _assign(self) -> None:
        ranks = {"server": 0, "worker": 0}
        # Ranks a launcher asked for (each distinct) win; otherwise arrival order.
        for role in ranks:
            wants = [p.want_rank for p in self.pending if p.role == role]
            if sorted(wants) != list(range(len(wants))):
                for p in self.pending:
                    if p.role == role:
                        p.want_rank = -1
        order = {id(p): i for i, p in enumerate(self.pending)}
        self.pending.sort(
            key=lambda p: (p.role, p.want_rank if p.want_rank >= 0 else 1 << 30, order[id(p)])
        )
        for p in self.pending:
            rank = ranks[p.role]
            ranks[p.role] += 1
            nid = P.server_id(rank) if p.role == "server" else P.worker_id(rank)
            self.nodes[nid] = NodeInfo(nid, p.role, rank, p.host, p.port)
            self.van.rename(p.origin, nid)
            self.van.admit(p.origin, nid)
            self.last_seen[nid] = time.monotonic()
            if self.cfg.verbose >= 1:
                log.info(
                    "assign rank=%d to node role=%s, ip=%s, port=%d, is_recovery=0",
                    nid,
                    p.role,
                    p.host,
                    p.port,
                )
        table = [n.to_wire() for n in self.nodes.values()]
        for p, nid in zip(self.pending, self.nodes, strict=False):
            # workers talk to servers; with copies (HETPS_REPLICAS) servers to servers too
            peers = [
                i
                for i, n in self.nodes.items()
                if n.role != p.role or (self.replicas > 1 and p.role == "server" and i != nid)
            ]
            body = {
                "nodes": table,
                "id": nid,
                "out": [[i, self._pair(nid, i)] for i in peers],  # routing ids to its peers
                "in": [[i, self._pair(i, nid)] for i in peers],  # and theirs to it
                **self.creds.issue(nid),  # what it proves who it is with (--recover)
            }
            if self.replicas > 1:
                body["replicas"] = self.replicas
            if self.elastic:
                body["elastic"] = self.elastic
            if P.METRICS_REPORT in self.services:  # live metrics are on: workers report
                body["metrics_s"] = self.cfg.metrics_interval
            self._send(nid, Message(P.NODES, req=p.req, reply=True, body=body))
        self.pending.clear()
        self.ready.set()
        if self.cfg.verbose >= 1:
            log.info(
                "the %d servers and %d workers are up", self.cfg.num_server, self.cfg.num_worker
            )

    # -- barriers ---------------------------------------------------------------------------
    def _members(self, group: str) -> set[int]:
        alive = {
            i
            for i in self.nodes
            if i not in self.dead and i not in self.finished and i not in self.left
        }
        if group == "all":
            return alive
        return {i for i in alive if self.nodes[i].role == group}

    def _barrier(self, msg: Message) -> None:
        group = msg.body.get("group")
        if group not in P.GROUPS or msg.sender not in self.nodes:
            self._refuse_request(
                msg, f"bad barrier group {_printable(group, 40)!r}: use one of {P.GROUPS}"
            )
            return
        if group != "all" and self.nodes[msg.sender].role != group:
            self._refuse_request(msg, f"node {msg.sender} is not in group {group!r}")
            return
        bar = self.barriers[group]
        n = msg.body.get("n")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            n = bar.reached.get(msg.sender, 0) + 1
        bar.arrived[msg.sender] = (msg.req, n)
        bar.reached[msg.sender] = max(n, bar.reached.get(msg.sender, 0))
        self._maybe_release(group)

    def _maybe_release(self, group: str) -> None:
        """Release each node waiting at its barrier n once every live member reached n (all
        at once, as a rule; after a restart some members may have gone past it already)."""
        bar = self.barriers[group]
        if not bar.arrived:
            return
        members = self._members(group)
        low = min((bar.reached.get(m, 0) for m in members), default=None)
        # HETPS_ELASTIC: the members it waited for, the same list for every node released
        # together (a worker's own view of who left may lag behind the scheduler's)
        body = {"members": sorted(members)} if self.elastic else {}
        for nid, (req, n) in list(bar.arrived.items()):
            if low is None or low >= n:
                self._send(nid, Message(P.BARRIER_DONE, req=req, reply=True, body=body))
                del bar.arrived[nid]

    # -- shutdown and failures --------------------------------------------------------------
    def _finish(self, msg: Message) -> None:
        """A worker is done: acknowledge at once (it may exit), tell the servers, and end the
        job when every worker is done."""
        if msg.sender not in self.nodes:
            return
        self.finished[msg.sender] = msg.req
        self.last_seen.pop(msg.sender, None)  # a finished worker no longer heartbeats
        self.admitting.pop(msg.sender, None)
        self._send(msg.sender, Message(P.EXIT, req=msg.req, reply=True))
        servers = [
            nid for nid, n in self.nodes.items() if n.role == "server" and nid not in self.dead
        ]
        for nid in servers:
            self._send(nid, Message(P.WORKER_DONE, body={"node": self.nodes[msg.sender].to_wire()}))
        for group in ("worker", "all"):  # barriers no longer wait for it
            self._maybe_release(group)
        for hook in self._on_worker_finished:
            self._service_q.put(lambda hook=hook: hook(self))
        self._maybe_admit()
        self._maybe_end()

    def _maybe_end(self) -> None:
        """End the job once every worker finished (or died and was let go: HETPS_ELASTIC)."""
        workers = {i for i, n in self.nodes.items() if n.role == "worker"}
        if self.finished and workers <= set(self.finished) | set(self.left):
            self._refuse_joiners("the job ended before this worker could join")
            for nid, n in self.nodes.items():
                if n.role == "server" and nid not in self.dead:
                    self._send(nid, Message(P.EXIT))
            if self.cfg.verbose >= 1:
                log.info("all workers finished; stopping the cluster")
            self.exit_code = 0

    def _check_timeouts(self) -> None:
        now = time.monotonic()
        if self.recovering:
            if now - self.started > max(self.cfg.heartbeat_timeout, 1.0):
                if self._view is None:
                    log.error(
                        "scheduler: started again (--recover), but no node of a running job "
                        "came back within %.0f s (PS_HEARTBEAT_TIMEOUT)",
                        self.cfg.heartbeat_timeout,
                    )
                    self.exit_code = 1
                else:
                    self._end_recovery()
            return
        if self._failed_start is not None:
            if now - self.started > self.cfg.connect_timeout:
                self.exit_code = 1  # the rest never came to be told
            return
        if not self.nodes:
            if self.pending and now - self.started > self.cfg.connect_timeout:
                counts = {
                    r: sum(1 for p in self.pending if p.role == r) for r in ("server", "worker")
                }
                text = (
                    f"only {counts['server']} of {self.cfg.num_server} servers and "
                    f"{counts['worker']} of {self.cfg.num_worker} workers registered within "
                    f"{self.cfg.connect_timeout:.0f} s (HETPS_CONNECT_TIMEOUT): start the missing "
                    "nodes or fix DMLC_NUM_SERVER/DMLC_NUM_WORKER"
                )
                log.error("scheduler: %s", text)
                for p in self.pending:
                    self._send(
                        p.origin, Message(P.REFUSED, req=p.req, reply=True, body={"error": text})
                    )
                self.exit_code = 1
            return
        if self.cfg.heartbeat_interval <= 0:
            return
        for nid, seen in list(self.last_seen.items()):
            if (
                nid not in self.dead
                and nid not in self.finished
                and now - seen > self.cfg.heartbeat_timeout
            ):
                self._declare_silent(
                    nid,
                    f"stopped answering heartbeats for {now - seen:.1f} s "
                    f"(PS_HEARTBEAT_TIMEOUT={self.cfg.heartbeat_timeout:g})",
                )

    def _apply_notice(self, role: str, rank: int, how: str) -> None:
        nid = next((i for i, n in self.nodes.items() if n.role == role and n.rank == rank), None)
        if nid is not None:
            if nid not in self.finished:
                self._declare_dead(nid, f"{how} (seen by the launcher)")
            return
        if self.nodes:  # every node registered, none with that rank: nothing to do
            log.warning("scheduler: the launcher reports %s %d, which is no node here", role, rank)
            return
        # it died before the cluster was complete: the others would wait for it in vain
        text = f"{role} {rank} {how} before it registered (seen by the launcher)"
        log.error("scheduler: %s", text)
        for p in self.pending:
            self._send(p.origin, Message(P.REFUSED, req=p.req, reply=True, body={"error": text}))
        self._dead_before_start += 1
        if self._failed_start is None:
            self._failed_start = text
            self._late_refused = len(self.pending)
            self.pending = []
        self._end_failed_start()

    def _end_failed_start(self) -> None:
        """A failed start ends once every node that was to come has been told (or died);
        until then the scheduler stays up to refuse the late ones (and at most
        HETPS_CONNECT_TIMEOUT, as any start)."""
        if self._late_refused + self._dead_before_start >= self.expected:
            self.exit_code = 1

    def _declare_dead(self, nid: int, reason: str) -> None:
        if nid in self.dead or nid not in self.nodes:
            return
        info = self.nodes[nid]
        if self._fail_over(nid, reason):
            return
        reason, gone = self._let_go(nid, reason)
        if gone:
            return
        text = f"{info.describe()} {reason}; the job cannot continue"
        self.dead[nid] = text
        log.error("scheduler: %s", text)
        if self.exit_code is None:
            self._name_cause(nid, text)
        for other in self.nodes:
            if other not in self.dead:
                self._send(
                    other, Message(P.NODE_DEAD, body={"node": info.to_wire(), "error": text})
                )
        self.exit_code = 1


def _printable(value: object, limit: int = 2000) -> str:
    """A node's own text for a log line: printable characters only, bounded."""
    text = value if isinstance(value, str) else repr(value)
    return "".join(c if c.isprintable() else "?" for c in text[:limit])
