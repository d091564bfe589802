"""ESync's state server: answers each worker, after each local step, "ready or not"
(docs/ESYNC.md, "The state server")."""

from __future__ import annotations

import logging
import re
import threading
import time
from typing import Any

import msgspec

from hetps.cluster import commands
from hetps.cluster import protocol as P
from hetps.cluster.node import Node
from hetps.cluster.ports import JobPort
from hetps.cluster.protocol import NodeInfo
from hetps.cluster.requests import Future
from hetps.esync.policy import ReadinessPolicy
from hetps.transport.codec import Message
from hetps.transport.links import PeerLinks
from hetps.transport.van import PeerGone, Van, new_routing_id

log = logging.getLogger("hetps.state_server")

REPORT = P.ESYNC_REPORT
STANDALONE_ID = 3  # sender id of a standalone state server (not a ps-lite role id)
#: a standalone state server gives a worker's rank to another connection only after the one
#: that reported it was silent this long (a worker started again)
RANK_HOLD_S = 30.0
# the endpoints it answers: host:port or [ipv6]:port
_ENDPOINT = re.compile(r"[A-Za-z0-9.\-]+:\d{1,5}|\[[0-9A-Fa-f:.]+\]:\d{1,5}")


class EsyncService:
    """The state server's logic over messages: one policy, rounds advanced by reports."""

    def __init__(self, num_workers: int, margin_s: float = 0.0) -> None:
        self.policy = ReadinessPolicy(num_workers, margin_s=margin_s)
        # a scheduler started again (--recover) begins at the round the workers are in
        self.adopt = False
        self.started: set[int] = set()
        self.steps_total = [0] * num_workers  # local steps reported, all rounds (live metrics)

    def decide(self, rank: int, rnd: int, step_s: float, elapsed_s: float, now: float) -> dict:
        """Record one local step; returns ``{"ready": bool, "round": n, "steps": k}``."""
        if rank < 0 or rank >= self.policy.num_workers:
            raise ValueError(f"rank {rank} outside 0..{self.policy.num_workers - 1}")
        if rnd < 1:
            raise ValueError(f"worker {rank} reports round {rnd}: rounds start at 1")
        if self.adopt and rnd > self.policy.round:
            self.policy.skip_to(rnd - 1)
        self.adopt = False
        if rnd > self.policy.round + 1:
            raise ValueError(
                f"worker {rank} reports round {rnd}, but the state server is at round "
                f"{self.policy.round}: rounds advance one at a time"
            )
        if rnd > self.policy.round:
            self.policy.start_round(now - elapsed_s)
            self.started = set()
        elif rnd < self.policy.round:
            raise ValueError(
                f"worker {rank} reports round {rnd} but the state server is at {self.policy.round}"
            )
        if rank not in self.started:
            self.policy.mark_start(rank, now - elapsed_s)
            self.started.add(rank)
        self.steps_total[rank] += 1
        if self.policy.is_ready(rank):
            return {"ready": True, "round": rnd, "steps": self.policy.local_steps(rank)}
        ready = self.policy.report_step(rank, step_s, now)
        answer = {"ready": ready, "round": rnd, "steps": self.policy.local_steps(rank)}
        deadline = self.policy.deadline()
        if not ready and deadline is not None:
            # the worker may decide its next steps itself: ready once a step would end
            # after this (seconds from now, so clocks never have to agree)
            answer["deadline_in_s"] = deadline - self.policy.margin_s - now
        return answer

    def progress(self) -> dict:
        """The round, each worker's local steps in it and in all rounds (live metrics)."""
        policy = self.policy
        return {
            "round": policy.round,
            "steps": [
                policy.local_steps(w) if policy.round else 0 for w in range(policy.num_workers)
            ],
            "total": list(self.steps_total),
        }

    def handle(self, msg: Message) -> dict:
        """Decide on a report message; errors come back as ``{"error": text}``."""
        b = msg.typed  # (an EsyncReport: decoded and checked by the dispatch that took it)
        try:
            if b.rank is None:
                raise ValueError("no rank")
            return self.decide(b.rank, b.round, b.step_s, b.elapsed_s, time.monotonic())
        except (TypeError, ValueError, OverflowError) as exc:
            text = f"esync report refused: {str(exc)[:200]}"
            log.warning("state server: %s", text)
            return {"error": text}

    def forget(self, sched: JobPort) -> None:
        """The scheduler's hook when a worker ends: one that died and was let go
        (HETPS_ELASTIC) is left out of every later round's readiness."""
        for nid in list(getattr(sched, "left", {})):  # (the scheduler's thread changes it)
            node = sched.nodes.get(nid)
            if node is not None and 0 <= node.rank < self.policy.num_workers:
                self.policy.remove(node.rank)

    def count_again(self, sched: JobPort, node: NodeInfo) -> None:
        """The scheduler's hook when a let-go worker is back (it was started again and
        joined, HETPS_ELASTIC): it counts in readiness again from the next round on, which
        runs in lockstep (its step time is not known yet). ``node`` is its NodeInfo."""
        if node.role == "worker" and 0 <= node.rank < self.policy.num_workers:
            self.policy.add(node.rank)

    def as_scheduler_service(self):
        """A callable for ``Scheduler(services={REPORT: ...})``."""

        def service(sched: JobPort, msg: Message) -> None:
            node = sched.nodes.get(msg.sender)
            if node is None or node.role != "worker":
                sched.reply(msg, {"error": "esync reports come from workers"})
                return
            # the rank is the connection's: a worker reports only for itself
            msg.typed.rank = node.rank
            sched.reply(msg, self.handle(msg))

        return service


class _Where(msgspec.Struct):  # where a refused report says to answer (its other fields unread)
    endpoint: Any = msgspec.field(default=None, name="ep")
    back: Any = None


