"""Run directories: ``run.json`` and per-worker iteration logs (JSON lines), and their writers.
(docs/MODULES.md, "hetps.metrics.records")"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

RUN_FILE = "run.json"
MODES = ("esync", "sync", "async", "dcasgd", "local")

#: Keys every ``run.json`` has (``RunWriter`` fills the ones marked optional in the docs).
RUN_KEYS = (
    "mode",
    "network",
    "workers",
    "servers",
    "batch_size",
    "slowdown",
    "split_by_class",
    "started_at",
    "devices",
)

#: Keys every iteration record has; ``loss`` may be null, the rest are numbers.
ITERATION_KEYS = (
    "rank",
    "iter",
    "epoch",
    "t",
    "samples",
    "loss",
    "local_steps",
    "compute_s",
    "push_s",
    "pull_s",
    "wait_s",
    "bytes_sent",
    "bytes_recv",
)
_INT_KEYS = ("rank", "iter", "epoch", "samples", "local_steps", "bytes_sent", "bytes_recv")
_NONNEG_KEYS = ("compute_s", "push_s", "pull_s", "wait_s", "samples", "bytes_sent", "bytes_recv")


class MetricsError(ValueError):
    """A run directory or record that does not follow the log format (message says the fix)."""


class RunNotFoundError(MetricsError, FileNotFoundError):
    """The directory has no ``run.json``: it is not a hetps run directory."""


# --------------------------------------------------------------------------------------------
# JSON helpers


def plain(value: Any) -> Any:
    """``value`` as plain JSON data: NumPy/torch scalars and arrays become numbers and lists,
    non-finite floats become ``None`` (standard JSON has no NaN)."""
    if value is None or isinstance(value, (bool, str, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    for attr in ("tolist", "item"):  # numpy, torch: no import needed
        fn = getattr(value, attr, None)
        if callable(fn):
            return plain(fn())
    raise MetricsError(
        f"cannot write {value!r} (type {type(value).__name__}) as JSON; "
        "fix: pass numbers, strings, lists or dicts"
    )


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def write_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` (its folder made if need be) through a file beside it, so a
    reader sees the old file or the new one, never part of it; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


def _write_json_atomic(path: Path, obj: Any) -> None:
    write_atomic(path, json.dumps(obj, indent=2, sort_keys=True, allow_nan=False) + "\n")


def read_jsonl(
    path: str | os.PathLike[str], keys: tuple[str, ...] = (), what: str = "record"
) -> tuple[list[dict[str, Any]], bool]:
    """Read a JSON-lines file; returns ``(objects, truncated)``.

    Blank lines are skipped. A last line that does not parse (a run killed mid-write) is
    dropped and ``truncated`` is True; a bad line anywhere else raises :class:`MetricsError`
    naming the file and line, and then an object without one of ``keys`` (the message calls
    the ``n``-th object "``what`` n").
    """
    p = Path(path)
    lines = p.read_text(encoding="utf-8", errors="replace").splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    out: list[dict[str, Any]] = []
    truncated = False
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:
                truncated = True
                break
            raise MetricsError(f"{p}:{i + 1}: not JSON ({e.msg}); the file is corrupt") from e
        if not isinstance(obj, dict):
            raise MetricsError(f"{p}:{i + 1}: expected a JSON object, got {type(obj).__name__}")
        out.append(obj)
    for n, obj in enumerate(out, 1):  # (after every line parsed: a corrupt file says so first)
        if missing := [k for k in keys if k not in obj]:
            raise MetricsError(f"{p}: {what} {n} misses {', '.join(missing)}")
    return out, truncated


# --------------------------------------------------------------------------------------------
# Writers


def run_meta(
    mode: str,
    network: str,
    workers: int,
    servers: int,
    batch_size: int,
    slowdown: list[float] | None = None,
    split_by_class: bool = False,
    started_at: float | None = None,
    devices: Mapping[Any, str] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A complete, validated ``run.json`` dict; missing optional fields get their defaults.

    ``slowdown`` defaults to 1 for every worker, ``started_at`` to now, and ``devices`` to
    ``"worker<r>"`` (with ``", slowdown x<k>"`` where k != 1). Extra keyword arguments are
    stored as free extra keys (``scheme``, ``slice_size``, ``scenario``...).
    """
    meta: dict[str, Any] = dict(extra)
    meta.update(
        mode=mode,
        network=network,
        workers=workers,
        servers=servers,
        batch_size=batch_size,
        split_by_class=split_by_class,
    )
    if slowdown is None:
        slowdown = [1.0] * int(workers) if isinstance(workers, int) else []
    meta["slowdown"] = slowdown
    meta["started_at"] = time.time() if started_at is None else started_at
    if devices is None:
        devices = {
            r: f"worker{r}" if float(s) == 1 else f"worker{r} (slowdown x{float(s):g})"
            for r, s in enumerate(slowdown)
        }
    meta["devices"] = devices
    return validate_meta(meta)


