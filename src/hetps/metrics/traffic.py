"""Traffic timelines: bytes pushed and pulled on every link, in fixed time buckets.
(docs/MODULES.md, "hetps.metrics.traffic")"""

from __future__ import annotations

import json
import math
import os
import re
import threading
from pathlib import Path
from typing import Any

from hetps.metrics.records import MetricsError, read_jsonl, write_atomic

__all__ = ["TrafficRecorder", "load_traffic", "worker_observer", "TRAFFIC_KEYS"]

TRAFFIC_KEYS = ("t", "dt", "peer", "push_bytes", "pull_bytes")
_TRAFFIC_FILE = re.compile(r"^traffic-(worker|server)(\d+)\.jsonl$")
_KIND = {"push": 0, "pull": 1}


class TrafficRecorder:
    """Thread-safe per-link byte counters in buckets of ``bucket_s`` seconds.

    ``run_start`` is the run's start as a unix time (``run.json`` ``started_at``); the ``ts``
    given to :meth:`record` must be on the same clock (``time.time()``). ``path`` (optional) is
    where :meth:`close` writes. After :meth:`close`, :meth:`record` is a no-op.
    """

    def __init__(
        self,
        run_start: float,
        bucket_s: float = 0.05,
        path: str | os.PathLike[str] | None = None,
    ) -> None:
        if not (isinstance(bucket_s, (int, float)) and bucket_s > 0 and math.isfinite(bucket_s)):
            raise MetricsError(f"bucket_s must be a positive number of seconds, got {bucket_s!r}")
        self.run_start = float(run_start)
        self.bucket_s = float(bucket_s)
        self.path = Path(path) if path is not None else None
        self._lock = threading.Lock()
        # (bucket index, peer) -> [push bytes, pull bytes]
        self._buckets: dict[tuple[int, Any], list[int]] = {}
        self._closed = False

    def record(self, ts: float, peer: Any, kind: str, nbytes: int) -> None:
        """Count ``nbytes`` of ``kind`` ('push' or 'pull') on the link to/from ``peer`` at
        unix time ``ts``. Cheap (O(1)); safe to call from any thread."""
        k = _KIND.get(kind)
        if k is None:
            raise MetricsError(f"traffic kind must be 'push' or 'pull', got {kind!r}")
        idx = math.floor((ts - self.run_start) / self.bucket_s)
        key = (idx, peer)
        with self._lock:
            if self._closed:
                return
            b = self._buckets.get(key) or self._buckets.setdefault(key, [0, 0])
            b[k] += nbytes

    def buckets(self) -> list[dict[str, Any]]:
        """The buckets so far as records, sorted by time then peer."""
        with self._lock:
            items = [(k, list(v)) for k, v in self._buckets.items()]
        items.sort(key=lambda kv: (kv[0][0], str(kv[0][1])))
        dt = self.bucket_s
        rows = ((round(i * dt, 9), dt, peer, *v) for (i, peer), v in items)
        return [dict(zip(TRAFFIC_KEYS, row, strict=True)) for row in rows]

    def totals(self) -> dict[str, int]:
        """Total bytes recorded: ``{"push": …, "pull": …}``."""
        with self._lock:
            push = sum(v[0] for v in self._buckets.values())
            pull = sum(v[1] for v in self._buckets.values())
        return {"push": push, "pull": pull}

    def write(self, path: str | os.PathLike[str] | None = None) -> Path:
        """Write every bucket so far to ``path`` (default: the constructor's), replacing the
        file atomically; may be called repeatedly (e.g. at each evaluation)."""
        target = Path(path) if path is not None else self.path
        if target is None:
            raise MetricsError("TrafficRecorder.write: no path given and none set at construction")
        lines = (json.dumps(b, separators=(",", ":")) + "\n" for b in self.buckets())
        return write_atomic(target, "".join(lines))

    def close(self) -> Path | None:
        """Stop recording and write to the constructor's ``path`` if one was given."""
        with self._lock:
            self._closed = True
        return self.write() if self.path is not None else None


def worker_observer(
    recorder: TrafficRecorder,
    servers: dict[Any, Any],
    on_answer: Any = None,
) -> Any:
    """A worker's transport observer (``node.observe_traffic``): every message sent to a server
    counts as push bytes, every one received from a server as pull bytes (pulled weights often
    come back in the answer to a push), on the link labelled ``servers[node id]``; messages
    to or from anyone else (the scheduler) are not counted. ``on_answer(ts)`` (optional) is
    called for every message received from a server."""

    def observe(direction: str, peer: Any, cmd: str, nbytes: int, ts: float) -> None:
        label = servers.get(peer)
        if label is None:
            return
        if direction == "send":
            recorder.record(ts, label, "push", nbytes)
        else:
            recorder.record(ts, label, "pull", nbytes)
            if on_answer is not None:
                on_answer(ts)

    return observe


def load_traffic(run_dir: str | os.PathLike[str]) -> dict[str, list[dict[str, Any]]]:
    """Read every ``traffic-<role><rank>.jsonl`` of a run: ``{"worker0": [buckets…], …}``,
    workers first then servers, by rank. A torn last line is dropped."""
    d = Path(run_dir)
    found = sorted(
        (m.group(1) != "worker", int(m.group(2)), m.group(1), f)
        for f in (d.iterdir() if d.is_dir() else [])
        if (m := _TRAFFIC_FILE.match(f.name)) and f.is_file()
    )
    return {f"{role}{rank}": read_jsonl(f, TRAFFIC_KEYS, "bucket")[0] for _, rank, role, f in found}
