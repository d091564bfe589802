"""A run log for a script that drives the KVStore itself (``examples/linear_regression.py``):
:class:`RoundLog` gives it the logs ``hetps train`` writes (docs/METRICS.md has the example).
(docs/MODULES.md, "hetps.metrics.roundlog")"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from hetps.metrics.records import IterationLog, RunWriter, run_meta
from hetps.metrics.runs import load_run
from hetps.metrics.spans import PHASES, Spans
from hetps.metrics.trace import write_trace
from hetps.metrics.traffic import TrafficRecorder, worker_observer

__all__ = ["RUN_START_KEY", "RoundLog", "pictures"]

#: the store key through which rank 0's start time (and run-directory suffix) reaches everyone
RUN_START_KEY = "__hetps_run_start"


def _run_dir(log_dir: Path, name: str, start: float, suffix: int) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(start))
    return log_dir / (f"{name}-{stamp}" + (f"-{suffix}" if suffix > 1 else ""))


class LoggedStore(Protocol):
    """What a round log uses of its store: the worker's rank, the job's size, and a key to
    agree on the run's start through."""

    @property
    def rank(self) -> int: ...
    @property
    def num_workers(self) -> int: ...
    def init(self, key: Any, value: Any) -> None: ...
    def pull(self, key: Any, out: Any = None, priority: int = 0) -> Any: ...


class RoundLog:
    """One worker's log of a KVStore training loop: ``run.json`` (rank 0), one record per
    round with its phase spans, and the bytes on each link to a server.

    ``bucket_s`` is the traffic bucket width; the default 0.5 ms resolves the push and the
    answer of a round of a few milliseconds."""

    def __init__(
        self,
        kv: LoggedStore,
        log_dir: str | os.PathLike[str],
        name: str,
        *,
        mode: str = "sync",
        network: str = "model",
        batch_size: int = 0,
        bucket_s: float = 0.0005,
        **extra: Any,
    ) -> None:
        self.kv = kv
        self.rank = int(kv.rank)
        base = Path(log_dir)
        # rank 0's clock and choice of directory win (init: rank 0's value is stored)
        now = time.time()
        suffix = 1
        if self.rank == 0:
            while (_run_dir(base, name, now, suffix) / "run.json").exists():
                suffix += 1
        start = np.array([now, suffix], np.float64)
        kv.init(RUN_START_KEY, start)
        kv.pull(RUN_START_KEY, out=start)
        self.started_at = float(start[0])
        self.run_dir = _run_dir(base, name, self.started_at, int(start[1]))
        if self.rank == 0:
            RunWriter(
                self.run_dir,
                run_meta(
                    mode,
                    network,
                    int(kv.num_workers),
                    int(getattr(kv, "num_servers", 0)),
                    int(batch_size),
                    started_at=self.started_at,
                    **extra,
                ),
            )
        self.log = IterationLog(self.run_dir, self.rank, started_at=self.started_at)
        self.spans = Spans(self.started_at)
        meter = getattr(kv, "meter", None)  # the live dashboard's timeline (docs/LIVE.md)
        if meter is not None:
            self.spans.sink = meter.add_round
            meter.bind_run(self.run_dir, lead=self.rank == 0)
        self.traffic = TrafficRecorder(
            self.started_at,
            bucket_s=bucket_s,
            path=self.run_dir / f"traffic-worker{self.rank}.jsonl",
        )
        node = getattr(kv, "node", None)  # None: a local store, no links to watch
        self._node = node
        self._servers = {s.id: f"server{s.rank}" for s in node.servers()} if node else {}
        self._lock = threading.Lock()
        self._last_answer = 0.0  # unix time of the last message from a server
        self._iter = 0
        self._round_start: float | None = None
        self._bytes0 = self._totals()
        if node is not None:
            node.observe_traffic(worker_observer(self.traffic, self._servers, self._answered))

    def _totals(self) -> tuple[int, int]:
        return tuple(self._node.counters.totals()) if self._node is not None else (0, 0)

    def _answered(self, ts: float) -> None:  # the transport's threads
        with self._lock:
            self._last_answer = max(self._last_answer, ts)

    # -- one round --------------------------------------------------------------------------
    def _start(self) -> float:
        """Now, which begins the round if nothing did yet."""
        t0 = time.perf_counter()
        if self._round_start is None:
            self._round_start = t0
        return t0

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as phase ``name`` (``compute``, ``push``, ...)."""
        self._start()
        with self.spans.phase(name):
            yield

    @contextmanager
    def pull(self) -> Iterator[None]:
        """Time a blocking pull: ``wait`` until the last answer from a server arrived (the
        servers wait for every worker's push, update, and answer), then ``pull`` (the
        weights copied out)."""
        t0 = self._start()
        try:
            yield
        finally:
            t1 = time.perf_counter()
            with self._lock:
                last = self._last_answer
            arrived = self.spans.from_unix(last) if last else t0
            if t0 < arrived < t1:
                self.spans.add("wait", t0, arrived)
                self.spans.add("pull", arrived, t1)
            else:  # the answer was there before the call
                self.spans.add("pull", t0, t1)

    def end_round(self, *, samples: int, loss: float | None, epoch: int = 0, **extra: Any) -> None:
        """Write this round's record (phase sums, spans, bytes) and start the next round."""
        end = time.perf_counter()
        totals = self.spans.totals()
        sent, recv = self._totals()
        start = self._round_start if self._round_start is not None else end
        rec = {
            "rank": self.rank,
            "iter": self._iter,
            "epoch": int(epoch),
            "t": self.log.now(),
            "samples": int(samples),
            "loss": loss,
            "local_steps": 1,
            **{f"{p}_s": totals.get(p, 0.0) for p in PHASES},
            "bytes_sent": sent - self._bytes0[0],
            "bytes_recv": recv - self._bytes0[1],
            "srit_s": end - start,
            "spans": self.spans.take(),
            **extra,
        }
        self._bytes0 = (sent, recv)
        self.log.write(rec)
        self._iter += 1
        self._round_start = None

    def close(self) -> Path:
        """Stop observing, close the log and write the traffic file; returns the run dir."""
        if self._node is not None:
            self._node.observe_traffic(None)
        self.log.close()
        self.traffic.close()
        if self.rank == 0:  # rank 0 got through its loop: run.json says the run completed
            RunWriter.reopen(self.run_dir).update(ended={"status": "completed", "at": time.time()})
        return self.run_dir