class StateServer:
    """A standalone state server on its own port (``hetps state-server``)."""

    def __init__(
        self,
        num_workers: int,
        host: str = "0.0.0.0",
        port: int = 0,
        margin_s: float = 0.0,
        secret: bytes | None = None,
    ):
        self.service = EsyncService(num_workers, margin_s)
        self.van = Van(
            host=host, port=port, max_message_bytes=1 << 20, name="state-server", secret=secret
        )
        self.van.my_id = STANDALONE_ID
        self._stop = threading.Event()
        self._peers: list[str] = []
        self._backs: dict[str, bytes | None] = {}
        # the reporter's rank is its connection's: the first connection to report a rank
        # holds it (a report's rank field is believed only then); another connection gets
        # the rank only once the holder was silent for RANK_HOLD_S (a worker started again)
        self._holder: dict[int, tuple[bytes, float]] = {}  # rank -> (connection, last seen)
        self._rank_of: dict[bytes, int] = {}  # connection -> its rank

    @property
    def port(self) -> int:
        """The bound port."""
        return self.van.port

    def serve(self, until: threading.Event | None = None) -> None:
        """Answer reports until stopped."""
        stop = until or self._stop
        try:
            while not stop.is_set():
                msg = self.van.recv(timeout=0.2)
                if msg is None or msg.cmd != REPORT:
                    continue
                # the one decode point here: the body as an EsyncReport, or why not
                why = commands.decode(msg)
                try:  # (refused: where it says to answer)
                    where = msg.typed if why is None else msgspec.convert(msg.body, _Where)
                except msgspec.ValidationError:  # (no map)
                    where = _Where()
                ep, back = where.endpoint, where.back  # (back: how it knows us)
                if not isinstance(ep, str) or not _ENDPOINT.fullmatch(ep):
                    log.warning("state server: report without a valid 'ep' (host:port) dropped")
                    continue
                if not (isinstance(back, bytes) and 0 < len(back) <= 255 and back[0] != 0):
                    back = None
                try:
                    if not self.van.has_peer(ep) or self._backs.get(ep) != back:
                        if ep not in self._backs and len(self._peers) >= 4096:  # bounded
                            old = self._peers.pop(0)
                            self._backs.pop(old, None)
                            self.van.disconnect(old)
                        self.van.connect(ep, ep, routing_id=back)
                        if ep not in self._backs:
                            self._peers.append(ep)
                        self._backs[ep] = back
                    if why is not None:
                        log.warning("state server: refused a report from %s: %s", ep, why)
                    why = why or self._bind_rank(msg)
                    answer = {"error": why} if why else self.service.handle(msg)
                    reply = Message(REPORT, req=msg.req, reply=True, body=answer)
                    self.van.send(ep, reply)
                except PeerGone as exc:
                    log.warning("state server: cannot answer %s: %s", ep, exc)
        finally:
            self.van.close()

    def _bind_rank(self, msg: Message) -> str | None:
        """Set the report's rank to its connection's; why it is refused (None: it is not)."""
        now = time.monotonic()
        origin = bytes(msg.origin or b"")
        rank = self._rank_of.get(origin)
        if rank is None:
            rank = msg.typed.rank
            if rank is None:
                return "esync report refused: no rank"
            if not 0 <= rank < self.service.policy.num_workers:
                return f"esync report refused: rank {rank} outside the job's workers"
            held = self._holder.get(rank)
            if held is not None and now - held[1] < RANK_HOLD_S:
                log.warning(
                    "state server: refused a report as worker %d from %s: another connection "
                    "reports as that worker",
                    rank,
                    msg.typed.endpoint,
                )
                return f"esync report refused: worker {rank} reports on another connection"
            if held is not None:
                self._rank_of.pop(held[0], None)
            self._rank_of[origin] = rank
        self._holder[rank] = (origin, now)
        msg.typed.rank = rank
        return None

    def stop(self) -> None:
        """End :meth:`serve`."""
        self._stop.set()


class StateClient:
    """A worker's link to the state server (the scheduler, or a standalone one)."""

    def __init__(self, node: Node, endpoint: str | None = None, timeout: float = 60.0) -> None:
        self.node = node
        self.timeout = timeout
        self.peer: Any = P.SCHEDULER_ID
        self._back: bytes | None = None
        if endpoint is not None:
            self.peer = "state-server"
            self.links.connect(self.peer, endpoint)
            # the state server answers over a connection of its own, with a routing id only
            # it learns (in each report): its answers read as STANDALONE_ID, nobody else's do
            self._back = new_routing_id()
            self.links.admit(self._back, STANDALONE_ID)

    @property
    def links(self) -> PeerLinks:
        """The worker node's connections (the port :attr:`Node.links` hands out)."""
        return self.node.links

    def report(self, rnd: int, step_s: float, elapsed_s: float) -> dict:
        """Report one local step; returns the state server's answer."""
        return self.report_nowait(rnd, step_s, elapsed_s).wait(self.timeout).body

    def report_nowait(self, rnd: int, step_s: float, elapsed_s: float) -> Future:
        """Report one local step without waiting; the future's result is the reply message."""
        body = {
            "rank": self.node.rank,
            "round": rnd,
            "step_s": step_s,
            "elapsed_s": elapsed_s,
            "ep": self.links.endpoint,
        }
        if self._back is not None:
            body["back"] = self._back
        fut: Future = self.node.requests.new(
            P.SCHEDULER_ID if self.peer == P.SCHEDULER_ID else STANDALONE_ID, "esync report"
        )
        msg = Message(REPORT, req=fut.req, body=body)
        if self.peer == P.SCHEDULER_ID:
            fut.sent = msg  # a scheduler started again (--recover) gets it again
        self.links.send(self.peer, msg)
        return fut
