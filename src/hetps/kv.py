"""``hetps.kv``: MXNet-style entry point (``hetps.kv.create('dist_sync')``), for every role.

In a process whose ``DMLC_ROLE`` is ``server`` or ``scheduler``, :func:`create` runs that role
until the job ends and then exits the process (0 on a clean end), so a script written for
MXNet runs unchanged in every role; a worker gets its store from :func:`hetps.kvstore.create`,
built by the composition root (:func:`hetps.roles.new_worker_store`).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from types import FrameType
from typing import Any

from hetps import kvstore
from hetps.config import ConfigError, node_config_from_env, role_from_env
from hetps.kvstore import NAMES, DistKVStore, LocalKVStore

__all__ = ["NAMES", "CreateError", "DistKVStore", "LocalKVStore", "create"]


class CreateError(ConfigError, SystemExit):
    """:func:`create` was given a configuration that cannot work. A ``ConfigError`` to a
    caller that catches one; uncaught, it ends the process as ``SystemExit`` does, with its
    message (which names the variable and the fix) and status 1, not a traceback."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.code = text  # (what the interpreter prints and exits 1 with)


def create(name: str = "local", env: Mapping[str, str] | None = None) -> Any:
    """Create a KVStore (MXNet's ``mx.kv.create``).

    For ``dist_*`` names the process joins the cluster described by ``DMLC_*`` variables.
    Under ``DMLC_ROLE=server`` or ``scheduler`` this call does not return: it serves, then
    exits the process. A configuration that cannot work (an empty ``HETPS_SECRET``, a bad
    variable) raises :class:`CreateError`: uncaught, it ends the process with the message
    that names the variable and the fix, in every role.
    """
    if not isinstance(name, str) or name not in NAMES:
        raise ValueError(f"unknown KVStore type {name!r}: use one of {', '.join(NAMES)}")
    try:
        role = role_from_env(env)
        # (the environment's variables, checked before anything starts)
        cfg = node_config_from_env(env) if name.startswith("dist") else None
    except ConfigError as exc:
        # the message names the variable and the fix; a traceback would only bury it
        raise CreateError(f"hetps.kv.create({name!r}): {exc}") from None
    if role not in ("server", "scheduler"):
        return _worker_store(name, env, sys._getframe(1))
    if cfg is None:
        sys.exit(0)  # nothing to serve for a local store; MXNet's servers idle out the same

    from hetps import roles

    kvstore.setup_logging(cfg.verbose)
    code = roles.run_scheduler(cfg) if cfg.role == "scheduler" else roles.run_server(cfg)
    logging.shutdown()
    sys.stdout.flush()
    os._exit(code) if code else sys.exit(0)


#: the dist store this process made, its arguments and where it was asked for (one worker
#: per process: ps-lite's Postoffice, which MXNet's stores share, is one node too)
_made: list[tuple[Any, str, dict[str, str] | None, str]] = []


def _worker_store(name: str, env: Mapping[str, str] | None, caller: FrameType | None) -> Any:
    """A worker's store: a new one, or for a dist name asked for again with the same
    arguments the one still open; other arguments are refused, naming the first call."""
    from hetps import roles

    if not name.startswith("dist"):
        return kvstore.create(name, env)
    args = None if env is None else dict(env)
    if _made and not _made[0][0].closed:
        kv, first, first_env, where = _made[0]
        if (first, first_env) == (name, args):
            return kv
        raise CreateError(
            f"hetps.kv.create({name!r}): this process is already a worker of the job, with "
            f"the store hetps.kv.create({first!r}{'' if first_env is None else ', env=...'}) "
            f"made at {where}; a process joins a job once: use that store (pass it on, or "
            "call hetps.kv.create again with the same arguments, which gives it back)"
        )
    where = f"{caller.f_code.co_filename}:{caller.f_lineno}" if caller is not None else "?"
    kv = kvstore.create(name, env, build=roles.new_worker_store)
    _made[:] = [(kv, name, args, where)]
    return kv
