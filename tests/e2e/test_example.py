"""The example and the CLI, run as a user runs them."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_linear_regression_example_learns_through_the_launcher(tmp_path):
    # from a scratch directory: the example's default log dir is runs/ under the cwd
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "hetps.cli",
            "launch",
            "-n",
            "2",
            "-s",
            "1",
            "--",
            sys.executable,
            str(ROOT / "examples" / "linear_regression.py"),
            "--epochs",
            "3",
            "--num-samples",
            "3000",
            "--frequent",
            "10",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    speeds = re.findall(
        r"\[worker (\d)\] Worker\[(\d)\] Epoch\[\d\] Batch \[\d+\]\tSpeed: ([\d.]+) samples/sec",
        out,
    )
    assert {(a, b) for a, b, _ in speeds} == {("0", "0"), ("1", "1")}, out
    assert all(float(s) > 0 for *_, s in speeds)
    mses = [float(m) for m in re.findall(r"Worker\[0\] Epoch\[\d\] Train-mse=([\d.]+)", out)]
    assert len(mses) == 3 and mses[-1] < mses[0] and mses[-1] < 0.5, mses
    # both workers hold the same model (sync training): identical training error
    assert re.findall(r"Worker\[1\] Epoch\[2\] Train-mse=([\d.]+)", out) == [f"{mses[-1]:.6f}"]
    _check_pictures(tmp_path, out)


def _check_pictures(cwd: Path, out: str) -> None:
    """The run ends with its trace and timeline figure, written by rank 0 into
    runs/linreg-<time>/ under the cwd, and says where they are and how to open them."""
    from hetps.metrics import load_run, load_traffic
    from tracecheck import counter_totals, validate_trace

    runs = list((cwd / "runs").glob("linreg-*"))
    assert len(runs) == 1, out
    run = runs[0]
    rel = run.relative_to(cwd)
    trace_line = re.findall(r"\[worker 0\] trace: (\S+)  \(open in https://ui.perfetto.dev", out)
    fig_line = re.findall(r"\[worker 0\] figure: (\S+)  ", out)
    assert trace_line == [str(rel / "trace.json")] and fig_line == [str(rel / "timeline.png")], out
    report_line = re.findall(r"\[worker 0\] report: (\S+)  \(one HTML file", out)
    assert report_line == [str(rel / "report.html")], out
    html = (run / "report.html").read_text()
    assert '<script type="application/json" id="report-data">' in html and "uPlot" in html
    assert "[worker 1] trace:" not in out  # rank 0 alone draws
    assert (run / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    trace = json.loads((run / "trace.json").read_text())
    validate_trace(trace)
    logs = load_run(run)
    assert logs.records and sorted(logs.records) == [0, 1]
    for rank, recs in logs.records.items():
        assert len(recs) == 3 * (1500 // 100)  # 3 epochs of 15 batches
        rounds = [
            e for e in trace["traceEvents"] if e.get("cat") == "round" and e["pid"] == rank + 1
        ]
        assert len(rounds) == len(recs)
        # the four phases of every batch, in order: compute, push, then the pull's wait and copy
        for rec in recs:
            assert [s[0] for s in rec["spans"]] in (
                ["compute", "push", "wait", "pull"],
                ["compute", "push", "pull"],  # the answer was in before the pull
            )
    # the answer needs both workers' pushes: in every batch the worker that pushed first waits
    # (the other may find the answer in already, when it came while its own push returned)
    for r0, r1 in zip(logs.records[0], logs.records[1], strict=True):
        assert "wait" in [s[0] for s in r0["spans"] + r1["spans"]], (r0["spans"], r1["spans"])
    totals = counter_totals(trace)
    for node, buckets in load_traffic(run).items():
        got = totals[f"bytes {node}↔server0"]
        assert got["push_bytes"] == sum(b["push_bytes"] for b in buckets) > 0
        assert got["pull_bytes"] == sum(b["pull_bytes"] for b in buckets) > 0


def test_cli_help_lists_commands():
    res = subprocess.run(
        [sys.executable, "-m", "hetps.cli", "--help"], capture_output=True, text=True, timeout=30
    )
    assert res.returncode == 0
    for sub in ("launch", "scheduler", "server"):
        assert sub in res.stdout
