"""benchmarks/sparse_tables.py at a tiny size: its hetps jobs (with and without shared memory)
run and give a figure per cell, and without MXNet's python it says the MXNet column was left
out. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "sparse_tables.py"


@pytest.mark.slow
def test_the_benchmark_runs_at_a_tiny_size(tmp_path):
    out = tmp_path / "bench.json"
    argv = [sys.executable, str(BENCH), "--rows", "20000", "--cols", "4", "--fracs", "0.01,0.0002"]
    argv += ["--opts", "adam", "--repeats", "1", "--rounds", "3", "--json", str(out)]
    argv += ["--mxnet-python", str(tmp_path / "no-python")]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "MXNet left out" in res.stdout, res.stdout
    data = json.loads(out.read_text())
    row, floor = data["table"]
    assert row["optimizer"] == "adam" and row["table"] == "0.02M x 4", row
    assert row["rows/worker"] == "1.0%" and floor["rows/worker"] == "4 rows", (row, floor)
    assert float(row["hetps shm ms"]) > 0 and float(row["hetps tcp ms"]) > 0, row
    assert len(data["times"]["adam hetps shm 4 0.01"]) == 3, data["times"]


@pytest.mark.slow
def test_several_tables_go_together_and_are_labelled(tmp_path):
    """--tables 3: each round pushes and pulls 3 tables of the size in one call each; the cell
    says so and has a figure per system."""
    out = tmp_path / "bench.json"
    argv = [sys.executable, str(BENCH), "--rows", "20000", "--cols", "4", "--fracs", "0.01"]
    argv += ["--opts", "sgd", "--repeats", "1", "--rounds", "3", "--tables", "3"]
    argv += ["--json", str(out), "--mxnet-python", str(tmp_path / "no-python")]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    (row,) = json.loads(out.read_text())["table"]
    assert row["table"] == "3 x 0.02M x 4" and row["rows/worker"] == "1.0%", row
    assert float(row["hetps shm ms"]) > 0 and float(row["hetps tcp ms"]) > 0, row


def test_a_bad_count_of_tables_is_one_clear_error(tmp_path):
    argv = [sys.executable, str(BENCH), "--tables", "0", "--mxnet-python", str(tmp_path / "no")]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert res.returncode == 2 and "--tables 0: give 1 to 999 tables" in res.stderr, res.stderr
