"""``hetps train``: Fashion-MNIST on a hetps cluster with SSGD, ASGD, DC-ASGD, ESync or locally.
(docs/MODULES.md, "hetps.app.train")"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from hetps import optim
from hetps.config import env_value, role_from_env
from hetps.launch.contract import Flags, add_flags, usable_cores
from hetps.metrics.records import RunWriter

if TYPE_CHECKING:
    from hetps.app.checkpointing import Preloaded
    from hetps.kvstore import KVStore

MODES = ("esync", "sync", "async", "local")


# -- argument parsing -------------------------------------------------------------------------
# fmt: off
_TRAIN_FLAGS: Flags = (
    (("-m", "--mode"), dict(choices=MODES, default="esync")),
    (("-n", "--network"), dict(default="mlp", help="model name (hetps models lists them)")),
    (("-l", "--learning-rate"), dict(type=float, default=0.05, help="sync/async/local lr")),
    (("-ll", "--local-lr"), dict(type=float, default=0.05, help="ESync local step lr")),
    (("-gl", "--global-lr"), dict(type=float, default=1.0, help="ESync global lr")),
    (("-b", "--batch-size"), dict(type=int, default=64)),
    (("-dd", "--data-dir"), dict(default="/usr/share/datasets/fashion-mnist")),
    (("-c", "--cpu"), dict(action="store_true", help="train on the CPU (default)")),
    (("-g", "--gpu"), dict(type=int, default=None,
        help="CUDA device index: the first GPU of each host; a worker a launcher started takes N "
             "+ LOCAL_RANK (its index on its host), wrapping around the host's GPUs")),
    (("-ld", "--log-dir"), dict(default="runs")),
    (("--overwrite-logs",), dict(action="store_true",
        help="delete an earlier run's logs in the same directory (default: move them to "
             "LOGDIR/.previous/)")),
    (("--run-name",), dict(default=None, help="default: MODE-NETWORK-wW")),
    (("--checkpoint-dir",), dict(default=None, metavar="D",
        help="take consistent checkpoints into D (sync, esync, local): every --checkpoint-every "
             "rounds, every --checkpoint-seconds, on SIGTERM and at the end")),
    (("--checkpoint-every",), dict(type=int, default=None, metavar="K")),
    (("--checkpoint-seconds",), dict(type=float, default=None, metavar="T")),
    (("--resume",), dict(default=None, metavar="D",
        help="continue from the last intact checkpoint in D (same workers and model; a damaged "
             "one is named and skipped)")),
    (("-e", "--eval-duration"), dict(type=int, default=10, help="evaluate every E rounds")),
    (("-dcasgd", "--use-dcasgd"), dict(type=int, default=0, choices=(0, 1))),
    (("--overlap-forward",), dict(action="store_true",
        help="-m async: step() does not wait for the new weights; each layer's forward waits for "
             "its own (DistributedOptimizer(overlap_forward=True))")),
    (("-s", "--split-by-class"), dict(action="store_true")),
    (("-ip", "--state-server-ip"), dict(default=None)),
    (("-port", "--state-server-port"), dict(type=int, default=None)),
    (("--workers",), dict(type=int, default=None, help="start a local cluster of W workers")),
    (("--servers",), dict(type=int, default=1)),
    (("--slowdown",), dict(default=None,
        help="emulated slowdown: one factor per worker (e.g. 1,1,2,4), or one factor for this "
             "worker (every worker under --workers), e.g. 4 for a worker started by hand")),
    (("--devices",), dict(default=None,
        help="per-worker device, e.g. gpu:0,cpu,cpu,cpu (a real heterogeneous cluster on one "
             "machine; instead of -g/-c)")),
    (("--time-budget",), dict(type=float, default=None, help="stop after SECONDS")),
    (("--epochs",), dict(type=float, default=None, help="stop after EPOCHS of rank 0's shard")),
    (("--max-rounds",), dict(type=int, default=None)),
    (("--train-limit",), dict(type=int, default=None, help="use the first N training images")),
    (("--test-limit",), dict(type=int, default=2000, help="evaluate on the first N test images")),
    (("--seed",), dict(type=int, default=0)),
    (("--progress",), dict(choices=("auto", "bar", "lines"), default="auto")),
    (("--tensorboard",), dict(metavar="DIR", default=None,
        help="also write TensorBoard scalars (loss, accuracy, samples/s, step and phase times) "
             "to DIR/RUN_NAME/worker<rank> (pip install 'hetps[tensorboard]')")),
)
# fmt: on


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``hetps train`` (ESync's names where ESync has them), each by its whole
    name: the launcher strips its own flags from the workers' command line by name, so an
    abbreviation (``--work 2``) would be taken by the launcher and passed on to the workers
    too; argparse refuses it instead (``unrecognized arguments: --work``)."""
    p.allow_abbrev = False
    add_flags(p, _TRAIN_FLAGS)
    p.add_argument(
        "--server-optimizer",
        default="sgd",
        choices=optim.registered_names(),
        help="-m async: the optimizer the servers step with (-dcasgd 1: dcasgd)",
    )


