"""ESync's state-server brain: which worker is ready to aggregate, and when."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

__all__ = ["ReadinessPolicy", "WorkerState"]


@dataclass
class WorkerState:
    """What the policy knows about one worker (a snapshot; mutating it changes nothing)."""

    worker: int
    estimate_s: float | None
    steps: int
    ready: bool
    round_start: float | None
    last_report: float | None


class ReadinessPolicy:
    """Decides, per ESync, whether a worker should take another local step or aggregate.

    ``num_workers`` workers with ids ``0..num_workers-1``. ``margin_s`` (>= 0) makes fast
    workers stop that many seconds before the slowest's expected end; ``smoothing`` in
    [0, 1) blends each new step time into the estimate (``est = s*est + (1-s)*new``; 0 keeps
    only the last step time, as ESync). Times are any consistent clock in seconds.
    """

    def __init__(self, num_workers: int, margin_s: float = 0.0, smoothing: float = 0.0) -> None:
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be a positive integer, got {num_workers!r}")
        if not (math.isfinite(margin_s) and margin_s >= 0):
            raise ValueError(f"margin_s must be a finite number >= 0, got {margin_s!r}")
        if not (0.0 <= smoothing < 1.0):
            raise ValueError(f"smoothing must be in [0, 1), got {smoothing!r}")
        self.num_workers = num_workers
        self.margin_s = float(margin_s)
        self.smoothing = float(smoothing)
        self._estimate: list[float | None] = [None] * num_workers
        self._steps = [0] * num_workers
        self._ready = [False] * num_workers
        self._start: list[float | None] = [None] * num_workers
        self._last: list[float | None] = [None] * num_workers
        self._round = 0
        self._slowest: int | None = None
        self._lockstep = True
        self._slowest_end: float | None = None  # actual end of the slowest's step, once known
        self._gone: set[int] = set()  # workers that left the job (always ready, never slowest)
        self._back: set[int] = set()  # workers that joined again: estimates forgotten next round

    # -- round lifecycle ---------------------------------------------------------------------

    @property
    def round(self) -> int:
        """Number of the current round (1 after the first ``start_round``; 0 before)."""
        return self._round

    def skip_to(self, rnd: int) -> None:
        """Continue after round ``rnd`` (a state server started again mid-job): the next
        ``start_round`` begins round ``rnd + 1``; what was known of the workers is kept."""
        self._round = max(self._round, int(rnd))

    def start_round(self, now: float) -> int:
        """Begin a new round at ``now`` for every worker; returns the new round number.

        Resets local step counts and readiness, and fixes this round's slowest worker and
        deadline from the current estimates (lockstep if any estimate is unknown).
        """
        now = _check_time(now, "now")
        self._round += 1
        for w in self._back:  # (kept until now: one may be the current round's slowest)
            self._estimate[w] = None
        self._back.clear()
        self._steps = [0] * self.num_workers
        self._ready = [w in self._gone for w in range(self.num_workers)]
        self._start = [now] * self.num_workers
        self._last = [None] * self.num_workers
        self._slowest_end = None
        here = [w for w in range(self.num_workers) if w not in self._gone]
        self._lockstep = any(self._estimate[w] is None for w in here)
        if self._lockstep or not here:
            self._slowest = None
        else:
            est = self._estimate
            self._slowest = max(here, key=lambda w: (est[w], -w))
        return self._round

    def remove(self, worker: int) -> None:
        """``worker`` left the job (it died; HETPS_ELASTIC): it counts as ready from now on
        and is never the slowest again. If it was this round's slowest, the others stop at
        the deadline it was expected to meet."""
        w = self._check_worker(worker)
        self._gone.add(w)
        self._ready[w] = True

    def add(self, worker: int) -> None:
        """``worker`` is back in the job (started again, it joined; HETPS_ELASTIC): it
        counts again from the next ``start_round`` on, and that round runs in lockstep, as
        its step-time estimate is forgotten then (a new process, maybe on another device).
        In the current round it stays ready: it joined after the round began. Adding a
        worker that never left only forgets its estimate at the next round."""
        w = self._check_worker(worker)
        self._gone.discard(w)
        self._back.add(w)
        self._ready[w] = True

    def mark_start(self, worker: int, now: float) -> None:
        """Refine when ``worker`` began its local steps this round (e.g. after its pull).

        Optional: ``start_round`` sets every worker's start to its ``now``. Only the slowest
        worker's start matters (it anchors the deadline). Must precede the worker's first
        report of the round.
        """
        self._check_round()
        w = self._check_worker(worker)
        if self._steps[w]:
            raise ValueError(f"worker {w} already reported a step in round {self._round}")
        self._start[w] = _check_time(now, "now")

    def report_step(self, worker: int, step_time_s: float, now: float) -> bool:
        """Record that ``worker`` finished a local step of ``step_time_s`` seconds at ``now``.

        Returns whether the worker is now ready to aggregate (take no more local steps).
        """
        self._check_round()
        w = self._check_worker(worker)
        step_time_s = _check_time(step_time_s, "step_time_s")
        now = _check_time(now, "now")
        if self._ready[w]:
            raise ValueError(
                f"worker {w} is already ready in round {self._round}; it must not take "
                "more local steps before the next round"
            )
        old = self._estimate[w]
        self._estimate[w] = (
            step_time_s
            if old is None
            else self.smoothing * old + (1.0 - self.smoothing) * step_time_s
        )
        self._steps[w] += 1
        self._last[w] = now
        if w == self._slowest:
            self._slowest_end = now
        self._ready[w] = self._decide(w, now)
        return self._ready[w]

    def is_ready(self, worker: int, now: float | None = None) -> bool:
        """Whether ``worker`` is ready to aggregate.

        Without ``now``: the answer given at its last report. With ``now`` (ESync's "apply"
        query, asked before starting another step): judged again at ``now``, so a worker
        that idled since its last step is ready if a step started now would end after the
        deadline. A True answer is recorded: the worker stays ready for the rest of the round.
        """
        self._check_round()
        w = self._check_worker(worker)
        if self._ready[w] or now is None:
            return self._ready[w]
        self._ready[w] = self._decide(w, _check_time(now, "now"))
        return self._ready[w]

    def round_complete(self) -> bool:
        """True when every worker is ready: aggregate, then call ``start_round``."""
        return self._round > 0 and all(self._ready)

    # -- queries -----------------------------------------------------------------------------

    def local_steps(self, worker: int) -> int:
        """Local steps ``worker`` has reported in the current round."""
        return self._steps[self._check_worker(worker)]

    def estimate(self, worker: int) -> float | None:
        """Current step-time estimate of ``worker`` in seconds (None before its first step)."""
        return self._estimate[self._check_worker(worker)]

    def slowest(self) -> int | None:
        """This round's slowest worker (None in a lockstep round or before the first)."""
        return self._slowest

    def deadline(self) -> float | None:
        """When this round's slowest step ends: actual once reported, else expected."""
        if self._slowest is None:
            return None
        if self._slowest_end is not None:
            return self._slowest_end
        start = self._start[self._slowest]
        est = self._estimate[self._slowest]
        assert start is not None and est is not None
        return start + est

    def state(self) -> list[WorkerState]:
        """A snapshot of every worker's state (for a status page or logs)."""
        return [
            WorkerState(
                w, self._estimate[w], self._steps[w], self._ready[w], self._start[w], self._last[w]
            )
            for w in range(self.num_workers)
        ]

    # -- internals ---------------------------------------------------------------------------

    def _decide(self, w: int, now: float) -> bool:
        if self._steps[w] == 0:
            return False  # everyone takes at least one step
        if self._lockstep or w == self._slowest or self._slowest_end is not None:
            return True
        deadline = self.deadline()
        est = self._estimate[w]
        assert deadline is not None and est is not None
        return now + est > deadline - self.margin_s

    def _check_round(self) -> None:
        if self._round == 0:
            raise RuntimeError("no round started: call start_round(now) first")

    def _check_worker(self, worker: int) -> int:
        try:
            w = operator.index(worker)  # ints and NumPy integers
        except TypeError:
            w = -1
        if isinstance(worker, bool) or not 0 <= w < self.num_workers:
            raise ValueError(f"worker must be in 0..{self.num_workers - 1}, got {worker!r}")
        return w


def _check_time(value: float, name: str) -> float:
    value = float(value)
    if not math.isfinite(value) or (name != "now" and value < 0):
        raise ValueError(f"{name} must be a finite number{'' if name == 'now' else ' >= 0'}")
    return value
