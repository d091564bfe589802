"""Horovod's PyTorch examples (examples/horovod/), the import line changed, under
``hetps launch -n 2 -s 1``: the MNIST script gives the same losses as the same script with
hetps's explicit API, and the synthetic benchmark (SyncBatchNorm) runs to its figures."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "horovod"
DATA = Path("/usr/share/datasets/fashion-mnist")


def _launch(tmp_path: Path, script: str, *args: str) -> str:
    res = subprocess.run(
        [sys.executable, "-m", "hetps.cli", "launch", "-n", "2", "-s", "1", "--",
         sys.executable, str(EXAMPLES / script), *args],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,
    )  # fmt: skip
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    return out


@pytest.mark.skipif(
    not DATA.exists(), reason="Fashion-MNIST not installed (scripts/setup.sh --tests)"
)
def test_horovod_mnist_gives_the_explicit_apis_losses(tmp_path):
    args = ["--epochs", "2", "--train-samples", "1280", "--test-samples", "400",
            "--log-interval", "4"]  # fmt: skip
    curves = []
    for script in ("pytorch_mnist.py", "pytorch_mnist_explicit.py"):
        out = _launch(tmp_path, script, *args)
        losses = {
            w: re.findall(rf"\[worker {w}\] Train Epoch: \d \[\d+/640\]\tLoss: ([\d.]+)", out)
            for w in (0, 1)
        }
        test = re.findall(r"\[worker 0\] Test set: Average loss: ([\d.]+), Accuracy", out)
        assert len(losses[0]) == len(losses[1]) == 6 and len(test) == 2, out
        curves.append((losses, test))
    assert curves[0] == curves[1]
    losses, test = curves[0]
    assert float(test[1]) < float(test[0])  # it learns


@pytest.mark.slow  # (SyncBatchNorm is checked against BatchNorm in the default run)
def test_horovod_synthetic_benchmark_runs_with_sync_batch_norm(tmp_path):
    out = _launch(
        tmp_path, "pytorch_synthetic_benchmark.py", "--num-warmup-batches", "2",
        "--num-iters", "2", "--num-batches-per-iter", "2", "--batch-size", "8",
    )  # fmt: skip
    assert re.search(r"\[worker 0\] Total img/sec on 2 CPU\(s\): [\d.]+ \+-[\d.]+", out), out
    last = dict(re.findall(r"rank (\d) last loss [\d.]+ weights (\S+)", out))
    assert sorted(last) == ["0", "1"] and last["0"] == last["1"], out
