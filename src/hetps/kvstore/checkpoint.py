"""Consistent, atomic checkpoints of a job: the servers' values and optimizer states, and each
worker's own state, taken at one round boundary for the whole cluster.

Every worker calls :func:`save` at the same point of its loop (after the same round)::

    from hetps.kvstore import checkpoint
    checkpoint.save(kv, "ckpt", step=rnd, state={"model": model.state_dict(), "pos": i})

    ck = checkpoint.latest("ckpt")      # the last complete checkpoint, or None
    if ck is not None:
        kv.set_optimizer(...)           # as before the checkpoint, then:
        ck.restore(kv)                  # every key takes its saved value, the optimizer its state
        state = ck.state(kv.rank)       # what this worker saved

How it is consistent: each worker waits for its pushes and meets the others at a barrier (the
scheduler's), so every push of the round has been applied and none of the next has been sent;
rank 0 then reads every key's value and every server's optimizer state. How it is atomic:
everything is written into ``DIR/ckpt-<step>.tmp/`` and, once every worker has written its own
file, rank 0 renames the folder to ``DIR/ckpt-<step>`` and points ``DIR/latest`` at it (itself
written and renamed). A checkpoint folder without its ``manifest.json`` is never read.

``DIR`` must be one folder every worker can reach: a shared filesystem across hosts. The
worker files are pickles: load checkpoints you (or your job) wrote, nobody else's.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MANIFEST = "manifest.json"
VALUES = "values.npz"
STATES = "optimizer.states"
KEEP = 2  # complete checkpoints kept; older ones are removed after a new one is complete


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read; the message names the fix."""


def _key_tag(key: Any) -> list:
    if isinstance(key, bool) or not isinstance(key, (int, str)):
        raise CheckpointError(f"key {key!r}: only int and str keys can be checkpointed")
    return ["int" if isinstance(key, int) else "str", key]


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(
    kv: Any,
    directory: str | os.PathLike[str],
    step: int,
    state: Any = None,
    meta: dict | None = None,
) -> Path:
    """Checkpoint the job at round ``step`` (every worker calls it, at the same round); each
    worker's ``state`` (any picklable object) is kept for that worker. Returns the folder."""
    root = Path(directory)
    step = int(step)
    tmp = root / f"ckpt-{step:08d}.tmp"
    final = root / f"ckpt-{step:08d}"
    kv.wait_outstanding()
    if _lead(kv):
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # a checkpoint of this step that a killed job left half written
            shutil.rmtree(tmp)
        tmp.mkdir()
    kv.barrier()  # every push of the round applied, the folder made
    # (unless the first worker died just now and the job went on without it: HETPS_ELASTIC)
    tmp.mkdir(parents=True, exist_ok=True)
    # each worker's file is named by its rank first (ranks never collide, whoever thinks it
    # leads); the manifest's writer names them by place among the live workers below
    with open(tmp / f"rank-{kv.rank}.pkl", "wb") as f:
        pickle.dump(state, f, protocol=pickle.HIGHEST_PROTOCOL)
        f.flush()
        os.fsync(f.fileno())
    kv.barrier()  # every worker's file written; a death before now reached every worker
    if _lead(kv):
        keys = list(kv.order)  # every key initialised, in init order
        values = kv.pull(keys) if keys else []
        index = [_key_tag(k) for k in keys]
        with open(tmp / VALUES, "wb") as f:
            np.savez(f, **{f"v{i}": np.asarray(v) for i, v in enumerate(values)})
        kv.save_optimizer_states(str(tmp / STATES))
        # worker-0.pkl .. worker-(n-1).pkl: the live workers in rank order, so a job that
        # went on without a dead worker (HETPS_ELASTIC) resumes with that many workers
        live = _live_ranks(kv)
        for place, rank in enumerate(live):
            os.replace(tmp / f"rank-{rank}.pkl", tmp / f"worker-{place}.pkl")
        for stale in tmp.glob("rank-*.pkl"):  # a worker that died after writing its own
            stale.unlink()
        manifest = {
            "step": step,
            "time": time.time(),
            "workers": len(live),
            "servers": kv.num_servers,
            "keys": index,
            **(meta or {}),
        }
        _finish(root, tmp, final, manifest)
    kv.barrier()  # nobody goes on (or stops) before the checkpoint is complete
    return final