def parse_slowdown(text: str | None, workers: int) -> list[float]:
    """``"1,1,2,4"`` -> factors per worker (all 1.0 when not given).

    One factor (``"4"``) is the factor of every worker that gets it, as ``-g``/``-c`` are:
    a worker started by hand (``DMLC_ROLE=worker hetps train ... --slowdown 4``) takes its
    own this way, and under ``--workers W`` every worker gets it."""
    if not text:
        return [1.0] * workers
    try:
        vals = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"hetps train: --slowdown {text!r} must be numbers like 1,1,2,4") from None
    if len(vals) == 1 and vals[0] >= 1:
        return vals * workers
    if env_value("HETPS_ELASTIC") and len(vals) > workers:
        vals = vals[:workers]  # a job that went on with fewer workers: the first W factors
    if len(vals) != workers or any(v < 1 for v in vals):
        raise SystemExit(
            f"hetps train: --slowdown needs factors >= 1: one (this worker's) or {workers} "
            f"(one per worker), got {text!r}"
        )
    return vals


def parse_devices(args: argparse.Namespace, workers: int) -> list[str]:
    """The torch device of every worker: ``--devices gpu:0,cpu`` (``cpu``, ``gpu:N`` or
    ``cuda:N`` per worker), else ``-g N`` for all (``-c`` wins), else ``cpu`` for all."""
    text = getattr(args, "devices", None)
    if not text:
        dev = "cpu" if args.gpu is None or args.cpu else f"cuda:{args.gpu}"
        return [dev] * workers
    if args.gpu is not None or args.cpu:
        raise SystemExit(
            "hetps train: --devices names every worker's device; drop -g/-c (or drop --devices)"
        )
    out: list[str] = []
    for item in (v.strip().lower() for v in text.split(",")):
        kind, _, idx = item.partition(":")
        if item == "cpu":
            out.append("cpu")
        elif kind in ("gpu", "cuda") and idx.isdigit():
            out.append(f"cuda:{int(idx)}")
        else:
            raise SystemExit(
                f"hetps train: --devices {text!r}: {item!r} is not a device; give cpu, gpu:N "
                "or cuda:N per worker, e.g. gpu:0,cpu,cpu"
            )
    if len(out) != workers:
        raise SystemExit(
            f"hetps train: --devices needs {workers} entries (one per worker), got {len(out)} "
            f"in {text!r}"
        )
    return out


def local_gpu(device: str, local_rank: int, count: int, per_host: bool) -> str:
    """The GPU this worker takes: ``-g N`` (``per_host``) names a host's first GPU, and a
    worker with a local rank (``LOCAL_RANK`` >= 0, set by the launchers) takes
    N + local rank modulo the host's ``count`` GPUs (with none, N + local rank, which the
    caller then refuses by name), so the workers of a host spread over its
    GPUs instead of all sharing cuda:N; ``--devices`` names each worker's GPU as it is."""
    if not per_host or local_rank < 0 or not device.startswith("cuda:"):
        return device
    index = int(device[5:]) + local_rank
    return f"cuda:{index % count if count > 0 else index}"


def stored_mode(args: argparse.Namespace) -> str:
    """The mode as logs name it (async with DC-ASGD is 'dcasgd')."""
    dcasgd = args.use_dcasgd or args.server_optimizer == "dcasgd"
    return "dcasgd" if args.mode == "async" and dcasgd else args.mode


def run_name(args: argparse.Namespace, workers: int) -> str:
    """The run directory's name."""
    return args.run_name or f"{stored_mode(args)}-{args.network}-w{workers}"


