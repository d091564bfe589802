"""A server's or worker's registration with the scheduler, a part of
:class:`hetps.cluster.node.Node`: ``add_node`` with the routing id the scheduler connects
back with, the scheduler's answers (progress, a refusal, the node table), the messages of
peers that learned of this node before it got the table, and the table itself: this node's
id, its peers, and the routing id of each direction of each connection to a peer."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from itertools import groupby
from typing import Any

import msgspec
import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from hetps.cluster import commands
from hetps.cluster import protocol as P
from hetps.cluster.commands import NodeTable, NodeWire
from hetps.cluster.errors import ClusterError
from hetps.cluster.ports import MemberPort
from hetps.cluster.protocol import NodeInfo
from hetps.transport.codec import Message
from hetps.transport.links import PeerLinks
from hetps.transport.van import PeerGone, new_routing_id

#: messages kept from connections not yet known while the node table is on its way
MAX_EARLY_MESSAGES = 4096
MAX_EARLY_BYTES = 1 << 30


#: a host-group pair on the wire: (node id, host group) as two little-endian int32
_GROUP_PAIR = np.dtype("<i4")


def pack_groups(pairs: list[tuple[int, int]]) -> bytes:
    """The workers' host groups as the node table carries them: ``(node id, group)`` pairs as
    little-endian int32 bytes, encoded once for every node (a list of N pairs cost each
    node's decode N Python lists: 2.3 ms a message at 4,096 workers)."""
    return np.asarray(pairs, dtype=_GROUP_PAIR).reshape(-1, 2).tobytes()


def unpack_groups(value: object) -> list[tuple[int, int]]:
    """Inverse of :func:`pack_groups`; a list of pairs (an older scheduler's form) is read as
    it is. Raises ValueError on anything else."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        if len(raw) % (2 * _GROUP_PAIR.itemsize):
            raise ValueError(f"host groups of {len(raw)} bytes are not whole (id, group) pairs")
        arr = np.frombuffer(raw, dtype=_GROUP_PAIR).reshape(-1, 2)
        return [(int(i), int(g)) for i, g in arr.tolist()]
    if isinstance(value, list):
        return [(int(i), int(g)) for i, g in value]
    raise ValueError(f"bad host groups {type(value).__name__}")


def worker_fields(nodes: dict[int, NodeInfo]) -> dict[str, Any]:
    """What a worker's node table carries instead of every worker's entry: ``n_workers``, how
    many there are, and ``group_runs``, their host groups in rank order as runs of
    ``(group, workers)`` int32 pairs (a host's workers have consecutive ranks under every
    launcher: a pair per host, not per worker)."""
    groups = [n.group for n in sorted(nodes.values(), key=lambda n: n.rank) if n.role == "worker"]
    runs = [(g, len(list(same))) for g, same in groupby(groups)]
    return {"n_workers": len(groups), "group_runs": pack_groups(runs)}


def server_fields(nodes: dict[int, NodeInfo]) -> dict[str, Any]:
    """A server's node table instead of every worker's entry: :func:`worker_fields` and each
    worker's address, which a server connects to: ``hosts``, the distinct host names,
    ``host_runs``, ``(host index, workers)`` int32 pairs in rank order, and ``ports``, one
    little-endian uint16 per worker in rank order (a port is the one thing a server needs per
    worker: 2 bytes)."""
    workers = sorted((n for n in nodes.values() if n.role == "worker"), key=lambda n: n.rank)
    hosts: dict[str, int] = {}
    index = [hosts.setdefault(n.host, len(hosts)) for n in workers]
    runs = [(h, len(list(same))) for h, same in groupby(index)]
    ports = np.asarray([n.port for n in workers], dtype="<u2").tobytes()
    return worker_fields(nodes) | {
        "hosts": list(hosts),
        "host_runs": pack_groups(runs),
        "ports": ports,
    }


def workers_of(table: NodeTable) -> list[NodeInfo]:
    """The workers' entries a worker's node table stands for (:func:`worker_fields`): rank,
    id and host group each, no address (a worker never connects to another). Raises
    ValueError when the runs do not add up to the count."""
    count = table.n_workers
    runs = unpack_groups(table.group_runs)
    if any(n < 1 for _, n in runs) or sum(n for _, n in runs) != count:
        raise ValueError(f"host-group runs that do not add up to {count} workers")
    by_rank = [g for g, n in runs for _ in range(n)]
    addrs = [("", 0)] * count
    if table.ports or table.route_key is not None:  # a server's: every worker's address
        ports = np.frombuffer(table.ports, dtype="<u2") if len(table.ports) == 2 * count else None
        runs = unpack_groups(table.host_runs)
        if ports is None or any(n < 1 for _, n in runs) or sum(n for _, n in runs) != count:
            raise ValueError(f"worker addresses that do not add up to {count} workers")
        if 0 in ports:
            raise ValueError("a worker's port 0 (ports are 1-65535)")
        if any(not 0 <= h < len(table.hosts) for h, _ in runs):
            raise ValueError(f"a worker's host index beyond the {len(table.hosts)} hosts")
        hosts = [table.hosts[h] for h, n in runs for _ in range(n)]
        addrs = list(zip(hosts, ports.tolist(), strict=True))
    return [
        NodeInfo(P.worker_id(r), "worker", r, h, p, g)
        for r, (g, (h, p)) in enumerate(zip(by_rank, addrs, strict=True))
    ]


def pair_cipher(key: bytes) -> Any:
    """The pseudo-random function routing ids come from: AES-256 under ``key``, one block per
    pair (every pair of a big cluster in one call)."""
    return Cipher(algorithms.AES(key), modes.ECB()).encryptor()


def pair_rows(prf: Any, src: Any, src_again: Any, dst: Any, dst_again: Any) -> np.ndarray:
    """The routing ids of the pairs ``(src[k], dst[k])`` as rows of 16 bytes: the block (src,
    its admissions, dst, its admissions) as four 32-bit numbers, encrypted by ``prf``
    (:func:`pair_cipher`); the id is ``h`` and 15 bytes of it."""
    blocks = np.empty((len(src), 4), dtype="<u4")
    blocks[:, 0], blocks[:, 1], blocks[:, 2], blocks[:, 3] = src, src_again, dst, dst_again
    out = np.frombuffer(prf.update(blocks.tobytes()), dtype=np.uint8).reshape(-1, 16)
    ids = np.empty((len(src), 16), dtype=np.uint8)
    ids[:, 0], ids[:, 1:] = ord("h"), out[:, :15]
    return ids


def derive_routes(key: bytes, me: int, peers: list[int]) -> tuple[dict, dict]:
    """A server's routing ids to the workers of its first table and theirs to it, derived
    from its own key (the scheduler's ``key``) as the scheduler derives them: (out, in)."""
    prf, mine = pair_cipher(key), np.full(len(peers), me)
    out = pair_rows(prf, mine, 0, peers, 0).tobytes()
    into = pair_rows(prf, peers, 0, mine, 0).tobytes()
    return (
        {p: out[16 * k : 16 * k + 16] for k, p in enumerate(peers)},
        {p: into[16 * k : 16 * k + 16] for k, p in enumerate(peers)},
    )


#: a routing-id record of a node table: the peer's id (int32, little-endian), then the id
ROUTE_BYTES = 20


def unpack_routes(value: object) -> dict[int, bytes]:
    """A node table's routing ids (``out``, ``in``) by peer: records of
    :data:`ROUTE_BYTES` (the scheduler's form), or ``[peer, id]`` pairs (a node taken back)."""
    if isinstance(value, bytes):
        if len(value) % ROUTE_BYTES:
            raise ValueError(f"routing ids of {len(value)} bytes are not whole records")
        return {
            int.from_bytes(value[k : k + 4], "little", signed=True): routing_id(
                value[k + 4 : k + ROUTE_BYTES]
            )
            for k in range(0, len(value), ROUTE_BYTES)
        }
    return {int(p): routing_id(t) for p, t in value}  # type: ignore[attr-defined]


def routing_id(value: object) -> bytes:
    """A routing id from the scheduler's table, checked (bytes, 1-255, not starting at 0)."""
    if not isinstance(value, bytes) or not 1 <= len(value) <= 255 or value[0] == 0:
        raise ValueError(f"bad routing id {value!r}")
    return value


class Enrolment:
    """The registration of ``node`` (see the module's text)."""

    def __init__(self, node: MemberPort, links: PeerLinks) -> None:
        self.node = node
        self.links = links  # the node's connections to its peers
        self._registered = threading.Event()
        self._reg_error: str | None = None
        self._reg_progress: dict | None = None
        self._early: list[Message] = []
        self._early_bytes = 0

    def register(self) -> None:
        """Register with the scheduler and wait for the node table.

        Raises :class:`ClusterError` when the scheduler cannot be reached or the cluster does
        not complete within ``HETPS_CONNECT_TIMEOUT``."""
        node = self.node
        # the scheduler connects back with a routing id only it learns: its messages are
        # the only ones that read as node 1
        back = new_routing_id()
        node.back_id = back
        self.links.admit(back, P.SCHEDULER_ID)
        self.links.connect(P.SCHEDULER_ID, f"{node.cfg.root_uri}:{node.cfg.root_port}", watch=True)
        watch = self.links.take_watch(P.SCHEDULER_ID)
        node.start_receiving()
        deadline = time.monotonic() + node.cfg.connect_timeout
        refused: str | None = None

        def give_up() -> str | None:
            # a refused handshake leaves no connection, so the registration could never leave
            nonlocal refused
            refused = refused or (watch.failure() if watch is not None else None)
            if refused is not None:
                return refused
            return "no connection" if time.monotonic() > deadline else None

        try:
            self.links.send(
                P.SCHEDULER_ID,
                Message(
                    P.ADD_NODE,
                    req=1,
                    body={
                        "role": node.role,
                        "host": node.cfg.node_host,
                        "port": self.links.port,
                        "back": back,
                        "want_rank": node.cfg.launch_rank,
                        "host_group": node.cfg.host_group if node.role == "worker" else -1,
                    },
                ),
                give_up=give_up,
            )
        except PeerGone:
            pass  # refused, or the deadline passed: said below
        try:
            while refused is None and not self._registered.wait(0.1):
                refused = watch.failure() if watch is not None else None
                if time.monotonic() > deadline:
                    break
        finally:
            if watch is not None:
                watch.close()
        if refused is not None:
            self.links.mark_dead(P.SCHEDULER_ID)  # nothing queued for it can ever leave
            node.close()
            have = "this node holds a cluster secret" if node.cfg.secret else "this node has none"
            raise ClusterError(
                f"the scheduler at {node.cfg.root_uri}:{node.cfg.root_port} refused the "
                f"connection: {refused}. Every role of a job needs the same cluster secret "
                f"({have}): set HETPS_SECRET_FILE to the job's secret file on every role "
                "(or run them all with `hetps launch`, which hands one to each)"
            )
        if not self._registered.is_set():
            node.close()
            if self._reg_progress is None:
                raise ClusterError(
                    f"could not reach the scheduler at {node.cfg.root_uri}:{node.cfg.root_port} "
                    f"within {node.cfg.connect_timeout:g} s (HETPS_CONNECT_TIMEOUT): is it running, "
                    "and are DMLC_PS_ROOT_URI and DMLC_PS_ROOT_PORT right?"
                )
            got = self._reg_progress
            raise ClusterError(
                f"the scheduler answered but the cluster did not complete within "
                f"{node.cfg.connect_timeout:g} s: {got.get('registered')} of {got.get('expected')} "
                "nodes registered; start the missing nodes or fix DMLC_NUM_SERVER/DMLC_NUM_WORKER"
            )
        if self._reg_error is not None:
            node.close()
            raise ClusterError(f"the scheduler refused this {node.role}: {self._reg_error}")

    def answer(self, msg: Message) -> None:
        """The scheduler's answer to ``add_node``: progress, a refusal or the node table
        (then the messages kept from peers that came before it are handled)."""
        node = self.node
        if msg.cmd == P.ADD_NODE:
            self._reg_progress = msg.body
        elif msg.cmd == P.REFUSED:
            self._reg_error = msg.error or "refused"
            self._registered.set()
        else:  # the node table (its type checked by the dispatch: commands.NodeTable)
            try:
                why = commands.decode(msg)  # (done by the dispatch: again, its refusal)
                if why is not None:
                    raise ValueError(why)
                self.take_table(msg.typed)
            except (KeyError, TypeError, ValueError) as exc:
                self._reg_error = f"the scheduler sent a malformed node table ({exc})"
                self._registered.set()
                return
            self._registered.set()
            early, self._early, self._early_bytes = self._early, [], 0
            for m in early:  # peers that learned of us before we did
                m.sender = self.links.node_of(m.origin)
                node.dispatch(m)

    def keep_early(self, msg: Message) -> bool:
        """Keep a message that came before the node table, within a bound."""
        if len(self._early) >= MAX_EARLY_MESSAGES or self._early_bytes > MAX_EARLY_BYTES:
            return False
        self._early.append(msg)
        self._early_bytes += msg.nbytes
        return True

    def take_table(self, table: NodeTable) -> None:
        """The scheduler's node table: this node's id, its peers, and the routing id of each
        direction of each connection to a peer."""
        node = self.node
        listed = table.nodes
        if isinstance(listed, bytes):  # (the scheduler encodes the table once for all)
            try:
                listed = msgspec.msgpack.decode(listed, type=list[NodeWire])
            except msgspec.DecodeError as exc:
                raise ValueError(f"unreadable node table: {exc}") from None
        # the workers' hosts (HETPS_HOST_GROUP), read into each entry as it is made
        groups = {i: g for i, g in unpack_groups(table.groups) if g >= 0}
        nodes = {n.id: n for n in (NodeInfo.from_wire(item, groups) for item in listed)}
        if table.n_workers is not None:  # the workers' entries made here (a worker's own
            mine = NodeInfo.from_wire(table.me) if table.me is not None else None  # beside)
            for n in workers_of(table):
                own = mine is not None and n.id == mine.id
                nodes[n.id] = replace(n, host=mine.host, port=mine.port) if own else n
        me = nodes[table.node_id]
        out, into = unpack_routes(table.out), unpack_routes(table.into)
        if table.route_key is not None:  # a server's: its ids with the workers derived here
            workers = [n.id for n in nodes.values() if n.role == "worker" and n.id not in out]
            more_out, more_in = derive_routes(table.route_key, me.id, workers)
            out.update(more_out)
            into.update(more_in)
        # Servers answer workers, workers talk to servers: connect before anything else is
        # handled, so no request can arrive from a peer we cannot answer.
        peer_role = "worker" if node.role == "server" else "server"
        replicas = table.replicas
        peers = [
            n
            for n in nodes.values()
            if n.role == peer_role
            or (replicas > 1 and node.role == "server" and n.role == "server" and n.id != me.id)
        ]
        down, redirect = set(table.down), dict(table.redirect)
        for n in peers:
            if n.id not in out or n.id not in into:
                raise ValueError(f"no routing ids for node {n.id}")
        for n in peers:
            if n.id in down:  # (admitted again, this node hears of dead servers too)
                self.links.mark_dead(n.id)
                continue
            self.links.admit(into[n.id], n.id)
            self.links.connect(n.id, f"{n.host}:{n.port}", routing_id=out[n.id], bulk=True)
        node.nodes, node.info = nodes, me
        node.down, node.redirect = down, redirect
        node.recovery = table.recovery == 1
        node.replicas = replicas
        node.elastic = table.elastic
        node.left = set(table.left)  # (a worker that joins again)
        if table.credential is not None and table.generation is not None:
            node.cred = {"cred": table.credential, "gen": table.generation}
        self.links.my_id = me.id
        if table.metrics_job is not None:  # (the live metrics' job id: hetps.metrics.reports)
            node.metrics_job = table.metrics_job
        if table.metrics_s is not None:  # the scheduler serves live metrics: report to it
            node.metrics_interval = table.metrics_s
