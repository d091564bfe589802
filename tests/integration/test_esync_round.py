"""ESync's round aggregation in `hetps train`, checked against a NumPy computation of the round.

Two workers of a real cluster run the real `hetps train -m esync` worker (through
``hetps.cli.main``) on a tiny synthetic Fashion-MNIST-format data set. The worker script only
observes: it keeps a reference to the model `hetps train` builds and records its parameters
when the model is built and whenever the worker hands its round to the KVStore (the model
after the round's local steps, before aggregation). Then, computed here in float64,

    w_round(1) = the initial model
    w_round(r + 1) = w_round(r) + global_lr * mean_k(w_k(r) - w_round(r))

and every worker's final model must be w_round(R + 1). With ``global_lr != 1`` the round's
starting point does not cancel out, so a wrong aggregation in any round shows at the end.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.torch

ROUNDS = 2
GLOBAL_LR = 0.5


def _write_idx_dataset(root: Path, n_train: int, n_test: int) -> None:
    """Random images and labels in Fashion-MNIST's idx format (uncompressed)."""
    rng = np.random.default_rng(11)
    root.mkdir()
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, n, dtype=np.uint8)
        header = struct.pack(">IIII", 0x803, n, 28, 28)
        (root / f"{prefix}-images-idx3-ubyte").write_bytes(header + images.tobytes())
        (root / f"{prefix}-labels-idx1-ubyte").write_bytes(
            struct.pack(">II", 0x801, n) + labels.tobytes()
        )


def test_esync_round_is_the_mean_model_delta_scaled_by_global_lr(cluster, tmp_path):
    data = tmp_path / "data"
    _write_idx_dataset(data, n_train=128, n_test=32)
    argv = [
        "train", "-m", "esync", "-n", "mlp", "-b", "16", "-ll", "0.1",
        "-gl", str(GLOBAL_LR), "--max-rounds", str(ROUNDS), "-e", "1000",
        "--test-limit", "32", "--progress", "lines",
        "-dd", str(data), "-ld", str(tmp_path / "runs"),
    ]  # fmt: skip
    code = f"""
import hetps.app.models as models

seen = {{'pre': []}}

def flat(model):
    return np.concatenate([p.detach().cpu().numpy().ravel() for p in model.parameters()])

_get_model = models.get_model
def get_model(*a, **kw):
    seen['model'] = m = _get_model(*a, **kw)
    seen['init'] = flat(m)
    return m
models.get_model = get_model

_create = hetps.kv.create
def create(*a, **kw):
    kv = _create(*a, **kw)
    seen['rank'] = kv.rank
    pushpull = kv.pushpull
    def observed(*args, **kw2):
        seen['pre'].append(flat(seen['model']))  # the model before this round's aggregation
        return pushpull(*args, **kw2)
    kv.pushpull = observed
    return kv
hetps.kv.create = create

from hetps.cli import main
assert main({argv!r}) == 0
np.savez({str(tmp_path)!r} + f"/esync-{{seen['rank']}}.npz",
         init=seen['init'], pre=np.array(seen['pre']), final=flat(seen['model']))
print('ESYNC-ROUND-OK', flush=True)
"""
    rc, out = cluster(code, workers=2, servers=1)
    assert rc == 0, out
    assert out.count("ESYNC-ROUND-OK") == 2, out

    rec = [np.load(tmp_path / f"esync-{k}.npz") for k in (0, 1)]
    init = rec[0]["init"].astype(np.float64)
    np.testing.assert_array_equal(rec[1]["init"], rec[0]["init"])  # same seed, same replica
    for k in (0, 1):
        assert rec[k]["pre"].shape == (ROUNDS, init.size), rec[k]["pre"].shape
    w_round = init
    for r in range(ROUNDS):
        local = [rec[k]["pre"][r].astype(np.float64) for k in (0, 1)]
        # the workers trained on different shards: their round deltas differ
        assert np.abs(local[0] - local[1]).max() > 1e-4, r
        w_round = w_round + GLOBAL_LR * np.mean([w - w_round for w in local], axis=0)
    assert np.abs(w_round - init).max() > 1e-3  # the model moved
    for k in (0, 1):
        np.testing.assert_allclose(
            rec[k]["final"], w_round, rtol=1e-5, atol=1e-6, err_msg=f"worker {k}"
        )
