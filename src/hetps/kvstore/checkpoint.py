"""Consistent, atomic checkpoints of a job: the servers' values and optimizer states, and each
worker's own state, taken at one round boundary for the whole cluster.
(docs/MODULES.md, "hetps.kvstore.checkpoint")"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hetps.cluster.errors import CheckpointError, DamagedCheckpoint
from hetps.tables import worker_checkpoint

if TYPE_CHECKING:
    from hetps.kvstore import KVStore

log = logging.getLogger("hetps.checkpoint")

MANIFEST = "manifest.json"
VALUES = "values.npz"
STATES = "optimizer.states"
KEEP = 2  # complete checkpoints kept; older ones are removed after a new one is complete


class _HashingWriter:
    """A file's ``write`` that also counts and hashes what goes through (for pickle.dump)."""

    def __init__(self, f: Any) -> None:
        self.f = f
        self.sha = hashlib.sha256()
        self.bytes = 0

    def write(self, data: Any) -> int:
        self.sha.update(data)
        self.bytes += len(data)
        return self.f.write(data)

    def summary(self) -> dict:
        return {"bytes": self.bytes, "sha256": self.sha.hexdigest()}


def _digest(path: Path) -> dict:
    """A file's size and SHA-256, as a manifest keeps them."""
    sha = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": sha.hexdigest()}


def _dump_state(path: Path, state: Any) -> dict:
    """Pickle ``state`` into ``path`` (flushed to disk); returns its size and SHA-256."""
    with open(path, "wb") as f:
        out = _HashingWriter(f)
        pickle.dump(state, out, protocol=pickle.HIGHEST_PROTOCOL)
        f.flush()
        os.fsync(f.fileno())
    return out.summary()


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
    kv: KVStore,
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
    # (its size and checksum beside it, for the manifest: the lead does not read it back)
    summary = _dump_state(tmp / f"rank-{kv.rank}.pkl", state)
    _write_atomic(tmp / f"rank-{kv.rank}.sum", json.dumps(summary).encode())
    kv.barrier()  # every worker's file written; a death before now reached every worker
    if _lead(kv):
        keys = list(kv.order)  # every key initialised, in init order
        values = kv.pull(keys) if keys else []
        index = [_key_tag(k) for k in keys]
        with open(tmp / VALUES, "wb") as f:
            np.savez(f, **{f"v{i}": np.asarray(v) for i, v in enumerate(values)})
        kv.save_optimizer_states(str(tmp / STATES))
        # the row-sparse keys (embedding tables): streamed in chunks, never whole in memory
        tables, files = worker_checkpoint.save_tables(kv, tmp, _key_tag, _HashingWriter)
        # worker-0.pkl .. worker-(n-1).pkl: the live workers in rank order, so a job that
        # went on without a dead worker (HETPS_ELASTIC) resumes with that many workers
        node = getattr(kv, "node", None)
        if node is None or not hasattr(node, "live_workers"):
            live = list(range(kv.num_workers))
        else:
            live = [n.rank for n in node.live_workers()]
        for place, rank in enumerate(live):
            name = f"worker-{place}.pkl"
            files[name] = json.loads((tmp / f"rank-{rank}.sum").read_text())
            os.replace(tmp / f"rank-{rank}.pkl", tmp / name)
        # a worker that died after writing its own file; the sums are in the manifest now
        for stale in [*tmp.glob("rank-*.pkl"), *tmp.glob("rank-*.sum")]:
            stale.unlink()
        for name in (VALUES, STATES):
            if (tmp / name).is_file():
                files[name] = _digest(tmp / name)
        manifest = {
            "step": step,
            "time": time.time(),
            "workers": len(live),
            "servers": kv.num_servers,
            "keys": index,
            "tables": tables,
            "files": files,
            **(meta or {}),
        }
        _finish(root, tmp, final, manifest)
    kv.barrier()  # nobody goes on (or stops) before the checkpoint is complete
    return final


