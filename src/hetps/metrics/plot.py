"""Figures of a log directory as PNG files (``hetps plot LOGDIR [--out DIR]``).
(docs/MODULES.md, "hetps.metrics.plot")"""

from __future__ import annotations

import os
from collections import namedtuple
from collections.abc import Sequence
from pathlib import Path

from hetps.metrics.plot_helpers import FIGURES, PlotContext
from hetps.metrics.records import MetricsError
from hetps.metrics.runs import Run
from hetps.metrics.summary import load_runs, summarize_run

# Importing the figure modules registers their figures, in the drawing order: the training
# figures, the phase timeline, then the load-balancing ones.
# isort: split
from hetps.metrics import plot_training, plot_timeline, plot_balance  # noqa: F401, I001

__all__ = ["PlotResult", "plot", "select_run"]


#: what :func:`plot` did: files written and notes about figures it skipped
PlotResult = namedtuple("PlotResult", "written notes")


# --------------------------------------------------------------------------------------------


def select_run(runs: Sequence[Run], which: str) -> Run:
    """The run named ``which``: a run directory path, its name, or its path relative to
    LOGDIR's runs; a unique substring of the path also works."""
    target = Path(which)
    for r in runs:
        if target.exists() and r.run_dir.resolve() == target.resolve():
            return r
    exact = [r for r in runs if r.name == which or str(r.run_dir).endswith(os.sep + which)]
    if len(exact) == 1:
        return exact[0]
    part = [r for r in runs if which in str(r.run_dir)]
    if len(part) == 1:
        return part[0]
    names = ", ".join(str(r.run_dir) for r in runs) or "none"
    if not part:
        raise MetricsError(f"--run {which!r}: no such run; runs found: {names}")
    raise MetricsError(
        f"--run {which!r} matches {len(part)} runs ({', '.join(str(r.run_dir) for r in part)}); "
        "give more of the path"
    )


def plot(
    logdir: str | os.PathLike[str],
    out: str | os.PathLike[str] | None = None,
    run: str | None = None,
    window: tuple[float, float] | None = None,
    only: Sequence[str] | None = None,
    errors: list[str] | None = None,
) -> PlotResult:
    """Draw every figure of :data:`FIGURES` (or those named in ``only``) for the runs under
    ``logdir`` into ``out`` (default ``LOGDIR/figures``).

    ``run`` restricts the per-run figures (the traffic timeline) to one run (see
    :func:`select_run`); ``window`` = (start, end) seconds zooms the timeline. Unreadable runs
    raise :class:`MetricsError` unless ``errors`` is a list (then they are skipped and noted).
    Raises :class:`MetricsError` when there are no runs or matplotlib is missing.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise MetricsError("hetps plot needs matplotlib; fix: pip install 'hetps[plots]'") from e
    runs = load_runs(logdir, errors)
    if not runs:
        raise MetricsError(f"{logdir}: no run directories (no run.json below it)")
    names = list(only) if only is not None else list(FIGURES)
    unknown = [n for n in names if n not in FIGURES]
    if unknown:
        raise MetricsError(f"unknown figure(s) {', '.join(unknown)}; known: {', '.join(FIGURES)}")
    ctx = PlotContext(
        runs=runs,
        summaries=[summarize_run(r) for r in runs],
        out=Path(out) if out is not None else Path(logdir) / "figures",
        timeline_runs=[select_run(runs, run)] if run is not None else list(runs),
        window=window,
    )
    written: list[Path] = []
    for name in names:
        written.extend(FIGURES[name](ctx))
    return PlotResult(written=written, notes=ctx.notes)
