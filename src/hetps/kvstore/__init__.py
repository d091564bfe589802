"""The KVStore: ``create(name)`` and the stores behind it (MXNet's API).

Names: ``local``, ``device`` (one process), ``dist_sync``, ``dist_async``,
``dist_sync_device``, ``dist_async_device`` (a cluster). In a process whose ``DMLC_ROLE`` is
``server`` or ``scheduler``, ``create`` runs that role until the job ends and then exits the
process (0 on a clean end), so a script written for MXNet runs unchanged in every role.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from collections.abc import Mapping
from typing import Any

from hetps.config import ConfigError, node_config_from_env, role_from_env
from hetps.kvstore import exits
from hetps.kvstore.client import DistKVStore
from hetps.kvstore.local import LocalKVStore

NAMES = ("local", "device", "dist_sync", "dist_async", "dist_sync_device", "dist_async_device")

__all__ = ["NAMES", "DistKVStore", "LocalKVStore", "create", "ConfigError"]

_live: list[DistKVStore] = []
_hooked = False


def _setup_logging(verbose: int) -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO if verbose >= 1 else logging.WARNING,
            format="[%(asctime)s] %(name)s %(levelname)s: %(message)s",
        )


def _install_exit_hooks() -> None:
    """Close live stores at exit; tell the scheduler at once when the script crashed or
    ends with ``sys.exit`` and a failing status."""
    global _hooked
    if _hooked:
        return
    _hooked = True
    failed: list[str] = []
    previous = sys.excepthook

    def excepthook(tp, value, tb):  # type: ignore[no-untyped-def]
        failed.append(f"{tp.__name__}: {value}")
        previous(tp, value, tb)

    sys.excepthook = excepthook
    exits.watch()  # sys.exit(3) is a failure too, not a finished worker

    def close_all() -> None:
        error = failed[0] if failed else exits.failing()
        while _live:
            kv = _live.pop()
            try:
                kv.close(error=error)
            except Exception as exc:  # noqa: BLE001 - at exit, report and go on
                print(f"hetps: closing the KVStore failed: {exc}", file=sys.stderr)

    atexit.register(close_all)


def create(name: str = "local", env: Mapping[str, str] | None = None) -> Any:
    """Create a KVStore (MXNet's ``mx.kv.create``).

    For ``dist_*`` names the process joins the cluster described by ``DMLC_*`` variables.
    Under ``DMLC_ROLE=server`` or ``scheduler`` this call does not return: it serves, then
    exits the process.
    """
    if not isinstance(name, str) or name not in NAMES:
        raise ValueError(f"unknown KVStore type {name!r}: use one of {', '.join(NAMES)}")
    role = role_from_env(env)
    if not name.startswith("dist"):
        if role in ("server", "scheduler"):
            sys.exit(0)  # nothing to serve for a local store; MXNet's servers idle out the same
        return LocalKVStore(name)
    cfg = node_config_from_env(env)
    _setup_logging(cfg.verbose)
    if cfg.role in ("server", "scheduler"):
        from hetps.kvstore.roles import run_scheduler, run_server

        code = run_scheduler(cfg) if cfg.role == "scheduler" else run_server(cfg)
        logging.shutdown()
        sys.stdout.flush()
        os._exit(code) if code else sys.exit(0)
    kv = DistKVStore(name, cfg)
    _install_exit_hooks()
    _live.append(kv)
    return kv
