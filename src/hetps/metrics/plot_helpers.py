"""The figure registry and the drawing helpers the figure modules share.
(docs/MODULES.md, "hetps.metrics.plot_helpers")"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetps.metrics.runs import Run

__all__ = [
    "FIGURES",
    "MODE_COLORS",
    "MODE_ORDER",
    "SCHEME_COLORS",
    "FigureFn",
    "PlotContext",
    "figure",
]

_DPI = 120


def new_figure(width: float = 8.0, height: float = 4.8) -> Any:
    """A fresh matplotlib ``Figure`` on an Agg canvas."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


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

    new_figure = staticmethod(new_figure)

    def save(self, fig: Any, name: str) -> Path:
        """Save ``fig`` as ``out/name`` (PNG) and return the path."""
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / name
        fig.savefig(path, format="png", bbox_inches="tight")
        return path

    def per_run(
        self, stem: str, runs: list[Run], draw: Callable[[Run, str], Path | None], missing: str
    ) -> list[Path]:
        """``draw(run, file name)`` for each of ``runs``: ``<stem>.png`` for one run,
        ``<stem>_<its path below the runs' common folder>.png`` each for more; the files
        drawn (none, with a note saying what is ``missing``, without runs)."""
        if not runs:
            self.notes.append(f"{stem}.png: skipped, {missing}")
            return []
        base = os.path.commonpath([r.run_dir.resolve() for r in runs]) if len(runs) > 1 else ""
        names = [f"{stem}_{_slug(r, Path(base))}.png" if base else f"{stem}.png" for r in runs]
        return [p for r, n in zip(runs, names, strict=True) if (p := draw(r, n)) is not None]

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


def _slug(run: Run, base: Path) -> str:
    """``run``'s path below ``base`` as a file name's part."""
    try:
        rel = run.run_dir.resolve().relative_to(base)
    except ValueError:
        rel = Path(run.name)
    text = str(rel) if str(rel) not in ("", ".") else run.name
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "run"


MODE_ORDER = ("local", "sync", "async", "dcasgd", "esync")
MODE_COLORS = {
    "esync": "#d62728",
    "sync": "#1f77b4",
    "async": "#2ca02c",
    "dcasgd": "#9467bd",
    "local": "#555555",
}
CYCLE = [
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
]
SCHEME_COLORS = {
    "average": "#7f7f7f",
    "elastic": "#ff7f0e",
    "aware": "#1f77b4",
    "optimal": "#2ca02c",
}


# --------------------------------------------------------------------------------------------
# Labels, titles, bars


def _slowdown_text(run: Run) -> str:
    return ",".join(f"{s:g}" for s in run.slowdown)


def figure_title(base: str, runs: Sequence[Run]) -> str:
    """``base`` plus "(emulated heterogeneity: --slowdown …)" when any run was slowed down."""
    het = [r for r in runs if r.heterogeneous]
    if not het:
        return base
    texts = list(dict.fromkeys(_slowdown_text(r) for r in het))
    note = "emulated heterogeneity: --slowdown " + " | ".join(texts)
    if len(het) < len(runs):
        note += f" in {len(het)} of {len(runs)} runs"
    return f"{base}\n({note})"


def mode_key(mode: str) -> int:
    return MODE_ORDER.index(mode) if mode in MODE_ORDER else len(MODE_ORDER)


def run_labels(runs: Sequence[Run], with_network: bool, base: str = "mode") -> list[str]:
    """One unique label per run: its mode (or scheme) plus whatever differs between the runs."""
    checks: list[tuple[str, Callable[[Run], Any]]] = [
        ("split", lambda r: "non-iid" if r.split_by_class else "iid"),
        ("workers", lambda r: f"W={r.workers}"),
        (
            "slowdown",
            lambda r: f"slowdown {_slowdown_text(r)}" if r.heterogeneous else "no slowdown",
        ),
        ("scheme", lambda r: f"{r.get('scheme')}" if r.get("scheme") is not None else None),
        (
            "slice",
            lambda r: f"x={r.get('slice_size')}" if r.get("slice_size") is not None else None,
        ),
    ]
    varying = [fn for key, fn in checks if key != base and len({fn(r) for r in runs}) > 1]
    labels = []
    for r in runs:
        head = str(r.get("scheme")) if base == "scheme" else r.mode
        parts = [head] + ([r.network] if with_network else [])
        parts += [v for fn in varying if (v := fn(r)) is not None]
        labels.append(" ".join(p for p in parts if p))
    # labels must be unique among runs drawn side by side: per network when it is not shown
    keys = [(None if with_network else r.network, lab) for r, lab in zip(runs, labels, strict=True)]
    return [
        lab if keys.count(k) == 1 else f"{lab} #{keys[: i + 1].count(k)}"
        for i, (k, lab) in enumerate(zip(keys, labels, strict=True))
    ]


