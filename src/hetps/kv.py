"""``hetps.kv``: MXNet-style entry point (``hetps.kv.create('dist_sync')``), for every role.
(docs/MODULES.md, "hetps.kv")"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from types import FrameType
from typing import Any

from hetps import kvstore
from hetps.config import ConfigError, check_node_env, node_config_from_env, role_from_env
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
        # (the environment's variables, checked before anything starts; a local store's too)
        cfg = node_config_from_env(env) if name.startswith("dist") else check_node_env(env)
    except ConfigError as exc:
        # the message names the variable and the fix; a traceback would only bury it
        raise CreateError(f"hetps.kv.create({name!r}): {exc}") from None
    if role not in ("server", "scheduler"):
        return _worker_store(name, env, cfg, sys._getframe(1))
    if cfg is None:
        sys.exit(0)  # nothing to serve for a local store; MXNet's servers idle out the same

    from hetps import roles

    kvstore.setup_logging(cfg.verbose)
    code = roles.run_scheduler(cfg) if cfg.role == "scheduler" else roles.run_server(cfg)
    logging.shutdown()
    sys.stdout.flush()
    os._exit(code) if code else sys.exit(0)


#: where the stores hetps.kv.create made were asked for (id of the store -> file:line)
_asked_at: dict[int, str] = {}


def _worker_store(name: str, env: Mapping[str, str] | None, cfg: Any, at: FrameType) -> Any:
    """A worker's store: a new one, or for a dist name and configuration asked for again the
    one still open (one worker per process, as ps-lite's one Postoffice under MXNet's
    stores); another name or configuration is refused, naming the first call's place."""
    from hetps import roles

    open_ = kvstore.live() if cfg is not None else []
    if open_:
        kv = open_[0]
        if (kv.type, kv.cfg) == (name, cfg):
            return kv
        raise CreateError(
            f"hetps.kv.create({name!r}): this process is already a worker of the job, with "
            f"the store hetps.kv.create({kv.type!r}) made at {_asked_at.get(id(kv), '?')}; "
            "a process joins a job once, so another name or configuration is refused: use "
            "that store (pass it on, or call hetps.kv.create again with the same arguments, "
            "which gives it back)"
        )
    kv = kvstore.create(name, env, build=roles.new_worker_store)
    if cfg is not None:
        _asked_at[id(kv)] = f"{at.f_code.co_filename}:{at.f_lineno}"
    return kv
