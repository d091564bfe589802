"""The scheduler's barriers: a node waits at its barrier n of a group (``worker``, ``server``,
``all``) until every live member reached n; each node counts its own barriers, so a node
started again can say which one it waits at. (docs/MODULES.md, "hetps.cluster.barriers")"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from hetps.cluster import protocol as P
from hetps.cluster.ports import JobPort
from hetps.transport.codec import Message


@dataclass
class Barrier:
    # node -> (request, n, the node to answer: itself or its host's leader)
    arrived: dict[int, tuple[int, int, int]] = field(default_factory=dict)
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

    def _view(self, group: str) -> Barrier:
        bar = self.groups[group]
        s = self.sched
        at = (self._version, len(s.nodes), len(s.dead), len(s.finished), len(s.left))
        at += (sum(s.rejoined.values()),)
        if bar.view_at != at:
            bar.members = self.members(group)
            bar.counts = Counter(bar.reached.get(m, 0) for m in bar.members)
            bar.low = min(bar.counts) if bar.counts else None
            bar.view_at = at
        return bar

    def arrive(self, msg: Message) -> None:
        b = msg.typed  # a Barrier: its group is one of P.GROUPS
        group = b.group
        nodes = self.sched.nodes
        if msg.sender not in nodes:
            self.sched.refuse_request(msg, f"node {msg.sender} is not in the job")
            return
        if group != "all" and nodes[msg.sender].role != group:
            self.sched.refuse_request(msg, f"node {msg.sender} is not in group {group!r}")
            return
        ids = [msg.sender] if b.host is None else b.host
        if b.host is not None:  # a host's leader arrives for its host's workers
            host = nodes[msg.sender].group
            bad = [i for i in ids if i not in nodes or nodes[i].group != host or host < 0]
            if bad or b.n is None or len(set(ids)) != len(ids):
                self.sched.refuse_request(
                    msg, f"a host's arrival names nodes {bad or ids} of no host {host} or no n"
                )
                return
        bar = self._view(group)
        before = bar.low
        n = b.n
        for nid in ids:
            old = bar.reached.get(nid, 0)
            n = b.n if b.n is not None else old + 1
            # answered: the node itself, or its host's leader once for all it arrived for
            if nid == msg.sender or bar.arrived.get(nid, (0, 0, 0))[2] != nid:  # (own: stays)
                bar.arrived[nid] = (msg.req, n, msg.sender)
            new = max(n, old)  # (counted once: arrived through its leader, then itself)
            bar.reached[nid] = new
            if nid in bar.members and new != old:
                bar.counts[old] -= 1
                if not bar.counts[old]:
                    del bar.counts[old]
                bar.counts[new] += 1
        bar.low = min(bar.counts) if bar.counts else None  # (a few values: the members' n)
        if bar.low != before:
            self._send_released(group, bar)
        elif bar.low is None or bar.low >= n:
            self._send_released(group, bar, only=ids)

    def release(self, group: str) -> None:
        """Release each node waiting at its barrier n once every live member reached n (all
        at once, as a rule; after a restart some members may have gone past it already).
        Called when the members changed: the view is read again."""
        self.changed()
        self._send_released(group, self._view(group))

    def _send_released(self, group: str, bar: Barrier, only: list[int] | None = None) -> None:
        if not bar.arrived:
            return
        low = bar.low
        # HETPS_ELASTIC: the members it waited for, the same list for every node released
        # together (a worker's own view of who left may lag behind the scheduler's)
        body = {"members": sorted(bar.members)} if self.sched.elastic else {}
        waiting = only if only is not None else list(bar.arrived)
        told = set()  # (leader, request): one answer for the nodes a host's leader arrived for
        for nid in waiting:
            req, n, via = bar.arrived[nid]
            if low is None or low >= n:
                if (via, req) not in told:
                    told.add((via, req))
                    msg = Message(P.BARRIER_DONE, req=req, reply=True, body=body)
                    self.sched.send_to(via, msg)
                del bar.arrived[nid]
