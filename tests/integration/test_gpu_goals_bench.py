"""benchmarks/gpu_goals.py end to end on the CPU, small: every case measured, ratios
the quotients of what it measured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # (a benchmark run; the refusal below is the default run's)
@pytest.mark.timeout(300)
def test_gpu_goals_measures_every_case_and_its_ratio(tmp_path):
    out = tmp_path / "goals.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_goals.py"), "--cpu", "--models",
           "mlp", "--pairs", "1", "--rounds", "12", "--warmup", "3", "--share-model", "mlp:64",
           "--share-workers", "2", "--share-rounds", "12", "--logdir", str(tmp_path / "logs"),
           "--json", str(out)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "these are not the GPU goals" in r.stderr
    assert json.loads(out.read_text())["machine"]["server_device"] == "cpu"
    res = json.loads(out.read_text())["results"]
    step = next(x for x in res if x.get("model") == "mlp")
    assert step["local_s"] > 0 and step["sync_s"] > 0
    assert abs(step["ratio"] - step["sync_s"] / step["local_s"]) < 1e-9
    share = next(x for x in res if "share_model" in x)
    assert share["workers"] == 2 and share["one_sps"] > 0 and share["many_sps"] > 0
    assert abs(share["ratio"] - share["many_sps"] / share["one_sps"]) < 1e-9
    assert "mlp b64" in r.stdout and "2 workers / 1" in r.stdout


def test_gpu_goals_refuses_a_server_gpu_it_cannot_have(tmp_path):
    """--server-device cuda:0 where torch sees no GPU: one line saying so, nothing run."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the refusal is for machines without one")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_goals.py"), "--server-device",
           "cuda:0", "--logdir", str(tmp_path / "logs")]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--server-device cuda:0: torch sees no CUDA device here" in r.stderr, r.stderr
    assert not (tmp_path / "logs").exists()
