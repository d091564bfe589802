"""The wire protocol: every command name and role (each command's body, senders and answer are
declared in :mod:`hetps.cluster.bodies` and :mod:`hetps.cluster.commands`).

Node ids follow ps-lite: the scheduler is 1, server rank r is ``8 + 2r``, worker rank r is
``9 + 2r``. Group ids for barriers: ``worker``, ``server``, ``all``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hetps.cluster.errors import BadRequest

SCHEDULER_ID = 1

# -- roles (who may send what: hetps.cluster.allow) ----------------------------------------
SCHEDULER = "scheduler"
SERVER = "server"
WORKER = "worker"
NEWCOMER = "newcomer"  # a connection that belongs to no registered node

# -- control plane: node -> scheduler ------------------------------------------------------
ADD_NODE = "add_node"  # role, host, port, token, want_rank
BARRIER = "barrier"  # group
HEARTBEAT = "heartbeat"
FINISH = "finish"
LEAVE = "leave"  # reason: a node is going away because it failed
# id, role, rank, host, port, back, view: a node of a running job asks a scheduler started
# again at the same address (hetps scheduler --recover) to take it back
READMIT = "readmit"
# -- control plane: scheduler -> node ------------------------------------------------------
NODES = "nodes"  # nodes (NodeInfo.to_wire each), id: the node table, once the cluster is up
BARRIER_DONE = "barrier_done"
HEARTBEAT_ACK = "heartbeat_ack"
NODE_DEAD = "node_dead"  # node, error
# node, error, to: a server died and its keys live on (HETPS_REPLICAS): requests that were
# going to it go to ``to`` (the next live server), which holds a copy of each of its keys
FAILOVER = "failover"
# node, out, in: a dead server that was taken over is back (is_recovery): connect to it with
# routing id ``out``, admit its connection ``in``; it is a replica again, primary of nothing
REJOIN = "rejoin"
EXIT = "exit"
WORKER_DONE = "worker_done"  # to servers: node, a worker finished its job
# node, error, workers: a worker died and the job goes on without it (HETPS_ELASTIC): servers
# drop what it pushed into rounds not yet complete and finish them with the others
WORKER_LEFT = "worker_left"
# node: a let-go worker was started again and waits to join (live workers then agree on a round
# boundary: admit); node, workers: it joined, and counts in every round from now on
WORKER_JOINING = "worker_joining"
WORKER_BACK = "worker_back"
REFUSED = "refused"  # error

GROUPS = ("worker", "server", "all")

# -- joining a running job (HETPS_ELASTIC) ---------------------------------------------------
JOIN = "join"  # a worker started again -> scheduler: let me in; answer: state, barriers
ADMIT = "admit"  # a live worker at a round boundary -> scheduler (the first: array 0, state)
ENTER = "enter"  # the joiner -> each server: count me in rounds from now on
ENTERED = "entered"  # the joiner -> scheduler: every server counts me

# -- scheduler services (plug-ins) ---------------------------------------------------------
ESYNC_REPORT = "esync_report"  # worker -> ESync state server: ready for the round?
BALANCE_REPORT = "balance_report"  # worker -> load planner: measurements; answer: the plan
METRICS_REPORT = "metrics_report"  # worker -> live metrics (HETPS_METRICS_PORT): its counters

# -- data plane: worker <-> server ---------------------------------------------------------
INIT = "init"
PUSH = "push"
PULL = "pull"
SET_OPTIMIZER = "set_optimizer"
GET_STATES = "get_states"
SET_STATES = "set_states"
FORECAST = "forecast"  # tag: announces the next data message (link measurement)
PROBE = "probe"  # a probe payload for links that carry no data
DROP = "drop"  # slices: forget slices that moved to another server
RECEIPT = "receipt"  # req: a server got a push (credit for the worker's push window)
BATCH = "batch"  # items: several small requests (or their answers) in one message
# row-sparse keys (embedding tables, tables/worker.py and tables/server.py)
SINIT = "sinit"  # declare a table's part on a server (and write rows of its first value)
SPUSH = "spush"  # a round's row-sparse gradient: distinct sorted row ids, their rows
SPULL = "spull"  # read rows by id
SDUMP = "sdump"  # a checkpoint reads a table's part: its used rows, their state (in chunks)
SLOAD = "sload"  # a restore writes a table's part back (in chunks)
SPARSE_COMMANDS = frozenset({SINIT, SPUSH, SPULL, SDUMP, SLOAD})
# -- data plane: server -> server (HETPS_REPLICAS) -----------------------------------------
# op ("init": a chunk of a key's first value; "round": a dist_sync round's merged pushes),
# then the fields of that op: a primary's copy to a replica
REPLICATE = "replicate"

#: the commands a batch may carry (requests from a worker; answers from a server)
BATCH_COMMANDS = frozenset({INIT, PUSH, PULL, SPUSH, SPULL})
#: at most this many items in one batch
MAX_BATCH_ITEMS = 1024


def printable(value: object, limit: int = 2000) -> str:
    """A peer's text for a log line or an answer: printable characters only, bounded."""
    text = value if isinstance(value, str) else repr(value)
    return "".join(c if c.isprintable() else "?" for c in text[:limit])


