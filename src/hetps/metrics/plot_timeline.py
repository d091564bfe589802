"""The phase timeline: when each worker computes, pushes, waits and pulls, round by round.
(docs/MODULES.md, "hetps.metrics.plot_timeline")"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hetps.metrics.plot_helpers import PlotContext, abs_formatter, figure, figure_title, new_figure
from hetps.metrics.records import MetricsError
from hetps.metrics.runs import Run
from hetps.metrics.spans import PHASES
from hetps.metrics.trace import round_spans
from hetps.metrics.traffic import load_traffic

__all__ = ["PHASE_COLORS", "default_window", "draw_phase_timeline", "fig_phase_timeline"]

PHASE_COLORS = {
    "compute": "#4c72b0",
    "push": "#dd8452",
    "wait": "#b0b0b0",
    "pull": "#55a868",
    "eval": "#8172b3",
}
_WORKER_COLORS = ["#4c72b0", "#c44e52", "#55a868", "#8172b3", "#ccb974", "#64b5cd"]


def default_window(run: Run, rounds: int = 6) -> tuple[float, float]:
    """Seconds since the run's start covering ``rounds`` consecutive rounds of the lowest rank,
    from the middle of its log (past the first rounds' start-up)."""
    if not run.ranks or not run.records[run.ranks[0]]:
        raise MetricsError(f"{run.run_dir}: no iteration was logged, so there is no timeline")
    recs = run.records[run.ranks[0]]
    n = max(1, min(rounds, len(recs)))
    first = max(0, (len(recs) - n) // 2)
    start, _, _, _ = round_spans(recs[first])
    _, end, _, _ = round_spans(recs[first + n - 1])
    pad = 0.04 * max(end - start, 1e-6)
    return start - pad, end + pad


def draw_phase_timeline(
    run: Run,
    path: str | Path,
    window: tuple[float, float] | None = None,
    rounds: int = 6,
) -> Path:
    """Draw the phase timeline of ``run`` into ``path`` (PNG) and return the path."""
    from matplotlib.patches import Patch

    lo, hi = window if window is not None else default_window(run, rounds)
    ranks = run.ranks
    traffic = {k: v for k, v in load_traffic(run.run_dir).items() if k.startswith("worker")}
    fig = new_figure(11.0, 2.2 + 0.75 * len(ranks))
    gs = fig.add_gridspec(2, 2, width_ratios=[5.0, 1.0], height_ratios=[1.25, 1.0])
    ax = fig.add_subplot(gs[0, 0])
    axb = fig.add_subplot(gs[1, 0], sharex=ax)
    axm = fig.add_subplot(gs[:, 1])
    ms = 1000.0
    any_derived = False
    for lane, rank in enumerate(ranks):
        y = len(ranks) - 1 - lane
        for rec in run.records[rank]:
            start, end, spans, derived = round_spans(rec)
            if end < lo or start > hi:
                continue
            any_derived |= derived
            # the round: a thin outline under the phases, its number above
            ax.broken_barh(
                [(start * ms, (end - start) * ms)],
                (y - 0.36, 0.72),
                facecolors="none",
                edgecolors="0.35",
                lw=0.6,
            )
            mid = (max(start, lo) + min(end, hi)) / 2
            ax.text(
                mid * ms,
                y + 0.4,
                f"round {rec.get('iter')}",
                ha="center",
                va="bottom",
                fontsize=6.5,
                color="0.3",
            )
            eval_s = float(rec.get("eval_s") or 0.0)
            if eval_s > 0:  # rank 0's test evaluation after the round
                ax.broken_barh(
                    [((float(rec["t"]) - eval_s) * ms, eval_s * ms)],
                    (y - 0.3, 0.6),
                    facecolors=PHASE_COLORS["eval"],
                    lw=0,
                )
            for name, s, d in spans:
                ax.broken_barh(
                    [(s * ms, max(d, 1e-7) * ms)],
                    (y - 0.3, 0.6),
                    facecolors=PHASE_COLORS.get(name, "#937860"),
                    hatch="//" if derived else None,
                    lw=0,
                )
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([run.device_label(r) for r in reversed(ranks)], fontsize=8)
    ax.set_ylim(-0.6, len(ranks) - 0.2)
    ax.set_xlim(lo * ms, hi * ms)
    ax.grid(axis="x", alpha=0.25)
    names = [*PHASES, "eval"]
    ax.legend(
        handles=[Patch(color=PHASE_COLORS[p], label=p) for p in names],
        fontsize=7,
        ncol=len(names),
        loc="lower left",
        bbox_to_anchor=(0.0, 1.0),
        frameon=False,
    )
    ax.tick_params(labelbottom=False)

    # bytes on each worker's links in the window: sent (push) up, received (pull) down; each
    # worker's bar takes its own slice of the bucket, so the workers' bars never hide each other
    width = None
    n_nodes = max(1, len(traffic))
    for i, (node, buckets) in enumerate(traffic.items()):
        c = _WORKER_COLORS[i % len(_WORKER_COLORS)]
        t = np.array([float(b["t"]) for b in buckets])
        dt = np.array([float(b["dt"]) for b in buckets])
        keep = (t + dt >= lo) & (t <= hi)
        if not keep.any():
            continue
        push = np.array([b["push_bytes"] for b in buckets], float)[keep] / 1e3
        pull = np.array([b["pull_bytes"] for b in buckets], float)[keep] / 1e3
        width = float(dt[keep][0])
        x = (t[keep] + dt[keep] * i / n_nodes) * ms
        w = dt[keep] / n_nodes * ms
        axb.bar(x, push, width=w, align="edge", color=c, alpha=0.85, label=f"{node} push", lw=0)
        axb.bar(x, -pull, width=w, align="edge", color=c, alpha=0.45, label=f"{node} pull", lw=0)
    axb.axhline(0, color="0.2", lw=0.6)
    axb.set_ylabel("kB per bucket\npush ↑  pull ↓", fontsize=8)
    axb.yaxis.set_major_formatter(abs_formatter())
    axb.set_xlabel("time since run start (ms)")
    axb.grid(alpha=0.25)
    if width is not None:
        axb.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    else:
        axb.text(0.5, 0.5, "no traffic logged in this window", transform=axb.transAxes, ha="center")

    # whole run: mean milliseconds per round in each phase, per worker
    labels = [f"worker {r}" for r in ranks]
    left = np.zeros(len(ranks))
    for p in PHASES:
        vals = np.array(
            [
                np.mean([float(rec.get(f"{p}_s") or 0.0) for rec in run.records[r]]) * ms
                for r in ranks
            ]
        )
        axm.barh(range(len(ranks)), vals, left=left, color=PHASE_COLORS[p], label=p)
        left += vals
    for i, total in enumerate(left):
        axm.text(total, i, f" {total:.2f}", va="center", fontsize=7)
    axm.set_yticks(range(len(ranks)))
    axm.set_yticklabels(labels, fontsize=8)
    axm.invert_yaxis()
    axm.set_xlim(0, max(float(left.max()), 1e-6) * 1.35)
    axm.set_xlabel("ms per round, mean", fontsize=8)
    counts = sorted({len(run.records[r]) for r in ranks})
    axm.set_title(f"rounds per worker: {'/'.join(map(str, counts))}", fontsize=8)

    n_rounds = len(run.records[ranks[0]]) if ranks else 0
    title = figure_title(
        f"When do push and pull happen inside a batch?  {run.mode} / {run.network}  "
        f"({run.name}, {n_rounds} rounds)",
        [run],
    )
    sub = "phases where they ran (from the logs' spans)"
    if any_derived:
        sub = "hatched: no spans logged, phase sums laid end to end (order assumed)"
    if width:
        sub += f"; traffic in buckets of {width * 1000:g} ms"
    fig.suptitle(f"{title}\n{sub}", fontsize=9.5)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out


@figure("phase_timeline")
def fig_phase_timeline(ctx: PlotContext) -> list[Path]:
    """The phase timeline of each chosen run (``--window`` picks the seconds)."""
    runs = [r for r in ctx.timeline_runs if any(r.records.values())]

    def draw(run: Run, name: str) -> Path:
        return draw_phase_timeline(run, ctx.out / name, window=ctx.window)

    return ctx.per_run("phase_timeline", runs, draw, "no run with iterations")
