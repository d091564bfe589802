"""Errors a hetps node raises to its user (checkpoints included), and a server's refusal of a
request (BadRequest, with values from the network shown short)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class ClusterError(RuntimeError):
    """The cluster cannot go on (a peer died, the scheduler is unreachable, a timeout)."""


class NodeFailure(ClusterError):
    """A peer stopped answering; the message names it (role, rank, host:port)."""


class RequestError(RuntimeError):
    """A server refused a request (bad shape, unknown key, ...); the server goes on serving."""


class RequestTimeout(ClusterError):
    """A request got no answer within the configured timeout."""


class NodeClosed(ClusterError):
    """The node (the KVStore) was closed and is used again."""


class BadRequest(ValueError):
    """A request the server refuses; the text goes back to the worker."""


def short(value: Any, limit: int = 80) -> str:
    """``repr`` of a value from the network, cut for a log line or an error."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


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