def _lead(kv: KVStore) -> bool:
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
    files = {"worker-0.pkl": _dump_state(tmp / "worker-0.pkl", state)}
    manifest = {
        "step": step,
        "time": time.time(),
        "workers": 1,
        "servers": 0,
        "keys": [],
        "files": files,
    }
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

    @property
    def checked(self) -> bool:
        """Whether its manifest holds every file's checksum (written by this hetps)."""
        return isinstance(self.manifest.get("files"), dict)

    def values(self) -> dict[Any, np.ndarray]:
        """Every key's value on the servers at the checkpoint."""
        out: dict[Any, np.ndarray] = {}
        try:
            with np.load(self.path / VALUES) as z:
                for i, (kind, key) in enumerate(self.manifest["keys"]):
                    out[int(key) if kind == "int" else str(key)] = z[f"v{i}"]
        except Exception as exc:  # a cut or changed zip fails in many ways
            raise DamagedCheckpoint(self.path, VALUES, _why(exc)) from exc
        return out

    def state(self, rank: int) -> Any:
        """What worker ``rank`` saved."""
        name = f"worker-{int(rank)}.pkl"
        f = self.path / name
        if not f.exists():
            raise CheckpointError(
                f"{self.path} has no state of worker {rank} (the job had {self.workers} "
                "workers); resume with the same number of workers"
            )
        try:
            with open(f, "rb") as fh:
                return pickle.load(fh)
        except Exception as exc:  # unpickling a cut or changed file fails in many ways
            raise DamagedCheckpoint(self.path, name, _why(exc)) from exc

    def verify(self) -> None:
        """Raise :class:`DamagedCheckpoint` (naming the file and why) when a file is missing,
        cut short or changed since it was written: by its size and SHA-256 in the manifest,
        or, for a checkpoint written without them, by loading every file."""
        files = self.manifest.get("files")
        if not self.checked:
            self._load_everything()
            return
        assert isinstance(files, dict)
        needed = [f"worker-{k}.pkl" for k in range(self.workers)]
        if self.manifest.get("keys"):
            needed.append(VALUES)
        needed += worker_checkpoint.needed_files(self.manifest)
        for name in needed:
            if name not in files:
                raise DamagedCheckpoint(self.path, name, "the manifest has no checksum of it")
        for name, want in files.items():
            f = self.path / name
            if not f.is_file():
                raise DamagedCheckpoint(self.path, name, "missing")
            size = f.stat().st_size
            if size != want.get("bytes"):
                cut = "cut short" if size < want.get("bytes", 0) else "longer than written"
                raise DamagedCheckpoint(
                    self.path, name, f"{size} bytes, the manifest says {want.get('bytes')} ({cut})"
                )
            if _digest(f)["sha256"] != want.get("sha256"):
                raise DamagedCheckpoint(
                    self.path, name, "its SHA-256 differs from the manifest's (bytes changed)"
                )

    def _load_everything(self) -> None:
        """The check of a checkpoint without checksums: every file must load."""
        for k in range(self.workers):
            self.state(k)
        if self.manifest.get("keys"):
            self.values()  # reading every array checks its CRC in the zip
        states = self.path / STATES
        if states.is_file() and states.stat().st_size > 0:
            try:
                _has_states(states)
            except Exception as exc:
                raise DamagedCheckpoint(self.path, STATES, _why(exc)) from exc

    def restore(self, kv: KVStore) -> None:
        """Every worker calls it: each key gets its saved value (``init``: rank 0's value
        wins), then, if the servers had an optimizer state, it is loaded (set the optimizer
        first, as before the checkpoint); then each row-sparse key (embedding table) gets its
        saved rows, optimizer state and id index (a table the job has not declared yet is
        declared as the checkpoint's job had it)."""
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
        if self.manifest.get("tables"):  # after the optimizer: it is the tables' state's too
            worker_checkpoint.restore_tables(self.path, self.manifest, kv, DamagedCheckpoint)


def _why(exc: BaseException) -> str:
    """What loading a file raised, in one line."""
    text = str(exc).strip().splitlines()
    return f"cannot be loaded ({type(exc).__name__}: {text[0] if text else 'no detail'})"


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


def latest(directory: str | os.PathLike[str], verify: bool = True) -> Checkpoint | None:
    """The last complete checkpoint in ``directory`` whose files are intact (None: there is
    none). A damaged one is logged, naming the file and why, and the one before it is
    tried; when every one is damaged, :class:`CheckpointError` lists them. ``verify=False``:
    the last one with a manifest, unchecked."""
    found = complete(directory)
    if not verify:
        return found[-1] if found else None
    skipped = _unsealed(Path(directory), found)
    damaged: list[DamagedCheckpoint] = []
    for ck in reversed(found):
        if not ck.checked:
            log.warning(
                "checkpoint %s has no checksums (written by an older hetps): checking it by "
                "loading every file; a changed byte inside a file may go unnoticed",
                ck.path,
            )
        try:
            ck.verify()
        except DamagedCheckpoint as exc:
            log.warning(
                "checkpoint %s is damaged: %s: %s; %s",
                ck.path,
                exc.file,
                exc.why,
                "trying the one before it" if ck is not found[0] else "no older one is left",
            )
            damaged.append(exc)
            continue
        if damaged or any(name > ck.path.name for name, _ in skipped):
            log.warning("going on from %s, the newest intact checkpoint", ck.path)
        return ck
    if damaged or skipped:
        raise CheckpointError(
            f"every checkpoint in {directory} is damaged: "
            + "; ".join(
                [f"{d.path.name}/{d.file}: {d.why}" for d in damaged]
                + [f"{name}/{MANIFEST}: {why}" for name, why in skipped]
            )
            + ". Restore them from a copy, or start again without them"
        )
    return None


def _unsealed(root: Path, found: list[Checkpoint]) -> list[tuple[str, str]]:
    """The checkpoint folders of ``root`` that are not complete though they should be: a
    ``ckpt-<round>`` folder (not ``.tmp``: one is renamed only after its manifest is
    written) whose manifest is missing or unreadable, and the folder ``latest`` names when
    it is not a complete one. Each is logged (its name and why), newest first: a resume
    never falls back past one in silence."""
    if not root.is_dir():
        return []
    ok = {ck.path.name for ck in found}
    try:
        named = (root / "latest").read_text().strip()
    except OSError:
        named = ""
    out: dict[str, str] = {}
    for d in root.glob("ckpt-*"):
        if d.name.endswith(".tmp") or d.name in ok or not d.is_dir():
            continue
        m = d / MANIFEST
        if not m.is_file():
            out[d.name] = f"{MANIFEST} is missing (deleted?)"
            continue
        try:
            int(json.loads(m.read_text())["step"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            out[d.name] = f"{MANIFEST} cannot be read ({type(exc).__name__}: {exc})"
    if named and named not in ok and named not in out:
        out[named] = "the folder is not there"
    newest = max(ok, default="")
    for name in sorted(out, reverse=True):
        why = out[name]
        said = f" (the one {root / 'latest'} names)" if name == named else ""
        log.warning(
            "checkpoint %s%s is damaged: %s; %s",
            root / name,
            said,
            why,
            "trying the one before it" if name > newest and newest else "skipped",
        )
    return sorted(out.items(), reverse=True)
