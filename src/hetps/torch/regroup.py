"""The DistributedOptimizer's groups re-made at backward's pace (from rank 0's timings of
the first steps), and the state a worker joining a running job takes from a live one (the
groups, the step count, the optimizer's state). A part of
:class:`hetps.torch.optimizer.DistributedOptimizer`, which it is mixed into."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from hetps.torch.fusion import measured_groups, ready_times

if TYPE_CHECKING:
    from hetps.kvstore import KVStore

#: a group ready this close to backward's end is sent by its hook, not the launcher thread
LAUNCH_INLINE_S = 500e-6


class Regrouping:
    """The DistributedOptimizer's methods that re-make its groups (mixed into it: they use
    its attributes)."""

    named: list
    groups: list
    kv: KVStore

    # -- groups that follow backward's pace ---------------------------------------------------
    def _retune(self) -> None:
        """Re-make the groups from rank 0's timings, on every worker (a collective: each
        worker calls it at the same step). Groups that did not change keep their keys."""
        ids = torch.zeros(len(self.named), dtype=torch.float64)
        if getattr(self.kv, "live_rank", self.kv.rank) == 0:
            ready = ready_times(self._timed, list(self._index))  # rank 0's own timings
            plan = ready and measured_groups(self.named, ready, self.fusion_bytes)
            groups = self.groups if plan is None else self._as_groups(plan)
            if self.extra_rides and not groups[0].fused:
                groups = self.groups  # the extra tensor needs a fused first group: keep the old
            for g in groups:
                for n in g.names:
                    ids[self._index[n]] = g.index
        self.kv.broadcast(f"{self.prefix}fusion-groups", ids, out=ids)
        by_id: dict[int, list[str]] = {}
        for (n, _), i in zip(self.named, ids.tolist(), strict=True):
            by_id.setdefault(int(i), []).append(n)
        self._switch_groups(list(by_id.values()), self.kv.init)

    def _switch_groups(self, names: list[list[str]], make: Any) -> None:
        """Use the groups ``names`` from now on (each list a group's parameters); the keys of
        new groups are made with ``make(keys, values)``. Groups that did not change keep
        their keys."""
        new_groups = self._as_groups(names)
        old = {tuple(g.names): g for g in self.groups}
        if [g.names for g in new_groups] == [g.names for g in self.groups]:
            self._mark_inline()
            return
        keys, values = [], []
        for i, g in enumerate(new_groups):
            kept = old.get(tuple(g.names))
            if kept is not None and (kept.index == 0) == (i == 0):
                kept.index = i
                new_groups[i] = kept
                continue
            if i == 0 and self.extra_rides:
                assert self.extra is not None
                g.numel += self.extra.numel()
            values.append(self._first(g))
            keys.append(self._key(g))
        self.groups = new_groups
        self._group_of = {n: g for g in self.groups for n in g.names}
        self._mark_inline()
        if keys:
            make(keys, values)

    def _first(self, g: Any) -> torch.Tensor:
        """The value group ``g``'s key is made with: a fused group's send buffer, made now;
        a lone parameter's zeros in the wire dtype, or under update_on="server" (no fusion
        there) the parameter itself."""
        if g.fused:
            g.make_buffers(self._wire(g.names[0]), self._cpu)
            return g.send
        if self.update_on == "server":
            return self._cpu[g.names[0]]
        return torch.zeros_like(self._cpu[g.names[0]], dtype=self._wire(g.names[0]))

    # -- a worker joining a running job (--elastic) ---------------------------------------------
    def join_state(self) -> dict:
        """What a worker that joins needs to exchange the same keys as this one: the groups
        (they may have been re-made), the step count, and the wrapped optimizer's state."""
        return {
            "groups": [list(g.names) for g in self.groups],
            "steps": self._steps,
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "local": self._local.state_bytes() if self._local is not None else None,
        }

    def adopt(self, state: dict) -> None:
        """Take a live worker's :meth:`join_state` (this worker joined a running job): its
        groups, whose keys exist on the servers already, and its step count (the groups are
        not re-made again)."""
        self._switch_groups(state["groups"], self.kv.declare)
        self._steps = int(state["steps"])
        if self._steps >= self._timing_steps:
            self._clock = None
        if self.optimizer is not None and state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if self._local is not None and state.get("local") is not None:
            self._local.load_state_bytes(state["local"])

    def _mark_inline(self) -> None:
        """Groups that are ready within ``LAUNCH_INLINE_S`` of backward's end (by this
        worker's own timings) are sent by their hook: there is too little backward left to
        overlap a launch with, and the hand-off to the launcher would only add its wake-up."""
        ready = ready_times(self._timed, list(self._index))
        if ready is None:
            return
        end = max(ready.values())
        for g in self.groups:
            g.inline = g.index == 0 or end - max(ready[n] for n in g.names) < LAUNCH_INLINE_S
