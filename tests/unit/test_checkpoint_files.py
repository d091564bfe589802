"""Damaged checkpoints (hetps.kvstore.checkpoint): every file's size and SHA-256 are in the
manifest; a checkpoint with a file missing, cut short or changed is logged by file name and
the one before it is used; when all are damaged the error lists them. Checkpoints written
before checksums are checked by loading every file, with a warning."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from hetps import optim
from hetps.kvstore import checkpoint
from hetps.kvstore.local import LocalKVStore


class OneWorkerStore(LocalKVStore):
    """The single-process store with what ``checkpoint.save`` asks of a worker's store."""

    num_servers = 1

    def __init__(self) -> None:
        super().__init__()
        self.order: list = []

    def init(self, key, value) -> None:
        super().init(key, value)
        self.order.append(key)

    def wait_outstanding(self) -> None:
        pass


def _job(tmp_path: Path, steps=(1, 2)) -> Path:
    """Checkpoints after each of ``steps``: two keys (one big), SGD momentum on the 'servers'."""
    kv = OneWorkerStore()
    kv.init("w", np.arange(1000, dtype=np.float32))
    kv.init(3, np.ones(4, np.float32))
    kv.set_optimizer(optim.SGD(learning_rate=0.1, momentum=0.9))
    root = tmp_path / "ck"
    for step in steps:
        kv.push("w", np.full(1000, step, np.float32))
        kv.push(3, np.full(4, step, np.float32))
        checkpoint.save(kv, root, step, state={"step": step, "blob": list(range(500))})
    return root


def _flip(path: Path, at: int = -40) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def test_the_manifest_holds_every_file_s_size_and_sha256(tmp_path):
    root = _job(tmp_path, steps=(1,))
    folder = root / "ckpt-00000001"
    files = json.loads((folder / "manifest.json").read_text())["files"]
    assert sorted(files) == ["optimizer.states", "values.npz", "worker-0.pkl"]
    for name, want in files.items():
        assert want == checkpoint._digest(folder / name), name
    assert not list(folder.glob("rank-*")), "the per-rank files are renamed or gone"
    ck = checkpoint.latest(root)
    assert ck is not None and ck.checked and ck.step == 1
    ck.verify()


@pytest.mark.parametrize(
    "name, damage, why",
    [
        ("worker-0.pkl", _truncate, "cut short"),
        ("worker-0.pkl", _flip, "SHA-256 differs"),
        ("values.npz", _truncate, "cut short"),
        ("values.npz", _flip, "SHA-256 differs"),
        ("optimizer.states", _flip, "SHA-256 differs"),
        ("values.npz", Path.unlink, "missing"),
    ],
)
def test_a_damaged_newest_checkpoint_is_named_and_the_one_before_used(
    tmp_path, caplog, name, damage, why
):
    root = _job(tmp_path)
    damage(root / "ckpt-00000002" / name)
    with caplog.at_level(logging.WARNING, logger="hetps.checkpoint"):
        ck = checkpoint.latest(root)
    assert ck is not None and ck.step == 1
    text = caplog.text
    assert f"ckpt-00000002 is damaged: {name}: " in text and why in text, text
    assert "going on from" in text and "ckpt-00000001" in text, text
    kv = OneWorkerStore()
    kv.set_optimizer(optim.SGD(learning_rate=0.1, momentum=0.9))
    ck.restore(kv)  # the older one loads whole
    assert ck.state(0)["step"] == 1
    assert checkpoint.latest(root, verify=False).step == 2  # (unchecked: the newest)


def test_every_checkpoint_damaged_is_one_error_that_lists_them(tmp_path):
    root = _job(tmp_path)
    _truncate(root / "ckpt-00000002" / "worker-0.pkl")
    _flip(root / "ckpt-00000001" / "values.npz")
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.latest(root)
    text = str(err.value)
    assert "every checkpoint in" in text, text
    assert "ckpt-00000002/worker-0.pkl:" in text and "ckpt-00000001/values.npz:" in text, text


def test_loading_a_damaged_file_names_it(tmp_path):
    """Without the check (verify=False), loading the cut file still names it, not a bare
    UnpicklingError."""
    root = _job(tmp_path, steps=(1,))
    _truncate(root / "ckpt-00000001" / "worker-0.pkl")
    _truncate(root / "ckpt-00000001" / "values.npz")
    ck = checkpoint.latest(root, verify=False)
    with pytest.raises(checkpoint.DamagedCheckpoint, match=r"worker-0\.pkl: cannot be loaded"):
        ck.state(0)
    with pytest.raises(checkpoint.DamagedCheckpoint, match=r"values\.npz: cannot be loaded"):
        ck.values()


def _without_sums(folder: Path) -> None:
    """The manifest as hetps wrote it before checksums."""
    manifest = json.loads((folder / "manifest.json").read_text())
    del manifest["files"]
    (folder / "manifest.json").write_text(json.dumps(manifest))


def test_a_checkpoint_without_checksums_is_checked_by_loading_it_with_a_warning(tmp_path, caplog):
    root = _job(tmp_path)
    for step in (1, 2):
        _without_sums(root / f"ckpt-{step:08d}")
    with caplog.at_level(logging.WARNING, logger="hetps.checkpoint"):
        ck = checkpoint.latest(root)
    assert ck is not None and ck.step == 2 and not ck.checked
    assert "ckpt-00000002 has no checksums" in caplog.text, caplog.text
    caplog.clear()
    _truncate(root / "ckpt-00000002" / "values.npz")  # a cut file does not load
    with caplog.at_level(logging.WARNING, logger="hetps.checkpoint"):
        ck = checkpoint.latest(root)
    assert ck is not None and ck.step == 1
    assert "ckpt-00000002 is damaged: values.npz: cannot be loaded" in caplog.text, caplog.text


def test_save_alone_has_checksums_too(tmp_path):
    root = tmp_path / "ck"
    checkpoint.save_alone(root, 4, state={"x": 1})
    checkpoint.save_alone(root, 5, state={"x": 2})
    _flip(root / "ckpt-00000005" / "worker-0.pkl", at=-3)
    ck = checkpoint.latest(root)
    assert ck is not None and ck.state(0) == {"x": 1}