# -- entry ------------------------------------------------------------------------------------
def main(args: argparse.Namespace) -> int:
    """``hetps train``: one worker under a launcher, a whole local cluster, or local training."""
    from hetps.app.checkpointing import check_args, preload_state, resume_after_restart

    resume_after_restart(args)
    check_args(args)
    if getattr(args, "overlap_forward", False) and args.mode != "async":
        raise SystemExit(
            "hetps train: --overlap-forward applies to -m async (the servers update, the "
            f"pulls bring the new weights), not to -m {args.mode}; drop it or use -m async"
        )
    role = role_from_env()
    if args.mode == "local":
        return train_worker(args, kv=None)
    if role in ("server", "scheduler"):
        import hetps.kv

        hetps.kv.create("dist_async" if args.mode == "async" else "dist_sync")  # serves, exits
        return 0
    if role == "worker":
        import hetps.kv

        pre = None
        if args.resume:  # a worker that cannot load its state fails before it joins
            pre = preload_state(args)
        kv = hetps.kv.create("dist_async" if args.mode == "async" else "dist_sync")
        try:
            code = train_worker(args, kv, pre)
        except SystemExit as exc:
            if exc.code not in (None, 0):
                kv.close(error=f"hetps train exited: {exc.code}")
            raise
        except BaseException as exc:
            # a crash, reported as one: every other node stops with this cause (a plain
            # close would look like a finished worker, and the others would blame the rounds)
            kv.close(error=f"{type(exc).__name__}: {exc}")
            raise
        kv.close()
        return code
    if not args.workers:
        raise SystemExit(
            "hetps train: give --workers W (and --servers S) to start a local cluster, run it "
            "under `hetps launch`, or use -m local"
        )
    return launch_cluster(args)


#: flags (with a value) for the launcher alone: not on the workers' command line
LAUNCH_ONLY = (
    "--workers",
    "--servers",
    "--netem",
    "--balance",
    "--slice-size",
    "--metrics-port",
    "--server-device",
    "--host-aggregation",
)


def launch_cluster(args: argparse.Namespace) -> int:
    """Start scheduler, servers and W workers running this same command as workers."""
    from hetps.launch.contract import (
        LaunchSpec,
        check_recovery,
        host_aggregation_env,
        server_device_env,
    )
    from hetps.launch.local import run_cluster_from

    parse_slowdown(args.slowdown, args.workers)  # fail early
    parse_devices(args, args.workers)
    # drop the launcher's flags (and their values) from the worker command line
    cleaned: list[str] = []
    given = iter(sys.argv[1:])
    for a in given:
        if a in LAUNCH_ONLY:
            next(given, None)  # its value
        elif a != "--colocate" and not a.startswith(tuple(f"{f}=" for f in LAUNCH_ONLY)):
            cleaned.append(a)
    cmd = [sys.executable, "-m", "hetps.cli", *cleaned]
    env_value("OMP_NUM_THREADS")  # a malformed value fails here, before anything starts
    # threads: the user's OMP_NUM_THREADS reaches every process unchanged; without it the
    # launcher gives each process its share of the cores (hetps.launch.contract.thread_share)
    check_recovery(
        "hetps train",
        f"--workers {args.workers}",
        f"--servers {args.servers}",
        args.replicas,
        args.elastic,
        args.max_restarts,
    )
    if args.elastic and args.mode not in ("sync", "esync"):
        raise SystemExit(
            "hetps train: --elastic needs -m sync or esync (the rounds a dead worker leaves "
            "are finished by the others)"
        )
    if args.replicas > 1 and args.mode not in ("sync", "esync"):
        raise SystemExit(
            "hetps train: --replicas needs -m sync or esync (copies keep dist_sync rounds)"
        )
    spec = LaunchSpec(
        num_workers=args.workers,
        num_servers=args.servers,
        command=cmd,
        max_restarts=args.max_restarts,
        elastic_min=args.elastic,
        # (joining is not built with --balance: a let-go worker stays out)
        rejoin_workers=args.mode in ("sync", "esync") and args.balance in (None, "none"),
        replicas=args.replicas,
    )
    server_device_env(spec.env, args.server_device)  # (a bad value fails before anything starts)
    host_aggregation_env(spec.env, args.host_aggregation)
    started = time.time()
    code = run_cluster_from(spec, args)
    if code != 0 and args.resume:
        _resume_failed(args, code, started)
    return code


def _resume_failed(args: argparse.Namespace, code: int, started: float) -> None:
    """A resumed job that failed before worker 0 took its run over (a worker could not load
    its state, say): ``run.json`` still says how the earlier run ended; it says failed now."""
    with contextlib.suppress(OSError, ValueError, TypeError):  # no run.json: nothing to say
        writer = RunWriter.reopen(Path(args.log_dir) / run_name(args, args.workers))
        ended = writer.meta.get("ended") or {}
        if float(ended.get("at", started)) < started:
            writer.update(
                ended={
                    "status": "failed",
                    "cause": f"the job resumed from {args.resume} failed (exit code {code}) "
                    "before training; the launcher's output names the cause",
                    "at": time.time(),
                }
            )