def _shade(color: str, k: int) -> tuple[float, float, float]:
    """``color`` for the k-th variant of a mode: 0 as is, then alternately lighter and darker."""
    from matplotlib.colors import to_rgb

    r, g, b = to_rgb(color)
    if k == 0:
        return (r, g, b)
    f = min(0.7, 0.2 * ((k + 1) // 2))
    if k % 2:  # lighter
        return (r + (1 - r) * f, g + (1 - g) * f, b + (1 - b) * f)
    return (r * (1 - f), g * (1 - f), b * (1 - f))


def hue_colors(
    hues: Sequence[str], keys: Sequence[str], palette: dict[str, str] | None = None
) -> dict[str, Any]:
    """A colour per hue: the colour of its key (mode or scheme) in ``palette`` (default
    :data:`MODE_COLORS`; unknown keys take the next free colour), in lighter/darker shades
    for further hues with the same key."""
    palette = dict(MODE_COLORS if palette is None else palette)
    free = [c for c in CYCLE if c not in palette.values()] or CYCLE
    seen: dict[str, int] = {}
    out: dict[str, Any] = {}
    for h, key in zip(hues, keys, strict=True):
        if key not in palette:
            palette[key] = free[len(palette) % len(free)]
        k = seen.get(key, 0)
        seen[key] = k + 1
        out[h] = _shade(palette[key], k)
    return out


def abs_formatter() -> Any:
    """Tick labels without the sign (pull drawn below the axis, in positive units)."""
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda v, _pos: f"{abs(v):g}")


def grouped_bars(
    ax: Any,
    groups: Sequence[str],
    hues: Sequence[str],
    values: dict[tuple[str, str], float | None],
    colors: dict[str, Any],
    fmt: str = "{:.3g}",
) -> None:
    """Bars of ``values[(group, hue)]``: one compact cluster per group (only the hues it has),
    one colour per hue, one legend entry per hue."""
    x = 0.0
    centers = []
    labelled: set[str] = set()
    total = sum(1 for g in groups for h in hues if values.get((g, h)) is not None)
    rot = 90 if total > 14 else 0
    for g in groups:
        present = [h for h in hues if values.get((g, h)) is not None]
        start = x
        for h in present:
            v = values[(g, h)]
            bar = ax.bar(
                [x],
                [v],
                0.9,
                color=colors.get(h),
                label=None if h in labelled else h,
            )
            labelled.add(h)
            ax.bar_label(bar, labels=[fmt.format(v)], fontsize=7, padding=1, rotation=rot)
            x += 1.0
        centers.append((start + x - 1.0) / 2 if present else start)
        x += 0.8  # gap between clusters
    if max((len(lab) for lab in groups), default=0) > 14:  # long labels slanted
        ax.set_xticks(centers, list(groups), fontsize=7, rotation=20, ha="right")
    else:
        ax.set_xticks(centers, list(groups), fontsize=8)
    ax.margins(y=0.12)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)


def scheme_key(scheme: Any) -> int:
    order = list(SCHEME_COLORS)
    return order.index(scheme) if scheme in order else len(order)


def sorted_pairs(
    pairs: list[tuple[Run, dict[str, Any]]], by_scheme: bool = False
) -> list[tuple[Run, dict[str, Any]]]:
    """``pairs`` by their run's mode (or scheme), network and directory."""
    head = (lambda r: scheme_key(r.get("scheme"))) if by_scheme else (lambda r: mode_key(r.mode))
    return sorted(pairs, key=lambda p: (head(p[0]), p[0].network, str(p[0].run_dir)))


def colors_by(runs: Sequence[Run], labels: Sequence[str], base: str) -> dict[str, Any]:
    """A colour per label of ``runs``: its run's mode's, or its scheme's (``base``)."""
    if base == "scheme":
        return hue_colors(labels, [str(r.get("scheme")) for r in runs], SCHEME_COLORS)
    return hue_colors(labels, [r.mode for r in runs])


def bars_by_network(
    ctx: PlotContext,
    pairs: list[tuple[Run, dict[str, Any]]],
    value: Callable[[dict[str, Any]], float | None] | dict[str, Callable],
    name: str,
    title: str,
    ylabel: str,
    base: str = "mode",
    fmt: str = "{:.3g}",
    missing: str = "no run has the value",
) -> list[Path]:
    """One bar per run: clusters by network, colours by mode (or scheme); ``value`` a
    function of a run's summary, or ``{panel title: function}`` for panels side by side.
    None, with a note saying what is ``missing``, when there are no runs."""
    if not pairs:
        ctx.notes.append(f"{name}: skipped, {missing}")
        return []
    pairs = sorted_pairs(pairs, by_scheme=base == "scheme")
    runs = [r for r, _ in pairs]
    labels = run_labels(runs, with_network=False, base=base)
    groups = list(dict.fromkeys(r.network for r in runs))
    hues = list(dict.fromkeys(labels))
    colors = colors_by(runs, labels, base)
    panels = value if isinstance(value, dict) else {"": value}
    width = min(16.0, max(6.0, 2.0 + 0.45 * len(pairs))) * (1 + 0.5 * (len(panels) - 1))
    fig = ctx.new_figure(width, 4.6)
    axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
    for ax, (sub, fn) in zip(axes, panels.items(), strict=True):
        values = {(r.network, lab): fn(s) for (r, s), lab in zip(pairs, labels, strict=True)}
        grouped_bars(ax, groups, hues, values, colors, fmt)
        ax.set_title(sub, fontsize=9)
    axes[0].set_ylabel(ylabel)
    axes[-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(figure_title(title, runs), fontsize=10)
    return [ctx.save(fig, name)]
