"""``hetps train`` takes each flag by its whole name only: the launcher strips its own flags
(``--workers``, ``--servers``, ``--balance``...) from the workers' command line by name, so an
abbreviation would reach both sides. The real command refuses one before anything starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"


def _train(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "HETPS_"))}
    return subprocess.run(
        [sys.executable, "-m", "hetps.cli", "train", "-m", "sync", *args],
        env={**env, "PYTHONPATH": str(SRC)},
        capture_output=True,
        text=True,
        timeout=60,
    )


# --max-restarts -1 stops a launch that got past the parser at once, before anything starts
@pytest.mark.parametrize("flag", ["--work", "--serv", "--bal", "--max-rest", "--colo"])
def test_an_abbreviated_flag_is_refused(flag):
    args = ["--workers", "2", "--max-restarts", "-1"]
    res = _train(*args, flag, "1")
    assert res.returncode == 2, res
    assert f"hetps: error: unrecognized arguments: {flag} 1" in res.stderr, res.stderr


def test_the_whole_names_are_taken():
    res = _train("--workers", "2", "--servers", "1", "--balance", "none", "--max-restarts", "-1")
    assert res.returncode == 1, res
    assert "hetps train: --max-restarts must be >= 0" in res.stderr, res.stderr
