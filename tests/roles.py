"""Hand-started roles for tests: the environment of a ``hetps scheduler``/``hetps server``
process and the :class:`NodeConfig` of an in-process node, both on loopback.

Tests that start a role by hand (rather than through ``hetps launch`` or the ``cluster``
fixture) take their variables from here, so a new required variable is added once.
"""

from __future__ import annotations

import os
import re

import numpy as np

from hetps.config import NodeConfig
from hetps.kvstore.client import DistKVStore
from hetps.roles import new_worker_store

#: two hosts (groups 0, 1) of two workers; worker launch rank r is local rank r % 2
HOSTS = {
    ("worker", r): {
        "HETPS_HOST_GROUP": str(r // 2),
        "LOCAL_RANK": str(r % 2),
        "LOCAL_WORLD_SIZE": "2",
    }
    for r in range(4)
}


def role_env(
    role: str, port: int = 0, *, servers: int = 1, workers: int = 1, clean: bool = False, **extra
) -> dict[str, str]:
    """The environment of one loopback role process (``python -m hetps.cli ROLE``).

    ``clean`` drops every inherited ``HETPS_*``/``DMLC_*`` variable first (a cluster secret
    of the outer environment among them); ``extra`` adds or overrides variables (values are
    turned into strings).
    """
    env = dict(os.environ)
    if clean:
        env = {k: v for k, v in env.items() if not k.startswith(("HETPS_", "DMLC_"))}
    env.update(
        DMLC_ROLE=role,
        DMLC_PS_ROOT_URI="127.0.0.1",
        DMLC_PS_ROOT_PORT=str(port),
        DMLC_NUM_SERVER=str(servers),
        DMLC_NUM_WORKER=str(workers),
        PYTHONUNBUFFERED="1",
    )
    env.update({k: str(v) for k, v in extra.items()})
    return env


def loopback_config(role: str, port: int = 0, **overrides) -> NodeConfig:
    """A loopback :class:`NodeConfig` for an in-process node (scheduler, server or worker)
    with short test timeouts; ``overrides`` set any other field."""
    fields = dict(
        role=role,
        root_uri="127.0.0.1",
        root_port=port,
        num_server=1,
        num_worker=1,
        node_host="127.0.0.1",
        heartbeat_interval=0.5,
        heartbeat_timeout=10.0,
        connect_timeout=20,
        request_timeout=30,
    )
    fields.update(overrides)
    return NodeConfig(**fields)


def worker_store(name: str, cfg: NodeConfig) -> DistKVStore:
    """An in-process worker's store with its fault parts, as :func:`hetps.kv.create` makes
    it (without the exit hooks: the test closes it)."""
    return new_worker_store(name, cfg)


def read_port(stream) -> int:
    """The port a ``hetps scheduler`` started with port 0 prints ("hetps scheduler port N"),
    read from its text output; lines before it (a warning on stderr merged in) are skipped.
    Fails when the output ends first."""
    seen = []
    for line in stream:
        match = re.search(r"hetps scheduler port (\d+)", line)
        if match:
            return int(match.group(1))
        seen.append(line)
    raise AssertionError("the scheduler ended before printing its port:\n" + "".join(seen))


class ServerNodeStub:
    """What a server's parts read of its node in an in-process unit test: its workers' roles,
    and where its replies go, kept as ``(sender, req, body)``; with ``rows``, as
    ``(sender, req, body, arrays)``, each array copied when the reply is made (a table's rows
    may be gathered lazily)."""

    def __init__(self, workers, rows: bool = False) -> None:
        self.roles = dict.fromkeys(workers, "worker")
        self.rows = rows
        self.replies: list = []

    def role_of(self, node_id: int) -> str | None:
        return self.roles.get(node_id)

    def workers(self) -> list:
        return list(self.roles)

    def reply(self, msg, body=None, arrays=None, track=False):
        if self.rows:
            kept = [np.array(np.asarray(a)) for a in arrays or []]
            self.replies.append((msg.sender, msg.req, body, kept))
        else:
            self.replies.append((msg.sender, msg.req, body))