def _live_ranks(kv: Any) -> list[int]:
    """The ranks of the workers in the job's rounds, in order."""
    node = getattr(kv, "node", None)
    if node is None or not hasattr(node, "live_workers"):
        return list(range(kv.num_workers))
    return [n.rank for n in node.live_workers()]


def _lead(kv: Any) -> bool:
    """Whether ``kv``'s worker does the checkpoint's shared work: the first live worker."""
    return getattr(kv, "live_rank", kv.rank) == 0


def save_alone(
    directory: str | os.PathLike[str], step: int, state: Any = None, meta: dict | None = None
) -> Path:
    """:func:`save` for one process without a KVStore (``hetps train -m local``): the same
    folder, with this process as worker 0 and no server values."""
    root = Path(directory)
    step = int(step)
    tmp = root / f"ckpt-{step:08d}.tmp"
    final = root / f"ckpt-{step:08d}"
    root.mkdir(parents=True, exist_ok=True)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    with open(tmp / "worker-0.pkl", "wb") as f:
        pickle.dump(state, f, protocol=pickle.HIGHEST_PROTOCOL)
        f.flush()
        os.fsync(f.fileno())
    manifest = {"step": step, "time": time.time(), "workers": 1, "servers": 0, "keys": []}
    _finish(root, tmp, final, {**manifest, **(meta or {})})
    return final


def _finish(root: Path, tmp: Path, final: Path, manifest: dict) -> None:
    """Seal ``tmp`` (its manifest last), rename it to ``final``, point ``latest`` at it and
    keep the newest :data:`KEEP` complete checkpoints."""
    _write_atomic(tmp / MANIFEST, json.dumps(manifest).encode())
    _fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    _write_atomic(root / "latest", final.name.encode())
    _fsync_dir(root)
    for old in complete(root)[:-KEEP]:
        shutil.rmtree(old.path, ignore_errors=True)


@dataclass
class Checkpoint:
    """A complete checkpoint folder."""

    path: Path
    manifest: dict

    @property
    def step(self) -> int:
        """The round it was taken after."""
        return int(self.manifest["step"])

    @property
    def workers(self) -> int:
        """How many workers the job had."""
        return int(self.manifest["workers"])

    def values(self) -> dict[Any, np.ndarray]:
        """Every key's value on the servers at the checkpoint."""
        out: dict[Any, np.ndarray] = {}
        with np.load(self.path / VALUES) as z:
            for i, (kind, key) in enumerate(self.manifest["keys"]):
                out[int(key) if kind == "int" else str(key)] = z[f"v{i}"]
        return out

    def state(self, rank: int) -> Any:
        """What worker ``rank`` saved."""
        f = self.path / f"worker-{int(rank)}.pkl"
        if not f.exists():
            raise CheckpointError(
                f"{self.path} has no state of worker {rank} (the job had {self.workers} "
                "workers); resume with the same number of workers"
            )
        with open(f, "rb") as fh:
            return pickle.load(fh)

    def restore(self, kv: Any) -> None:
        """Every worker calls it: each key gets its saved value (``init``: rank 0's value
        wins), then, if the servers had an optimizer state, it is loaded (set the optimizer
        first, as before the checkpoint)."""
        if kv.num_workers != self.workers:
            raise CheckpointError(
                f"{self.path} was taken with {self.workers} workers, this job has "
                f"{kv.num_workers}; resume with the same number of workers"
            )
        values = self.values()
        if values:
            keys = list(values)
            kv.init(keys, [values[k] for k in keys])
        states = self.path / STATES
        if states.exists() and states.stat().st_size > 0 and _has_states(states):
            kv.load_optimizer_states(str(states))


def _has_states(path: Path) -> bool:
    from hetps import optim

    return bool(optim.load_states(path.read_bytes()))


def complete(directory: str | os.PathLike[str]) -> list[Checkpoint]:
    """The complete checkpoints in ``directory``, oldest first."""
    root = Path(directory)
    found = []
    if not root.is_dir():
        return found
    for d in sorted(root.glob("ckpt-*")):
        if d.name.endswith(".tmp") or not (d / MANIFEST).is_file():
            continue
        try:
            manifest = json.loads((d / MANIFEST).read_text())
            int(manifest["step"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        found.append(Checkpoint(d, manifest))
    return found


def latest(directory: str | os.PathLike[str]) -> Checkpoint | None:
    """The last complete checkpoint in ``directory`` (None: there is none)."""
    found = complete(directory)
    return found[-1] if found else None
