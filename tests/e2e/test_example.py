"""The example and the CLI, run as a user runs them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_linear_regression_example_learns_through_the_launcher():
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


def test_cli_help_lists_commands():
    res = subprocess.run(
        [sys.executable, "-m", "hetps.cli", "--help"], capture_output=True, text=True, timeout=30
    )
    assert res.returncode == 0
    for sub in ("launch", "scheduler", "server"):
        assert sub in res.stdout
