"""The scheduler's barriers: a node waits at its barrier n of a group (``worker``, ``server``,
``all``) until every live member reached n; each node counts its own barriers, so a node
started again can say which one it waits at."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hetps.cluster import protocol as P
from hetps.transport.codec import Message


@dataclass
class Barrier:
    arrived: dict[int, tuple[int, int]] = field(default_factory=dict)  # node -> (request, n)
    # node -> the highest barrier of the group it reached (its n: each node counts its own)
    reached: dict[int, int] = field(default_factory=dict)


class Barriers:
    """The barriers of every group (a part of :class:`~hetps.cluster.scheduler.Scheduler`)."""

    def __init__(self, sched: Any) -> None:
        self.sched = sched
        self.groups: dict[str, Barrier] = {g: Barrier() for g in P.GROUPS}

    def members(self, group: str) -> set[int]:
        alive = {
            i
            for i in self.sched.nodes
            if i not in self.sched.dead
            and i not in self.sched.finished
            and i not in self.sched.left
        }
        if group == "all":
            return alive
        return {i for i in alive if self.sched.nodes[i].role == group}

    def arrive(self, msg: Message) -> None:
        b = msg.typed  # a Barrier: its group is one of P.GROUPS
        group = b.group
        if msg.sender not in self.sched.nodes:
            self.sched.refuse_request(msg, f"node {msg.sender} is not in the job")
            return
        if group != "all" and self.sched.nodes[msg.sender].role != group:
            self.sched.refuse_request(msg, f"node {msg.sender} is not in group {group!r}")
            return
        bar = self.groups[group]
        n = b.n if b.n is not None else bar.reached.get(msg.sender, 0) + 1
        bar.arrived[msg.sender] = (msg.req, n)
        bar.reached[msg.sender] = max(n, bar.reached.get(msg.sender, 0))
        self.release(group)

    def release(self, group: str) -> None:
        """Release each node waiting at its barrier n once every live member reached n (all
        at once, as a rule; after a restart some members may have gone past it already)."""
        bar = self.groups[group]
        if not bar.arrived:
            return
        members = self.members(group)
        low = min((bar.reached.get(m, 0) for m in members), default=None)
        # HETPS_ELASTIC: the members it waited for, the same list for every node released
        # together (a worker's own view of who left may lag behind the scheduler's)
        body = {"members": sorted(members)} if self.sched.elastic else {}
        for nid, (req, n) in list(bar.arrived.items()):
            if low is None or low >= n:
                self.sched.send_to(nid, Message(P.BARRIER_DONE, req=req, reply=True, body=body))
                del bar.arrived[nid]
