"""benchmarks/linreg_vs_mxnet.py at a tiny size: its hetps side runs and yields a samples/s
figure, and without MXNet's python it says the MXNet half was not run. No timing is asserted."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "linreg_vs_mxnet.py"


def _load():
    spec = importlib.util.spec_from_file_location("linreg_vs_mxnet", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_speed_lines_of_both_systems_parse():
    bench = _load()
    lines = [
        "[worker 0] Worker[0] Epoch[0] Batch [20]\tSpeed: 100.50 samples/sec\tmse=1.0",
        "[worker 0] Worker[0] Epoch[0] Batch [40]\tSpeed: 300.00 samples/sec\tmse=1.0",
        "[worker 0] Worker[0] Epoch[0] Batch [60]\tSpeed: 500.00 samples/sec\tmse=1.0",
        "[worker 1] Worker[1] Epoch[0] Batch [20]\tSpeed: 7.00 samples/sec\tmse=1.0",
        "[worker 1] Worker[1] Epoch[0] Batch [40]\tSpeed: 200.00 samples/sec\tmse=1.0",
        "[worker 1] Worker[1] Epoch[0] Train-mse=1.0",
        "[server 0] unrelated Speed: 9 samples/sec",
    ]
    got = bench.parse_speeds(lines, warmup=1)
    assert got["per_worker"] == {"0": 400.0, "1": 200.0}
    assert got["samples_per_s"] == 300.0
    mx = [  # MXNet's Speedometer through the benchmark's own launcher
        "[worker0] 2026-01-01 10:00:00,000 Epoch[0] Batch [5-10]\tSpeed: 1000.00 samples/sec\tmse=2",
        "[worker0] 2026-01-01 10:00:01,000 Epoch[0] Batch [10-15]\tSpeed: 2000.00 samples/sec\tmse=2",
        "[worker1] 2026-01-01 10:00:01,000 Epoch[0] Batch [10-15]\tSpeed: 4000.00 samples/sec\tmse=2",
    ]
    assert bench.parse_speeds(mx, warmup=0)["per_worker"] == {"0": 1500.0, "1": 4000.0}


def test_hetps_side_runs_at_a_tiny_size_without_mxnet(tmp_path):
    out = tmp_path / "linreg.json"
    res = subprocess.run(
        [sys.executable, str(BENCH), "--num-samples", "2000", "--batch-sizes", "100"]
        + ["--repeats", "1", "--variants", "auto", "--json", str(out)]
        + ["--mxnet-python", str(tmp_path / "no-mxnet" / "python")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "MXNet half: not run: no MXNet python at" in res.stdout, res.stdout
    data = json.loads(out.read_text())
    jobs = {(j["system"], j["variant"]): j for j in data["jobs"]}
    assert set(jobs) == {("hetps", "auto"), ("hetps", "local")}, jobs
    dist, alone = jobs["hetps", "auto"], jobs["hetps", "local"]
    assert dist["rc"] == 0 and alone["rc"] == 0
    assert set(dist["lines"]) == {"0", "1"} and all(len(v) >= 5 for v in dist["lines"].values())
    # alone: one process with a local store, on a worker's share (as many batches)
    assert set(alone["lines"]) == {"0"} and len(alone["lines"]["0"]) == len(dist["lines"]["0"])
    summary = data["summary"]["100"]
    assert summary["hetps"]["auto"] > 0 and summary["hetps_local"] > 0
    assert summary["hetps_dist_over_local"] == summary["hetps"]["auto"] / summary["hetps_local"]
    assert summary["mxnet"] is None and summary["mxnet_local"] is None
