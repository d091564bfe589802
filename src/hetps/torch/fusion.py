"""Tensor fusion's groups: which parameters' gradients travel together as one KVStore key.

:func:`plan_groups` is the pure grouping rule, :class:`FusionGroup` a group's buffers; the
rule (sizes below ``fusion_bytes`` grouped in backward order, then re-made after
``tune_steps`` timed steps where backward pauses) is docs/ARCHITECTURE.md, "Training".
Fusion applies to ``update_on="worker"`` only; a member with no gradient this step adds
zeros and keeps ``p.grad`` None (a parameter gets a gradient on every worker or on none)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["FUSION_GAP_S", "FUSION_SPLIT_BYTES", "plan_groups"]

#: a fused group also closes where backward pauses at least this long before the next
#: gradient (about one small request's round trip here), ...
FUSION_GAP_S = 250e-6
#: ... once it holds this much: a smaller group gains little by leaving early (its round trip
#: is latency, which the last group pays anyway) and costs a request
FUSION_SPLIT_BYTES = 64 << 10


def plan_groups(
    entries: Sequence[tuple[str, int, Any, float | None]],
    fusion_bytes: int,
    gap_s: float = FUSION_GAP_S,
    split_bytes: int = FUSION_SPLIT_BYTES,
) -> list[list[str]]:
    """Fusion groups from ``(name, nbytes, kind, ready)`` in the order backward produces the
    gradients. Neighbours of one ``kind`` (dtype and device) share a group up to
    ``fusion_bytes``; a gradient of ``fusion_bytes`` or more goes alone. With ``ready`` times
    (seconds, or None where not measured) a group also closes before a gradient that comes
    ``gap_s`` or more after the previous one, if it already holds ``split_bytes``."""
    groups: list[list[str]] = []
    cur: list[str] = []
    cur_bytes = 0
    cur_kind: Any = None
    prev_ready: float | None = None
    for name, nbytes, kind, ready in entries:
        fits = bool(cur) and nbytes + cur_bytes <= fusion_bytes and kind == cur_kind
        if (
            fits
            and ready is not None
            and prev_ready is not None
            and ready - prev_ready >= gap_s
            and cur_bytes >= split_bytes
        ):
            fits = False  # backward pauses here: what the group holds leaves now
        prev_ready = ready
        if fits:
            cur.append(name)
            cur_bytes += nbytes
            continue
        if cur:
            groups.append(cur)
        cur, cur_bytes, cur_kind = [name], nbytes, kind
        if nbytes >= fusion_bytes:  # too big to share: goes alone
            groups.append(cur)
            cur, cur_bytes = [], 0
    if cur:
        groups.append(cur)
    return groups


class FusionGroup:
    """Parameters whose gradients travel as one key (one member: no fusion, no copy)."""

    __slots__ = (
        "index",
        "names",
        "offsets",
        "numel",
        "send",
        "recv",
        "ready",
        "send_of",
        "recv_of",
        "inline",
        "queued",
        "staged",
    )

    def __init__(self, index: int, names: list[str], params: dict[str, torch.Tensor]) -> None:
        self.index = index
        self.names = names
        self.offsets: dict[str, tuple[int, int]] = {}
        n = 0
        for name in names:
            k = params[name].numel()
            self.offsets[name] = (n, n + k)
            n += k
        self.numel = n
        self.send: torch.Tensor | None = None  # flat buffers of a fused group
        self.recv: torch.Tensor | None = None
        self.ready: set[str] = set()
        self.inline = index == 0  # sent by its hook, not by the launcher thread
        self.queued = False  # handed to the launcher thread, not launched yet
        self.staged: Any = None  # the copy of send to the host last queued (a device's)
        # each member's view into send / recv, made once (slicing per step costs ~5 us each)
        self.send_of: dict[str, torch.Tensor] = {}
        self.recv_of: dict[str, torch.Tensor] = {}

    def make_buffers(self, dtype: torch.dtype, like: dict[str, torch.Tensor]) -> None:
        """The flat send/receive buffers of a fused group and each member's views."""
        # on the members' device: backward's gradients are gathered there, and the KVStore
        # stages the group to the host in one copy
        self.send = torch.zeros(self.numel, dtype=dtype, device=like[self.names[0]].device)
        self.recv = torch.empty_like(self.send)
        self.send_of = {n: self.view(self.send, n, like[n]) for n in self.names}
        self.recv_of = {n: self.view(self.recv, n, like[n]) for n in self.names}

    @property
    def fused(self) -> bool:
        return len(self.names) > 1

    def view(self, flat: torch.Tensor, name: str, like: torch.Tensor) -> torch.Tensor:
        a, b = self.offsets[name]
        return flat[a:b].view_as(like)


@dataclass
class StepTiming:
    """Where a step's communication went, for the run log (``perf_counter`` times): each
    launch of a group (the pushes, mostly under backward), the waits for the answers, the
    last ``synchronize`` and the last local update."""

    pushes: list[tuple[float, float]] = field(default_factory=list)
    waits: list[tuple[float, float]] = field(default_factory=list)
    sync: tuple[float, float] | None = None
    update: tuple[float, float] | None = None

    @property
    def wait_s(self) -> float:
        return sum(b - a for a, b in self.waits)

    def take(self) -> StepTiming:
        """This step's timing; the next step starts afresh."""
        out = StepTiming(self.pushes, self.waits, self.sync, self.update)
        self.pushes, self.waits, self.sync, self.update = [], [], None, None
        return out


def ready_times(timed: list[dict[str, float]], names: list[str]) -> dict[str, float] | None:
    """Each gradient's median ready time (seconds after the step's first one) over the timed
    steps ``timed`` (each: name -> when its gradient was ready; the first step dropped as
    warm-up), or None if a gradient of ``names`` was not timed in every one of them (hooks
    bypassed, unused parameters)."""
    steps = timed[1:] or timed
    if not steps or any(len(t) != len(names) for t in steps):
        return None
    return {n: statistics.median(t[n] - min(t.values()) for t in steps) for n in names}


def measured_groups(
    named: list[tuple[str, torch.Tensor]], ready: dict[str, float], fusion_bytes: int
) -> list[list[str]]:
    """:func:`plan_groups` over the parameters in the order their gradients were ready
    (``ready``: :func:`ready_times`), ties in backward order."""
    back = {n: i for i, (n, _) in enumerate(reversed(named))}  # tie-break
    params = dict(named)
    entries = [
        (
            n,
            params[n].numel() * params[n].element_size(),
            (params[n].dtype, params[n].device),
            ready[n],
        )
        for n in sorted(params, key=lambda n: (ready[n], back[n]))
    ]
    return plan_groups(entries, fusion_bytes)
