"""The scheduler's side of surviving deaths, as a part of
:class:`hetps.cluster.scheduler.Scheduler`.

* failover (HETPS_REPLICAS): a dead server whose keys live on is taken over by the next live
  server; every node hears ``failover`` and the job goes on;
* rejoin: a dead server registers again and is admitted with its old id (is_recovery), as a
  replica;
* readmit: a scheduler started again at the same address (``--recover``) takes back the
  running job's nodes, from what they say of it.

docs/FAULTS.md says what a user sees; docs/ARCHITECTURE.md how it fits.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from hetps.cluster import protocol as P
from hetps.cluster.protocol import NodeInfo
from hetps.transport.codec import Message
from hetps.transport.van import PeerGone

log = logging.getLogger("hetps.scheduler")


def _printable_text(value: object, limit: int = 64) -> str:
    """A peer's text for a log line: printable characters only, bounded."""
    text = value if isinstance(value, str) else repr(value)
    return "".join(c if c.isprintable() else "?" for c in text[:limit])


class Takeover:
    """Failover, rejoin and readmit (mixed into Scheduler, which holds what is used here)."""

    cfg: Any
    van: Any
    nodes: dict[int, NodeInfo]
    dead: dict[int, str]
    finished: dict[int, int]
    last_seen: dict[int, float]
    barriers: dict[str, Any]
    services: dict[str, Any]
    replicas: int
    failovers: list[tuple[int, int]]
    elastic: int
    left: dict[int, str]
    rejoined: dict[int, int]
    creds: Any  # Credentials
    recovering: bool
    exit_code: int | None
    ready: threading.Event
    _back: dict[int, int]
    _view: dict | None

    # -- a server admitted again (HETPS_REPLICAS) ---------------------------------------------
    def _rejoin_slot(self, role: str, want: int) -> int | None:
        """The id a late server registration takes: a dead server whose keys were taken over
        (the launcher's rank wish first). None: no such server (the registration is refused)."""
        if role != "server" or self.replicas <= 1 or self.exit_code is not None:
            return None
        taken = [nid for nid, _ in self.failovers if nid in self.dead]
        for nid in taken:
            if want < 0 or self.nodes[nid].rank == want:
                return nid
        return None

    def _redirects(self) -> dict[int, int]:
        """Each failed-over server -> the server that serves its keys now (chains followed)."""
        out: dict[int, int] = {}
        for dead, to in self.failovers:
            for k, v in out.items():
                if v == dead:
                    out[k] = to
            out[dead] = to
        return out

    def _readmit(self, msg: Message, nid: int, host: str, port: int, back: bytes) -> None:
        """A server that died and was taken over registers again (ps-lite's ``is_recovery``):
        it gets its old rank and id and new connections, holds no keys of its own (the server
        that took over keeps them) and is again the replica of those before it; every node
        connects to it, and the servers send it copies of what they serve."""
        info = self._take_back(
            msg, nid, host, port, back, "its keys stay where they were taken over"
        )
        if info is None:
            return
        live = [i for i in self.nodes if i not in self.dead and i != nid]
        redirects = self._redirects()
        body = {
            "nodes": [n.to_wire() for n in self.nodes.values()],
            "id": nid,
            "out": [[i, self._pair(nid, i)] for i in self.nodes if i != nid],
            "in": [[i, self._pair(i, nid)] for i in self.nodes if i != nid],
            "replicas": self.replicas,
            "recovery": 1,
            "down": [i for i in self.dead if self.nodes[i].role == "server"],
            "redirect": [[k, v] for k, v in redirects.items()],
            "left": list(self.left),  # (HETPS_ELASTIC) workers let go
            **self.creds.issue(nid),
        }
        if self.elastic:
            body["elastic"] = self.elastic
        if P.METRICS_REPORT in self.services:
            body["metrics_s"] = self.cfg.metrics_interval
        self._send(nid, Message(P.NODES, req=msg.req, reply=True, body=body))
        for other in live:
            if other in self.finished:
                continue
            self._send(
                other,
                Message(
                    P.REJOIN,
                    body={
                        "node": info.to_wire(),
                        "out": self._pair(other, nid),
                        "in": self._pair(nid, other),
                    },
                ),
            )

    def _take_back(
        self, msg: Message, nid: int, host: str, port: int, back: bytes, why: str
    ) -> NodeInfo | None:
        """A dead node registers again (is_recovery): connect back to it at its new address
        under its old id and rank, and count it alive. None: the address is bad."""
        origin = msg.origin
        self.rejoined[nid] = self.rejoined.get(nid, 0) + 1  # (new pair ids: _pair)
        try:
            self.van.connect(origin, f"{host}:{port}", routing_id=back)
        except PeerGone as exc:
            log.warning("scheduler: registration with a bad address: %s", exc)
            self.rejoined[nid] -= 1
            return None
        self.van.disconnect(nid)
        self.van.rename(origin, nid)
        self.van.admit(origin, nid)
        old = self.nodes[nid]
        info = NodeInfo(nid, old.role, old.rank, host, port)
        self.nodes[nid] = info
        del self.dead[nid]
        self.last_seen[nid] = time.monotonic()
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

    # -- started again (--recover) -----------------------------------------------------------
    def _readmit_node(self, msg: Message) -> None:
        """A node of the running job asks to be taken back. From a node this scheduler knows
        (it never died: the node only heard nothing for a while) it is answered at once."""
        if msg.sender in self.nodes:
            self.reply(msg)
            return
        if self.recovering and msg.sender in self._back:  # the same node asks again
            self._back[msg.sender] = msg.req
            return
        b = msg.body
        nid, role, rank = b.get("id"), b.get("role"), b.get("rank")
        host, port, back, view = b.get("host"), b.get("port"), b.get("back"), b.get("view")
        if not self.recovering:
            # (a stranger could fill the log with these: one line at debug level)
            log.debug(
                "scheduler: dropped a readmit of node %r: this scheduler did not restart", nid
            )
            return
        try:
            if not isinstance(view, dict):
                raise ValueError("no view of the job")
            table = {n.id: n for n in map(NodeInfo.from_wire, view["nodes"])}
            down = {int(i) for i in view.get("down", [])}
            redirect = [(int(a), int(c)) for a, c in view.get("redirect", [])]
            done = {int(i) for i in view.get("done", [])}
            me = table[int(nid)]
            if (
                me.role != role
                or me.rank != rank
                or not isinstance(host, str)
                or not isinstance(port, int)
                or isinstance(port, bool)
                or not isinstance(back, bytes)
                or not 0 < len(back) <= 255
            ):
                raise ValueError("its id, role and rank do not match its table")
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("scheduler: refused a malformed readmit: %s", exc)
            return
        # the node proves who it is with the credential it got when admitted, not by what
        # its message says; and an id that is back already stays with its connection
        why = self.creds.check(me.id, b.get("gen"), b.get("cred"))
        if why is None and me.id in self._back and msg.sender != me.id:
            why = "that node is back already, on another connection"
        if why is not None:
            self.creds.refusals.refused(
                "scheduler: refused a readmit as node %d (%s rank %s) from %s:%s: %s",
                me.id,
                _printable_text(role),
                _printable_text(rank),
                _printable_text(host),
                port,
                why,
            )
            return
        if self._view is None:
            self._view = {"nodes": table, "down": down, "redirect": redirect, "done": set()}
        elif set(self._view["nodes"]) != set(table):
            log.warning("scheduler: refused a readmit of node %d: another job's table", me.id)
            return
        self._view["done"] |= done
        self._view["down"] |= down
        passed = b.get("view", {}).get("barriers", {})
        if isinstance(passed, dict):
            for group, n in passed.items():
                if group in self.barriers and isinstance(n, int) and not isinstance(n, bool):
                    bar = self.barriers[group]
                    bar.reached[me.id] = max(n, bar.reached.get(me.id, 0))
        try:
            self.van.connect(msg.origin, f"{host}:{port}", routing_id=back)
        except PeerGone as exc:
            log.warning("scheduler: readmit with a bad address: %s", exc)
            return
        self.van.disconnect(me.id)
        self.van.rename(msg.origin, me.id)
        self.van.admit(msg.origin, me.id)
        table[me.id] = NodeInfo(me.id, role, rank, host, port)
        self._view["nodes"][me.id] = table[me.id]
        self._back[me.id] = msg.req
        if set(self._back) >= self._expected_back():
            self._end_recovery()

    def _expected_back(self) -> set[int]:
        view = self._view or {"nodes": {}, "down": set(), "done": set()}
        return set(view["nodes"]) - view["down"] - view["done"]

    def _end_recovery(self) -> None:
        """Every node that was to come back came (or the wait is over): the job goes on. The
        ones that did not come are dead from now on."""
        view = self._view
        assert view is not None
        self.recovering = False
        self.nodes = dict(sorted(view["nodes"].items()))
        now = time.monotonic()
        for nid in view["down"]:
            self.dead[nid] = f"{self.nodes[nid].describe()} died before the scheduler restarted"
        self.failovers = list(view["redirect"])
        for nid in view["done"]:
            self.finished[nid] = 0
        for nid in self._back:
            self.last_seen[nid] = now
        missing = self._expected_back() - set(self._back)
        for nid, req in self._back.items():
            self._send(nid, Message(P.READMIT, req=req, reply=True, body={"restarted": True}))
        log.warning(
            "scheduler: started again, it took back %d nodes of the running job%s",
            len(self._back),
            f"; {len(missing)} did not come back" if missing else "",
        )
        self.ready.set()
        for nid in sorted(missing):
            self.last_seen[nid] = now
            self._declare_silent(nid, "did not come back to the restarted scheduler")

    def _fail_over(self, nid: int, reason: str) -> bool:
        """A dead server whose keys live on (HETPS_REPLICAS): the next live server in rank
        order holds a copy of each of its keys and takes them over; every node is told, and
        the job goes on. False: nothing can take over (the job ends as without copies)."""
        info = self.nodes[nid]
        if self.replicas <= 1 or info.role != "server" or self.exit_code is not None:
            return False
        servers = sorted(
            (n for n in self.nodes.values() if n.role == "server"), key=lambda n: n.rank
        )
        dead_servers = sum(1 for n in servers if n.id in self.dead) + 1
        if dead_servers >= self.replicas:  # some key may have had every copy there
            return False
        i = next(j for j, n in enumerate(servers) if n.id == nid)
        heir = next((n for n in servers[i + 1 :] + servers[:i] if n.id not in self.dead), None)
        if heir is None:
            return False
        text = f"{info.describe()} {reason}; {heir.describe()} takes over its keys"
        self.dead[nid] = text
        self.last_seen.pop(nid, None)
        self.failovers.append((nid, heir.id))
        log.warning("scheduler: %s", text)
        body = {"node": info.to_wire(), "error": text, "to": heir.id}
        for other in self.nodes:
            if other not in self.dead:
                self._send(other, Message(P.FAILOVER, body=body))
        for group in ("server", "all"):  # barriers no longer wait for it
            self._maybe_release(group)
        return True
