"""The process's store, as Horovod and BytePS keep one: ``init()``, ``rank()``, ``size()``,
``local_rank()``, ``local_size()``, ``shutdown()``.

``init()`` makes it once per process: a ``dist_sync`` store that joins the job under a
launched worker (``DMLC_ROLE=worker``), a local store of one worker otherwise, or the
``dist_*`` store the script made itself. The helpers given no store use it
(:func:`store_for`). ``local_rank()`` / ``local_size()`` read ``LOCAL_RANK`` /
``LOCAL_WORLD_SIZE``, else 0 and 1."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hetps.config import env_value, role_from_env

if TYPE_CHECKING:
    from hetps.kvstore import KVStore

__all__ = [
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "rank",
    "shutdown",
    "size",
    "store",
    "store_for",
]


class _Process:
    """What :func:`init` made: the store, whether this process owns it, the host fields."""

    kv: KVStore | None = None
    ended = False  # shutdown() ran: the worker left its job
    local_rank = 0
    local_size = 1


_state = _Process()


def _make_store(name: str) -> Any:
    """A worker's store, as ``hetps.kv.create`` (the composition root) builds it."""
    import hetps

    return hetps.kv.create(name)


def init(kvstore: Any = None) -> None:
    """Set up this process's store (Horovod's ``hvd.init()``); a second call does nothing.

    Under a launched worker (``DMLC_ROLE=worker``) the store is ``dist_sync`` (or the
    ``dist_*`` store this process already made with ``hetps.kv.create``); without
    ``DMLC_ROLE`` a local store (one worker). ``kvstore`` hands over a store made by the
    caller instead.
    """
    if _state.kv is not None:
        if kvstore is not None and kvstore is not _state.kv:
            raise ValueError(
                "hetps.torch.init() already set this process's store; pass the same store "
                "or call hetps.torch.shutdown() first"
            )
        return
    if _state.ended:
        raise RuntimeError(
            "hetps.torch.shutdown() ended this worker's part in the job; a process joins a "
            "job once: start the script again to train again"
        )
    if kvstore is None:
        import hetps.kvstore

        live = hetps.kvstore.live()  # the dist_* stores made here, still open
        if len(live) > 1:
            raise ValueError(
                f"{len(live)} hetps KVStores are open in this process: pass the one to use, "
                "hetps.torch.init(kvstore=kv)"
            )
        if live:
            kvstore = live[0]
        elif role_from_env() == "worker":
            kvstore = _make_store("dist_sync")
        else:
            kvstore = _make_store("local")
    cfg = getattr(kvstore, "cfg", None)
    if cfg is not None:
        here = (cfg.local_rank, cfg.local_world_size)
    else:  # a local store: the variables, when a launcher set them anyway
        here = (env_value("LOCAL_RANK"), env_value("LOCAL_WORLD_SIZE"))
    _state.kv = kvstore
    _state.local_rank = max(0, int(here[0]))  # -1: not set
    _state.local_size = int(here[1]) or 1  # 0: not set


def is_initialized() -> bool:
    """Whether :func:`init` has run (and :func:`shutdown` not since)."""
    return _state.kv is not None


def store() -> Any:
    """This process's store (:func:`init` must have run)."""
    if _state.kv is None:
        raise ValueError(
            "hetps.torch has not been initialized: call hetps.torch.init() first "
            "(import hetps.torch as hvd; hvd.init())"
        )
    return _state.kv


def store_for(kvstore: Any = None) -> Any:
    """The store a helper given ``kvstore`` uses: a store as it is; a name (``"dist_sync"``,
    ``"local"``, ...) a new store of that type; None this process's store, made by
    :func:`init` when there is none yet (``dist_sync`` under a launched worker, a store the
    script made with ``hetps.kv.create`` found, never a local one under ``DMLC_ROLE=worker``).
    """
    if isinstance(kvstore, str):
        return _make_store(kvstore)
    if kvstore is not None:
        return kvstore
    init()
    return _state.kv


def rank() -> int:
    """This worker's rank, 0 .. size()-1."""
    return int(store().rank)


def size() -> int:
    """The number of workers in the job."""
    return int(store().num_workers)


def local_rank() -> int:
    """This worker's rank on its host: ``LOCAL_RANK`` when set, else 0."""
    store()
    return _state.local_rank


def local_size() -> int:
    """The number of workers on this host: ``LOCAL_WORLD_SIZE`` when set, else 1."""
    store()
    return _state.local_size


def shutdown() -> None:
    """Finish this worker's part in the job: wait for its requests, tell the scheduler,
    close the store (Horovod's ``hvd.shutdown()``). Nothing to do before :func:`init`."""
    kv = _state.kv
    if kv is None:
        return
    _state.kv = None  # (closed, it is no store of hetps.kvstore.live any more)
    if hasattr(kv, "node"):  # a dist store: the process leaves its job
        _state.ended = True
    kv.close()
