"""The KVStore: ``create(name)`` and the stores behind it (MXNet's API).
(docs/MODULES.md, "hetps.kvstore")"""

from __future__ import annotations

import atexit
import logging
import sys
from collections.abc import Callable, Mapping
from typing import Any

from hetps.config import (
    ConfigError,
    NodeConfig,
    check_node_env,
    node_config_from_env,
    role_from_env,
)
from hetps.kvstore import exits
from hetps.kvstore.client import DistKVStore
from hetps.kvstore.local import LocalKVStore

#: a worker's store, in one process or in a cluster (what :func:`create` returns)
KVStore = DistKVStore | LocalKVStore

NAMES = ("local", "device", "dist_sync", "dist_async", "dist_sync_device", "dist_async_device")

__all__ = ["NAMES", "DistKVStore", "KVStore", "LocalKVStore", "create", "ConfigError"]

_live: list[DistKVStore] = []
_hooked = False


def live() -> list[DistKVStore]:
    """The ``dist_*`` stores :func:`create` made in this process that are still open."""
    return [kv for kv in _live if not kv.closed]


def setup_logging(verbose: int) -> None:
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


def create(
    name: str = "local",
    env: Mapping[str, str] | None = None,
    *,
    build: Callable[[str, NodeConfig], DistKVStore] | None = None,
) -> Any:
    """A worker's KVStore (MXNet's ``mx.kv.create``, on a worker): for ``dist_*`` names the
    process joins the cluster described by ``DMLC_*`` variables as a worker, in the store
    that ``build`` makes of the name and the configuration: the composition root's
    :func:`hetps.roles.new_worker_store`, which builds its Node, its parts and its meter.
    (docs/MODULES.md, "hetps.kvstore")"""
    if not isinstance(name, str) or name not in NAMES:
        raise ValueError(f"unknown KVStore type {name!r}: use one of {', '.join(NAMES)}")
    role = role_from_env(env)
    if role in ("server", "scheduler"):
        raise ConfigError(
            f"hetps.kvstore.create makes a worker's store, and DMLC_ROLE is {role}: "
            "call hetps.kv.create, which runs a scheduler's or server's role"
        )
    if not name.startswith("dist"):
        check_node_env(env)  # (a bad value is refused here too, as a cluster's node does)
        return LocalKVStore(name)
    if build is None:
        raise TypeError(
            f"hetps.kvstore.create({name!r}) makes a worker's store with the parts the "
            "composition root builds (its Node, fault parts, balance agent, meter), and no "
            f"builder was given: call hetps.kv.create({name!r}), which gives it"
        )
    cfg = node_config_from_env(env)
    setup_logging(cfg.verbose)
    kv = build(name, cfg)
    _install_exit_hooks()
    _live.append(kv)
    return kv