def validate_meta(meta: Mapping[str, Any], where: str = "run.json") -> dict[str, Any]:
    """Check a ``run.json`` dict against the format; returns it as plain JSON data."""
    m = plain(dict(meta))
    missing = [k for k in RUN_KEYS if k not in m]
    if missing:
        raise MetricsError(
            f"{where}: missing key(s) {', '.join(missing)}; fix: see docs/METRICS.md"
        )
    if m["mode"] not in MODES:
        raise MetricsError(
            f"{where}: mode {m['mode']!r} is not one of {', '.join(MODES)} "
            "(async with DC-ASGD is stored as 'dcasgd')"
        )
    if not isinstance(m["network"], str) or not m["network"]:
        raise MetricsError(f"{where}: network must be a non-empty model name")
    for k in ("workers", "servers", "batch_size"):
        if not isinstance(m[k], int) or isinstance(m[k], bool) or m[k] < 0:
            raise MetricsError(f"{where}: {k} must be an integer >= 0, got {m[k]!r}")
    if m["workers"] < 1:
        raise MetricsError(f"{where}: workers must be >= 1, got {m['workers']}")
    sd = m["slowdown"]
    if not isinstance(sd, list) or not all(_is_number(x) and x > 0 for x in sd):
        raise MetricsError(f"{where}: slowdown must be a list of numbers > 0, got {sd!r}")
    if len(sd) != m["workers"]:
        raise MetricsError(
            f"{where}: slowdown has {len(sd)} value(s) for {m['workers']} worker(s); "
            "fix: one factor per worker (1 = real speed)"
        )
    if not isinstance(m["split_by_class"], bool):
        raise MetricsError(f"{where}: split_by_class must be true or false")
    if not _is_number(m["started_at"]):
        raise MetricsError(f"{where}: started_at must be a unix time in seconds")
    dev = m["devices"]
    if not isinstance(dev, dict) or not all(isinstance(v, str) for v in dev.values()):
        raise MetricsError(f"{where}: devices must map rank (as a string) to a label string")
    for k in dev:
        if not k.isdigit():
            raise MetricsError(f"{where}: devices key {k!r} is not a rank")
    return m


def new_run_dir(logdir: str | os.PathLike[str], mode: str, network: str) -> Path:
    """A fresh, not yet existing directory ``LOGDIR/<mode>-<network>-<YYYYmmdd-HHMMSS>[-k]``."""
    base = Path(logdir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{mode}-{network}-{stamp}")
    return _unused(base / safe)


def _unused(path: Path) -> Path:
    """``path``, or the first of ``path-2``, ``path-3``, ... that does not exist."""
    k, cand = 2, path
    while cand.exists():
        cand, k = path.with_name(f"{path.name}-{k}"), k + 1
    return cand


PREVIOUS_DIR = ".previous"
"""Where :class:`RunWriter` moves an earlier run that sat in the directory of a new one
(``LOGDIR/.previous/<name>.<its start>``); :func:`find_runs` does not descend into it."""


def keep_aside(run_dir: str | os.PathLike[str]) -> Path | None:
    """Move the run in ``run_dir`` (its ``run.json`` and logs) to
    ``<parent>/.previous/<name>.<YYYYmmdd-HHMMSS of its start>[-k]`` and return where it went;
    ``None`` when ``run_dir`` holds no run."""
    d = Path(run_dir)
    if not (d / RUN_FILE).exists() and not any(d.glob("*.jsonl")):
        return None
    started = None
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        started = float(json.loads((d / RUN_FILE).read_text())["started_at"])
    if started is None:
        started = (d / RUN_FILE).stat().st_mtime if (d / RUN_FILE).exists() else time.time()
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(started))
    dest_dir = d.parent / PREVIOUS_DIR
    dest_dir.mkdir(parents=True, exist_ok=True)
    dest = _unused(dest_dir / f"{d.name}.{stamp}")
    os.rename(d, dest)
    return dest


