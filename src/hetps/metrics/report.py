"""``hetps report RUN [-o FILE]``: one self-contained HTML file of a run, to mail or attach.

Its summary, configuration, how it ended, charts of every worker's rounds and a timeline,
drawn by the dashboard's chart library inlined with its licence, and the run's PNGs; nothing
is fetched when the file is opened (docs/LIVE.md)."""

from __future__ import annotations

import argparse
import base64
import html
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from hetps.metrics.dashboard import FINAL_FILE, static_file
from hetps.metrics.records import MetricsError, plain, write_atomic
from hetps.metrics.runs import Run, load_run
from hetps.metrics.spans import PHASES
from hetps.metrics.summary import summarize_run

__all__ = ["build_report", "cmd_report", "report_data", "write_report"]

#: bounds on what a report embeds (a long run's file stays small)
MAX_POINTS = 4000  # chart points per worker (evenly thinned beyond)
MAX_SPAN_ROUNDS = 400  # rounds with their spans per worker (the last ones)
MAX_FIGURE_BYTES = 4 << 20  # a PNG bigger than this is named, not embedded


def _thin(items: list, most: int) -> list:
    if len(items) <= most:
        return items
    step = len(items) / most
    return [items[int(i * step)] for i in range(most)] + [items[-1]]


def _num(x: Any) -> float | None:
    ok = isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
    return float(x) if ok else None


def report_data(run: Run) -> dict[str, Any]:
    """What the report draws, JSON-able: summary, config, per-worker series and spans."""
    summary = summarize_run(run)
    workers = []
    for rank in run.ranks:
        recs = run.records[rank]
        series = []
        prev_t = None
        for rec in _thin(recs, MAX_POINTS):
            t = _num(rec.get("t"))
            rt = _num(rec.get("srit_s"))
            if rt is None and t is not None and prev_t is not None:
                rt = t - prev_t
            prev_t = t
            series.append(
                [rec.get("iter"), t, rt, _num(rec.get("loss")), rec.get("bytes_sent"),
                 rec.get("bytes_recv")]
            )  # fmt: skip
        took = {
            p: [x for rec in recs if (x := _num(rec.get(f"{p}_s"))) is not None] for p in PHASES
        }
        timeline = [
            {
                "round": rec.get("iter"),
                "spans": [s for s in rec.get("spans") or [] if isinstance(s, list) and len(s) == 3],
                "links": [[0, int(rec.get("bytes_sent") or 0), int(rec.get("bytes_recv") or 0)]],
            }
            for rec in recs[-MAX_SPAN_ROUNDS:]
        ]
        workers.append(
            {
                "rank": rank,
                "label": run.device_label(rank),
                "rounds": len(recs),
                "series": series,
                "phase_ms": {k: 1000 * sum(v) / max(1, len(recs)) for k, v in took.items() if v},
                "timeline": timeline,
            }
        )
    final = None
    path = run.run_dir / FINAL_FILE
    if path.is_file():
        try:
            final = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            final = {"error": f"{path.name} unreadable: {exc}"}
    failures = []
    if not str(summary.get("ended", "")).startswith("completed"):
        failures.append(f"run end: {summary.get('ended')}")
    failures += [f"{p.name}: its last line was torn (the writer was killed)" for p in run.truncated]
    if isinstance(final, dict):
        for ev in final.get("events") or []:
            if isinstance(ev, dict) and ev.get("kind") == "failure":
                failures.append(f"at {ev.get('uptime')} s: {ev.get('text')}")
    figures = [
        {"name": png.name, "data": base64.b64encode(png.read_bytes()).decode("ascii")}
        if (size := png.stat().st_size) <= MAX_FIGURE_BYTES
        else {"name": png.name, "data": None, "size": size}
        for png in sorted(run.run_dir.glob("*.png"))
    ]
    return {
        "run": run.name,
        "summary": summary,
        "config": run.meta,
        "workers": workers,
        "failures": failures,
        "live": final,
        "figures": figures,
    }


def _safe_js(code: bytes) -> str:
    return code.decode("utf-8").replace("</script", "<\\/script")


def build_report(run_dir: str | os.PathLike[str]) -> str:
    """The report of ``run_dir`` as one HTML document."""
    run = load_run(run_dir)
    # JSON safe inside a <script> element (no </, no <!--; non-finite floats as null)
    data = json.dumps(plain(report_data(run)), allow_nan=False)
    data = data.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    title = html.escape(f"hetps report: {run.name}")
    css = (
        static_file("vendor/uplot/uPlot.min.css") + b"\n" + static_file("dashboard.css")
    ).decode()
    lic = html.escape(static_file("vendor/uplot/LICENSE").decode("utf-8"))
    return "\n".join(
        [
            "<!doctype html>",
            '<html lang="en"><head><meta charset="utf-8">',
            f"<title>{title}</title>",
            f"<style>{css}</style>",
            "</head><body>",
            static_file("report.html").decode("utf-8").replace("{{title}}", title),
            f'<script type="application/json" id="report-data">{data}</script>',
            f"<script>{_safe_js(static_file('vendor/uplot/uPlot.iife.min.js'))}</script>",
            f"<script>{_safe_js(static_file('timeline.js'))}</script>",
            f"<script>{_safe_js(static_file('report.js'))}</script>",
            f"<!-- uPlot (vendored, MIT):\n{lic}\n-->",
            "</body></html>",
        ]
    )


def write_report(
    run_dir: str | os.PathLike[str], out: str | os.PathLike[str] | None = None
) -> Path:
    """Write the report (default: ``RUN/report.html``); returns its path."""
    return write_atomic(
        out if out is not None else Path(run_dir) / "report.html", build_report(run_dir)
    )


def cmd_report(args: argparse.Namespace) -> int:
    """``hetps report RUN [-o FILE]``."""
    try:
        path = write_report(args.run, args.output)
    except MetricsError as exc:
        print(f"hetps report: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"hetps report: cannot write the report: {exc}", file=sys.stderr)
        return 1
    print(f"report: {path}  (one HTML file: open it in a browser, or attach it)")
    return 0
