"""benchmarks/message_floor.py: its bare rounds (the messages of a table round and nothing
else) run between real processes over each transport and give a figure; at a tiny size the
whole benchmark runs beside hetps's round of 4 rows. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "message_floor.py"
sys.path.insert(0, str(ROOT / "benchmarks"))

from message_floor import parse, run_bare  # noqa: E402


@pytest.mark.parametrize("mode", ["zmq", "curve", "handoff", "unix"])
def test_a_bare_round_runs_over_each_transport(mode):
    """Two servers and two workers exchange 200 timed rounds (and 100 warm-up ones): every
    process ends well, worker 0 gives each timed round and its CPU, and each server answered
    every request, each of hetps's frames (parse checks the counts)."""
    rc, lines = run_bare(mode, 200, 60)
    assert rc == 0, "\n".join(lines)
    ((rounds, cpu),) = parse(f"bare {mode}", lines, 200).values()
    assert len(rounds) == 200 and min(rounds) > 0 and cpu >= 0, lines
    with pytest.raises(SystemExit, match="answered"):
        parse(f"bare {mode}", lines, 201)


def test_a_bad_count_is_one_clear_error(tmp_path):
    argv = [sys.executable, str(BENCH), "--bare-rounds", "0", "--mxnet-python", str(tmp_path)]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert res.returncode == 2 and "take a count of at least 1" in res.stderr, res.stderr


@pytest.mark.slow
def test_the_benchmark_runs_at_a_tiny_size(tmp_path):
    out = tmp_path / "floor.json"
    argv = [sys.executable, str(BENCH), "--repeats", "1", "--rounds", "5", "--bare-rounds", "50"]
    argv += ["--json", str(out), "--mxnet-python", str(tmp_path / "no-python")]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "MXNet left out" in res.stdout, res.stdout
    data = json.loads(out.read_text())
    systems = [row["system"] for row in data["table"]]
    assert systems == [
        "hetps shm, 4 rows",
        "hetps shm, 0.1%",
        "hetps tcp, 4 rows",
        "hetps tcp, 0.1%",
        "bare curve",
        "bare handoff",
        "bare zmq",
        "bare unix",
    ], systems
    for row in data["table"]:
        assert float(row["round ms"]) > 0, row
    times = {k: v.split(",") for k, v in data["times_us"].items()}
    assert len(times["hetps shm, 0.1%"]) == 5 and len(times["bare unix"]) == 50, times
    assert len(data["cpu_us"]["bare unix"].split(",")) == 1, data["cpu_us"]
    floor, tenth = data["table"][:2]
    assert floor["over its bare messages ms"].endswith("(bare curve)"), floor
    assert tenth["over its round of 4 rows ms"] != "-", tenth
