"""benchmarks/server_update.py --quick runs and prints every case with its ratio."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_server_update_quick_prints_every_case():
    pytest.importorskip("torch")
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "server_update.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    for case in ("sgd momentum", "adam", "dcasgd", "merge 2 pushes", "2-bit push into the sum"):
        row = next((ln for ln in lines if ln.strip().startswith(case)), None)
        assert row is not None, out.stdout
        assert len(row.split()) >= 5, row
    assert "hetps/torch" in out.stdout
