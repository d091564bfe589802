"""The figure registry: :data:`FIGURES`, the :func:`figure` decorator, and the
:class:`PlotContext` every figure function gets.

The figure modules (:mod:`hetps.metrics.plot_training`, :mod:`hetps.metrics.plot_balance`)
register their figures when imported. :data:`FIGURES` keeps the order of registration, which
is the drawing order: :mod:`hetps.metrics.plot` imports the training figures, then the
load-balancing ones, and draws them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetps.metrics.records import Run

__all__ = ["FIGURES", "FigureFn", "PlotContext", "figure"]

_DPI = 120


@dataclass
class PlotContext:
    """What a figure function gets: the runs (with their summaries, same order), the output
    directory, the runs chosen for per-run figures, an optional time window, and a list for
    notes about skipped figures."""

    runs: list[Run]
    summaries: list[dict[str, Any]]
    out: Path
    timeline_runs: list[Run]
    window: tuple[float, float] | None = None
    notes: list[str] = field(default_factory=list)

    def new_figure(self, width: float = 8.0, height: float = 4.8) -> Any:
        """A fresh matplotlib ``Figure`` on an Agg canvas."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(width, height), dpi=_DPI, layout="constrained")
        FigureCanvasAgg(fig)
        return fig

    def save(self, fig: Any, name: str) -> Path:
        """Save ``fig`` as ``out/name`` (PNG) and return the path."""
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / name
        fig.savefig(path, format="png", bbox_inches="tight")
        return path

    def pairs(self) -> list[tuple[Run, dict[str, Any]]]:
        """``[(run, summary)]`` in order."""
        return list(zip(self.runs, self.summaries, strict=True))


FigureFn = Callable[[PlotContext], list[Path]]
#: Figure functions by name, in drawing order (register with :func:`figure`).
FIGURES: dict[str, FigureFn] = {}


def figure(name: str) -> Callable[[FigureFn], FigureFn]:
    """Decorator registering a figure function under ``name`` in :data:`FIGURES`."""

    def deco(fn: FigureFn) -> FigureFn:
        FIGURES[name] = fn
        return fn

    return deco
