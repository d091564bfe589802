"""Elastic workers (HETPS_ELASTIC), the scheduler's side, as a part of
:class:`hetps.cluster.scheduler.Scheduler`.

* let go: a dead worker leaves while at least HETPS_ELASTIC workers remain; every node hears
  ``worker_left`` and the job goes on;
* join: a let-go worker started again registers with its old rank (is_recovery) and waits
  (``join``). The live workers hear ``worker_joining``, agree on a round boundary and each
  ``admit`` there (the first live worker with the state to start from). The joiner gets that
  state, tells every server to count it (``enter``), says ``entered``, the services' hooks
  hear it (``on_worker_back``), and the live workers go on with it (``worker_back``).

docs/FAULTS.md says what a user sees; docs/ARCHITECTURE.md how it fits.
"""

from __future__ import annotations

import logging
from typing import Any

from hetps.cluster import protocol as P
from hetps.cluster.protocol import NodeInfo
from hetps.transport.codec import Message

log = logging.getLogger("hetps.scheduler")


class Elastic:
    """Letting workers go and in (mixed into Scheduler, which holds what is used here)."""

    cfg: Any
    van: Any
    nodes: dict[int, NodeInfo]
    dead: dict[int, str]
    finished: dict[int, int]
    last_seen: dict[int, float]
    barriers: dict[str, Any]
    services: dict[str, Any]
    replicas: int
    rejoined: dict[int, int]
    creds: Any  # Credentials
    elastic: int
    left: dict[int, str]
    joining: dict[int, int]
    admitting: dict[int, Message]
    entering: dict[int, dict[str, int]]
    exit_code: int | None
    _on_worker_finished: list
    _on_worker_back: list
    _service_q: Any

    def _live_workers(self, but: int | None = None) -> list[int]:
        """Workers in the job's rounds now: not dead, finished, let go or joining."""
        return sorted(
            i
            for i, n in self.nodes.items()
            if n.role == "worker"
            and i != but
            and i not in self.dead
            and i not in self.finished
            and i not in self.left
        )

    # -- a dead worker is let go -------------------------------------------------------------
    def _let_go(self, nid: int, reason: str) -> tuple[str, bool]:
        """A dead worker while at least HETPS_ELASTIC others remain: the job goes on without
        it (returns True). Every node hears ``worker_left``; servers finish the rounds it had
        not completed with the others, barriers and services stop waiting for it. Else the
        reason, with why the job cannot go on, and False."""
        info = self.nodes[nid]
        if info.role != "worker" or not self.elastic or nid in self.finished:
            return reason, False
        text = f"{info.describe()} {reason}"
        if nid in self.left:  # started again, it died before it joined: still let go
            self.dead[nid] = text
            self.left[nid] = text
            self.joining.pop(nid, None)
            self.entering.pop(nid, None)
            self.last_seen.pop(nid, None)
            log.warning("scheduler: %s before it joined; the job goes on without it", text)
            # every node forgets it again (a server it entered already counts it)
            self._tell_left(info, text)
            self._maybe_admit()
            self._release_admits()
            return reason, True
        live = self._live_workers(but=nid)
        if len(live) < self.elastic:
            reason += (
                f"; {len(live)} workers would be left, fewer than HETPS_ELASTIC={self.elastic}"
            )
            return reason, False
        self.dead[nid] = text
        self.left[nid] = text
        self.last_seen.pop(nid, None)
        self.admitting.pop(nid, None)
        log.warning(
            "scheduler: %s; elastic: the job goes on with %d workers (HETPS_ELASTIC=%d)",
            text,
            len(live),
            self.elastic,
        )
        self._tell_left(info, text)
        for group in ("worker", "all"):  # barriers no longer wait for it
            self._maybe_release(group)
        for hook in self._on_worker_finished:
            self._service_q.put(lambda hook=hook: hook(self))
        self._maybe_admit()  # it may have been the last one the boundary waited for
        self._maybe_end()
        return reason, True

    def _tell_left(self, info: NodeInfo, text: str) -> None:
        """``worker_left`` to every live node: the workers first (a worker that leads from now
        on should know before a server answers it a round without the dead one)."""
        body = {"node": info.to_wire(), "error": text, "workers": self._live_workers()}
        order = sorted(self.nodes, key=lambda i: self.nodes[i].role != "worker")
        for other in order:
            if other not in self.dead and other not in self.finished:
                self._send(other, Message(P.WORKER_LEFT, body=body))

    def _release_admits(self) -> None:
        """No worker waits to join or is entering (it died): the live workers waiting at
        their boundary go on."""
        if not self.joining and not self.entering and self.admitting:
            for m in self.admitting.values():
                self.reply(m)
            self.admitting = {}

    # -- a let-go worker joins again -----------------------------------------------------------
    def _join_slot(self, role: str, want: int) -> int | None:
        """The id a late worker registration takes: a dead worker that was let go (the
        launcher's rank wish first). None: no such worker (the registration is refused)."""
        if role != "worker" or not self.elastic or self.exit_code is not None:
            return None
        for nid in sorted(self.left):
            if nid in self.dead and (want < 0 or self.nodes[nid].rank == want):
                return nid
        return None

    def _admit_worker(self, msg: Message, nid: int, host: str, port: int, back: bytes) -> None:
        """A let-go worker registers again: it gets its old rank and id and new connections
        to the servers, and stays out of the rounds until it joined (``join``)."""
        info = self._take_back(
            msg, nid, host, port, back, "it joins at the workers' next round boundary"
        )
        if info is None:
            return
        servers = [i for i, n in self.nodes.items() if n.role == "server"]
        body = {
            "nodes": [n.to_wire() for n in self.nodes.values()],
            "id": nid,
            "out": [[i, self._pair(nid, i)] for i in servers],
            "in": [[i, self._pair(i, nid)] for i in servers],
            "recovery": 1,
            "elastic": self.elastic,
            "left": [i for i in self.left if i != nid],
            "down": [i for i in servers if i in self.dead],
            "redirect": [[k, v] for k, v in self._redirects().items()],
            **self.creds.issue(nid),
        }
        if self.replicas > 1:
            body["replicas"] = self.replicas
        if P.METRICS_REPORT in self.services:
            body["metrics_s"] = self.cfg.metrics_interval
        self._send(nid, Message(P.NODES, req=msg.req, reply=True, body=body))
        for s in servers:
            if s not in self.dead:
                rejoin = {
                    "node": info.to_wire(),
                    "out": self._pair(s, nid),
                    "in": self._pair(nid, s),
                }
                self._send(s, Message(P.REJOIN, body=rejoin))

    def _join_step(self, msg: Message) -> None:
        """``join`` (a worker started again), ``admit`` (a live worker at its round
        boundary) and ``entered`` (the joiner, counted by every server now)."""
        nid, info = msg.sender, self.nodes[msg.sender]
        if msg.cmd == P.JOIN:
            if nid not in self.left or nid in self.dead or nid in self.entering:
                self._refuse_request(
                    msg, "join: only a worker that was let go and started again joins"
                )
                return
            self.joining[nid] = msg.req
            live = self._live_workers()
            log.warning(
                "scheduler: %s waits to join; the %d workers let it in at their next round "
                "boundary",
                info.describe(),
                len(live),
            )
            for w in live:
                self._send(w, Message(P.WORKER_JOINING, body={"node": info.to_wire()}))
            self._maybe_admit()
        elif msg.cmd == P.ADMIT:
            if nid in self.left or nid in self.finished:
                self._refuse_request(msg, "admit: only a worker in the job's rounds admits")
                return
            self.admitting[nid] = msg
            self._maybe_admit()
        else:
            barriers = self.entering.pop(nid, None)
            if barriers is None:
                self._refuse_request(msg, "entered: no join of this worker is under way")
                return
            self._entered(msg, barriers)

    def _maybe_admit(self) -> None:
        """Every live worker reached the boundary and a worker waits: give it the first live
        worker's state and the barrier counts it starts at; the live workers wait until it
        entered."""
        live = self._live_workers()
        if not self.joining or not live or not all(w in self.admitting for w in live):
            return
        # the state of the first live worker that gave one (each decides whether it leads
        # from its own view, which a death in the same round may not have reached yet)
        lead = next((self.admitting[w] for w in live if self.admitting[w].arrays), None)
        lead = lead if lead is not None else self.admitting[live[0]]
        state, rounds = lead.arrays[:1], lead.body.get("rounds", [])
        tables = lead.body.get("tables", [])  # the row-sparse keys' declarations
        barriers = {
            group: min(self.barriers[group].reached.get(w, 0) for w in live)
            for group in ("worker", "all")
        }
        for nid, req in self.joining.items():
            self.entering[nid] = barriers
            self._send(
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

    def _entered(self, msg: Message, barriers: dict[str, int]) -> None:
        """Every server counts the joiner: it is in. The services hear it first (their hooks
        are queued before any reply, so they run before a message of the next round), then
        the joiner, the other nodes (``worker_back``), and the live workers at their
        boundary go on."""
        nid, info = msg.sender, self.nodes[msg.sender]
        for group, n in barriers.items():
            self.barriers[group].reached[nid] = n
        del self.left[nid]
        for hook in self._on_worker_back:
            self._service_q.put(lambda hook=hook: hook(self, info))
        self.reply(msg)
        live = self._live_workers()
        log.warning(
            "scheduler: %s joined; the job goes on with %d workers", info.describe(), len(live)
        )
        body = {"node": info.to_wire(), "workers": live}
        for other in self.nodes:
            if other != nid and other not in self.dead and other not in self.finished:
                self._send(other, Message(P.WORKER_BACK, body=body))
        if not self.entering:  # every joiner is in: the live workers go on
            for m in self.admitting.values():
                self.reply(m)
            self.admitting = {}

    def _refuse_joiners(self, text: str) -> None:
        """The job is over: a worker that waits to join is told so."""
        for nid, req in self.joining.items():
            self._send(nid, Message(P.JOIN, req=req, reply=True, body={"error": text}))
        self.joining = {}