def pictures(run_dir: str | os.PathLike[str], window_rounds: int = 6) -> dict[str, Path]:
    """Write ``trace.json``, ``timeline.png`` and ``report.html`` (``hetps report``) into
    ``run_dir`` and print where they are and how to open them; returns ``{"trace": path,
    "figure": path, "report": path}`` (no figure and no report without matplotlib: a line says
    how to get it)."""
    out: dict[str, Path] = {}
    trace_path, _ = write_trace(run_dir)
    out["trace"] = trace_path
    print(f"trace: {trace_path}  (open in https://ui.perfetto.dev or chrome://tracing)", flush=True)
    try:
        from hetps.metrics.plot_timeline import draw_phase_timeline
    except ImportError:  # pragma: no cover - matplotlib missing
        print("figure: skipped, matplotlib missing (pip install 'hetps[plots]')", flush=True)
        return out
    fig_path = draw_phase_timeline(
        load_run(run_dir), Path(run_dir) / "timeline.png", rounds=window_rounds
    )
    out["figure"] = fig_path
    print(f"figure: {fig_path}  (when each worker computes, pushes, waits and pulls)", flush=True)
    from hetps.metrics.report import write_report

    out["report"] = write_report(run_dir)
    print(
        f"report: {out['report']}  (one HTML file: summary, charts, timeline, configuration; "
        "open it in a browser)",
        flush=True,
    )
    return out
