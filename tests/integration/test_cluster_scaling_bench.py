"""benchmarks/cluster_scaling.py at a tiny size (1 and 2 workers, 1 server, few rounds): every
run finishes, and the JSON has a row per cluster with its growth against one worker. No
timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_cluster_scaling_benchmark_runs(tmp_path):
    out = tmp_path / "scaling.json"
    res = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "cluster_scaling.py"),
            "--workers",
            "1",
            "2",
            "--servers",
            "1",
            "--repeats",
            "1",
            "--rounds",
            "20",
            "--warmup",
            "5",
            "--timeout",
            "60",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=150,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "x W=1" in res.stdout, res.stdout
    data = json.loads(out.read_text())
    assert data["benchmark"] == "cluster_scaling"
    assert [tuple(s) for s in data["shapes"]] == [(256, 1), (256,), (64, 256), (64,), (1, 64), (1,)]
    assert [(r["workers"], r["servers"]) for r in data["rows"]] == [(1, 1), (2, 1)]
    for row in data["rows"]:
        assert row["round_s"] > 0 and row["processes"] == row["workers"] + row["servers"] + 1
        assert "cores_busy" in row and "cpu_s_per_round" in row
    assert data["rows"][0]["growth_vs_w1"] == 1.0
    assert data["rows"][1]["growth_vs_w1"] > 0
    assert len(data["runs"]) == 2
    for run in data["runs"]:
        assert run["rc"] == 0 and not run["timed_out"] and "error" not in run
        assert len(run["results"]) == run["workers"]
        assert all(r["value_ok"] for r in run["results"])
    assert "cores" in data["machine"] and "loadavg" in data["machine"]
