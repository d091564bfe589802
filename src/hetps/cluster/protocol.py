"""Control-plane vocabulary shared by the scheduler and the nodes.

Node ids follow ps-lite: the scheduler is 1, server rank r is ``8 + 2r``, worker rank r is
``9 + 2r``. Group ids for barriers: ``worker``, ``server``, ``all``.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULER_ID = 1

# node -> scheduler
ADD_NODE = "add_node"
BARRIER = "barrier"
HEARTBEAT = "heartbeat"
FINISH = "finish"
LEAVE = "leave"  # a node is going away because it failed
# scheduler -> node
NODES = "nodes"
BARRIER_DONE = "barrier_done"
HEARTBEAT_ACK = "heartbeat_ack"
NODE_DEAD = "node_dead"
EXIT = "exit"
WORKER_DONE = "worker_done"  # to servers: a worker finished its job
REFUSED = "refused"

GROUPS = ("worker", "server", "all")


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

    def describe(self) -> str:
        """Human description: ``worker rank 1 (node 11, 127.0.0.1:4242)``."""
        if self.role == "scheduler":
            return f"scheduler (node 1, {self.host}:{self.port})"
        return f"{self.role} rank {self.rank} (node {self.id}, {self.host}:{self.port})"

    def to_wire(self) -> list:
        """Compact msgpack-able form."""
        return [self.id, self.role, self.rank, self.host, self.port]

    @classmethod
    def from_wire(cls, item: list) -> NodeInfo:
        """Inverse of :meth:`to_wire`."""
        i, role, rank, host, port = item
        return cls(int(i), str(role), int(rank), str(host), int(port))
