"""Figures of a log directory as PNG files (``hetps plot LOGDIR [--out DIR]``).

matplotlib is imported only when a figure is drawn (``pip install 'hetps[plots]'``), and only
through its object API with the Agg canvas: no pyplot, no global backend switch, safe to call
from a notebook or a thread.

Every figure is a function ``fn(ctx: PlotContext) -> list[Path]`` registered in
:data:`FIGURES` with :func:`figure`; it returns the files it wrote, or ``[]`` after adding a
note to ``ctx.notes`` saying why it was skipped. New figures (the load-balance ones below are
the model) are one decorated function each.

Figures:

- ``accuracy_vs_time_iid.png`` / ``accuracy_vs_time_noniid.png``: rank 0's test accuracy over
  wall time, one curve per run (mode/network), runs split by run.json ``split_by_class``;
- ``throughput.png``: samples/s, bars per mode grouped by network;
- ``traffic.png``: MB/s pushed and pulled, bars per mode grouped by network;
- ``computing_time_ratio.png``: per-device computing-time ratio, grouped by mode;
- ``traffic_timeline.png`` (one run) or ``traffic_timeline_<run>.png`` (several): bytes/s on
  every link over time, push and pull separately, one panel per node, iteration ends marked;
- load balancing (drawn when the logs carry the keys): ``speed_per_scheme.png`` (``scheme``),
  ``srit_over_iterations.png`` (``srit_s``), ``asrit_vs_slice_size.png`` (``slice_size``),
  ``overhead.png`` (``overhead_s``).

Titles say when workers were slowed down on purpose (run.json ``slowdown`` != 1).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hetps.metrics.records import MetricsError, Run
from hetps.metrics.summary import (
    THRESHOLDS,
    accuracy_curve,
    computing_time_ratios,
    load_runs,
    summarize_run,
)
from hetps.metrics.traffic import load_traffic

__all__ = ["FIGURES", "PlotContext", "PlotResult", "figure", "plot", "select_run"]

MODE_ORDER = ("local", "sync", "async", "dcasgd", "esync")
MODE_COLORS = {
    "esync": "#d62728",
    "sync": "#1f77b4",
    "async": "#2ca02c",
    "dcasgd": "#9467bd",
    "local": "#555555",
}
_CYCLE = [
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


@dataclass
class PlotResult:
    """What :func:`plot` did: files written and notes about figures it skipped."""

    written: list[Path]
    notes: list[str]


FigureFn = Callable[[PlotContext], list[Path]]
#: Figure functions by name, in drawing order (register with :func:`figure`).
FIGURES: dict[str, FigureFn] = {}


def figure(name: str) -> Callable[[FigureFn], FigureFn]:
    """Decorator registering a figure function under ``name`` in :data:`FIGURES`."""

    def deco(fn: FigureFn) -> FigureFn:
        FIGURES[name] = fn
        return fn

    return deco


# --------------------------------------------------------------------------------------------
# Labels, titles, bars


def _slowdown_text(run: Run) -> str:
    return ",".join(f"{s:g}" for s in run.slowdown)


def _title(base: str, runs: Sequence[Run]) -> str:
    """``base`` plus "(emulated heterogeneity: --slowdown …)" when any run was slowed down."""
    het = [r for r in runs if r.heterogeneous]
    if not het:
        return base
    texts = list(dict.fromkeys(_slowdown_text(r) for r in het))
    note = "emulated heterogeneity: --slowdown " + " | ".join(texts)
    if len(het) < len(runs):
        note += f" in {len(het)} of {len(runs)} runs"
    return f"{base}\n({note})"


def _mode_key(mode: str) -> int:
    return MODE_ORDER.index(mode) if mode in MODE_ORDER else len(MODE_ORDER)


def _labels(runs: Sequence[Run], with_network: bool, base: str = "mode") -> list[str]:
    """One unique label per run: its mode (or scheme) plus whatever differs between the runs."""
    varying = []
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
    for key, fn in checks:
        if key == base:
            continue
        vals = {fn(r) for r in runs}
        if len(vals) > 1:
            varying.append(fn)
    labels = []
    for r in runs:
        head = str(r.get("scheme")) if base == "scheme" else r.mode
        parts = [head] + ([r.network] if with_network else [])
        parts += [v for fn in varying if (v := fn(r)) is not None]
        labels.append(" ".join(p for p in parts if p))
    # labels must be unique among runs drawn side by side: per network when it is not shown
    keys = [(None if with_network else r.network, lab) for r, lab in zip(runs, labels, strict=True)]
    seen: dict[tuple[str | None, str], int] = {}
    out = []
    for key, lab in zip(keys, labels, strict=True):
        seen[key] = seen.get(key, 0) + 1
        out.append(lab if keys.count(key) == 1 else f"{lab} #{seen[key]}")
    return out


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


def _hue_colors(
    hues: Sequence[str], keys: Sequence[str], palette: dict[str, str] | None = None
) -> dict[str, Any]:
    """A colour per hue: the colour of its key (mode or scheme) in ``palette`` (default
    :data:`MODE_COLORS`; unknown keys take the next free colour), in lighter/darker shades
    for further hues with the same key."""
    palette = dict(MODE_COLORS if palette is None else palette)
    free = [c for c in _CYCLE if c not in palette.values()] or _CYCLE
    seen: dict[str, int] = {}
    out: dict[str, Any] = {}
    for h, key in zip(hues, keys, strict=True):
        if key not in palette:
            palette[key] = free[len(palette) % len(free)]
        k = seen.get(key, 0)
        seen[key] = k + 1
        out[h] = _shade(palette[key], k)
    return out


def _xticks(ax: Any, positions: Sequence[float], labels: Sequence[str]) -> None:
    """Tick labels, slanted when long."""
    if max((len(lab) for lab in labels), default=0) > 14:
        ax.set_xticks(positions, labels, fontsize=7, rotation=20, ha="right")
    else:
        ax.set_xticks(positions, labels, fontsize=8)


def _grouped_bars(
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
    _xticks(ax, centers, list(groups))
    ax.margins(y=0.12)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)


def _scheme_key(scheme: Any) -> int:
    order = list(SCHEME_COLORS)
    return order.index(scheme) if scheme in order else len(order)


def _sorted_pairs(
    pairs: list[tuple[Run, dict[str, Any]]], by_scheme: bool = False
) -> list[tuple[Run, dict[str, Any]]]:
    def key(p: tuple[Run, dict[str, Any]]) -> tuple[Any, ...]:
        r = p[0]
        head = _scheme_key(r.get("scheme")) if by_scheme else _mode_key(r.mode)
        return (head, r.network, str(r.run_dir))

    return sorted(pairs, key=key)


def _bars_by_network(
    ctx: PlotContext,
    pairs: list[tuple[Run, dict[str, Any]]],
    value: Callable[[dict[str, Any]], float | None],
    name: str,
    title: str,
    ylabel: str,
    base: str = "mode",
    fmt: str = "{:.3g}",
) -> list[Path]:
    """One bar per run: clusters by network, colours by mode (or scheme)."""
    pairs = _sorted_pairs(pairs, by_scheme=base == "scheme")
    runs = [r for r, _ in pairs]
    labels = _labels(runs, with_network=False, base=base)
    groups = list(dict.fromkeys(r.network for r in runs))
    hues = list(dict.fromkeys(labels))
    values = {(r.network, lab): value(s) for (r, s), lab in zip(pairs, labels, strict=True)}
    if base == "scheme":
        key = {lab: str(r.get("scheme")) for r, lab in zip(runs, labels, strict=True)}
        colors = _hue_colors(hues, [key[h] for h in hues], SCHEME_COLORS)
    else:
        key = {lab: r.mode for r, lab in zip(runs, labels, strict=True)}
        colors = _hue_colors(hues, [key[h] for h in hues])
    fig = ctx.new_figure(min(16.0, max(6.0, 2.0 + 0.45 * len(pairs))), 4.6)
    ax = fig.subplots()
    _grouped_bars(ax, groups, hues, values, colors, fmt)
    ax.set_ylabel(ylabel)
    ax.set_title(_title(title, runs), fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return [ctx.save(fig, name)]


# --------------------------------------------------------------------------------------------
# ESync figures


def _accuracy(ctx: PlotContext, non_iid: bool) -> list[Path]:
    kind = "non-i.i.d." if non_iid else "i.i.d."
    name = f"accuracy_vs_time_{'noniid' if non_iid else 'iid'}.png"
    runs = [r for r in ctx.runs if r.split_by_class == non_iid]
    runs = sorted(runs, key=lambda r: (_mode_key(r.mode), r.network, str(r.run_dir)))
    curves = [(r, accuracy_curve(r)) for r in runs]
    curves = [(r, c) for r, c in curves if c]
    if not curves:
        what = "runs" if not runs else "evaluated runs (records with accuracy)"
        ctx.notes.append(f"{name}: skipped, no {kind} {what} (run.json split_by_class)")
        return []
    fig = ctx.new_figure(8.0, 5.0)
    ax = fig.subplots()
    labels = _labels([r for r, _ in curves], with_network=True)
    networks = list(dict.fromkeys(r.network for r, _ in curves))
    styles = ["-", "--", "-.", ":"]
    colors = _hue_colors(labels, [r.mode for r, _ in curves])
    for (r, c), lab in zip(curves, labels, strict=True):
        t, a = zip(*c, strict=True)
        ax.plot(
            t,
            a,
            styles[networks.index(r.network) % len(styles)],
            color=colors[lab],
            marker="o",
            markersize=3,
            label=lab,
        )
    for thr in THRESHOLDS:
        ax.axhline(thr, color="0.6", lw=0.7, ls=":", zorder=0)
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("test accuracy")
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(
        _title(f"Test accuracy vs time ({kind} data)", [r for r, _ in curves]), fontsize=10
    )
    return [ctx.save(fig, name)]


@figure("accuracy_vs_time_iid")
def fig_accuracy_iid(ctx: PlotContext) -> list[Path]:
    """Test accuracy vs wall time, runs with i.i.d. data."""
    return _accuracy(ctx, non_iid=False)


@figure("accuracy_vs_time_noniid")
def fig_accuracy_noniid(ctx: PlotContext) -> list[Path]:
    """Test accuracy vs wall time, runs with data split by class."""
    return _accuracy(ctx, non_iid=True)


@figure("throughput")
def fig_throughput(ctx: PlotContext) -> list[Path]:
    """Data throughput (samples/s) per mode, grouped by network."""
    pairs = [(r, s) for r, s in ctx.pairs() if s["throughput_samples_per_s"] is not None]
    if not pairs:
        ctx.notes.append("throughput.png: skipped, no run has iteration records")
        return []
    return _bars_by_network(
        ctx,
        pairs,
        lambda s: s["throughput_samples_per_s"],
        "throughput.png",
        "Data throughput",
        "samples / s",
        fmt="{:.0f}",
    )


@figure("traffic")
def fig_traffic(ctx: PlotContext) -> list[Path]:
    """Traffic load (MB/s pushed and pulled by all workers) per mode, grouped by network."""
    pairs = _sorted_pairs(
        [(r, s) for r, s in ctx.pairs() if s["traffic_mb_per_s"]["push"] is not None]
    )
    if not pairs:
        ctx.notes.append("traffic.png: skipped, no run has iteration records")
        return []
    runs = [r for r, _ in pairs]
    labels = _labels(runs, with_network=False)
    groups = list(dict.fromkeys(r.network for r in runs))
    hues = list(dict.fromkeys(labels))
    modes = {lab: r.mode for r, lab in zip(runs, labels, strict=True)}
    colors = _hue_colors(hues, [modes[h] for h in hues])
    fig = ctx.new_figure(min(18.0, max(9.0, 2.5 + 0.9 * len(pairs))), 4.6)
    axes = fig.subplots(1, 2, sharey=True)
    for ax, kind in zip(axes, ("push", "pull"), strict=True):
        vals = {
            (r.network, lab): s["traffic_mb_per_s"][kind]
            for (r, s), lab in zip(pairs, labels, strict=True)
        }
        _grouped_bars(ax, groups, hues, vals, colors, "{:.3g}")
        ax.set_title(
            f"{kind} (workers → servers)" if kind == "push" else f"{kind} (servers → workers)",
            fontsize=9,
        )
    axes[0].set_ylabel("MB / s (all workers)")
    axes[1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(_title("Traffic load", runs), fontsize=10)
    return [ctx.save(fig, "traffic.png")]


@figure("computing_time_ratio")
def fig_computing_time_ratio(ctx: PlotContext) -> list[Path]:
    """Computing-time ratio per device, bars per device grouped by mode; a panel per network."""
    pairs = _sorted_pairs([(r, s) for r, s in ctx.pairs() if s["computing_time_ratio"]])
    if not pairs:
        ctx.notes.append("computing_time_ratio.png: skipped, no run has iteration records")
        return []
    networks = list(dict.fromkeys(r.network for r, _ in pairs))
    ranks = sorted({rank for r, _ in pairs for rank in r.ranks})
    # A legend label per rank: the device label if every run agrees, else "worker<r>".
    rank_label = {}
    for rank in ranks:
        labs = {r.device_label(rank) for r, _ in pairs if rank in r.records}
        rank_label[rank] = labs.pop() if len(labs) == 1 else f"worker{rank}"
    colors = {rank: _CYCLE[i % len(_CYCLE)] for i, rank in enumerate(ranks)}
    nbars = [
        sum(len(computing_time_ratios(r)) + 1 for r, _ in pairs if r.network == net)
        for net in networks
    ]
    fig = ctx.new_figure(min(20.0, max(7.0, 2.5 + 0.3 * sum(nbars))), 5.0)
    axes = np.atleast_1d(
        fig.subplots(
            1, len(networks), sharey=True, squeeze=False, gridspec_kw={"width_ratios": nbars}
        )[0]
    )
    top = 1.0
    rot = 90 if sum(nbars) > 20 else 0
    for ax, net in zip(axes, networks, strict=True):
        sub = [(r, s) for r, s in pairs if r.network == net]
        labels = _labels([r for r, _ in sub], with_network=False)
        x = 0.0
        centers = []
        for r, _s in sub:
            ratios = computing_time_ratios(r)
            start = x
            for rank in ranks:
                if rank not in ratios:
                    continue
                y = ratios[rank]
                top = max(top, y)
                bar = ax.bar([x], [y], 0.9, color=colors[rank], label=rank_label[rank])
                ax.bar_label(bar, labels=[f"{y:.2f}"], fontsize=6, padding=1, rotation=rot)
                x += 1.0
            centers.append((start + x - 1.0) / 2 if x > start else start)
            x += 1.0
        _xticks(ax, centers, labels)
        ax.set_title(net, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    axes[0].set_ylim(0, top * 1.12)
    axes[0].set_ylabel("computing time / wall time")
    handles: list[Any] = []
    labs: list[str] = []
    for ax in axes:
        for hh, ll in zip(*ax.get_legend_handles_labels(), strict=True):
            if ll not in labs:
                handles.append(hh)
                labs.append(ll)
    axes[-1].legend(handles, labs, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(_title("Computing-time ratio per device", [r for r, _ in pairs]), fontsize=10)
    return [ctx.save(fig, "computing_time_ratio.png")]


def _slug(run: Run, base: Path | None) -> str:
    try:
        rel = run.run_dir.resolve().relative_to(base.resolve()) if base else Path(run.name)
    except ValueError:
        rel = Path(run.name)
    text = str(rel) if str(rel) not in ("", ".") else run.name
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "run"


def _timeline(ctx: PlotContext, run: Run, name: str) -> Path | None:
    from matplotlib.ticker import FuncFormatter

    traffic = load_traffic(run.run_dir)
    traffic = {k: v for k, v in traffic.items() if v}
    if not traffic:
        ctx.notes.append(
            f"{name}: skipped for {run.run_dir}, no traffic-<role><rank>.jsonl files "
            "(the run had no TrafficRecorder)"
        )
        return None
    dts = {float(b["dt"]) for bs in traffic.values() for b in bs}
    dt = min(dts)
    t_all = [float(b["t"]) for bs in traffic.values() for b in bs]
    lo, hi = min(t_all), max(t_all)
    if ctx.window is not None:
        lo, hi = max(lo, ctx.window[0]), min(hi, ctx.window[1])
        if hi < lo:
            ctx.notes.append(f"{name}: skipped for {run.run_dir}, no traffic in the window")
            return None
    else:
        lo = min(lo, 0.0)
    i0, i1 = int(np.floor(lo / dt + 1e-9)), int(np.floor(hi / dt + 1e-9))
    grid = (np.arange(i0, i1 + 2)) * dt
    peers = sorted(
        {b["peer"] for bs in traffic.values() for b in bs},
        key=lambda p: (0, p, "") if isinstance(p, (int, float)) else (1, 0, str(p)),
    )
    colors = {p: _CYCLE[i % len(_CYCLE)] for i, p in enumerate(peers)}
    nodes = list(traffic)
    fig = ctx.new_figure(11.0, 1.2 + 1.9 * len(nodes))
    axes = np.atleast_1d(fig.subplots(len(nodes), 1, sharex=True, squeeze=False)[:, 0])
    for ax, node in zip(axes, nodes, strict=True):
        series: dict[Any, np.ndarray] = {}
        for b in traffic[node]:
            i = int(np.floor(float(b["t"]) / dt + 1e-9)) - i0
            if not 0 <= i <= i1 - i0:
                continue
            arr = series.setdefault(b["peer"], np.zeros((2, len(grid))))
            # bytes/s in MB/s; a wider bucket than dt is spread evenly over its span
            width = max(1, round(float(b["dt"]) / dt))
            span = slice(i, min(i + width, len(grid) - 1))
            arr[0, span] += b["push_bytes"] / (width * dt) / 1e6
            arr[1, span] += b["pull_bytes"] / (width * dt) / 1e6
        # stacked bands, one per peer: push stacked upwards, pull downwards
        below = np.zeros((2, len(grid)))
        for peer in peers:
            if peer not in series:
                continue
            top = below + series[peer]
            c = colors[peer]
            for k, sign in ((0, 1.0), (1, -1.0)):
                if series[peer][k].any():
                    ax.fill_between(
                        grid, sign * below[k], sign * top[k], step="post", color=c, alpha=0.45, lw=0
                    )
                    ax.step(grid, sign * top[k], where="post", color=c, lw=0.8)
            ax.fill_between([], [], [], color=c, alpha=0.45, label=str(peer))  # legend entry
            below = top
        ax.axhline(0, color="0.2", lw=0.6)
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{abs(v):g}"))
        ymax = max(float(below.max()), 1e-9)
        ax.set_ylim(-ymax * 1.12, ymax * 1.12)
        m = re.match(r"worker(\d+)$", node)
        if m and int(m.group(1)) in run.records:
            ends = [float(rec["t"]) for rec in run.records[int(m.group(1))]]
            ends = [t for t in ends if lo <= t <= hi + dt]
            if ends and len(ends) <= 400:
                ax.vlines(
                    ends, 0, 1, transform=ax.get_xaxis_transform(), colors="0.75", lw=0.6, zorder=0
                )
        label = node
        if m:
            label = run.device_label(int(m.group(1)))
        ax.set_ylabel(f"{label}\nMB/s: push ↑ pull ↓", fontsize=8)
        ax.grid(alpha=0.25)
        ax.legend(
            fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="peer", title_fontsize=7
        )
    axes[-1].set_xlabel("time since run start (s)")
    axes[-1].set_xlim(grid[0], grid[-1])
    title = _title(f"Traffic per link over time: {run.mode} / {run.network}  ({run.name})", [run])
    title += (
        f"\nMB/s stacked by peer: push above the axis, pull below; buckets of {dt * 1000:g} ms; "
        "grey lines: iteration ends"
    )
    fig.suptitle(title, fontsize=10)
    return ctx.save(fig, name)


@figure("traffic_timeline")
def fig_traffic_timeline(ctx: PlotContext) -> list[Path]:
    """Bytes/s on every link over time (push and pull), one file per chosen run."""
    runs = ctx.timeline_runs
    if not runs:
        ctx.notes.append("traffic_timeline.png: skipped, no runs")
        return []
    base = (
        Path(os.path.commonpath([str(r.run_dir.resolve()) for r in runs]))
        if len(runs) > 1
        else None
    )
    out = []
    for r in runs:
        name = (
            "traffic_timeline.png" if len(runs) == 1 else f"traffic_timeline_{_slug(r, base)}.png"
        )
        p = _timeline(ctx, r, name)
        if p is not None:
            out.append(p)
    return out


# --------------------------------------------------------------------------------------------
# Load-balancing figures (drawn only when the logs carry the keys)


@figure("speed_per_scheme")
def fig_speed_per_scheme(ctx: PlotContext) -> list[Path]:
    """Training speed (samples/min) per model and load-balancing scheme (runs with ``scheme``)."""
    pairs = [
        (r, s)
        for r, s in ctx.pairs()
        if s["scheme"] is not None and s["speed_samples_per_min"] is not None
    ]
    if not pairs:
        ctx.notes.append("speed_per_scheme.png: skipped, no run records a 'scheme'")
        return []
    return _bars_by_network(
        ctx,
        pairs,
        lambda s: s["speed_samples_per_min"],
        "speed_per_scheme.png",
        "Training speed per model and scheme",
        "samples / min",
        base="scheme",
        fmt="{:.0f}",
    )


@figure("srit_over_iterations")
def fig_srit(ctx: PlotContext) -> list[Path]:
    """Single-round iteration time over iterations, one line per run (records with ``srit_s``)."""
    series = []
    for r in ctx.runs:
        rank = 0 if 0 in r.records else (r.ranks[0] if r.ranks else None)
        if rank is None:
            continue
        pts = [
            (float(rec["iter"]), float(rec["srit_s"]))
            for rec in r.records[rank]
            if rec.get("srit_s") is not None
        ]
        if pts:
            series.append((r, pts))
    if not series:
        ctx.notes.append("srit_over_iterations.png: skipped, no record has 'srit_s'")
        return []
    runs = [r for r, _ in series]
    base = "scheme" if all(r.get("scheme") is not None for r in runs) else "mode"
    series.sort(
        key=lambda rp: (
            _scheme_key(rp[0].get("scheme")) if base == "scheme" else _mode_key(rp[0].mode),
            str(rp[0].run_dir),
        )
    )
    networks = list(dict.fromkeys(r.network for r, _ in series))
    fig = ctx.new_figure(9.0, 1.0 + 3.2 * len(networks))
    axes = np.atleast_1d(fig.subplots(len(networks), 1, squeeze=False)[:, 0])
    ymax = max(y for _, pts in series for _, y in pts) or 1.0
    for ax, net in zip(axes, networks, strict=True):
        sub = [(r, pts) for r, pts in series if r.network == net]
        labels = _labels([r for r, _ in sub], with_network=False, base=base)
        if base == "scheme":
            keys = [str(r.get("scheme")) for r, _ in sub]
            colors = _hue_colors(labels, keys, SCHEME_COLORS)
        else:
            colors = _hue_colors(labels, [r.mode for r, _ in sub])
        for (_r, pts), lab in zip(sub, labels, strict=True):
            x, y = zip(*pts, strict=True)
            ax.plot(x, y, color=colors[lab], lw=1.0, label=lab)
        ax.set_ylabel(f"{net}\nSRIT (s)")
        ax.set_ylim(0, 1.12 * ymax)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    axes[-1].set_xlabel("iteration")
    scen = {str(r.get("scenario")) for r in runs if r.get("scenario") is not None}
    base_title = "Single-round iteration time"
    if scen:
        base_title += f" ({', '.join(sorted(scen))} network)"
    fig.suptitle(_title(base_title, runs), fontsize=10)
    return [ctx.save(fig, "srit_over_iterations.png")]


@figure("asrit_vs_slice_size")
def fig_asrit_vs_slice(ctx: PlotContext) -> list[Path]:
    """ASRIT against slice size, one line per (network, scheme) (runs with ``slice_size``)."""
    pts: dict[str, list[tuple[float, float]]] = {}
    scheme_of: dict[str, str] = {}
    used = []
    for r, s in ctx.pairs():
        if s["slice_size"] is None or s["asrit_s"] is None:
            continue
        key = r.network + (f" {s['scheme']}" if s["scheme"] is not None else "")
        pts.setdefault(key, []).append((float(s["slice_size"]), float(s["asrit_s"])))
        scheme_of[key] = str(s["scheme"])
        used.append(r)
    if not pts:
        ctx.notes.append("asrit_vs_slice_size.png: skipped, no run records a 'slice_size'")
        return []
    keys = sorted(pts)
    colors = _hue_colors(keys, [scheme_of[k] for k in keys], SCHEME_COLORS)
    fig = ctx.new_figure(7.5, 4.6)
    ax = fig.subplots()
    for key in keys:
        p = sorted(pts[key])
        x, y = zip(*p, strict=True)
        ax.plot(x, y, "o-", color=colors[key], label=key)
    ax.set_xscale("log")
    ax.set_xlabel("slice size (parameters)")
    ax.set_ylabel("ASRIT (s)")
    ax.set_ylim(0, 1.12 * max(y for p in pts.values() for _, y in p) or 1.0)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax.set_title(_title("Average single-round iteration time vs slice size", used), fontsize=10)
    return [ctx.save(fig, "asrit_vs_slice_size.png")]


@figure("overhead")
def fig_overhead(ctx: PlotContext) -> list[Path]:
    """Probing and re-planning overhead (% of run time) per run (records with ``overhead_s``)."""
    pairs = [(r, s) for r, s in ctx.pairs() if s["overhead_ratio"] is not None]
    if not pairs:
        ctx.notes.append("overhead.png: skipped, no record has 'overhead_s'")
        return []
    base = "scheme" if all(s["scheme"] is not None for _, s in pairs) else "mode"
    return _bars_by_network(
        ctx,
        pairs,
        lambda s: 100.0 * s["overhead_ratio"],
        "overhead.png",
        "Probing and re-planning overhead",
        "% of run time",
        base=base,
        fmt="{:.2f}",
    )


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
