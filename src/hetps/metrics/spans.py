"""When each phase of an iteration ran: the ``spans`` of a ``worker-<rank>.jsonl`` record.
(docs/MODULES.md, "hetps.metrics.spans")"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["PHASES", "Spans"]

#: The phase names the tools know (any other name is kept and drawn as well).
PHASES = ("compute", "push", "wait", "pull")


class Spans:
    """Phase start/end times of one iteration, on ``time.perf_counter()``, reported relative to
    ``run_start`` (a unix time, ``run.json``'s ``started_at``)."""

    def __init__(self, run_start: float) -> None:
        # perf_counter is monotonic and fine-grained; this offset puts it on the run's clock
        self._run_start = float(run_start)
        self._offset = time.time() - time.perf_counter() - self._run_start
        self._spans: list[tuple[str, float, float]] = []
        #: called by :meth:`take` with the iteration's spans as ``(phase, unix start,
        #: seconds)``: the live dashboard's timeline (``WorkerMeter.add_round``), when set
        self.sink: Callable[[list[tuple[str, float, float]]], None] | None = None

    def from_unix(self, unix: float) -> float:
        """A ``time.time()`` value (e.g. a message's timestamp) on the perf_counter clock."""
        return unix - self._run_start - self._offset

    def add(self, phase: str, start: float, end: float) -> None:
        """One phase from ``start`` to ``end`` (``time.perf_counter()`` values)."""
        self._spans.append((phase, start, max(end, start)))

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """``with spans.phase("push"): kv.push(...)`` records the block as one span."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, t0, time.perf_counter())

    def totals(self) -> dict[str, float]:
        """Seconds per phase so far in this iteration: ``{"compute": …, …}``."""
        out: dict[str, float] = {}
        for name, s, e in self._spans:
            out[name] = out.get(name, 0.0) + (e - s)
        return out

    def take(self) -> list[list]:
        """This iteration's spans as ``[[phase, start_s, duration_s], …]`` (microsecond
        precision, run time), in start order; the next iteration starts empty."""
        spans, self._spans = self._spans, []
        spans.sort(key=lambda x: x[1])
        if self.sink is not None:
            unix = self._offset + self._run_start
            self.sink([(n, s + unix, e - s) for n, s, e in spans])
        return [[n, round(s + self._offset, 6), round(e - s, 6)] for n, s, e in spans]
