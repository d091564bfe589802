"""Errors a hetps node raises to its user."""

from __future__ import annotations


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
