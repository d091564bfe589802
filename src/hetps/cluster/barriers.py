"""The scheduler's barriers: a node waits at its barrier n of a group (``worker``, ``server``,
``all``) until every live member reached n; each node counts its own barriers, so a node
started again can say which one it waits at.

Each group keeps a view of its live members and how many of them reached each barrier
(``counts``), so an arrival costs O(1) and a barrier's release one pass over the waiting
nodes: a view walked the node table on every arrival, O(N^2) a barrier (3.5 s at 4,224
nodes, benchmarks/scale_sim.py). The view is read again whenever the membership may have
changed: the sizes of the node table, the dead, finished and let-go nodes and the admissions
differ, or a part that writes ``reached`` itself (a node admitted again, a worker that joins)
calls :meth:`Barriers.changed`, or another part asks for a :meth:`Barriers.release`."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from hetps.cluster import protocol as P
from hetps.cluster.ports import JobPort
from hetps.transport.codec import Message


@dataclass
class Barrier:
    arrived: dict[int, tuple[int, int]] = field(default_factory=dict)  # node -> (request, n)
    # node -> the highest barrier of the group it reached (its n: each node counts its own)
    reached: dict[int, int] = field(default_factory=dict)
    # the view: the live members, how many of them reached each n, the lowest such n
    members: set[int] = field(default_factory=set)
    counts: Counter[int] = field(default_factory=Counter)
    low: int | None = None
    view_at: tuple | None = None


class Barriers:
    """The barriers of every group (a part of :class:`~hetps.cluster.scheduler.Scheduler`)."""

    def __init__(self, sched: JobPort) -> None:
        self.sched = sched
        self.groups: dict[str, Barrier] = {g: Barrier() for g in P.GROUPS}
        self._version = 0  # bumped by changed()

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

    def changed(self) -> None:
        """A part wrote ``reached`` or the membership itself: every view is read again."""
        self._version += 1

    def _at(self) -> tuple:
        s = self.sched
        return (
            self._version,
            len(s.nodes),
            len(s.dead),
            len(s.finished),
            len(s.left),
            sum(s.rejoined.values()),
        )

    def _view(self, group: str) -> Barrier:
        bar = self.groups[group]
        at = self._at()
        if bar.view_at != at:
            bar.members = self.members(group)
            bar.counts = Counter(bar.reached.get(m, 0) for m in bar.members)
            bar.low = min(bar.counts) if bar.counts else None
            bar.view_at = at
        return bar

    def arrive(self, msg: Message) -> None:
        b = msg.typed  # a Barrier: its group is one of P.GROUPS
        group = b.group
        if msg.sender not in self.sched.nodes:
            self.sched.refuse_request(msg, f"node {msg.sender} is not in the job")
            return
        if group != "all" and self.sched.nodes[msg.sender].role != group:
            self.sched.refuse_request(msg, f"node {msg.sender} is not in group {group!r}")
            return
        bar = self._view(group)
        old = bar.reached.get(msg.sender, 0)
        n = b.n if b.n is not None else old + 1
        bar.arrived[msg.sender] = (msg.req, n)
        new = max(n, old)
        bar.reached[msg.sender] = new
        before = bar.low
        if msg.sender in bar.members and new != old:
            bar.counts[old] -= 1
            if not bar.counts[old]:
                del bar.counts[old]
            bar.counts[new] += 1
            bar.low = min(bar.counts)  # (a few distinct values: the members' barriers)
        if bar.low != before:
            self._send_released(group, bar)
        elif bar.low is None or bar.low >= n:
            self._send_released(group, bar, only=msg.sender)

    def release(self, group: str) -> None:
        """Release each node waiting at its barrier n once every live member reached n (all
        at once, as a rule; after a restart some members may have gone past it already).
        Called when the members changed: the view is read again."""
        self.changed()
        self._send_released(group, self._view(group))

    def _send_released(self, group: str, bar: Barrier, only: int | None = None) -> None:
        if not bar.arrived:
            return
        low = bar.low
        # HETPS_ELASTIC: the members it waited for, the same list for every node released
        # together (a worker's own view of who left may lag behind the scheduler's)
        body = {"members": sorted(bar.members)} if self.sched.elastic else {}
        waiting = [only] if only is not None else list(bar.arrived)
        for nid in waiting:
            req, n = bar.arrived[nid]
            if low is None or low >= n:
                self.sched.send_to(nid, Message(P.BARRIER_DONE, req=req, reply=True, body=body))
                del bar.arrived[nid]
