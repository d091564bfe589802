"""Metrics: per-iteration JSON-lines logs, traffic timelines, summaries and figures.

This layer imports no other hetps module, so every layer may record. Figures
(:mod:`hetps.metrics.plot`) need matplotlib and are imported only on use.
The log format is documented in docs/METRICS.md.
"""

from hetps.metrics.records import (
    ITERATION_KEYS,
    MODES,
    RUN_KEYS,
    IterationLog,
    MetricsError,
    RunNotFoundError,
    RunWriter,
    new_run_dir,
    run_meta,
    validate_record,
)
from hetps.metrics.runs import Run, find_runs, load_run
from hetps.metrics.summary import (
    THRESHOLDS,
    format_summary,
    load_runs,
    summarize,
    summarize_run,
)
from hetps.metrics.traffic import TrafficRecorder, load_traffic

__all__ = [
    "ITERATION_KEYS",
    "MODES",
    "RUN_KEYS",
    "THRESHOLDS",
    "IterationLog",
    "MetricsError",
    "Run",
    "RunNotFoundError",
    "RunWriter",
    "TrafficRecorder",
    "find_runs",
    "format_summary",
    "load_run",
    "load_runs",
    "load_traffic",
    "new_run_dir",
    "run_meta",
    "summarize",
    "summarize_run",
    "validate_record",
]
