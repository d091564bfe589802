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

import gc
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import IO, Any

from hetps.cluster import allow, commands
from hetps.cluster import protocol as P
from hetps.cluster.barriers import Barriers
from hetps.cluster.credentials import Credentials
from hetps.cluster.launcher_link import LauncherLink
from hetps.cluster.protocol import NodeInfo
from hetps.cluster.registration import Registration
from hetps.config import NodeConfig, check_exposure, is_loopback
from hetps.transport.codec import Message
from hetps.transport.handshakes import RefusalLog
from hetps.transport.links import PeerLinks
from hetps.transport.van import PeerGone, Van

log = logging.getLogger("hetps.scheduler")
Service = Callable[["Scheduler", Message], None]
#: a service's quick part: a message's checks, run on the loop; returns what is left to do on
#: the services' thread (or None)
Quick = Callable[["Scheduler", Message], "Callable[[], None] | None"]


class Scheduler:
    """Runs the scheduler role for one cluster. ``run()`` returns the process exit code.

    ``takeover`` and ``elastic`` make its fault parts from it (:mod:`hetps.faults`);
    :func:`hetps.roles.new_scheduler` builds a scheduler with them."""

    def __init__(
        self,
        cfg: NodeConfig,
        services: dict[str, Service] | None = None,
        bind_host: str | None = None,
        recover: bool = False,
        *,
        takeover: Callable[[Scheduler, PeerLinks], Any],
        elastic: Callable[[Scheduler], Any],
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
        self._on_refused: dict[str, Callable[[Scheduler, Message, str], None]] = {}
        #: command -> its service's quick part (register's ``quick``), run on the loop
        self.quick_parts: dict[str, Quick] = {}
        # refused messages: a few lines per window, the rest counted in one line (a forger
        # sending without end fills no disk)
        self.refused_msgs = RefusalLog("scheduler", "messages", cfg.refusal_lines)
        self.nodes: dict[int, NodeInfo] = {}
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
        # started again at the same address (--recover): the running nodes come back with
        # readmit, and the job goes on once they all did (or PS_HEARTBEAT_TIMEOUT passed)
        self.recovering = recover
        # each node's credential, proven to a scheduler started again (cluster/credentials.py)
        self.creds = Credentials(self.van.port, recover)
        self._table_mark: tuple = ()  # what the node table kept beside the key was made of
        self._notices: queue.SimpleQueue[tuple[str, int, str]] = queue.SimpleQueue()
        #: why the start failed (a node died before the cluster was complete), or None
        self.failed_start: str | None = None
        self._late_refused = 0  # nodes told so
        self._dead_before_start = 0
        # plug-in services (and their worker-finished hooks) run in order on a thread of their
        # own, so a long one (a big plan) never holds up heartbeats, barriers or registration
        self._service_q: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        # jobs handed to that thread and not finished: a quick part runs on the loop only
        # while there are none (so every service sees its messages in order)
        self._jobs = 0
        self._jobs_lock = threading.Lock()
        # a quick part kept a message and is waiting for more of its kind (a round's reports
        # before its last): the loop then waits gather_hold_s (HETPS_GATHER_HOLD_MS) before
        # its next look, when nothing is queued, so that what comes meanwhile is read in one
        # turn: a report that wakes the loop costs it about 3 times its work when a round's
        # 512 come one at a time (docs/PERFORMANCE.md, "Scale (simulated)")
        self._gathering = False
        self.gather_hold_s = cfg.gather_hold_ms / 1000.0
        self._gathers: dict[str, Callable[[], bool]] = {}  # (register(gathers=))
        self._service_thread: threading.Thread | None = None
        self.to_launcher: Callable[[str], None] | None = None  # --launcher-notices: stdout
        # the parts: registration, barriers, a server's death (takeover, --recover's
        # readmits), workers let go and joining again (HETPS_ELASTIC), the lines to the
        # launcher; the fault parts are the wing hetps.faults, plugged in by hetps.roles
        self.registration = Registration(self, self.van)
        self.barriers = Barriers(self)
        self.takeover = takeover(self, self.van)
        self.workers_part = elastic(self)
        self.launcher = LauncherLink(self)

    def register(
        self,
        cmd: str,
        handler: Service,
        on_worker_finished: Callable[[Scheduler], None] | None = None,
        on_worker_back: Callable[[Scheduler, NodeInfo], None] | None = None,
        on_refused: Callable[[Scheduler, Message, str], None] | None = None,
        quick: Quick | None = None,
        gathers: Callable[[], bool] | None = None,
    ) -> None:
        """Plug in a service: ``handler(scheduler, msg)`` gets every ``cmd`` message (and may
        answer with :meth:`reply`); ``on_worker_finished(scheduler)`` runs when a worker
        finishes or is let go (a service that waits for every worker must stop waiting for
        it); ``on_worker_back(scheduler, node)`` when a let-go worker joined again
        (HETPS_ELASTIC), before the live workers go on from their round boundary, so before
        any message of theirs from the next round; ``on_refused(scheduler, msg, why)`` when the
        dispatch refused a ``cmd`` whose body is not of its declared type (it was logged and
        answered: the service counts it). Handlers and hooks run in order on one thread of
        their own. ``quick(scheduler, msg)``, if given, does what ``handler`` does for a
        message in a few microseconds and returns what is left (a callable, or None: kept):
        while
        that thread has nothing to do, a message goes to ``quick`` on the scheduler's loop
        (no hand-off between threads: at 4,096 workers a round's 512 host reports cost 8 ms
        less CPU) and only what it returns goes to the thread; otherwise to ``handler`` there,
        after what waits. ``gathers()``, if given, says whether more of its kind are on their
        way in numbers (a round's reports of many hosts): while it says so, a message that
        ``quick`` kept makes the loop wait ``HETPS_GATHER_HOLD_MS`` before its next look when
        nothing is queued, and read what came meanwhile in one turn."""
        if cmd in self.services:
            raise ValueError(f"the scheduler already has a service for {cmd!r}")
        self.services[cmd] = handler
        if on_worker_finished is not None:
            self._on_worker_finished.append(on_worker_finished)
        if on_worker_back is not None:
            self._on_worker_back.append(on_worker_back)
        if on_refused is not None:
            self._on_refused[cmd] = on_refused
        if quick is not None:
            self.quick_parts[cmd] = quick
        if gathers is not None:
            self._gathers[cmd] = gathers

    def worker_finished_hooks(self) -> None:
        """A worker finished or was let go: the services' hooks run (on their thread)."""
        for hook in self._on_worker_finished:
            self.to_services(lambda hook=hook: hook(self))

    def worker_back_hooks(self, info: NodeInfo) -> None:
        """A let-go worker joined again: the services' hooks run (on their thread)."""
        for hook in self._on_worker_back:
            self.to_services(lambda hook=hook: hook(self, info))

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

    @property
    def port(self) -> int:
        """The port the scheduler receives on (what a launcher reads)."""
        return self.van.port

    def close_unrun(self) -> None:
        """Close the sockets of a scheduler that will not run (its services failed to start);
        :meth:`run` closes them itself when it ends."""
        self.van.close()

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

    def to_services(self, job: Callable[[], None]) -> None:
        """Run ``job`` on the services' thread, after the jobs handed to it before."""
        with self._jobs_lock:
            self._jobs += 1
        self._service_q.put(job)

    def _serve_services(self) -> None:
        while True:
            job = self._service_q.get()
            if job is None:
                return
            try:
                job()
            except Exception:  # a service's bug must not stop the others
                log.exception("scheduler: a service failed")
            finally:
                with self._jobs_lock:
                    self._jobs -= 1

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
                        P.printable(parts[3].strip() if len(parts) > 3 else "ended"),
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
        # a scheduler of its own process (not start()'s) keeps the job's tables out of full
        # collections once made: at 4,224 nodes one walked them for 80 ms within a round
        frozen = threading.current_thread() is not threading.main_thread()
        try:
            while not self._stop.is_set() and self.exit_code is None:
                # what one turn read off the socket (the host reports queued while it worked)
                msgs = self.van.inbox.recv_many(timeout=tick)
                while not self._notices.empty():
                    self._apply_notice(*self._notices.get())
                for msg in msgs:
                    try:
                        self._dispatch(msg)
                    except Exception:  # a bad control message must not stop the scheduler
                        log.exception("scheduler: error handling %s from %d", msg.cmd, msg.sender)
                if self._gathering:  # (a round's reports: those coming now read together)
                    self._gathering = False
                    if self.gather_hold_s > 0 and not self.van.inbox.queued():
                        self._stop.wait(self.gather_hold_s)
                if msgs:
                    self.keep_table()
                    if not frozen and self.ready.is_set():
                        gc.freeze()
                        frozen = True
                # once per tick, not per message: the check walks every node, so per message
                # it cost O(N) per heartbeat, O(N^2) per heartbeat period (scale_sim.py)
                now = time.monotonic()
                if now >= next_check:
                    next_check = now + tick
                    self._check_timeouts()
                    self.keep_table()
                    self.launcher.say_alive()
                    self.refused_msgs.tick()
        finally:
            self._service_q.put(None)  # what was asked before the end is still answered
            self._service_thread.join(timeout=10)
            self.van.close()
            self.creds.close()
            self.refused_msgs.flush()
        if self.exit_code is None:
            self.exit_code = 0
        return self.exit_code

    def keep_table(self) -> None:
        """Save the node table beside the credential key when it changed (a node assigned,
        dead, finished, let go, back, taken over): a scheduler started again (``--recover``)
        takes the job back from it (cluster/credentials.py)."""
        if not self.nodes or self.recovering:
            return
        mark = (
            len(self.nodes),
            len(self.dead),
            len(self.finished),
            len(self.failovers),
            len(self.left),
            sum(self.rejoined.values()),
        )
        if mark == self._table_mark:
            return
        self._table_mark = mark
        self.creds.keep_table(
            {
                "nodes": [n.to_wire() for n in self.nodes.values()],
                "down": sorted(self.dead),
                "redirect": [list(pair) for pair in self.failovers],
                "done": sorted(self.finished),
                "left": sorted(self.left),  # (HETPS_ELASTIC) the job ends without them
                # the workers' host groups (HETPS_HOST_GROUP): a restarted scheduler's
                # balancing and host-local sums see the job's hosts, not a host per worker
                "groups": [[i, n.group] for i, n in self.nodes.items() if n.group >= 0],
            }
        )

    # -- dispatch ---------------------------------------------------------------------------
    def _dispatch(self, msg: Message) -> None:
        cmd = msg.cmd
        info = self.nodes.get(msg.sender)
        role = info.role if info is not None else None
        if self.recovering and info is None and cmd != P.READMIT:
            return  # the nodes of the running job say who they are first (readmit)
        if msg.reply or not allow.permits("scheduler", role, cmd, cmd in self.services):
            who = info.describe() if info is not None else "a connection of no node of this job"
            self.refused_msgs.refused(
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
        why = commands.decode(msg)  # the body as its command's declared type, or why not
        if why is not None:
            who = info.describe() if info is not None else "a connection of no node of this job"
            self.refused_msgs.refused("scheduler: refused %s from %s: %s", cmd, who, why)
            if info is not None and msg.req:
                self.reply(msg, {"error": why})
            hook = self._on_refused.get(cmd)
            if hook is not None:
                self.to_services(lambda: hook(self, msg, why))
            return
        if cmd == P.HEARTBEAT:
            self.send_to(msg.sender, Message(P.HEARTBEAT_ACK, req=msg.req, reply=True))
        elif cmd == P.READMIT:
            self.takeover.readmit_node(msg)
        elif cmd == P.ADD_NODE:
            self.registration.add_node(msg)
        elif cmd == P.BARRIER:
            self.barriers.arrive(msg)
        elif cmd == P.FINISH:
            self._finish(msg)
        elif cmd in (P.JOIN, P.ADMIT, P.ENTERED):
            self.workers_part.join_step(msg)
        elif cmd == P.LEAVE:
            reason = P.printable(msg.typed.reason)
            self.declare_dead(msg.sender, f"exited with an error: {reason}")
        elif cmd in self.services:
            quick = self.quick_parts.get(cmd)
            if quick is not None and not self._jobs:  # (the thread is idle: nothing waits)
                rest = quick(self, msg)
                # kept, nothing left to do, and more of its kind are on their way in numbers
                # (a round's reports before its last); the last one's release ends it
                gathers = self._gathers.get(cmd)
                self._gathering = rest is None and gathers is not None and gathers()
                if rest is not None:
                    self.to_services(rest)
                return
            handler = self.services[cmd]
            self.to_services(lambda: handler(self, msg))
        else:  # a command of a service this job does not run (e.g. no load balancing)
            self.refuse_request(msg, f"this job's scheduler runs no service for {cmd!r}")

    def refuse_request(self, msg: Message, text: str) -> None:
        """Answer a request with an error, and log it (one line)."""
        self.refused_msgs.refused(
            "scheduler: refused %s from node %d: %s", msg.cmd, msg.sender, text
        )
        if msg.req:
            self.reply(msg, {"error": text})

    def reply(self, request: Message, body: dict | None = None, arrays: list | None = None) -> None:
        """Answer ``request`` (used by services too)."""
        self.send_to(
            request.sender,
            Message(request.cmd, req=request.req, reply=True, body=body or {}, arrays=arrays or []),
        )

    def send(self, node_id: int, msg: Message) -> None:
        """Send a message to a registered node (services use this for pushes of state)."""
        self.send_to(node_id, msg)

    def send_to(self, peer: int | str, msg: Message) -> None:
        try:
            self.van.send(peer, msg)
        except PeerGone:
            log.debug("scheduler: cannot reach %s for %s", peer, msg.cmd)

    # -- shutdown and failures --------------------------------------------------------------
    def _finish(self, msg: Message) -> None:
        """A worker is done: acknowledge at once (it may exit), tell the servers, and end the
        job when every worker is done."""
        if msg.sender not in self.nodes:
            return
        self.finished[msg.sender] = msg.req
        self.last_seen.pop(msg.sender, None)  # a finished worker no longer heartbeats
        self.workers_part.admitting.pop(msg.sender, None)
        self.send_to(msg.sender, Message(P.EXIT, req=msg.req, reply=True))
        servers = [
            nid for nid, n in self.nodes.items() if n.role == "server" and nid not in self.dead
        ]
        for nid in servers:
            self.send_to(
                nid, Message(P.WORKER_DONE, body={"node": self.nodes[msg.sender].to_wire()})
            )
        for group in ("worker", "all"):  # barriers no longer wait for it
            self.barriers.release(group)
        self.worker_finished_hooks()
        self.workers_part.maybe_admit()
        self.maybe_end()

    def maybe_end(self) -> None:
        """End the job once every worker finished (or died and was let go: HETPS_ELASTIC)."""
        workers = {i for i, n in self.nodes.items() if n.role == "worker"}
        if self.finished and workers <= set(self.finished) | set(self.left):
            self.workers_part.refuse_joiners("the job ended before this worker could join")
            for nid, n in self.nodes.items():
                if n.role == "server" and nid not in self.dead:
                    self.send_to(nid, Message(P.EXIT))
            if self.cfg.verbose >= 1:
                log.info("all workers finished; stopping the cluster")
            self.exit_code = 0

    def _check_timeouts(self) -> None:
        now = time.monotonic()
        if self.recovering:
            if now - self.started > max(self.cfg.heartbeat_timeout, 1.0):
                if self.takeover.view is None:
                    log.error(
                        "scheduler: started again (--recover), but no node of a running job "
                        "came back within %.0f s (PS_HEARTBEAT_TIMEOUT)",
                        self.cfg.heartbeat_timeout,
                    )
                    self.exit_code = 1
                else:
                    self.takeover.end_recovery()
            return
        if self.failed_start is not None:
            if now - self.started > self.cfg.connect_timeout:
                self.exit_code = 1  # the rest never came to be told
            return
        if not self.nodes:
            if self.registration.pending and now - self.started > self.cfg.connect_timeout:
                counts = {
                    r: sum(1 for p in self.registration.pending if p.role == r)
                    for r in ("server", "worker")
                }
                text = (
                    f"only {counts['server']} of {self.cfg.num_server} servers and "
                    f"{counts['worker']} of {self.cfg.num_worker} workers registered within "
                    f"{self.cfg.connect_timeout:.0f} s (HETPS_CONNECT_TIMEOUT): start the missing "
                    "nodes or fix DMLC_NUM_SERVER/DMLC_NUM_WORKER"
                )
                log.error("scheduler: %s", text)
                for p in self.registration.pending:
                    self.send_to(
                        p.origin, Message(P.REFUSED, req=p.req, reply=True, body={"error": text})
                    )
                self.exit_code = 1
            return
        if self.cfg.heartbeat_interval <= 0:
            return
        since = now - self.cfg.heartbeat_timeout  # (one comparison per node: 4,224 a tick)
        for nid in [nid for nid, seen in self.last_seen.items() if seen < since]:
            if nid not in self.dead and nid not in self.finished:
                seen = self.last_seen.get(nid, since)  # (one declared dead may take others)
                self.launcher.declare_silent(
                    nid,
                    f"stopped answering heartbeats for {now - seen:.1f} s "
                    f"(PS_HEARTBEAT_TIMEOUT={self.cfg.heartbeat_timeout:g})",
                )

    def _apply_notice(self, role: str, rank: int, how: str) -> None:
        nid = next((i for i, n in self.nodes.items() if n.role == role and n.rank == rank), None)
        if nid is not None:
            if nid not in self.finished:
                self.declare_dead(nid, f"{how} (seen by the launcher)")
            return
        if self.nodes:  # every node registered, none with that rank: nothing to do
            log.warning("scheduler: the launcher reports %s %d, which is no node here", role, rank)
            return
        # it died before the cluster was complete: the others would wait for it in vain
        text = f"{role} {rank} {how} before it registered (seen by the launcher)"
        log.error("scheduler: %s", text)
        for p in self.registration.pending:
            self.send_to(p.origin, Message(P.REFUSED, req=p.req, reply=True, body={"error": text}))
        self._dead_before_start += 1
        if self.failed_start is None:
            self.failed_start = text
            self._late_refused = len(self.registration.pending)
            self.registration.pending = []
        self._end_failed_start()

    def refused_late(self) -> None:
        """A node that came after a failed start was told why (:attr:`failed_start`)."""
        self._late_refused += 1
        self._end_failed_start()

    def _end_failed_start(self) -> None:
        """A failed start ends once every node that was to come has been told (or died);
        until then the scheduler stays up to refuse the late ones (and at most
        HETPS_CONNECT_TIMEOUT, as any start)."""
        if self._late_refused + self._dead_before_start >= self.expected:
            self.exit_code = 1

    def declare_dead(self, nid: int, reason: str) -> None:
        if nid in self.dead or nid not in self.nodes:
            return
        info = self.nodes[nid]
        if self.takeover.fail_over(nid, reason):
            return
        reason, gone = self.workers_part.let_go(nid, reason)
        if gone:
            return
        text = f"{info.describe()} {reason}; the job cannot continue"
        self.dead[nid] = text
        log.error("scheduler: %s", text)
        if self.exit_code is None:
            self.launcher.name_cause(nid, text)
        for other in self.nodes:
            if other not in self.dead:
                self.send_to(
                    other, Message(P.NODE_DEAD, body={"node": info.to_wire(), "error": text})
                )
        self.exit_code = 1
