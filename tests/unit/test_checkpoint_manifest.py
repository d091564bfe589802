"""A newest checkpoint whose manifest was deleted or damaged is named, with the folder
``latest`` names, and the resume says which checkpoint it goes on from: it never falls back
to an older one in silence."""

from __future__ import annotations

import argparse
import logging

import pytest
from test_checkpoint_files import _job

from hetps.app.checkpointing import chosen
from hetps.kvstore import checkpoint


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (lambda m: m.unlink(), "manifest.json is missing"),
        (lambda m: m.write_text('{"step": '), "manifest.json cannot be read (JSONDecodeError"),
    ],
)
def test_a_newest_manifest_deleted_or_damaged_is_named_and_the_one_before_used(
    tmp_path, caplog, capsys, damage, why
):
    root = _job(tmp_path)
    assert (root / "latest").read_text() == "ckpt-00000002"
    damage(root / "ckpt-00000002" / "manifest.json")
    with caplog.at_level(logging.WARNING, logger="hetps.checkpoint"):
        ck = chosen(argparse.Namespace(), str(root))
    assert ck is not None and ck.step == 1
    text = caplog.text
    named = f"ckpt-00000002 (the one {root / 'latest'} names) is damaged: {why}"
    assert named in text and "trying the one before it" in text, text
    assert f"going on from {root / 'ckpt-00000001'}" in text, text
    said = capsys.readouterr().out
    assert f"the last intact checkpoint in {root} is ckpt-00000001 (round 1)" in said, said


def test_latest_naming_a_folder_that_is_gone_is_said_too(tmp_path, caplog):
    root = _job(tmp_path)
    (root / "latest").write_text("ckpt-00000003")
    with caplog.at_level(logging.WARNING, logger="hetps.checkpoint"):
        ck = checkpoint.latest(root)
    assert ck is not None and ck.step == 2
    assert "ckpt-00000003 (the one" in caplog.text and "the folder is not there" in caplog.text


def test_every_manifest_gone_is_one_error_that_lists_them(tmp_path):
    root = _job(tmp_path)
    for step in (1, 2):
        (root / f"ckpt-0000000{step}" / "manifest.json").unlink()
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.latest(root)
    text = str(err.value)
    assert "ckpt-00000002/manifest.json: manifest.json is missing" in text, text
    assert "ckpt-00000001/manifest.json: manifest.json is missing" in text, text