class RunWriter:
    """Create a run directory and its ``run.json``.

    ``meta`` must hold every key of :data:`RUN_KEYS` (build it with :func:`run_meta` to get
    defaults); extra keys are kept. A directory that already holds a run is an error, unless
    ``keep_previous=True``, which first moves that run to ``LOGDIR/.previous/`` (see
    :func:`keep_aside`; :attr:`previous` says where), or ``overwrite=True``, which deletes its
    ``worker-*.jsonl`` and ``traffic-*.jsonl`` files so two runs never mix in one directory.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        meta: Mapping[str, Any],
        overwrite: bool = False,
        keep_previous: bool = False,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.meta = validate_meta(meta)
        self.previous: Path | None = None
        path = self.run_dir / RUN_FILE
        if keep_previous and not overwrite:
            self.previous = keep_aside(self.run_dir)
        if path.exists():
            if not overwrite:
                raise MetricsError(
                    f"{path} already exists; fix: log each run to a new directory "
                    "(hetps.metrics.new_run_dir), or pass keep_previous=True to move the old "
                    "run aside or overwrite=True to delete its logs"
                )
            for pattern in ("worker-*.jsonl", "traffic-*.jsonl"):
                for old in self.run_dir.glob(pattern):
                    old.unlink()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        _write_json_atomic(path, self.meta)

    @classmethod
    def reopen(cls, run_dir: str | os.PathLike[str]) -> RunWriter:
        """The writer of the run already in ``run_dir`` (a resumed run goes on in its log)."""
        self = cls.__new__(cls)
        self.run_dir = Path(run_dir)
        self.previous = None
        self.meta = validate_meta(json.loads((self.run_dir / RUN_FILE).read_text()))
        self._lock = threading.Lock()
        return self

    @property
    def started_at(self) -> float:
        """The run's start (unix time); every ``t`` in the logs counts from it."""
        return float(self.meta["started_at"])

    def update(self, **extra: Any) -> None:
        """Add or replace keys of ``run.json`` (e.g. ``finished_at``), rewriting it atomically."""
        with self._lock:
            meta = dict(self.meta)
            with contextlib.suppress(OSError, ValueError):  # keep keys another writer added
                on_disk = json.loads((self.run_dir / RUN_FILE).read_text())  # (live_job)
                meta = {**on_disk, **meta} if isinstance(on_disk, dict) else meta
            meta.update(extra)
            self.meta = validate_meta(meta)
            _write_json_atomic(self.run_dir / RUN_FILE, self.meta)


class IterationLog:
    """Append one JSON line per iteration to ``RUN/worker-<rank>.jsonl``.

    Each :meth:`write` validates the record (every key of :data:`ITERATION_KEYS`, numbers
    where numbers belong, ``rank`` equal to this log's rank, ``accuracy`` null or in [0, 1]),
    converts NumPy/torch scalars, and flushes the line, so a killed run keeps every finished
    iteration. The file is opened for appending (a recovered worker continues its log).

    ``started_at`` is the run's start (unix time); by default it is read from ``run.json`` if
    that exists, else the moment the log is opened. :meth:`now` gives ``t`` for a record.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        rank: int,
        started_at: float | None = None,
    ) -> None:
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise MetricsError(f"rank must be an integer >= 0, got {rank!r}")
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if started_at is None:
            try:
                started_at = float(json.loads((self.run_dir / RUN_FILE).read_text())["started_at"])
            except (OSError, ValueError, KeyError, TypeError):
                started_at = time.time()
        self.started_at = float(started_at)
        self.path = self.run_dir / f"worker-{rank}.jsonl"
        self._lock = threading.Lock()
        self._fh: Any = open(self.path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115

    def now(self) -> float:
        """Seconds since the run's start (wall clock): the ``t`` of an iteration ending now."""
        return time.time() - self.started_at

    def write(self, record: Mapping[str, Any]) -> dict[str, Any]:
        """Validate ``record``, append it as one line and flush; returns what was written."""
        rec = validate_record(record, where=str(self.path))
        if rec["rank"] != self.rank:
            raise MetricsError(
                f"{self.path}: record has rank {rec['rank']} but this is worker {self.rank}'s log"
            )
        line = json.dumps(rec, separators=(",", ":"), allow_nan=False) + "\n"
        with self._lock:
            if self._fh is None:
                raise MetricsError(f"{self.path}: write after close()")
            self._fh.write(line)
            self._fh.flush()
        return rec

    def close(self) -> None:
        """Close the file (idempotent)."""
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None

    def __enter__(self) -> IterationLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def validate_record(record: Mapping[str, Any], where: str = "record") -> dict[str, Any]:
    """Check one iteration record against the format; returns it as plain JSON data."""
    if not isinstance(record, Mapping):
        raise MetricsError(f"{where}: a record must be a dict, got {type(record).__name__}")
    rec = plain(dict(record))
    missing = [k for k in ITERATION_KEYS if k not in rec]
    if missing:
        raise MetricsError(
            f"{where}: record misses {', '.join(missing)}; fix: every record has "
            f"{', '.join(ITERATION_KEYS)} (see docs/METRICS.md)"
        )
    for k in ITERATION_KEYS:
        v = rec[k]
        if k == "loss" and v is None:
            continue
        if not _is_number(v):
            raise MetricsError(f"{where}: {k} must be a number, got {v!r}")
        if k in _INT_KEYS and isinstance(v, float):
            if not v.is_integer():
                raise MetricsError(f"{where}: {k} must be an integer, got {v!r}")
            rec[k] = int(v)
        if k in _NONNEG_KEYS and v < 0:
            raise MetricsError(f"{where}: {k} must be >= 0, got {v!r}")
    acc = rec.get("accuracy")
    if acc is not None and (not _is_number(acc) or not 0.0 <= acc <= 1.0):
        raise MetricsError(
            f"{where}: accuracy must be a fraction in [0, 1] or null, got {acc!r} "
            "(fix: divide a percentage by 100)"
        )
    return rec
