"""``hetps train --checkpoint-dir D`` and ``--resume D``: when to take a checkpoint, what each
worker keeps in it, and how a worker starts again from one (docs/FAULTS.md, "Checkpoints and
resume"). (docs/MODULES.md, "hetps.app.checkpointing")"""

from __future__ import annotations

import argparse
import json
import signal
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hetps.config import env_value, resolve
from hetps.kvstore import checkpoint

if TYPE_CHECKING:
    from hetps.kvstore import KVStore

CKPT_FLAG = 1024.0  # more than any number of workers: a sum tells both wishes apart
MODES = ("sync", "esync", "local")
#: a worker's state loaded before it joined: ((rank, workers), state)
Preloaded = tuple[tuple[int, int], dict]


def encode(stop: bool, ckpt: bool) -> float:
    """One worker's control number for the round."""
    return (1.0 if stop else 0.0) + (CKPT_FLAG if ckpt else 0.0)


def decode(total: float) -> tuple[bool, bool]:
    """The sum over the workers: (any worker wants to stop, any wants a checkpoint)."""
    total = float(total)
    return (total % CKPT_FLAG) > 0.5, total >= CKPT_FLAG - 0.5


def resume_after_restart(args: argparse.Namespace) -> None:
    """In a job that ``hetps launch --max-restarts`` started again (``HETPS_RESTART`` > 0),
    go on from the last checkpoint of ``--checkpoint-dir``, if there is one."""
    restart = env_value("HETPS_RESTART") or 0
    if restart and args.checkpoint_dir and not args.resume:
        if chosen(args, args.checkpoint_dir) is not None:
            args.resume = args.checkpoint_dir
            print(
                f"hetps train: restart {restart}: going on from the last checkpoint in "
                f"{args.checkpoint_dir}",
                flush=True,
            )


def chosen(args: argparse.Namespace, directory: str) -> checkpoint.Checkpoint | None:
    """The last intact checkpoint in ``directory`` (checked once per process: every file
    against its checksum; a damaged one is logged and the one before it taken)."""
    seen = args.__dict__.setdefault("_checkpoints", {})
    if directory not in seen:
        try:
            seen[directory] = ck = checkpoint.latest(directory)
        except checkpoint.CheckpointError as exc:
            raise SystemExit(f"hetps train: {exc}") from None
        if ck is not None:
            print(
                f"hetps train: the last intact checkpoint in {directory} is {ck.path.name} "
                f"(round {ck.step})",
                flush=True,
            )
    return seen[directory]


def check_args(args: argparse.Namespace) -> None:
    """Refuse what cannot work, before anything starts."""
    for flag in ("checkpoint_dir", "resume"):
        if getattr(args, flag, None) and args.mode not in MODES:
            raise SystemExit(
                f"hetps train: --{flag.replace('_', '-')} works with -m {', '.join(MODES)}: in "
                f"-m {args.mode} every worker runs its own rounds, so there is no round the "
                "whole cluster shares to checkpoint at"
            )
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        raise SystemExit("hetps train: --checkpoint-every must be at least 1 round")
    if args.checkpoint_seconds is not None and args.checkpoint_seconds <= 0:
        raise SystemExit("hetps train: --checkpoint-seconds must be > 0")
    if args.resume and chosen(args, args.resume) is None:
        raise SystemExit(
            f"hetps train: --resume {args.resume}: no complete checkpoint there (a folder "
            "ckpt-<round> with its manifest.json); check the path, or start without --resume"
        )


class TrainCheckpoints:
    """One worker's checkpointing: its wishes, and saving."""

    def __init__(self, args: argparse.Namespace, kv: KVStore, rank: int) -> None:
        self.dir = Path(args.checkpoint_dir)
        self.every = args.checkpoint_every
        self.seconds = args.checkpoint_seconds
        self.kv = kv
        self.rank = rank
        self.last = time.monotonic()
        self.term = False
        self.over = False  # the last round is done (the job may be over)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_term)

    def _on_term(self, signum: int, frame: Any) -> None:  # noqa: ARG002
        if self.term:  # a second SIGTERM: stop now
            raise SystemExit(128 + signum)
        if self.over:  # (the launcher stops what is left at the job's end): it ends anyway
            print(f"worker {self.rank}: SIGTERM after its last round: it ends", flush=True)
            return
        if self.kv is not None and getattr(self.kv, "rejoining", False):
            # started again, and not in the job's rounds yet (the job may be over: the
            # launcher stops such a worker at its end): no round of its own to checkpoint
            print(
                f"worker {self.rank}: SIGTERM before it joined the running job: it stops",
                flush=True,
            )
            raise SystemExit(128 + signum)
        self.term = True
        print(
            f"worker {self.rank}: SIGTERM: checkpoint after this round, then stop "
            "(a second SIGTERM stops at once)",
            flush=True,
        )

    def wish(self) -> bool:
        """Whether this worker asks for a checkpoint after the current round."""
        timed = (
            (self.kv is None or self.kv.live_rank == 0)
            and self.seconds is not None
            and time.monotonic() - self.last >= self.seconds
        )
        return timed or self.term

    def due(self, rnd: int, agreed: bool, stop: bool) -> bool:
        """Whether to checkpoint after round ``rnd`` (the same answer on every worker)."""
        return agreed or stop or (self.every is not None and rnd % self.every == 0)

    def save(self, run: Any, rnd: int, opt: Any) -> Path:
        """Every worker: checkpoint after round ``rnd``."""
        import torch  # (here: the flag checks above run before torch loads)

        state = {
            "round": rnd,
            "steps_done": run.steps_done,
            "model": run.model.state_dict(),
            "optimizer": opt.state_dict() if opt is not None else None,
            "torch_rng": torch.get_rng_state(),
        }
        meta = {"mode": run.args.mode, "network": run.args.network}
        if self.kv is None:
            path = checkpoint.save_alone(self.dir, rnd, state, meta)
        else:
            path = checkpoint.save(self.kv, self.dir, rnd, state, meta)
        self.last = time.monotonic()
        if self.kv is None or self.kv.live_rank == 0:
            print(f"checkpoint after round {rnd}: {path}", flush=True)
        return path


