"""One round of ``hetps train``'s worker: its tallies (:class:`Round`: samples, losses, local
steps, link counters) and the phase timers (compute, push, pull, wait) each step adds to, with
where each phase ran; the progress a worker prints."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hetps.kvstore import KVStore


class Clock:
    """Phase timers of one iteration, and where each phase ran (``spans``, when given)."""

    def __init__(self, spans: Any = None) -> None:
        self.phases = {"compute_s": 0.0, "push_s": 0.0, "pull_s": 0.0, "wait_s": 0.0}
        self.spans = spans  # hetps.metrics.spans.Spans

    def add(self, name: str, seconds: float, end: float | None = None) -> None:
        """``seconds`` more of phase ``name`` (``compute_s``...), which ended at ``end``
        (``time.perf_counter()``; default now)."""
        self.phases[name] += seconds
        if self.spans is not None and seconds > 0:
            end = time.perf_counter() if end is None else end
            self.spans.add(name[:-2], end - seconds, end)


def account_step(r: Any, timing: Any, t1: float, t2: float) -> None:
    """A DistributedOptimizer step's phases into round ``r``'s clock, each at the times it
    ran: every launch of a group is push (most run under backward, from its hooks), each
    wait for answers is wait, the time ``synchronize`` spent between them placing the
    answers (the mean, the copies into the gradients or weights) is pull, and the local
    update is compute. The rest of the ``step()`` call (``t1``..``t2``) is wait."""
    for a, b in timing.pushes:
        r.clock.add("push_s", b - a, b)
    for a, b in timing.waits:
        r.clock.add("wait_s", b - a, b)
    taken = []  # parts of t1..t2 accounted for
    if timing.sync is not None:
        s0, s1 = timing.sync
        cur = s0
        for a, b in sorted([(a, b) for a, b in timing.pushes if a >= s0] + timing.waits):
            if a > cur:
                r.clock.add("pull_s", a - cur, a)
            cur = max(cur, b)
        if s1 > cur:
            r.clock.add("pull_s", s1 - cur, s1)
        taken.append((s0, s1))
    if timing.update is not None:
        u0, u1 = timing.update
        r.clock.add("compute_s", u1 - u0, u1)
        taken.append((u0, u1))
    cur = t1
    for a, b in sorted(taken) + [(t2, t2)]:
        if a > cur:
            r.clock.add("wait_s", a - cur, a)
        cur = max(cur, b)


class Progress:
    """A progress bar in a terminal, plain lines otherwise."""

    def __init__(self, mode: str, rank: int, total: float | None) -> None:
        self.bar = mode == "bar" or (mode == "auto" and sys.stdout.isatty())
        self.rank = rank
        self.total = total
        self.last_line = 0.0

    def update(self, it: int, sps: float, loss: float, acc: float | None, elapsed: float) -> None:
        acc_s = f"{acc:.4f}" if acc is not None else "-"
        if self.bar:
            frac = min(1.0, elapsed / self.total) if self.total else 0.0
            filled = int(frac * 20)
            sys.stdout.write(
                f"\r[worker {self.rank}] [{'#' * filled}{'.' * (20 - filled)}] it {it} "
                f"{sps:8.1f} samples/s loss {loss:.4f} acc {acc_s}"
            )
            sys.stdout.flush()
        elif time.monotonic() - self.last_line > 2.0 or acc is not None:
            print(
                f"worker {self.rank} iter {it} {sps:.1f} samples/s loss {loss:.4f} acc {acc_s} "
                f"t {elapsed:.1f}s",
                flush=True,
            )
            self.last_line = time.monotonic()

    def close(self) -> None:
        if self.bar:
            sys.stdout.write("\n")


class Round:
    """One round's tallies: phase times, samples, losses, local steps, link counters."""

    def __init__(self, rnd: int, kv: KVStore, spans: Any = None) -> None:
        self.rnd = rnd
        self.clock = Clock(spans)
        self.t_iter = time.perf_counter()
        self.sent0, self.recv0 = kv.node.counters.totals() if kv is not None else (0, 0)
        self.samples = 0
        self.losses: list[float] = []
        self.local_steps = 0
        self.epoch = 0
        self.plan: dict | None = None
        self.overhead = 0.0
        self.checkpoint = False  # the workers agreed on a checkpoint after this round
        self.admit = False  # a worker waits to join: the workers let it in after this round

    def add_step(
        self, loss: float, compute_s: float, samples: int, epoch: int, end: float | None = None
    ) -> None:
        """Count one local step (that ended at ``end``, ``time.perf_counter()``; default now)."""
        self.clock.add("compute_s", compute_s, end)
        self.samples += samples
        self.losses.append(loss)
        self.local_steps += 1
        self.epoch = epoch
