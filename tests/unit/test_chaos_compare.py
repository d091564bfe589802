"""benchmarks/chaos_multi.py's comparison of a trial's last checkpoint with the reference's:
bit for bit, every worker's weights, every key's value on the servers, the optimizer states;
one element changed anywhere is found and named."""

from __future__ import annotations

import importlib.util
import pickle
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from test_checkpoint_files import OneWorkerStore

from hetps import optim
from hetps.kvstore import checkpoint

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "chaos_multi.py"
_spec = importlib.util.spec_from_file_location("chaos_multi", _PATH)
cm = importlib.util.module_from_spec(_spec)
sys.modules["chaos_multi"] = cm
_spec.loader.exec_module(cm)


def _job(root: Path) -> None:
    kv = OneWorkerStore()
    kv.init("w", np.arange(10, dtype=np.float32))
    kv.init("b", np.ones(3, np.float32))
    kv.set_optimizer(optim.SGD(learning_rate=0.1, momentum=0.9))
    kv.push("w", np.full(10, 0.5, np.float32))
    kv.push("b", np.full(3, 0.25, np.float32))
    model = {"fc.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    checkpoint.save(kv, root, 5, state={"model": model})


def test_equal_checkpoints_are_bit_for_bit_and_any_change_is_named(tmp_path):
    ref, same = tmp_path / "ref", tmp_path / "same"
    _job(ref)
    _job(same)
    got = cm.compare(same, ref)
    assert got["bit_for_bit"] and got["workers_equal"] == got["workers"] == 1, got
    assert got["stale_values"] == 0 and got["states_equal"], got

    # a stale value on the servers (one element), a worker's weight, a momentum
    stale = tmp_path / "stale"
    shutil.copytree(same, stale)
    folder = stale / "ckpt-00000005"
    with np.load(folder / "values.npz") as z:
        arrays = {k: z[k].copy() for k in z.files}
    arrays["v0"][3] += np.float32(1e-7) * arrays["v0"][3]
    np.savez(folder / "values.npz", **arrays)
    got = cm.compare(stale, ref)
    assert not got["bit_for_bit"] and got["stale_values"] == 1, got
    assert "values.npz v0" in got["why"], got

    weights = tmp_path / "weights"
    shutil.copytree(same, weights)
    pkl = weights / "ckpt-00000005" / "worker-0.pkl"
    state = pickle.loads(pkl.read_bytes())
    state["model"]["fc.weight"][1, 2] = torch.nextafter(
        state["model"]["fc.weight"][1, 2], torch.tensor(100.0)
    )
    pkl.write_bytes(pickle.dumps(state))
    got = cm.compare(weights, ref)
    assert not got["bit_for_bit"] and got["workers_equal"] == 0, got
    assert "worker-0.pkl weights" in got["why"], got

    states = tmp_path / "states"
    shutil.copytree(same, states)
    path = states / "ckpt-00000005" / "optimizer.states"
    loaded = optim.load_states(path.read_bytes())
    key = next(iter(loaded))
    loaded[key]["mom"][0] += 1
    path.write_bytes(optim.dump_states(loaded))
    got = cm.compare(states, ref)
    assert not got["bit_for_bit"] and not got["states_equal"], got
