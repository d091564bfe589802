"""benchmarks/round_trip.py at a tiny size: both sides run as separate processes and give a
round-trip time, and the JSON holds them. No timing is asserted."""

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
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "hetps/raw" in res.stdout, res.stdout
    data = json.loads(out.read_text())
    assert data["rounds"] == 50 and len(data["runs"]) == 1
    assert data["hetps_s"] > 0 and data["zmq_s"] > 0
