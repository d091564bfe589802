"""The scheduler's registration part: nodes register (``add_node``), are refused with a
reason (over a connection of their own), and once every expected node did, get their ranks,
the node table and the routing ids of each peer pair (``assign``). Nodes that come back
(a server admitted again, a let-go worker that joins) go to the other parts."""

from __future__ import annotations

import logging
import re
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from hetps.cluster import protocol as P
from hetps.cluster.enrol import (
    ROUTE_BYTES,
    pack_groups,
    pair_cipher,
    pair_rows,
    server_fields,
    worker_fields,
)
from hetps.cluster.ports import JobPort
from hetps.cluster.protocol import NodeInfo
from hetps.transport.codec import Message
from hetps.transport.links import PeerLinks
from hetps.transport.van import PeerGone

log = logging.getLogger("hetps.scheduler")
#: what a node may give as its address: a host name or an IPv4/IPv6 address, nothing else
_HOST = re.compile(r"[A-Za-z0-9._:%\[\]-]+")

#: refusals (each opens a connection back to the host:port a registration names, which
#: nothing proves): a burst of this many, then :data:`REFUSALS_PER_S` a second; beyond,
#: dropped unanswered (so the scheduler never becomes a tool to connect anywhere at will)
REFUSAL_BURST = 8
REFUSALS_PER_S = 2.0
#: one host:port is answered once in this many seconds at most (a late node asks once)
REFUSAL_REPEAT_S = 10.0


@dataclass
class Pending:
    origin: bytes  # routing id of the connection the registration came on
    role: str
    host: str
    port: int
    req: int
    want_rank: int = -1
    group: int = -1  # a worker's host group (HETPS_HOST_GROUP)


