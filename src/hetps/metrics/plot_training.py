"""The training figures (the ESync study): test accuracy over time (i.i.d. and non-i.i.d.
data), data throughput, traffic load, computing-time ratio per device, and the traffic
timeline of single runs. Registered on import, in this order."""

from __future__ import annotations

import re
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from hetps.metrics.plot_helpers import (
    CYCLE,
    PlotContext,
    abs_formatter,
    bars_by_network,
    figure,
    figure_title,
    grouped_bars,
    hue_colors,
    mode_key,
    run_labels,
    sorted_pairs,
)
from hetps.metrics.runs import Run
from hetps.metrics.summary import THRESHOLDS, accuracy_curve, computing_time_ratios
from hetps.metrics.traffic import load_traffic

__all__ = [
    "fig_accuracy_iid",
    "fig_accuracy_noniid",
    "fig_computing_time_ratio",
    "fig_throughput",
    "fig_traffic",
    "fig_traffic_timeline",
]


def _accuracy(ctx: PlotContext, non_iid: bool) -> list[Path]:
    kind = "non-i.i.d." if non_iid else "i.i.d."
    name = f"accuracy_vs_time_{'noniid' if non_iid else 'iid'}.png"
    runs = [r for r in ctx.runs if r.split_by_class == non_iid]
    runs = sorted(runs, key=lambda r: (mode_key(r.mode), r.network, str(r.run_dir)))
    curves = [(r, accuracy_curve(r)) for r in runs]
    curves = [(r, c) for r, c in curves if c]
    if not curves:
        what = "runs" if not runs else "evaluated runs (records with accuracy)"
        ctx.notes.append(f"{name}: skipped, no {kind} {what} (run.json split_by_class)")
        return []
    fig = ctx.new_figure(8.0, 5.0)
    ax = fig.subplots()
    labels = run_labels([r for r, _ in curves], with_network=True)
    networks = list(dict.fromkeys(r.network for r, _ in curves))
    styles = ["-", "--", "-.", ":"]
    colors = hue_colors(labels, [r.mode for r, _ in curves])
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
        figure_title(f"Test accuracy vs time ({kind} data)", [r for r, _ in curves]), fontsize=10
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
    return bars_by_network(
        ctx,
        pairs,
        lambda s: s["throughput_samples_per_s"],
        "throughput.png",
        "Data throughput",
        "samples / s",
        fmt="{:.0f}",
        missing="no run has iteration records",
    )


@figure("traffic")
def fig_traffic(ctx: PlotContext) -> list[Path]:
    """Traffic load (MB/s pushed and pulled by all workers) per mode, grouped by network."""
    pairs = [(r, s) for r, s in ctx.pairs() if s["traffic_mb_per_s"]["push"] is not None]
    return bars_by_network(
        ctx,
        pairs,
        {
            "push (workers → servers)": lambda s: s["traffic_mb_per_s"]["push"],
            "pull (servers → workers)": lambda s: s["traffic_mb_per_s"]["pull"],
        },
        "traffic.png",
        "Traffic load",
        "MB / s (all workers)",
        missing="no run has iteration records",
    )


@figure("computing_time_ratio")
def fig_computing_time_ratio(ctx: PlotContext) -> list[Path]:
    """Computing-time ratio per device, bars per device grouped by run; a panel per network."""
    pairs = sorted_pairs([(r, s) for r, s in ctx.pairs() if s["computing_time_ratio"]])
    if not pairs:
        ctx.notes.append("computing_time_ratio.png: skipped, no run has iteration records")
        return []
    networks = list(dict.fromkeys(r.network for r, _ in pairs))
    ranks = sorted({rank for r, _ in pairs for rank in r.ranks})
    # a legend label per rank: the device label if every run agrees, else "worker<r>"
    hue = {}
    for rank in ranks:
        labs = {r.device_label(rank) for r, _ in pairs if rank in r.records}
        lab = labs.pop() if len(labs) == 1 else f"worker{rank}"
        hue[rank] = lab if lab not in hue.values() else f"{lab} [rank {rank}]"
    colors = {hue[rank]: CYCLE[i % len(CYCLE)] for i, rank in enumerate(ranks)}
    nbars = [
        sum(len(computing_time_ratios(r)) + 1 for r, _ in pairs if r.network == net)
        for net in networks
    ]
    fig = ctx.new_figure(min(20.0, max(7.0, 2.5 + 0.3 * sum(nbars))), 5.0)
    axes = fig.subplots(1, len(networks), sharey=True, squeeze=False, width_ratios=nbars)[0]
    for ax, net in zip(axes, networks, strict=True):
        runs = [r for r, _ in pairs if r.network == net]
        labels = run_labels(runs, with_network=False)
        values = {
            (lab, hue[rank]): ratio
            for r, lab in zip(runs, labels, strict=True)
            for rank, ratio in computing_time_ratios(r).items()
        }
        grouped_bars(ax, labels, list(colors), values, colors, "{:.2f}")
        ax.set_title(net, fontsize=9)
    axes[0].set_ylabel("computing time / wall time")
    legend = {lab: h for ax in axes for h, lab in zip(*ax.get_legend_handles_labels(), strict=True)}
    axes[-1].legend(legend.values(), legend.keys(), fontsize=7, loc="upper left",
                    bbox_to_anchor=(1.01, 1.0))  # fmt: skip
    fig.suptitle(
        figure_title("Computing-time ratio per device", [r for r, _ in pairs]), fontsize=10
    )
    return [ctx.save(fig, "computing_time_ratio.png")]


def _timeline(ctx: PlotContext, run: Run, name: str) -> Path | None:
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
    colors = {p: CYCLE[i % len(CYCLE)] for i, p in enumerate(peers)}
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
        ax.yaxis.set_major_formatter(abs_formatter())
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
        label = run.device_label(int(m.group(1))) if m else node
        ax.set_ylabel(f"{label}\nMB/s: push ↑ pull ↓", fontsize=8)
        ax.grid(alpha=0.25)
        ax.legend(
            fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="peer", title_fontsize=7
        )
    axes[-1].set_xlabel("time since run start (s)")
    axes[-1].set_xlim(grid[0], grid[-1])
    title = figure_title(
        f"Traffic per link over time: {run.mode} / {run.network}  ({run.name})", [run]
    )
    title += (
        f"\nMB/s stacked by peer: push above the axis, pull below; buckets of {dt * 1000:g} ms; "
        "grey lines: iteration ends"
    )
    fig.suptitle(title, fontsize=10)
    return ctx.save(fig, name)


@figure("traffic_timeline")
def fig_traffic_timeline(ctx: PlotContext) -> list[Path]:
    """Bytes/s on every link over time (push and pull), one file per chosen run."""
    return ctx.per_run("traffic_timeline", ctx.timeline_runs, partial(_timeline, ctx), "no runs")