# -- one worker -------------------------------------------------------------------------------
def train_worker(args: argparse.Namespace, kv: KVStore, pre: Preloaded | None = None) -> int:
    """Train as one worker (or alone, for ``-m local``); returns 0.

    Sets up what every mode shares (device, data shard, model, the run's log) and runs the
    mode's loop (:mod:`hetps.app.modes`)."""
    import torch

    from hetps.app.checkpointing import load_state
    from hetps.app.data import load_fashion_mnist, partition
    from hetps.app.models import get_model
    from hetps.app.modes import RUNNERS
    from hetps.app.worker import WorkerRun

    threads = env_value("OMP_NUM_THREADS")
    if threads is None:  # hetps launch sets it; alone (-m local) every core, by hand 1
        threads = usable_cores() if kv is None else 1
    torch.set_num_threads(max(1, threads))
    rank = kv.rank if kv is not None else 0
    workers = kv.num_workers if kv is not None else 1
    devices = parse_devices(args, workers)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = torch.device(
        local_gpu(devices[rank], env_value("LOCAL_RANK"), count, per_host=not args.devices)
    )
    if device.type == "cuda" and device.index >= count:
        flag = "--devices" if args.devices else "-g"
        raise SystemExit(
            f"hetps train: {flag}: worker {rank} wants {device}, but this machine has "
            f"{count} CUDA device(s); train on the CPU instead (cpu)"
        )
    slowdown = parse_slowdown(args.slowdown, workers)
    slow = slowdown[rank]
    mode = stored_mode(args)

    images, labels = load_fashion_mnist(args.data_dir, train=True, limit=args.train_limit)
    test_x, test_y = load_fashion_mnist(args.data_dir, train=False, limit=args.test_limit)
    shard = partition(labels, workers, rank, split_by_class=args.split_by_class, seed=args.seed)
    torch.manual_seed(args.seed)
    model = get_model(args.network).to(device)
    model.train()
    resume = None
    if args.resume:
        resume = load_state(args, rank, workers, pre)
        model.load_state_dict(resume["model"])  # before the store's keys take its weights

    run_dir = Path(args.log_dir) / run_name(args, workers)
    writer = None
    rejoining = kv is not None and kv.rejoining  # (the run's log is the others' already)
    if rejoining and args.mode not in ("sync", "esync"):
        raise SystemExit(
            f"hetps train: worker {rank} was started again, but joining a running job works "
            f"with -m sync or esync only (this job is -m {args.mode})"
        )
    if rank == 0 and resume is not None and (run_dir / "run.json").exists():
        # the run goes on in its own log: its records after the checkpoint are done again
        writer = RunWriter.reopen(run_dir)
        writer.update(resumed={"from": resume["path"], "round": resume["round"]}, ended=None)
    elif rank == 0 and not rejoining:
        balanced = kv is not None and kv.cfg.balance != "none"
        writer = RunWriter(
            run_dir,
            overwrite=args.overwrite_logs,
            keep_previous=True,
            meta={
                "mode": mode,
                "network": args.network,
                "workers": workers,
                # (--servers is the launcher's: a worker reads the job's from its store)
                "servers": kv.num_servers if kv is not None else 0,
                "batch_size": args.batch_size,
                "slowdown": slowdown,
                "split_by_class": bool(args.split_by_class),
                "started_at": time.time(),
                "devices": {
                    str(r): f"worker{r} ({d}" + (f", slowdown x{s:g})" if s != 1 else ")")
                    for r, (s, d) in enumerate(zip(slowdown, devices, strict=True))
                },
                "learning_rate": args.learning_rate,
                "local_lr": args.local_lr,
                "global_lr": args.global_lr,
                "scheme": kv.cfg.balance if balanced else None,
                "slice_size": kv.cfg.slice_elems if balanced else None,
                "scenario": env_value("HETPS_NETEM_SCENARIO"),
                "emulated_heterogeneity": any(s != 1 for s in slowdown),
            },
        )
        if writer.previous is not None:
            print(f"hetps train: the earlier run in {run_dir} moved to {writer.previous}")
    else:
        run_dir.mkdir(parents=True, exist_ok=True)

    run = WorkerRun(
        args,
        kv,
        rank=rank,
        device=device,
        slow=slow,
        model=model,
        train_data=(images, labels, shard),
        test_data=(test_x, test_y),
        run_dir=run_dir,
        writer=writer,
        resume=resume,
    )
    if writer is None:
        code = RUNNERS[args.mode](run)
        if rank != 0 and run.lead and (run_dir / "run.json").exists():
            # worker 0 died and the job went on without it (--elastic): the lead says how
            # the run ended
            RunWriter.reopen(run_dir).update(ended={"status": "completed", "at": time.time()})
        return code
    try:
        code = RUNNERS[args.mode](run)
    except BaseException as exc:
        # run.json says how the run ended; a cluster error names the node that failed
        cause = "interrupted" if isinstance(exc, KeyboardInterrupt) else f"{exc}"
        writer.update(ended={"status": "failed", "cause": cause[:500], "at": time.time()})
        raise
    writer.update(ended={"status": "completed", "at": time.time()})
    return code
