"""The scheduler's side of surviving deaths, as a part of
:class:`hetps.cluster.scheduler.Scheduler`. (docs/MODULES.md, "hetps.faults.takeover")"""

from __future__ import annotations

import logging
import time

from hetps.cluster import protocol as P
from hetps.cluster.enrol import unpack_groups
from hetps.cluster.ports import JobPort
from hetps.cluster.protocol import NodeInfo
from hetps.transport.codec import Message
from hetps.transport.links import PeerLinks
from hetps.transport.van import PeerGone

log = logging.getLogger("hetps.scheduler")


class Takeover:
    """Failover, rejoin and readmit (a part of Scheduler, whose tables it reads and changes)."""

    # -- a server admitted again (HETPS_REPLICAS) ---------------------------------------------

    def __init__(self, sched: JobPort, links: PeerLinks) -> None:
        self.sched = sched
        self.links = links  # the scheduler's connections to the nodes
        self.back: dict[int, int] = {}  # node id -> its readmit request (--recover)
        self.view: dict | None = None  # the job, once a node of it came back (--recover)
        # the node table the scheduler that died kept beside its key (--recover), and why
        # there is none: the job is taken back from it, never from what a node says
        self.saved: dict | None = None
        self.unsaved: str | None = None

    def rejoin_slot(self, role: str, want: int) -> int | None:
        """The id a late server registration takes: a dead server whose keys were taken over
        (the launcher's rank wish first). None: no such server (the registration is refused)."""
        if role != "server" or self.sched.replicas <= 1 or self.sched.exit_code is not None:
            return None
        taken = [nid for nid, _ in self.sched.failovers if nid in self.sched.dead]
        for nid in taken:
            if want < 0 or self.sched.nodes[nid].rank == want:
                return nid
        return None

    def redirects(self) -> dict[int, int]:
        """Each failed-over server -> the server that serves its keys now (chains followed)."""
        out: dict[int, int] = {}
        for dead, to in self.sched.failovers:
            for k, v in out.items():
                if v == dead:
                    out[k] = to
            out[dead] = to
        return out

    def readmit(self, msg: Message, nid: int, host: str, port: int, back: bytes) -> None:
        """A server that died and was taken over registers again (ps-lite's ``is_recovery``):
        it gets its old rank and id and new connections, holds no keys of its own (the server
        that took over keeps them) and is again the replica of those before it; every node
        connects to it, and the servers send it copies of what they serve."""
        info = self.take_back(
            msg, nid, host, port, back, "its keys stay where they were taken over"
        )
        if info is None:
            return
        live = [i for i in self.sched.nodes if i not in self.sched.dead and i != nid]
        redirects = self.redirects()
        body, mine, theirs = self.sched.registration.taken_back(nid)  # (its ids, the peers')
        body.update(
            replicas=self.sched.replicas,
            recovery=1,
            down=[i for i in self.sched.dead if self.sched.nodes[i].role == "server"],
            redirect=[[k, v] for k, v in redirects.items()],
            left=list(self.sched.left),  # (HETPS_ELASTIC) workers let go
        )
        if self.sched.elastic:
            body["elastic"] = self.sched.elastic
        self.sched.send_to(nid, Message(P.NODES, req=msg.req, reply=True, body=body))
        for other in live:
            if other in self.sched.finished:
                continue
            body = {"node": info.to_wire(), "out": theirs[other], "in": mine[other]}
            self.sched.send_to(other, Message(P.REJOIN, body=body))

    def take_back(
        self, msg: Message, nid: int, host: str, port: int, back: bytes, why: str
    ) -> NodeInfo | None:
        """A dead node registers again (is_recovery): connect back to it at its new address
        under its old id and rank, and count it alive. None: the address is bad."""
        self.sched.rejoined[nid] = self.sched.rejoined.get(nid, 0) + 1  # (new pair ids: pair_id)
        if not self._reconnect(msg.origin, nid, f"{host}:{port}", back, "registration"):
            self.sched.rejoined[nid] -= 1
            return None
        old = self.sched.nodes[nid]
        info = NodeInfo(nid, old.role, old.rank, host, port, old.group)
        self.sched.nodes[nid] = info
        del self.sched.dead[nid]
        self.sched.last_seen[nid] = time.monotonic()
        log.warning(
            "scheduler: assign rank=%d to node role=%s, ip=%s, port=%d, is_recovery=1 "
            "(%s rank %d again; %s)",
            nid,
            old.role,
            host,
            port,
            old.role,
            old.rank,
            why,
        )
        return info

    def _reconnect(self, origin: bytes, nid: int, address: str, back: bytes, what: str) -> bool:
        """Connect to node ``nid`` again at ``address``, under its old id; False (logged): the
        address is bad."""
        try:
            self.links.connect(origin, address, routing_id=back)
        except PeerGone as exc:
            log.warning("scheduler: %s with a bad address: %s", what, exc)
            return False
        self.links.disconnect(nid)
        self.links.rename(origin, nid)
        self.links.admit(origin, nid)
        return True

    # -- started again (--recover) -----------------------------------------------------------
    def readmit_node(self, msg: Message) -> None:
        """A node of the running job asks to be taken back. From a node this scheduler knows
        (it never died: the node only heard nothing for a while) it is answered at once."""
        if msg.sender in self.sched.nodes:
            self.sched.reply(msg)
            return
        if self.sched.recovering and msg.sender in self.back:  # the same node asks again
            self.back[msg.sender] = msg.req
            return
        b = msg.typed  # (a Readmit: every field's type and bound checked at decode)
        nid, role, rank, host, port, back = b.node_id, b.role, b.rank, b.host, b.port, b.back
        if not self.sched.recovering:
            # (a stranger could fill the log with these: one line at debug level)
            log.debug(
                "scheduler: dropped a readmit of node %r: this scheduler did not restart", nid
            )
            return
        saved = self.saved_view()
        try:
            told = {n[0] for n in b.view.nodes}
            if saved is None:
                raise LookupError(self.unsaved)
            table = saved["nodes"]
            me = table.get(nid)
            if me is None:
                raise LookupError(f"node {P.printable(nid, 32)} is no node of this job")
            if me.role != role or me.rank != rank:
                raise ValueError("its id, role and rank do not match the job's table")
        except LookupError as exc:
            self.sched.creds.refusals.refused("scheduler: refused a readmit: %s", exc.args[0])
            return
        except (KeyError, TypeError, ValueError) as exc:
            self.sched.creds.refusals.refused("scheduler: refused a malformed readmit: %s", exc)
            return
        # the node proves who it is with the credential it got when admitted, not by what
        # its message says; and an id that is back already stays with its connection
        why = self.sched.creds.check(me.id, b.generation, b.credential)
        if why is None and me.id in self.back and msg.sender != me.id:
            why = "that node is back already, on another connection"
        if why is None and told != set(table):
            # a node of the job (its credential is good) whose view is not the job's: it is
            # not taken back, and its view changes nothing
            extra, lacks = sorted(told - set(table)), sorted(set(table) - told)
            parts = [f"it lists node(s) {extra[:8]} the job does not have"] * bool(extra)
            parts += [f"it lacks node(s) {lacks[:8]}"] * bool(lacks)
            why = f"its node table is not the job's the scheduler kept ({'; '.join(parts)})"
        if why is not None:
            self.sched.creds.refusals.refused(
                "scheduler: refused a readmit as node %d (%s rank %s) from %s:%s: %s",
                me.id,
                P.printable(role, 64),
                P.printable(rank, 64),
                P.printable(host, 64),
                port,
                why,
            )
            return
        if self.view is None:
            self.view = {k: type(v)(v) for k, v in saved.items()}  # (a copy of each part)
        if b.view.barriers:
            for group, n in b.view.barriers.items():
                if group in self.sched.barriers.groups:
                    bar = self.sched.barriers.groups[group]
                    bar.reached[me.id] = max(n, bar.reached.get(me.id, 0))
            self.sched.barriers.changed()
        if not self._reconnect(msg.origin, me.id, f"{host}:{port}", back, "readmit"):
            return
        old = table.get(me.id)
        table[me.id] = NodeInfo(me.id, role, rank, host, port, old.group if old else -1)
        self.view["nodes"][me.id] = table[me.id]
        self.back[me.id] = msg.req
        if set(self.back) >= self.expected_back():
            self.end_recovery()

    def saved_view(self) -> dict | None:
        """The node table the scheduler that died kept (read once), or None (``unsaved``
        says why)."""
        if self.saved is None and self.unsaved is None:
            state, self.unsaved = self.sched.creds.saved_table()
            if state is not None:
                try:
                    # the workers' host groups, kept as (id, group) pairs beside the nodes
                    groups = {i: g for i, g in unpack_groups(state.get("groups", [])) if g >= 0}
                    nodes = {
                        n.id: n for n in (NodeInfo.from_wire(w, groups) for w in state["nodes"])
                    }
                    self.saved = {
                        "nodes": nodes,
                        "redirect": [(int(a), int(b)) for a, b in state.get("redirect", [])],
                    } | {
                        k: {int(i) for i in state.get(k, []) if int(i) in nodes}
                        for k in ("down", "done", "left")
                    }
                except (KeyError, TypeError, ValueError) as exc:
                    self.unsaved = f"the node table the scheduler kept is unreadable: {exc}"
            if self.unsaved is not None:
                log.error("scheduler: started again (--recover), but %s", self.unsaved)
        return self.saved

    def expected_back(self) -> set[int]:
        view = self.view or {"nodes": {}, "down": set(), "done": set()}
        return set(view["nodes"]) - view["down"] - view["done"]

    def end_recovery(self) -> None:
        """Every node that was to come back came (or the wait is over): the job goes on. The
        ones that did not come are dead from now on."""
        view = self.view
        assert view is not None
        self.sched.recovering = False
        self.sched.nodes = dict(sorted(view["nodes"].items()))
        now = time.monotonic()
        for nid in view["down"]:
            self.sched.dead[nid] = (
                f"{self.sched.nodes[nid].describe()} died before the scheduler restarted"
            )
        self.sched.failovers = list(view["redirect"])
        for nid in view["done"]:
            self.sched.finished[nid] = 0
        for nid in view["left"]:  # (HETPS_ELASTIC) let go: the job does not wait for them
            self.sched.left[nid] = f"{self.sched.nodes[nid].describe()} was let go"
        for nid in self.back:
            self.sched.last_seen[nid] = now
        missing = self.expected_back() - set(self.back)
        for nid, req in self.back.items():
            self.sched.send_to(
                nid, Message(P.READMIT, req=req, reply=True, body={"restarted": True})
            )
        log.warning(
            "scheduler: started again, it took back %d nodes of the running job%s",
            len(self.back),
            f"; {len(missing)} did not come back" if missing else "",
        )
        self.sched.ready.set()
        for nid in sorted(missing):
            self.sched.last_seen[nid] = now
            self.sched.launcher.declare_silent(nid, "did not come back to the restarted scheduler")

    def fail_over(self, nid: int, reason: str) -> bool:
        """A dead server whose keys live on (HETPS_REPLICAS): the next live server in rank
        order holds a copy of each of its keys and takes them over; every node is told, and
        the job goes on. False: nothing can take over (the job ends as without copies)."""
        info = self.sched.nodes[nid]
        if self.sched.replicas <= 1 or info.role != "server" or self.sched.exit_code is not None:
            return False
        servers = sorted(
            (n for n in self.sched.nodes.values() if n.role == "server"), key=lambda n: n.rank
        )
        dead_servers = sum(1 for n in servers if n.id in self.sched.dead) + 1
        if dead_servers >= self.sched.replicas:  # some key may have had every copy there
            return False
        i = next(j for j, n in enumerate(servers) if n.id == nid)
        heir = next(
            (n for n in servers[i + 1 :] + servers[:i] if n.id not in self.sched.dead), None
        )
        if heir is None:
            return False
        text = f"{info.describe()} {reason}; {heir.describe()} takes over its keys"
        self.sched.dead[nid] = text
        self.sched.last_seen.pop(nid, None)
        self.sched.failovers.append((nid, heir.id))
        log.warning("scheduler: %s", text)
        body = {"node": info.to_wire(), "error": text, "to": heir.id}
        for other in self.sched.nodes:
            if other not in self.sched.dead:
                self.sched.send_to(other, Message(P.FAILOVER, body=body))
        for group in ("server", "all"):  # barriers no longer wait for it
            self.sched.barriers.release(group)
        return True