def server_id(rank: int) -> int:
    """ps-lite id of server ``rank``."""
    return 8 + 2 * rank


def worker_id(rank: int) -> int:
    """ps-lite id of worker ``rank``."""
    return 9 + 2 * rank


def role_of(node_id: int) -> str:
    """Role of a ps-lite node id."""
    if node_id == SCHEDULER_ID:
        return "scheduler"
    return "server" if node_id % 2 == 0 else "worker"


def rank_of(node_id: int) -> int:
    """Rank of a server or worker id."""
    return (node_id - 8) // 2


@dataclass(frozen=True)
class NodeInfo:
    """A registered node as every member of the cluster knows it."""

    id: int
    role: str
    rank: int
    host: str
    port: int
    group: int = -1  # a worker's host group (HETPS_HOST_GROUP); -1: not known

    def describe(self) -> str:
        """Human description: ``worker rank 1 (node 11, 127.0.0.1:4242)``."""
        if self.role == "scheduler":
            return f"scheduler (node 1, {self.host}:{self.port})"
        where = f", {self.host}:{self.port}" if self.host else ""  # (a worker's view of another)
        return f"{self.role} rank {self.rank} (node {self.id}{where})"

    def to_wire(self) -> list:
        """Compact msgpack-able form (the host group travels beside it: the node table's
        ``groups``)."""
        return [self.id, self.role, self.rank, self.host, self.port]

    @classmethod
    def from_wire(cls, item: list, groups: dict[int, int] | None = None) -> NodeInfo:
        """Inverse of :meth:`to_wire`; ``groups`` (node id -> host group) gives its group."""
        i, role, rank, host, port = item
        i = int(i)
        group = groups.get(i, -1) if groups else -1
        return cls(i, str(role), int(rank), str(host), int(port), group)


def normalize_keys(key: Any) -> tuple[list[Any], bool]:
    """(list of keys, whether the caller passed a list)."""
    if isinstance(key, (list, tuple)):
        keys = list(key)
        for k in keys:
            check_key(k)
        return keys, True
    check_key(key)
    return [key], False


def check_key(key: Any) -> None:
    """Raise TypeError unless ``key`` is an int or a str."""
    if isinstance(key, bool) or not isinstance(key, (int, str)):
        raise TypeError(f"a key must be an int or a str, got {type(key).__name__} {key!r}")


def check_sender(
    nodes: Mapping[int, NodeInfo] | None, worker: int, host: Sequence[int], what: str
) -> None:
    """Refuse a push whose host tag names another host group than its sender registered
    with, or more workers than that host group has (a host's push stands for its own).
    ``nodes``: the job's node table (None: a server without it checks nothing)."""
    info = nodes.get(worker) if nodes is not None else None
    if info is None or info.group < 0:  # (its host not known here)
        return
    if host[0] != info.group:
        raise BadRequest(
            f"{what}: its host tag names host group {host[0]} but its sender registered with "
            f"host group {info.group}; a worker pushes for its own host (HETPS_HOST_GROUP)"
        )
    have = sum(1 for n in nodes.values() if n.role == "worker" and n.group == info.group)
    if host[2] > have:
        raise BadRequest(
            f"{what}: it stands for {host[2]} workers but host group {info.group} has "
            f"{have}; LOCAL_WORLD_SIZE must be the number of workers the host really runs"
        )