class Registration:
    """Registration and ranks (a part of :class:`~hetps.cluster.scheduler.Scheduler`)."""

    def __init__(self, sched: JobPort, links: PeerLinks) -> None:
        self.sched = sched
        self.links = links  # the scheduler's connections to the nodes
        self.pending: list[Pending] = []
        # what the pending registrations hold, for O(1) checks of each new one (a walk of
        # them per registration was O(N^2) a start): their connections, the count per role
        # and the ranks claimed; read again when ``pending`` was changed from outside
        self._origins: set[bytes] = set()
        self._per_role: dict[str, int] = {}
        self._claims: dict[tuple[str, int], Pending] = {}
        self._seen: tuple[int, int] = (0, 0)
        self.tokens = float(REFUSAL_BURST)  # refusals that may be answered now
        self.filled = time.monotonic()
        self.answered: dict[tuple[str, int], float] = {}  # host:port -> when refused last
        self.pair_key = secrets.token_bytes(32)  # derives the routing id of each peer pair
        # AES-256 of one block per pair (a pseudo-random function of the pair): every pair of
        # a big cluster in one call (N^2 HMACs took seconds at 4,096 nodes); a pair of a
        # server and a worker under the server's own key (server_key), which its first table
        # carries instead of an id per worker
        self._prf = pair_cipher(self.pair_key)

    def add_node(self, msg: Message) -> None:
        b = msg.typed  # an AddNode: every field's type and bound checked by the dispatch
        role, host, port, back = b.role, b.host, b.port, b.back
        if not _HOST.fullmatch(host) or back[0] == 0:  # (a host is logged and written out)
            self.sched.refused_msgs.refused(
                "scheduler: refused a malformed registration %r", msg.body
            )
            return
        origin = msg.origin
        self._index()
        if origin in self._origins:
            self.sched.refused_msgs.refused(
                "scheduler: refused a second registration on one connection"
            )
            return
        want = b.want_rank
        limit = self.sched.cfg.num_server if role == "server" else self.sched.cfg.num_worker
        refusal = None
        if self.sched.recovering:
            self.refuse(
                origin, host, port, back, msg.req,
                "the scheduler was started again and is taking back the running job's nodes; "
                "a new node can join once it did",
            )  # fmt: skip
            return
        if self.sched.failed_start is not None:
            # a node died before the cluster was complete: every late one is told why
            self.refuse(origin, host, port, back, msg.req, self.sched.failed_start)
            self.sched.refused_late()
            return
        slot = self.sched.takeover.rejoin_slot(role, want) if self.sched.nodes else None
        if slot is not None:
            self.sched.takeover.readmit(msg, slot, host, port, back)
            return
        slot = self.sched.workers_part.join_slot(role, want) if self.sched.nodes else None
        if slot is not None:
            self.sched.workers_part.admit_worker(msg, slot, host, port, back)
            return
        if self.sched.nodes or len(self.pending) >= self.sched.expected:
            refusal = (
                f"the cluster is already complete ({self.sched.cfg.num_server} "
                f"servers, {self.sched.cfg.num_worker} workers): check DMLC_NUM_SERVER/"
                "DMLC_NUM_WORKER and that no old job uses this scheduler port"
            )
        elif self._per_role.get(role, 0) >= limit:
            refusal = (
                f"too many {role}s: the scheduler expects {limit} "
                f"(DMLC_NUM_{role.upper()}={limit} on the scheduler)"
            )
        elif want >= limit:
            refusal = f"{role} rank {want} (HETPS_LAUNCH_RANK) is not below {limit}"
        elif want >= 0:
            rival = self._claims.get((role, want))
            if rival is not None:
                refusal = (
                    f"{role} rank {want} (HETPS_LAUNCH_RANK) is already claimed by "
                    f"{rival.host}:{rival.port}: a rank is given once; is another job using "
                    "this scheduler port?"
                )
                log.error("scheduler: a second claim of %s rank %d (%s:%s)", role, want, host, port)
        if refusal is not None:
            self.refuse(origin, host, port, back, msg.req, refusal)
            return
        try:
            self.links.connect(origin, f"{host}:{port}", routing_id=back)
        except PeerGone as exc:
            log.warning("scheduler: registration with a bad address: %s", exc)
            return
        group = b.host_group if role == "worker" else -1
        self.pending.append(Pending(origin, role, host, port, msg.req, want, group))
        self._add(self.pending[-1])
        self.sched.send_to(
            origin,
            Message(
                P.ADD_NODE,
                req=0,
                reply=True,
                body={"registered": len(self.pending), "expected": self.sched.expected},
            ),
        )
        if len(self.pending) == self.sched.expected:
            self.assign()

    def _add(self, p: Pending) -> None:
        self._origins.add(p.origin)
        self._per_role[p.role] = self._per_role.get(p.role, 0) + 1
        if p.want_rank >= 0:
            self._claims.setdefault((p.role, p.want_rank), p)
        self._seen = (id(self.pending), len(self.pending))

    def _index(self) -> None:
        """Read the pending registrations again if they changed from outside."""
        if self._seen != (id(self.pending), len(self.pending)):
            self._origins, self._per_role, self._claims = set(), {}, {}
            for p in self.pending:
                self._add(p)
            self._seen = (id(self.pending), len(self.pending))

    def refuse(self, origin: bytes, host: str, port: int, back: bytes, req: int, text: str):
        """Answer a registration with a refusal (over a connection of its own, closed after)."""
        now = time.monotonic()
        self.tokens = min(REFUSAL_BURST, self.tokens + (now - self.filled) * REFUSALS_PER_S)
        self.filled = now
        if len(self.answered) > 4 * REFUSAL_BURST:
            self.answered = {a: t for a, t in self.answered.items() if now - t < REFUSAL_REPEAT_S}
        last = self.answered.get((host, port))
        if self.tokens < 1 or (last is not None and now - last < REFUSAL_REPEAT_S):
            self.sched.refused_msgs.refused(
                "scheduler: dropped a registration from %s:%s unanswered (too many refusals): %s",
                host,
                port,
                text,
            )
            return
        self.tokens -= 1
        self.answered[(host, port)] = now
        log.warning("scheduler: refused a registration from %s:%s: %s", host, port, text)
        key = ("refusal", origin)
        try:
            self.links.connect(key, f"{host}:{port}", routing_id=back)
        except PeerGone as exc:
            log.warning("scheduler: registration with a bad address: %s", exc)
            return
        self.sched.send_to(key, Message(P.REFUSED, req=req, reply=True, body={"error": text}))
        self.links.disconnect(key, linger_ms=1000)  # let the refusal leave first

    def pair_id(self, src: int, dst: int) -> bytes:
        """The routing id node ``src`` connects to node ``dst`` with (known to both alone; a
        node admitted again gets new ones)."""
        return self.pair_ids([src], [dst])[0]

    def pair_ids(self, src: Sequence[int], dst: Sequence[int]) -> list[bytes]:
        """:meth:`pair_id` of every pair ``(src[k], dst[k])``, in one AES call."""
        raw = self.pair_block(src, dst).tobytes()
        return [raw[k : k + 16] for k in range(0, len(raw), 16)]

    def pairs_with(self, nid: int, others: Sequence[int]) -> tuple[list, list]:
        """``[[i, id], ...]`` of node ``nid``'s routing ids to each of ``others`` (``out``) and
        of theirs to it (``in``), in two AES calls (a node admitted again: every peer's)."""
        others = list(others)
        if not others:
            return [], []
        outs = self.pair_ids([nid] * len(others), others)
        ins = self.pair_ids(others, [nid] * len(others))
        pairs = [[list(p) for p in zip(others, ids, strict=True)] for ids in (outs, ins)]
        return pairs[0], pairs[1]

    def routes(self, src: np.ndarray, dst: np.ndarray) -> tuple[bytes, bytes]:
        """The routing ids of every pair ``(src[k], dst[k])`` as a node table carries them
        (:func:`~hetps.cluster.enrol.unpack_routes`): records of the peer ``dst[k]`` and the
        id, ``src[k]``'s to it (``out``) and its to ``src[k]`` (``in``), all in one buffer
        each (no Python object per pair: a million pairs at 4,096 workers)."""
        rec = np.empty((len(src), ROUTE_BYTES), dtype=np.uint8)
        rec[:, :4] = np.asarray(dst, dtype="<i4").view(np.uint8).reshape(-1, 4)
        rec[:, 4:] = self.pair_block(src, dst)
        out = rec.tobytes()
        rec[:, 4:] = self.pair_block(dst, src)
        return out, rec.tobytes()

    def server_key(self, server: int) -> bytes:
        """Server ``server``'s own key, which the ids of its pairs with workers come from: the
        blocks (2^32 - 1, server, its admissions, 0 and 1) under the scheduler's key (no pair's
        block starts so: a node id is below 2^31). It derives no other node's ids, and a
        server admitted again gets a new one."""
        again = self.sched.rejoined.get(server, 0)
        blocks = np.array([[0xFFFFFFFF, server, again, half] for half in (0, 1)], dtype="<u4")
        return self._prf.update(blocks.tobytes())

    def pair_block(self, src: Sequence[int], dst: Sequence[int]) -> np.ndarray:
        """The ids of :meth:`pair_ids` as rows of 16 bytes (:func:`~hetps.cluster.enrol.pair_rows`):
        those of a server and a worker under the server's key, the others under the
        scheduler's; one AES call per key."""
        again = self.sched.rejoined
        s, d = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
        s_again = np.array([again.get(int(i), 0) for i in s] if again else 0)
        d_again = np.array([again.get(int(i), 0) for i in d] if again else 0)
        s_srv, d_srv = (s >= 8) & (s % 2 == 0), (d >= 8) & (d % 2 == 0)
        owner = np.where(s_srv & ~d_srv, s, np.where(d_srv & ~s_srv, d, -1))
        order = np.argsort(owner, kind="stable")
        cuts = np.flatnonzero(np.diff(owner[order])) + 1
        ids = np.empty((len(s), 16), dtype=np.uint8)
        for rows in np.split(order, cuts) if len(s) else []:
            o = int(owner[rows[0]])
            prf = self._prf if o < 0 else pair_cipher(self.server_key(o))
            sa = s_again[rows] if s_again.ndim else 0
            da = d_again[rows] if d_again.ndim else 0
            if o >= 0:  # (a server's admissions are in its key: its side of the block is 0)
                sa, da = np.where(s[rows] == o, 0, sa), np.where(d[rows] == o, 0, da)
            ids[rows] = pair_rows(prf, s[rows], sa, d[rows], da)
        return ids

    def taken_back(self, nid: int) -> tuple[dict[str, Any], dict, dict]:
        """The node table of node ``nid`` taken back (a server admitted again after a
        failover, a worker that joins), as compact as a first one (:meth:`assign`): the
        servers' entries and the workers' as runs (a server's: their addresses and its new
        key, which it derives its ids with the workers from), the ids it cannot derive listed
        (with the servers, with workers admitted again). Also ``nid``'s ids to each peer it
        talks to and theirs to it (``out``, ``in``: what each is told of it)."""
        nodes = self.sched.nodes
        server = nodes[nid].role == "server"
        peers = [i for i, n in nodes.items() if i != nid and (server or n.role == "server")]
        out, into = self.pairs_with(nid, peers)
        listed = {i for i in peers if nodes[i].role == "server" or self.sched.rejoined.get(i)}
        body = {
            "nodes": msgpack.packb([n.to_wire() for n in nodes.values() if n.role == "server"]),
            "id": nid,
            "out": [p for p in out if p[0] in listed],
            "in": [p for p in into if p[0] in listed],
            **{k: v for k, v in self.table_fields().items() if k != "groups"},
            **self.sched.creds.issue(nid),
        }
        if server:
            body.update(server_fields(nodes), key=self.server_key(nid))
        else:
            body.update(worker_fields(nodes), me=nodes[nid].to_wire())
        return body, dict(out), dict(into)

    def table_fields(self) -> dict[str, Any]:
        """The fields of the job every node table carries beside its nodes, the first one
        and those of a node taken back (a server admitted again, a worker that joins):
        ``groups``, the workers' hosts (HETPS_HOST_GROUP) where their launchers said them,
        packed as int32 pairs (no list per worker for every node to decode); with live
        metrics, ``metrics_s`` and ``metrics_job``, the job's id (the lead worker writes it
        into its run.json, the one run directory the scheduler leaves the dashboard's last
        state in)."""
        fields: dict[str, Any] = {}
        pairs = [(i, n.group) for i, n in self.sched.nodes.items() if n.group >= 0]
        if pairs:
            fields["groups"] = pack_groups(pairs)
        if P.METRICS_REPORT in self.sched.services:  # live metrics are on: workers report
            fields["metrics_s"] = self.sched.cfg.metrics_interval
            fields["metrics_job"] = getattr(self.sched.metrics, "job", "")
        return fields

    def assign(self) -> None:
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
            self.sched.nodes[nid] = NodeInfo(nid, p.role, rank, p.host, p.port, p.group)
            self.links.rename(p.origin, nid)
            self.links.admit(p.origin, nid)
            self.sched.last_seen[nid] = time.monotonic()
            if self.sched.cfg.verbose >= 1:
                log.info(
                    "assign rank=%d to node role=%s, ip=%s, port=%d, is_recovery=0",
                    nid,
                    p.role,
                    p.host,
                    p.port,
                )
        # the table, encoded once (msgpack bytes in every answer: per answer a copy, not an
        # encoding of N entries), O(servers + hosts): the servers' entries, the number of
        # workers and their host groups by rank (each node makes their entries itself); a
        # worker's own entry beside it (a worker never connects to another), a server's
        # the workers' addresses (2 bytes a worker) and its own key, which it derives its
        # routing ids with every worker from, as the scheduler does (no id per worker)
        servers_only = msgpack.packb(
            [n.to_wire() for n in self.sched.nodes.values() if n.role == "server"]
        )
        shared = {k: v for k, v in self.table_fields().items() if k != "groups"}
        for_workers = shared | worker_fields(self.sched.nodes)
        for_servers = shared | server_fields(self.sched.nodes)
        by_role: dict[str, list[int]] = {"server": [], "worker": []}
        for i, n in self.sched.nodes.items():
            by_role[n.role].append(i)
        order = list(zip(self.pending, self.sched.nodes, strict=False))
        # workers talk to servers; with copies (HETPS_REPLICAS) servers to servers too (a
        # server's ids with workers: its key)
        peers_of = {
            nid: by_role["server"] if p.role == "worker" else
            [i for i in by_role["server"] if i != nid] if self.sched.replicas > 1 else []
            for p, nid in order
        }  # fmt: skip
        arrays = {id(v): np.asarray(v, dtype=np.int64) for v in peers_of.values()}
        counts = [len(peers_of[nid]) for _, nid in order]
        src = np.repeat(np.array([nid for _, nid in order], dtype=np.int64), counts)
        dst = np.concatenate([arrays[id(peers_of[nid])] for _, nid in order] or [src])
        outs, ins = self.routes(src, dst)
        at = 0
        for p, nid in order:
            peers = peers_of[nid]
            worker = p.role == "worker"
            body = {
                "nodes": servers_only,
                "id": nid,
                # routing ids to its peers, and theirs to it
                "out": outs[at * ROUTE_BYTES : (at + len(peers)) * ROUTE_BYTES],
                "in": ins[at * ROUTE_BYTES : (at + len(peers)) * ROUTE_BYTES],
                **self.sched.creds.issue(nid),  # what it proves who it is with (--recover)
            }
            at += len(peers)
            if worker:
                body.update(for_workers, me=self.sched.nodes[nid].to_wire())
            else:
                body.update(for_servers, key=self.server_key(nid))
            if self.sched.replicas > 1:
                body["replicas"] = self.sched.replicas
            if self.sched.elastic:
                body["elastic"] = self.sched.elastic
            self.sched.send_to(nid, Message(P.NODES, req=p.req, reply=True, body=body))
        self.pending.clear()
        self.sched.ready.set()
        if self.sched.cfg.verbose >= 1:
            log.info(
                "the %d servers and %d workers are up",
                self.sched.cfg.num_server,
                self.sched.cfg.num_worker,
            )
