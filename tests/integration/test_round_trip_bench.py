"""benchmarks/round_trip.py at a tiny size: hetps and the raw echo run as separate processes
and give a round-trip time, and the JSON holds them (MXNet's side is left out: it needs the
reference peer's python). No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_round_trip_benchmark_runs_both_sides(tmp_path):
    out = tmp_path / "rt.json"
    res = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "round_trip.py"),
            "--repeats",
            "1",
            "--rounds",
            "50",
            "--json",
            str(out),
            "--skip-mxnet",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "MXNet: skipped (--skip-mxnet)" in res.stdout, res.stdout
    assert "hetps/zmq" in res.stdout, res.stdout
    assert not any("mxnet" in ln.lower() for ln in res.stdout.splitlines()[1:]), res.stdout
    data = json.loads(out.read_text())
    assert data["rounds"] == 50 and len(data["runs"]) == 1
    (run,) = data["runs"]
    assert set(run) == {"hetps", "zmq"} and run["hetps"] > 0 and run["zmq"] > 0
    assert data["ratios"] == {"hetps/zmq": run["hetps"] / run["zmq"]}