def _source(args: argparse.Namespace, workers: int) -> tuple[checkpoint.Checkpoint, int | None]:
    """The checkpoint a worker of a job of ``workers`` goes on from, and whose state each
    worker takes: None, its own; 0, rank 0's (an elastic job with another number of workers).
    Exits with one line when the checkpoint does not fit the job."""
    ck = chosen(args, args.resume)
    assert ck is not None  # check_args made sure
    elastic = bool(env_value("HETPS_ELASTIC")) and args.mode in ("sync", "esync")
    if ck.workers != workers and not elastic:
        raise SystemExit(
            f"hetps train: --resume {args.resume}: {ck.path.name} was taken with {ck.workers} "
            f"workers, this job has {workers}; resume with --workers {ck.workers}"
        )
    if ck.manifest.get("network") not in (None, args.network):
        raise SystemExit(
            f"hetps train: --resume {args.resume}: {ck.path.name} holds a "
            f"{ck.manifest['network']} model, not {args.network}; pass -n {ck.manifest['network']}"
        )
    return ck, (0 if ck.workers != workers else None)


def preload_state(args: argparse.Namespace) -> Preloaded | None:
    """A worker under a launcher, before it joins the cluster: check the checkpoint of
    ``--resume`` against the job and load this worker's state, so that a worker that cannot
    fails the start of the job (exit 1, the file named); handed to :func:`load_state`. Without
    ``HETPS_LAUNCH_RANK`` the rank is not known yet: only the checks run (None), and the
    state is loaded after joining."""
    settings = resolve(role="worker")
    workers, rank = settings["DMLC_NUM_WORKER"].value, settings["HETPS_LAUNCH_RANK"].value
    if not isinstance(workers, int) or workers < 1:
        return None  # joining the cluster reports the configuration error
    _source(args, workers)
    if isinstance(rank, int) and 0 <= rank < workers:
        return (rank, workers), load_state(args, rank, workers)
    return None


def load_state(
    args: argparse.Namespace, rank: int, workers: int, pre: Preloaded | None = None
) -> dict:
    """This worker's state in the last intact checkpoint of ``--resume`` (``pre``'s, where
    :func:`preload_state` loaded it for this rank of this many workers)."""
    if pre is not None and pre[0] == (rank, workers):
        return pre[1]
    ck, source = _source(args, workers)
    try:
        state = ck.state(rank if source is None else source)
    except checkpoint.CheckpointError as exc:
        raise SystemExit(
            f"hetps train: worker {rank} cannot load its state: {exc}; restore the file or "
            "resume from another checkpoint folder"
        ) from None
    if source is not None:
        # elastic: another number of workers. At a checkpoint every worker of sync and esync
        # holds the same model; each takes rank 0's, and its data (a new shard) from the
        # checkpoint's round on
        state["steps_done"] = int(state["round"])
        print(
            f"hetps train: worker {rank}: going on with {workers} workers from {ck.path.name} "
            f"(taken with {ck.workers})",
            flush=True,
        )
    state["path"] = str(ck.path)
    return state


def last_t(path: Path) -> float:
    """The ``t`` of the last record in a worker's log (0: none)."""
    lines = path.read_text().splitlines() if path.exists() else []
    return ([t for line in lines if (t := _field(line, "t")) is not None] or [0.0])[-1]


def cut_log(path: Path, last_round: int) -> None:
    """Drop the records of rounds after ``last_round`` from a worker's log (they are done
    again after a resume), keeping the rest byte for byte."""
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [x for x in lines if (i := _field(x, "iter")) is not None and i <= last_round]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    tmp.replace(path)


def _field(line: str, key: str) -> float | None:
    """``key`` of the JSON record ``line`` as a number (None: a torn line, or no such key)."""
    try:
        return float(json.loads(line)[key])
    except (ValueError, KeyError, TypeError):
        return None
