"""The errors of checkpoints (:mod:`hetps.kvstore.checkpoint`, and the tables' files in
:mod:`hetps.tables.worker_checkpoint`)."""

from __future__ import annotations

from pathlib import Path


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read; the message names the fix."""


class DamagedCheckpoint(CheckpointError):
    """A file of a complete checkpoint is missing, cut short or changed since it was written:
    ``path`` is the checkpoint folder, ``file`` the file's name, ``why`` what is wrong."""

    def __init__(self, path: Path, file: str, why: str) -> None:
        super().__init__(f"{path / file}: {why}")
        self.path = path
        self.file = file
        self.why = why
