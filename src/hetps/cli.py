"""The ``hetps`` command: ``launch``, ``scheduler``, ``server``, ``config`` and the tools built on
them."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import threading
from dataclasses import fields
from typing import TYPE_CHECKING, Any

import hetps.balance  # noqa: F401 - the load plans register (--balance, `hetps config`)
from hetps import __version__
from hetps.config.table import balance_schemes
from hetps.launch.contract import Flags, add_flags, after_dashes, env_pairs

if TYPE_CHECKING:
    from hetps.config import NodeConfig


# fmt: off
#: what only some launchers take: (flag, whether it is given, those launchers, why)
_LAUNCHERS_OF = (
    ("--replicas", lambda a: a.replicas > 1, ("local", "ssh"),
     "elsewhere set HETPS_REPLICAS in the job's environment: the roles take over from a dead "
     "server; only the launcher's own notice of a death is missing"),
    ("--max-restarts", lambda a: a.max_restarts or a.elastic, ("local", "ssh"),
     "elsewhere resubmit the job; hetps train --resume goes on from its checkpoint"),
    ("--nproc-per-node", lambda a: a.nproc_per_node, ("local", "ssh"),
     "Slurm and Ray tell every worker its host: under Slurm ask the allocation for K tasks "
     "per node, sbatch/salloc --ntasks-per-node"),
    ("-H/--hostfile", lambda a: a.hostfile, ("ssh",), "the hosts it lists are ssh's"),
    ("--netem", lambda a: a.netem, ("local",), "it emulates a cluster on this machine"),
    ("--colocate", lambda a: a.colocate, ("local", "ssh"), "Slurm and Ray place the roles"),
)
# fmt: on


def cmd_launch(args: argparse.Namespace) -> int:
    """``hetps launch``: start a cluster and run CMD as every worker."""
    from hetps.config import ConfigError, env_value, user_threads
    from hetps.launch.contract import (
        LaunchSpec,
        balance_env,
        check_recovery,
        host_aggregation_env,
        places_by_host,
        server_device_env,
    )
    from hetps.launch.local import run_cluster_from
    from hetps.launch.wrappers import read_hostfile_slots, ssh_wrapper, worker_hosts

    command = after_dashes(args.command)
    if not command:
        raise SystemExit(
            "hetps launch: give the worker command after --, e.g. "
            "hetps launch -n 2 -- python train.py"
        )
    if args.num_workers < 1:
        raise SystemExit("hetps launch: -n/--num-workers must be >= 1")
    servers = args.num_servers if args.num_servers is not None else args.num_workers
    if servers < 1:
        raise SystemExit("hetps launch: -s/--num-servers must be >= 1")
    check_recovery(
        "hetps launch",
        f"-n {args.num_workers}",
        f"-s {servers}",
        args.replicas,
        args.elastic,
        args.max_restarts,
    )
    for flag, given, launchers, why in _LAUNCHERS_OF:
        if given(args) and args.launcher not in launchers:
            raise SystemExit(
                f"hetps launch: {flag} does not combine with --launcher {args.launcher}: "
                f"{flag} works with --launcher {' and '.join(launchers)} ({why})"
            )
    try:
        env = env_pairs(args.env)
        server_device_env(env, args.server_device)
        host_aggregation_env(env, args.host_aggregation)
    except ValueError as exc:
        raise SystemExit(f"hetps launch: {exc}") from None
    for bad, why in (
        ("HETPS_SECRET" in env, "--env HETPS_SECRET=... would put the cluster secret on a "
            "command line, where other users can read it: leave it out (hetps launch makes one "
            "for each job) or set HETPS_SECRET_FILE to a file made by `hetps secret FILE`"),
        (args.rejoin and not (args.elastic and args.max_restarts), "--rejoin starts a worker "
            "that was let go again, so it needs --elastic MIN and --max-restarts N (N >= 1)"),
        (args.rejoin and args.balance not in (None, "none"), "--rejoin with --balance: joining "
            "a running job is not built with the network-aware plans; leave out one of them"),
        (args.nproc_per_node < 0, "--nproc-per-node must be >= 1 (workers per host)"),
    ):  # fmt: skip
        if bad:
            raise SystemExit(f"hetps launch: {why}")
    if args.launcher == "ray":
        from hetps.launch.ray import cli_launch

        return cli_launch(args, command, servers, env)
    given = {f.name: getattr(args, f.name) for f in fields(LaunchSpec) if hasattr(args, f.name)}
    given |= dict(num_servers=servers, command=command, env=env, elastic_min=args.elastic)
    spec = LaunchSpec(**given, rejoin_workers=args.rejoin)
    if args.launcher == "ssh":
        if not args.hostfile:
            raise SystemExit("hetps launch: --launcher ssh needs -H/--hostfile")
        slotted = read_hostfile_slots(args.hostfile)
        hosts = [h for h, _ in slotted]
        spec.host = hosts[0]
        workers_on = worker_hosts(slotted, spec.num_workers, args.nproc_per_node)
        spec.places = places_by_host(workers_on)
        try:
            ssh = env_value("HETPS_SSH")
        except ConfigError as exc:
            raise SystemExit(f"hetps launch: {exc}") from None
        spec.wrap = ssh_wrapper(
            hosts,
            list(env),
            ssh=ssh,
            num_workers=spec.num_workers,
            num_servers=spec.num_servers,
            auto_threads=user_threads(env) is None,  # as the launcher decides (its env + --env)
            workers_on=workers_on,
        )
    if args.launcher == "slurm":
        from hetps.launch.slurm import run_slurm

        balance_env(spec.env, args.balance, args.slice_size)
        return run_slurm(spec)
    return run_cluster_from(spec, args)


def cmd_secret(args: argparse.Namespace) -> int:
    """``hetps secret FILE``: write a new cluster secret to FILE (mode 0600, never overwritten)."""
    import secrets as _secrets

    path = args.file
    try:
        fd = os.open(
            path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600
        )
    except FileExistsError:
        print(
            f"hetps secret: {path} exists; a secret file is never overwritten (a job using it "
            "would lose its peers): remove it first or pick another name",
            file=sys.stderr,
        )
        return 1
    except OSError as exc:
        print(f"hetps secret: cannot create {path}: {exc.strerror}", file=sys.stderr)
        return 1
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.write(fd, (_secrets.token_hex(32) + "\n").encode())
    finally:
        os.close(fd)
    print(
        f"hetps secret: wrote a new cluster secret to {path} (mode 0600). Copy it to every "
        f"host of the job (keep it 0600) and start every role with HETPS_SECRET_FILE={path}",
        file=sys.stderr,
    )
    return 0


def _role_config(role: str) -> NodeConfig | None:
    """``role``'s configuration from the environment, and logging to stderr at its verbosity;
    None (the error printed) when the environment is malformed."""
    from hetps.config import ConfigError, node_config_from_env

    try:
        cfg = node_config_from_env(role=role)
    except ConfigError as exc:
        print(f"hetps {role}: {exc}", file=sys.stderr)
        return None
    logging.basicConfig(
        level=logging.INFO if cfg.verbose >= 1 else logging.WARNING,
        format="[%(asctime)s] %(name)s %(levelname)s: %(message)s",
        stream=sys.stderr,
    )
    return cfg


def cmd_scheduler(args: argparse.Namespace) -> int:
    """``hetps scheduler``: be the scheduler (DMLC_* from the environment)."""
    from hetps.roles import make_scheduler, serve_scheduler

    cfg = _role_config("scheduler")
    if cfg is None:
        return 2
    import zmq

    # the launcher's lines go to the real stdout, never through the dashboard's copy of the
    # scheduler's output (they carry the launcher's token)
    launcher_out = sys.stdout
    try:
        sched = make_scheduler(cfg, recover=args.recover)
    except zmq.ZMQError as exc:  # the bind failed: port taken, address not ours
        print(
            f"hetps scheduler: cannot listen on port {cfg.root_port} (DMLC_PS_ROOT_PORT): "
            f"{exc}; pick a free port (hetps launch --port N) or 0 for any",
            file=sys.stderr,
        )
        return 1
    if args.launcher_notices:
        sched.follow_notices(sys.stdin)
        said = threading.Lock()
        # the launcher acts only on lines that carry its token (its own, in this process's
        # environment alone): a line a node gets logged cannot pass for one of these
        from hetps.cluster import launcher_link

        tag = launcher_link.tag(cfg.launcher_token)

        def to_launcher(line: str) -> None:  # one whole line per write (several threads say)
            with said:
                launcher_out.write(tag + line + "\n")
                launcher_out.flush()

        sched.to_launcher = to_launcher

        def up() -> None:  # the launcher's cue: a dead server can now be taken over
            if sched.ready.wait():
                to_launcher("hetps scheduler cluster up")

        threading.Thread(target=up, name="hetps-cluster-up", daemon=True).start()
    print(f"hetps scheduler port {sched.port}", flush=True)
    return serve_scheduler(sched)


def cmd_server(args: argparse.Namespace) -> int:
    """``hetps server``: be a KVStore server (DMLC_* from the environment)."""
    from hetps.roles import run_server

    cfg = _role_config("server")
    if cfg is None:
        return 2
    try:
        return run_server(cfg)
    except Exception as exc:  # noqa: BLE001 - a clear line instead of a traceback
        print(f"hetps server: {exc}", file=sys.stderr)
        return 1


def cmd_train(args: argparse.Namespace) -> int:
    """``hetps train``."""
    from hetps.app.train import main as train_main
    from hetps.config import ConfigError

    try:
        return train_main(args)
    # a ConfigError names the variable and the fix; the data reader's FileNotFoundError names
    # the file and the fix
    except (ConfigError, FileNotFoundError) as exc:
        print(f"hetps train: {exc}", file=sys.stderr)
        return 2
    except (ValueError, RuntimeError) as exc:  # scenario and emulator errors, bad flags
        if type(exc).__module__.startswith("hetps.netem") or "scenario" in str(exc):
            print(f"hetps train: {exc}", file=sys.stderr)
            return 2
        raise


def cmd_config(args: argparse.Namespace) -> int:
    """``hetps config``: every variable with its value here and where the value came from."""
    from hetps import config_report as config

    if args.markdown:
        print(config.markdown(), end="")
        return 0
    table, problems = config.report(role=args.role)
    print(table)
    for problem in problems:
        print(f"hetps config: {problem}", file=sys.stderr)
    return 2 if problems else 0


def cmd_models(args: argparse.Namespace) -> int:
    """``hetps models``: names and parameter counts."""
    from hetps.app.models import count_parameters, get_model, model_names

    print(f"{'model':<14}{'parameters':>14}")
    for name in model_names():
        print(f"{name:<14}{count_parameters(get_model(name)):>14,}")
    return 0


def cmd_state_server(args: argparse.Namespace) -> int:
    """``hetps state-server``: ESync's state server on its own port."""
    from hetps.config import ConfigError, check_exposure, security_from_env
    from hetps.esync.service import StateServer

    try:
        secret, insecure = security_from_env()
        check_exposure(secret, insecure, [args.host], "state server")
    except ConfigError as exc:
        print(f"hetps state-server: {exc}", file=sys.stderr)
        return 2
    srv = StateServer(
        args.workers, host=args.host, port=args.port, margin_s=args.margin, secret=secret
    )
    print(f"hetps state-server port {srv.port}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        srv.serve()
    return 0


# fmt: off
def _cluster_flags() -> Flags:
    """The flags ``launch`` and ``train`` share: surviving failures, emulated links,
    co-location, load balance (the plans' names as they are registered now)."""
    return (
        (("--max-restarts",), dict(type=int, default=0, metavar="N",
            help="when a process fails, start the whole job again, up to N times (HETPS_RESTART=k "
                 "in the new processes; hetps train goes on from its last --checkpoint-dir "
                 "checkpoint)")),
        (("--elastic",), dict(type=int, default=0, metavar="MIN",
            help="a worker that dies is let go and the job goes on with the others, without a "
                 "restart, while at least MIN remain (HETPS_ELASTIC=MIN in every process; hetps "
                 "train: -m sync or esync, the others take its data from the next epoch, and with "
                 "--max-restarts it is started again and joins at a round boundary)")),
        (("--replicas",), dict(type=int, default=1, metavar="R",
            help="dist_sync: keep every key on R servers (HETPS_REPLICAS=R); when a server dies "
                 "the next takes over its keys and the job goes on, while fewer than R died "
                 "(hetps train: -m sync or esync)")),
        (("--netem",), dict(default=None, metavar="SCENARIO",
            help="run each node in its own network namespace shaped by a scenario TOML file "
                 "(needs root; see docs/NETEM.md)")),
        (("--colocate",), dict(action="store_true",
            help="one server beside each worker (servers = workers)")),
        (("--balance",), dict(choices=balance_schemes(), default=None,
            help="network-aware load distribution scheme")),
        (("--slice-size",), dict(type=int, default=None,
            help="elements per slice for --balance (default 65536)")),
        (("--server-device",), dict(default=None, metavar="DEV",
            help="where the servers sum pushes and run SGD/Adam: cpu (the default) or cuda:N, "
                 "a GPU of each server machine (HETPS_SERVER_DEVICE; docs/ESYNC.md)")),
        (("--host-aggregation",), dict(choices=["auto", "off"], default=None,
            help="auto (the default): in dist_sync the workers of a host of several sum their "
                 "gradients through shared memory and push once; off: each worker pushes its own "
                 "(HETPS_HOST_AGGREGATION; docs/HOSTS.md)")),
        (("--metrics-port",), dict(type=int, default=None, metavar="P",
            help="serve live Prometheus metrics from the scheduler on port P (0: a free port, "
                 "printed); loopback only unless HETPS_METRICS_HOST names the scheduler's address "
                 "(docs/LIVE.md)")),
    )


_LAUNCH_FLAGS: Flags = (
    (("-n", "--num-workers"), dict(type=int, required=True)),
    (("-s", "--num-servers"), dict(type=int, default=None, help="default: = workers")),
    (("--launcher",), dict(choices=["local", "ssh", "slurm", "ray"], default="local")),
    (("-H", "--hostfile"), dict(default=None)),
    (("--nproc-per-node",), dict(type=int, default=0, metavar="K",
        help="K workers per host (consecutive launch ranks), as torchrun's: every worker gets "
             "LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK and HETPS_HOST_GROUP from it. Local: "
             "groups of K on this machine (default: all workers on the one host; with --netem, "
             "each emulated host runs K); ssh: K per hostfile host (default: its slots=N, else "
             "round-robin). Slurm and Ray know each worker's host by themselves")),
    (("--ray-address",), dict(default=None,
        help="--launcher ray: the Ray cluster (HOST:PORT, auto, ray://...; default "
             "RAY_ADDRESS, else a local Ray for the job; docs/RAY_K8S.md)")),
    (("--ray-cpus-per-worker",), dict(type=float, default=1.0, metavar="N")),
    (("--ray-cpus-per-server",), dict(type=float, default=1.0, metavar="N")),
    (("--env",), dict(action="append", default=[], metavar="K=V")),
    (("--port",), dict(type=int, default=0, help="scheduler port (default: ephemeral)")),
    (("--start-timeout",), dict(type=float, default=60.0)),
    (("--rejoin",), dict(action="store_true",
        help="with --elastic and --max-restarts: a worker that was let go is started again "
             "and joins the running job; the script handles it (kv.rejoining, kv.join(), "
             "kv.joining, kv.admit(); docs/FAULTS.md). hetps train does this by itself")),
)
# fmt: on


def _train_arguments(p: argparse.ArgumentParser) -> None:
    from hetps.app.train import add_arguments  # (torch loads lazily)

    add_arguments(p)
    add_cluster_arguments(p)


# fmt: off
#: the other commands: name -> (help, description, function, flags)
_COMMANDS: dict[str, tuple[str, str | None, Any, Any]] = {
    "secret": ("write a new cluster secret file (mode 0600) for roles started by hand", None,
               cmd_secret, ((("file",), dict(help="where to write it (never overwritten)")),)),
    "scheduler": ("run the scheduler role by hand", None, cmd_scheduler, (
        (("--recover",), dict(action="store_true",
            help="started again at the address of a scheduler that died: take back the running "
                 "job's nodes (they come back within PS_HEARTBEAT_TIMEOUT) instead of a new job")),
        (("--launcher-notices",), dict(action="store_true",
            help="read the launcher's notices of dead nodes from stdin ('dead ROLE RANK HOW'), "
                 "and tell it on stdout that this scheduler is alive, which silent nodes to stop "
                 "and whose death ended the job (hetps launch sets it)")),
    )),
    "server": ("run a server role by hand", None, cmd_server, ()),
    "train": ("train on Fashion-MNIST (ESync, SSGD, ASGD, DC-ASGD, local)", None, cmd_train,
              _train_arguments),
    "config": (
        "list every configuration variable with its value and where it came from",
        "List every environment variable hetps reads, with its value in this environment and "
        "its source (default, environment, derived). A malformed value gets the error a node "
        "would print, and exit status 2. Needs no cluster.",
        cmd_config, (
            (("--role",), dict(choices=["scheduler", "server", "worker"], default=None,
                help="resolve as this role would (as `hetps scheduler`/`hetps server` do)")),
            (("--markdown",), dict(action="store_true",
                help="print the reference table instead (docs/CONFIG.md is this output)")),
        )),
    "models": ("list the models with their parameter counts", None, cmd_models, ()),
    "state-server": ("run ESync's state server standalone", None, cmd_state_server, (
        (("--port",), dict(type=int, default=0)),
        (("--host",), dict(default="0.0.0.0")),
        (("-w", "--workers"), dict(type=int, required=True)),
        (("--margin",), dict(type=float, default=0.0, help="seconds (ESync uses 0.5)")),
    )),
}
# fmt: on


def add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    """Flags shared by ``launch`` and ``train``: emulated links, co-location, load balance."""
    add_flags(p, _cluster_flags())


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The argument parser of the ``hetps`` command; ``only`` (a role) builds that command
    alone: a role process starts without importing the other commands' modules."""
    p = argparse.ArgumentParser(prog="hetps", description=__doc__)
    p.add_argument("--version", action="version", version=f"hetps {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    if only is None:
        la = sub.add_parser("launch", help="start a scheduler, servers and workers running CMD")
        add_flags(la, _LAUNCH_FLAGS)
        add_cluster_arguments(la)
        la.add_argument("command", nargs=argparse.REMAINDER)
        la.set_defaults(func=cmd_launch)

    for name, (help_, description, func, flags) in _COMMANDS.items():
        if only not in (None, name):
            continue
        cp = sub.add_parser(name, help=help_, description=description)
        if callable(flags):  # (a function that adds them)
            flags(cp)
        else:
            add_flags(cp, flags)
        cp.set_defaults(func=func)
    for name in ("hetps.netem.cli", "hetps.metrics.cli", "hetps.launch.k8s") * (only is None):
        __import__(name, fromlist=["add_parser"]).add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hetps`` console script. A configuration or cluster error (the
    scheduler cannot be reached, a peer died, ...) is one line naming the cause, exit code 1,
    not a traceback."""
    from hetps.cluster.errors import ClusterError
    from hetps.config import ConfigError

    first = (sys.argv[1:] if argv is None else argv)[:1]
    args = build_parser(*[w for w in first if w in ("scheduler", "server")]).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ClusterError, ConfigError) as exc:
        print(f"hetps {args.cmd}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
