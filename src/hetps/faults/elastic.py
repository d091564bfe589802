"""Elastic workers (HETPS_ELASTIC), the scheduler's side, as a part of
:class:`hetps.cluster.scheduler.Scheduler`. (docs/MODULES.md, "hetps.faults.elastic")"""

from __future__ import annotations

import logging

from hetps.cluster import protocol as P
from hetps.cluster.ports import JobPort
from hetps.cluster.protocol import NodeInfo
from hetps.transport.codec import Message

log = logging.getLogger("hetps.scheduler")


class ElasticWorkers:
    """Letting workers go and in (a part of Scheduler, whose tables it reads and changes)."""

    def __init__(self, sched: JobPort) -> None:
        self.sched = sched
        # a let-go worker started again that waits to join (its join request), and the live
        # workers that reached the round boundary where it may (their admit requests)
        self.joining: dict[int, int] = {}
        self.admitting: dict[int, Message] = {}
        self.entering: dict[int, dict[str, int]] = {}  # joiner -> the barriers it starts at

    def live_workers(self, but: int | None = None) -> list[int]:
        """Workers in the job's rounds now: not dead, finished, let go or joining."""
        return sorted(
            i
            for i, n in self.sched.nodes.items()
            if n.role == "worker"
            and i != but
            and i not in self.sched.dead
            and i not in self.sched.finished
            and i not in self.sched.left
        )

    # -- a dead worker is let go -------------------------------------------------------------
    def let_go(self, nid: int, reason: str) -> tuple[str, bool]:
        """A dead worker while at least HETPS_ELASTIC others remain: the job goes on without
        it (returns True). Every node hears ``worker_left``; servers finish the rounds it had
        not completed with the others, barriers and services stop waiting for it. Else the
        reason, with why the job cannot go on, and False."""
        info = self.sched.nodes[nid]
        if info.role != "worker" or not self.sched.elastic or nid in self.sched.finished:
            return reason, False
        text = f"{info.describe()} {reason}"
        joiner = nid in self.sched.left  # started again, it died before it joined: still let go
        live = self.live_workers(but=nid)
        if not joiner and len(live) < self.sched.elastic:
            reason += f"; {len(live)} workers would be left, fewer than HETPS_ELASTIC={self.sched.elastic}"
            return reason, False
        self.sched.dead[nid] = text
        self.sched.left[nid] = text
        self.sched.last_seen.pop(nid, None)
        if joiner:
            self.joining.pop(nid, None)
            self.entering.pop(nid, None)
            log.warning("scheduler: %s before it joined; the job goes on without it", text)
            # every node forgets it again (a server it entered already counts it)
            self.tell_left(info, text)
            self.maybe_admit()
            self.release_admits()
            return reason, True
        self.admitting.pop(nid, None)
        log.warning(
            "scheduler: %s; elastic: the job goes on with %d workers (HETPS_ELASTIC=%d)",
            text,
            len(live),
            self.sched.elastic,
        )
        self.tell_left(info, text)
        for group in ("worker", "all"):  # barriers no longer wait for it
            self.sched.barriers.release(group)
        self.sched.worker_finished_hooks()
        self.maybe_admit()  # it may have been the last one the boundary waited for
        self.sched.maybe_end()
        return reason, True

    def tell_left(self, info: NodeInfo, text: str) -> None:
        """``worker_left`` to every live node: the workers first (a worker that leads from now
        on should know before a server answers it a round without the dead one)."""
        body = {"node": info.to_wire(), "error": text, "workers": self.live_workers()}
        order = sorted(self.sched.nodes, key=lambda i: self.sched.nodes[i].role != "worker")
        for other in order:
            if other not in self.sched.dead and other not in self.sched.finished:
                self.sched.send_to(other, Message(P.WORKER_LEFT, body=body))

    def release_admits(self) -> None:
        """No worker waits to join or is entering (it died): the live workers waiting at
        their boundary go on."""
        if not self.joining and not self.entering and self.admitting:
            for m in self.admitting.values():
                self.sched.reply(m)
            self.admitting = {}

    # -- a let-go worker joins again -----------------------------------------------------------
    def join_slot(self, role: str, want: int) -> int | None:
        """The id a late worker registration takes: a dead worker that was let go (the
        launcher's rank wish first). None: no such worker (the registration is refused)."""
        if role != "worker" or not self.sched.elastic or self.sched.exit_code is not None:
            return None
        for nid in sorted(self.sched.left):
            if nid in self.sched.dead and (want < 0 or self.sched.nodes[nid].rank == want):
                return nid
        return None

    def admit_worker(self, msg: Message, nid: int, host: str, port: int, back: bytes) -> None:
        """A let-go worker registers again: it gets its old rank and id and new connections
        to the servers, and stays out of the rounds until it joined (``join``)."""
        info = self.sched.takeover.take_back(
            msg, nid, host, port, back, "it joins at the workers' next round boundary"
        )
        if info is None:
            return
        servers = [i for i, n in self.sched.nodes.items() if n.role == "server"]
        body, mine, theirs = self.sched.registration.taken_back(nid)  # (its ids, the servers')
        body.update(
            recovery=1,
            elastic=self.sched.elastic,
            left=[i for i in self.sched.left if i != nid],
            down=[i for i in servers if i in self.sched.dead],
            redirect=[[k, v] for k, v in self.sched.takeover.redirects().items()],
        )
        if self.sched.replicas > 1:
            body["replicas"] = self.sched.replicas
        self.sched.send_to(nid, Message(P.NODES, req=msg.req, reply=True, body=body))
        for s in servers:
            if s not in self.sched.dead:
                rejoin = {"node": info.to_wire(), "out": theirs[s], "in": mine[s]}
                self.sched.send_to(s, Message(P.REJOIN, body=rejoin))

    def join_step(self, msg: Message) -> None:
        """``join`` (a worker started again), ``admit`` (a live worker at its round
        boundary) and ``entered`` (the joiner, counted by every server now)."""
        nid, info = msg.sender, self.sched.nodes[msg.sender]
        if msg.cmd == P.JOIN:
            if nid not in self.sched.left or nid in self.sched.dead or nid in self.entering:
                self.sched.refuse_request(
                    msg, "join: only a worker that was let go and started again joins"
                )
                return
            self.joining[nid] = msg.req
            live = self.live_workers()
            log.warning(
                "scheduler: %s waits to join; the %d workers let it in at their next round "
                "boundary",
                info.describe(),
                len(live),
            )
            for w in live:
                self.sched.send_to(w, Message(P.WORKER_JOINING, body={"node": info.to_wire()}))
            self.maybe_admit()
        elif msg.cmd == P.ADMIT:
            if nid in self.sched.left or nid in self.sched.finished:
                self.sched.refuse_request(msg, "admit: only a worker in the job's rounds admits")
                return
            self.admitting[nid] = msg
            self.maybe_admit()
        else:
            barriers = self.entering.pop(nid, None)
            if barriers is None:
                self.sched.refuse_request(msg, "entered: no join of this worker is under way")
                return
            self.entered(msg, barriers)

    def maybe_admit(self) -> None:
        """Every live worker reached the boundary and a worker waits: give it the first live
        worker's state and the barrier counts it starts at; the live workers wait until it
        entered."""
        live = self.live_workers()
        if not self.joining or not live or not all(w in self.admitting for w in live):
            return
        # the state of the first live worker that gave one (each decides whether it leads
        # from its own view, which a death in the same round may not have reached yet)
        lead = next((self.admitting[w] for w in live if self.admitting[w].arrays), None)
        lead = lead if lead is not None else self.admitting[live[0]]
        state, rounds = lead.arrays[:1], lead.typed.rounds
        tables = lead.typed.tables  # the row-sparse keys' declarations
        barriers = {
            group: min(self.sched.barriers.groups[group].reached.get(w, 0) for w in live)
            for group in ("worker", "all")
        }
        for nid, req in self.joining.items():
            self.entering[nid] = barriers
            self.sched.send_to(
                nid,
                Message(
                    P.JOIN,
                    req=req,
                    reply=True,
                    body={"barriers": barriers, "rounds": rounds, "tables": tables},
                    arrays=state,
                ),
            )
        self.joining = {}

    def entered(self, msg: Message, barriers: dict[str, int]) -> None:
        """Every server counts the joiner: it is in. The services hear it first (their hooks
        are queued before any reply, so they run before a message of the next round), then
        the joiner, the other nodes (``worker_back``), and the live workers at their
        boundary go on."""
        nid, info = msg.sender, self.sched.nodes[msg.sender]
        for group, n in barriers.items():
            self.sched.barriers.groups[group].reached[nid] = n
        self.sched.barriers.changed()
        del self.sched.left[nid]
        self.sched.worker_back_hooks(info)
        self.sched.reply(msg)
        live = self.live_workers()
        log.warning(
            "scheduler: %s joined; the job goes on with %d workers", info.describe(), len(live)
        )
        body = {"node": info.to_wire(), "workers": live}
        for other in self.sched.nodes:
            if other != nid and other not in self.sched.dead and other not in self.sched.finished:
                self.sched.send_to(other, Message(P.WORKER_BACK, body=body))
        if not self.entering:  # every joiner is in: the live workers go on
            for m in self.admitting.values():
                self.sched.reply(m)
            self.admitting = {}

    def refuse_joiners(self, text: str) -> None:
        """The job is over: a worker that waits to join is told so."""
        for nid, req in self.joining.items():
            self.sched.send_to(nid, Message(P.JOIN, req=req, reply=True, body={"error": text}))
        self.joining = {}
