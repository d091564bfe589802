"""``hetps train --tensorboard``: which scalars a round's record gives, and a missing package."""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("torch")

from hetps.app.tboard import TensorBoardLog, scalars_of  # noqa: E402


def test_scalars_of_a_round():
    rec = {
        "iter": 3, "t": 1.0, "samples": 96, "loss": 0.5, "local_steps": 3, "srit_s": 0.2,
        "compute_s": 0.12, "push_s": 0.03, "wait_s": 0.04, "pull_s": 0.0, "accuracy": 0.75,
    }  # fmt: skip
    assert scalars_of(rec) == pytest.approx(
        {
            "train/loss": 0.5,
            "eval/accuracy": 0.75,
            "speed/samples_per_s": 480.0,
            "time/round_s": 0.2,
            "time/step_s": 0.2 / 3,
            "time/compute_s": 0.12,
            "time/push_s": 0.03,
            "time/wait_s": 0.04,
            "time/pull_s": 0.0,
        }
    )
    # no accuracy on a round that was not evaluated, no loss when it is null
    rec.update(loss=None)
    del rec["accuracy"]
    assert {"train/loss", "eval/accuracy"}.isdisjoint(scalars_of(rec))


def test_without_the_tensorboard_package_it_says_how_to_get_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    with pytest.raises(SystemExit) as e:
        TensorBoardLog(tmp_path, "run", 0, 0.0)
    assert "pip install 'hetps[tensorboard]'" in str(e.value.code)
