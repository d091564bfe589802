"""Run directories read back (:func:`load_run`, :func:`find_runs`): they tolerate the torn
last line a killed run leaves behind, and fail with a message that names the file and line
for anything else (docs/METRICS.md)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetps.metrics.records import (
    ITERATION_KEYS,
    PREVIOUS_DIR,
    RUN_FILE,
    MetricsError,
    RunNotFoundError,
    read_jsonl,
    validate_meta,
)

_WORKER_FILE = re.compile(r"^worker-(\d+)\.jsonl$")


@dataclass
class Run:
    """One run directory, read: ``meta`` (run.json) and ``records[rank]`` (iterations in order).

    ``truncated`` lists the files whose torn last line was dropped (the run was killed).
    """

    run_dir: Path
    meta: dict[str, Any]
    records: dict[int, list[dict[str, Any]]]
    truncated: list[Path] = field(default_factory=list)

    @property
    def mode(self) -> str:
        """Training mode (``esync``, ``sync``, ``async``, ``dcasgd`` or ``local``)."""
        return str(self.meta.get("mode"))

    @property
    def network(self) -> str:
        """Model name."""
        return str(self.meta.get("network"))

    @property
    def workers(self) -> int:
        """Number of workers in run.json."""
        return int(self.meta.get("workers") or len(self.records))

    @property
    def split_by_class(self) -> bool:
        """True for a non-i.i.d. (by class) data split."""
        return bool(self.meta.get("split_by_class", False))

    @property
    def slowdown(self) -> list[float]:
        """Emulated slowdown factor per worker (1 = real speed)."""
        return [float(x) for x in self.meta.get("slowdown") or []]

    @property
    def heterogeneous(self) -> bool:
        """True if any worker ran with an emulated slowdown (factor != 1)."""
        return any(s != 1 for s in self.slowdown)

    @property
    def ranks(self) -> list[int]:
        """Ranks that wrote a log, ascending."""
        return sorted(self.records)

    def device_label(self, rank: int) -> str:
        """The device label of ``rank`` from run.json ``devices`` (``worker<r>`` if absent)."""
        dev = self.meta.get("devices") or {}
        return str(dev.get(str(rank), f"worker{rank}"))

    def get(self, key: str) -> Any:
        """A run-level value: run.json's ``key``, else the first record that has it, else None."""
        if self.meta.get(key) is not None:
            return self.meta[key]
        return next((rec[key] for rec in self.iter_records() if rec.get(key) is not None), None)

    def iter_records(self) -> Iterator[dict[str, Any]]:
        """Every record of every worker (by rank, then in file order)."""
        for rank in self.ranks:
            yield from self.records[rank]

    @property
    def name(self) -> str:
        """The run directory's name."""
        return self.run_dir.name or str(self.run_dir)


def load_run(run_dir: str | os.PathLike[str]) -> Run:
    """Read a run directory: ``run.json`` and every ``worker-<rank>.jsonl``.

    Raises :class:`RunNotFoundError` if ``run.json`` is missing and :class:`MetricsError` for
    a corrupt ``run.json`` or log line (other than a torn last line, which is dropped).
    """
    d = Path(run_dir)
    path = d / RUN_FILE
    if not path.is_file():
        raise RunNotFoundError(
            f"{d}: no {RUN_FILE} here, so this is not a hetps run directory "
            "(fix: point at a directory written by hetps train / RunWriter, or at a LOGDIR "
            "holding such directories)"
        )
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise MetricsError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from e
    if not isinstance(meta, dict):
        raise MetricsError(f"{path}: expected a JSON object")
    meta = validate_meta(meta, where=str(path))
    records: dict[int, list[dict[str, Any]]] = {}
    truncated: list[Path] = []
    for f in sorted(d.iterdir()):
        m = _WORKER_FILE.match(f.name)
        if not m or not f.is_file():
            continue
        records[int(m.group(1))], torn = read_jsonl(f, ITERATION_KEYS)
        if torn:
            truncated.append(f)
    return Run(run_dir=d, meta=meta, records=records, truncated=truncated)


def find_runs(logdir: str | os.PathLike[str]) -> list[Path]:
    """Every directory under ``logdir`` (itself included, any depth) holding a ``run.json``,
    sorted by path; runs moved aside to a ``.previous`` folder are left out (name one to read
    it). Raises :class:`FileNotFoundError` if ``logdir`` does not exist."""
    base = Path(logdir)
    if not base.is_dir():
        raise FileNotFoundError(f"{base}: no such log directory")
    found = []
    for root, dirs, files in os.walk(base):
        dirs[:] = sorted(d for d in dirs if d != PREVIOUS_DIR)
        if RUN_FILE in files:
            found.append(Path(root))
    return sorted(found)
