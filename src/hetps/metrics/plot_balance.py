"""The load-balancing figures, drawn only when the logs carry their keys: training speed per
scheme (``scheme``), SRIT over iterations (``srit_s``), ASRIT against slice size
(``slice_size``) and the probing/re-planning overhead (``overhead_s``). Registered on
import, in this order."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hetps.metrics.plot_helpers import (
    SCHEME_COLORS,
    PlotContext,
    bars_by_network,
    colors_by,
    figure,
    figure_title,
    hue_colors,
    mode_key,
    run_labels,
    scheme_key,
)
from hetps.metrics.summary import eval_rank

__all__ = ["fig_asrit_vs_slice", "fig_overhead", "fig_speed_per_scheme", "fig_srit"]


@figure("speed_per_scheme")
def fig_speed_per_scheme(ctx: PlotContext) -> list[Path]:
    """Training speed (samples/min) per model and load-balancing scheme (runs with ``scheme``)."""
    pairs = [
        (r, s)
        for r, s in ctx.pairs()
        if s["scheme"] is not None and s["speed_samples_per_min"] is not None
    ]
    return bars_by_network(
        ctx,
        pairs,
        lambda s: s["speed_samples_per_min"],
        "speed_per_scheme.png",
        "Training speed per model and scheme",
        "samples / min",
        base="scheme",
        fmt="{:.0f}",
        missing="no run records a 'scheme'",
    )


@figure("srit_over_iterations")
def fig_srit(ctx: PlotContext) -> list[Path]:
    """Single-round iteration time over iterations, one line per run (records with ``srit_s``)."""
    series = []
    for r in ctx.runs:
        recs = r.records[eval_rank(r)] if r.ranks else []
        pts = [(float(x["iter"]), float(x["srit_s"])) for x in recs if x.get("srit_s") is not None]
        if pts:
            series.append((r, pts))
    if not series:
        ctx.notes.append("srit_over_iterations.png: skipped, no record has 'srit_s'")
        return []
    runs = [r for r, _ in series]
    base = "scheme" if all(r.get("scheme") is not None for r in runs) else "mode"
    head = (
        (lambda r: scheme_key(r.get("scheme"))) if base == "scheme" else lambda r: mode_key(r.mode)
    )
    series.sort(key=lambda rp: (head(rp[0]), str(rp[0].run_dir)))  # (not by network: the panels)
    networks = list(dict.fromkeys(r.network for r, _ in series))
    fig = ctx.new_figure(9.0, 1.0 + 3.2 * len(networks))
    axes = np.atleast_1d(fig.subplots(len(networks), 1, squeeze=False)[:, 0])
    ymax = max(y for _, pts in series for _, y in pts) or 1.0
    for ax, net in zip(axes, networks, strict=True):
        sub = [(r, pts) for r, pts in series if r.network == net]
        labels = run_labels([r for r, _ in sub], with_network=False, base=base)
        colors = colors_by([r for r, _ in sub], labels, base)
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
    fig.suptitle(figure_title(base_title, runs), fontsize=10)
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
    colors = hue_colors(keys, [scheme_of[k] for k in keys], SCHEME_COLORS)
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
    ax.set_title(
        figure_title("Average single-round iteration time vs slice size", used), fontsize=10
    )
    return [ctx.save(fig, "asrit_vs_slice_size.png")]


@figure("overhead")
def fig_overhead(ctx: PlotContext) -> list[Path]:
    """Probing and re-planning overhead (% of run time) per run (records with ``overhead_s``)."""
    pairs = [(r, s) for r, s in ctx.pairs() if s["overhead_ratio"] is not None]
    base = "scheme" if all(s["scheme"] is not None for _, s in pairs) else "mode"
    return bars_by_network(
        ctx,
        pairs,
        lambda s: 100.0 * s["overhead_ratio"],
        "overhead.png",
        "Probing and re-planning overhead",
        "% of run time",
        base=base,
        fmt="{:.2f}",
        missing="no record has 'overhead_s'",
    )
