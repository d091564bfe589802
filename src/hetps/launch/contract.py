"""What every launcher hands the roles: the scheduler's lines a launcher reads, the job's
fresh cluster secret, the variables forwarded to a role on another host, and each process's
share of the cores (``OMP_NUM_THREADS``); :class:`LaunchSpec`, what to start."""

from __future__ import annotations

import argparse
import os
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

PORT_LINE = re.compile(r"hetps scheduler port (\d+)")
#: hetps's scheduler says so (with --launcher-notices) once every node has registered
UP_LINE = "hetps scheduler cluster up"
FORWARDED_PREFIXES = ("DMLC_", "PS_", "HETPS_", "MXNET_", "PYTHON", "OMP_NUM_THREADS")
#: never on a remote command line (others on either host may read command lines)
NOT_ON_COMMAND_LINE = ("HETPS_SECRET",)


@dataclass
class LaunchSpec:
    """What to start: W workers running ``command``, S servers, one scheduler."""

    num_workers: int
    num_servers: int
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    host: str = "127.0.0.1"
    port: int = 0  # scheduler port; 0 = ephemeral, read back from the scheduler
    server_command: list[str] | None = None  # default: hetps' own server
    scheduler_command: list[str] | None = None
    # (role, rank, argv, env) -> (argv, env) or (argv, env, bytes for its stdin): run a role
    # elsewhere (ssh, a network namespace)
    wrap: Callable[[str, int, list[str], dict[str, str]], tuple] | None = None
    start_timeout: float = 60.0
    stop_grace: float = 5.0
    # after a child fails, how long the others get to notice (and say why) before being stopped
    failure_grace: float = 15.0
    # on Ctrl-C/SIGTERM the workers get SIGTERM first and this long to end on their own
    worker_grace: float = 30.0
    # after a child fails, start the whole job again up to this many times (HETPS_RESTART
    # tells the new processes which start this is)
    max_restarts: int = 0
    # --elastic MIN: a worker that dies is let go and the job goes on with the others, while
    # at least MIN remain (HETPS_ELASTIC; does not use up max_restarts)
    elastic_min: int = 0
    # with --elastic and restarts left: a worker let go is started again alone and joins the
    # running job (its script must call kv.join(): hetps train -m sync does)
    rejoin_workers: bool = False
    # --replicas R: copies of every key on R servers (HETPS_REPLICAS); a server that dies is
    # taken over by the next one and the job goes on, while fewer than R servers died
    replicas: int = 1
    # --nproc-per-node K: the workers in hosts of K consecutive ranks (0: every worker on the
    # one host the local launcher runs on); ``places`` (set by a launcher that knows the hosts,
    # e.g. ssh from its hostfile) wins over it
    nproc_per_node: int = 0
    places: list[Place] | None = None

    @property
    def grouped(self) -> bool:
        """Whether the workers' hosts are hetps's host groups (``HETPS_HOST_GROUP``): a
        launcher that knows them (``places``) or ``--nproc-per-node``; not the local
        launcher's default (every worker on this one machine, each a host of its own)."""
        return self.places is not None or self.nproc_per_node > 0

    def worker_places(self) -> list[Place]:
        """Where each worker runs (:class:`Place`, by worker rank)."""
        if self.places is not None:
            return self.places
        return places_per_node(self.num_workers, self.nproc_per_node or self.num_workers)


#: a table of flags: (names, add_argument's keywords) each
Flags = tuple[tuple[tuple[str, ...], dict], ...]


def add_flags(p: argparse.ArgumentParser, flags: Flags) -> None:
    """Add each ``(names, add_argument's keywords)`` of a flag table to ``p``."""
    for names, kw in flags:
        p.add_argument(*names, **kw)


def env_pairs(items: list[str]) -> dict[str, str]:
    """``--env NAME=VALUE`` items as a mapping; ValueError names an item of another form."""
    env = {}
    for item in items:
        if "=" not in item or item.startswith("="):
            raise ValueError(f"--env {item!r} must look like NAME=VALUE")
        k, v = item.split("=", 1)
        env[k] = v
    return env


def after_dashes(argv: list[str]) -> list[str]:
    """The command given after ``--`` (argparse's REMAINDER keeps the ``--``)."""
    return argv[1:] if argv[:1] == ["--"] else list(argv)


def check_recovery(
    prog: str, workers: str, servers: str, replicas: int, elastic: int, max_restarts: int
) -> None:
    """Refuse, naming the flag, ``--replicas``, ``--elastic`` and ``--max-restarts`` values a
    job of ``workers`` and ``servers`` (each a flag and its value, e.g. ``-n 4``) cannot take."""
    n_workers, n_servers = int(workers.split()[-1]), int(servers.split()[-1])
    if not 1 <= replicas <= n_servers:
        raise SystemExit(
            f"{prog}: --replicas {replicas} must be between 1 and the number of servers ({servers})"
        )
    if elastic and not 1 <= elastic <= n_workers:
        raise SystemExit(
            f"{prog}: --elastic {elastic}: the smallest number of workers to go on with must "
            f"be between 1 and the number of workers ({workers})"
        )
    if max_restarts < 0:
        raise SystemExit(f"{prog}: --max-restarts must be >= 0")


def give_secret(env: dict[str, str]) -> None:
    """Put a fresh cluster secret in ``env`` (``HETPS_SECRET``) unless it brings its own or
    opts out with ``HETPS_INSECURE=1`` (every process then warns that it runs unauthenticated).
    """
    if (env.get("HETPS_INSECURE") or "").strip() not in ("", "0"):
        return
    if (env.get("HETPS_SECRET") or "").strip() or (env.get("HETPS_SECRET_FILE") or "").strip():
        return
    env["HETPS_SECRET"] = secrets.token_hex(32)


def balance_env(env: dict[str, str], balance: str | None, slice_elems: int | None) -> None:
    """Tell every role the load-balance scheme (``HETPS_BALANCE``) and the slice size
    (``HETPS_SLICE_ELEMS``) the launcher was given, where it was given them."""
    if balance:
        env["HETPS_BALANCE"] = balance
    if slice_elems:
        env["HETPS_SLICE_ELEMS"] = str(slice_elems)


def server_device_env(env: dict[str, str], device: str | None) -> None:
    """``--server-device``: every role gets ``HETPS_SERVER_DEVICE`` (the servers sum and
    update there); a value that names no device fails here, before anything starts."""
    if device is None:
        return
    from hetps.config import env_value

    env["HETPS_SERVER_DEVICE"] = device
    env_value("HETPS_SERVER_DEVICE", env)  # ConfigError naming the forms it takes


def host_aggregation_env(env: dict[str, str], mode: str | None) -> None:
    """``--host-aggregation {auto,off}``: every role gets ``HETPS_HOST_AGGREGATION`` (1: the
    workers of a host of several sum before one push, docs/HOSTS.md; 0: each its own). A
    contradicting ``--env HETPS_HOST_AGGREGATION=...`` fails here, before anything starts."""
    if mode is None:
        return
    value = {"auto": "1", "off": "0"}[mode]
    given = env.get("HETPS_HOST_AGGREGATION")
    if given is not None and given.strip() != value:
        raise ValueError(
            f"--host-aggregation {mode} and --env HETPS_HOST_AGGREGATION={given} disagree: "
            "give one of them"
        )
    env["HETPS_HOST_AGGREGATION"] = value


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask, as ``taskset`` or a cgroup set
    it), which every child inherits."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def thread_share(role: str, cores: int, processes: int) -> int:
    """Intra-op threads for one process of ``role`` on a host with ``cores`` CPUs shared by
    ``processes`` processes of the job: a worker ``cores // processes`` (at least 1), a
    server or the scheduler 1 (their work is message handling and element-wise sums, which
    use one thread whatever the setting). The cores the servers and the scheduler leave are
    spare for their I/O threads, so the job never asks for more threads than cores while it
    has no more processes than cores."""
    if role != "worker":
        return 1
    return max(1, cores // max(1, processes))


#: torchrun's variables, which every hetps launcher sets for a worker (and for no other role);
#: MASTER_ADDR/MASTER_PORT are not among them: hetps has no torch.distributed rendezvous, and a
#: script that read them would meet the scheduler's port, which speaks no c10d
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
#: what a worker's host is told by: torchrun's variables and hetps's own host group
HOST_VARS = (*TORCHRUN_VARS, "HETPS_HOST_GROUP")


@dataclass(frozen=True)
class Place:
    """Where a worker runs among the job's hosts: its host's group (numbered from 0 by the
    launcher), its index among its host's workers, and how many workers that host runs."""

    group: int
    local_rank: int
    local_size: int


def places_by_host(hosts: list[str]) -> list[Place]:
    """Each worker's :class:`Place` from the host each runs on (``hosts[r]``, worker rank r):
    groups numbered by first appearance, local ranks in rank order within a host."""
    groups: dict[str, int] = {}
    members: dict[str, int] = {}
    local: list[tuple[int, int]] = []
    for h in hosts:
        g = groups.setdefault(h, len(groups))
        local.append((g, members.get(h, 0)))
        members[h] = members.get(h, 0) + 1
    return [Place(g, lr, members[h]) for (g, lr), h in zip(local, hosts, strict=True)]


def places_per_node(num_workers: int, per_node: int) -> list[Place]:
    """``--nproc-per-node K``: workers in groups of K consecutive ranks, each group a host
    (the last one smaller when K does not divide the count)."""
    if per_node < 1:
        raise ValueError(f"--nproc-per-node {per_node}: give 1 or more workers per host")
    return places_by_host([str(r // per_node) for r in range(num_workers)])


def host_env(rank: int, num_workers: int, place: Place, grouped: bool = True) -> dict[str, str]:
    """A worker's host contract: torchrun's variables and ``HETPS_HOST_GROUP`` (-1 unless
    ``grouped``: the local launcher without ``--nproc-per-node``, whose workers share the one
    machine for torchrun's variables, but not a host for hetps: each plans and pushes alone)."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(num_workers),
        "LOCAL_RANK": str(place.local_rank),
        "LOCAL_WORLD_SIZE": str(place.local_size),
        "GROUP_RANK": str(place.group),
        "HETPS_HOST_GROUP": str(place.group if grouped else -1),
    }


def role_env(
    role: str,
    rank: int,
    num_servers: int,
    num_workers: int,
    root: tuple[str, int],
    place: Place | None = None,
    grouped: bool = True,
) -> dict[str, str]:
    """What every launcher tells one role: ps-lite's ``DMLC_*`` (its role, the scheduler's
    address ``root``, the job's size), its launch rank (not the scheduler's) and, for a
    worker at ``place``, its host (:func:`host_env`)."""
    env = {
        "DMLC_ROLE": role,
        "DMLC_PS_ROOT_URI": root[0],
        "DMLC_PS_ROOT_PORT": str(root[1]),
        "DMLC_NUM_SERVER": str(num_servers),
        "DMLC_NUM_WORKER": str(num_workers),
        "PYTHONUNBUFFERED": "1",
    }
    if role != "scheduler":
        env["HETPS_LAUNCH_RANK"] = str(rank)
    if role == "worker" and place is not None:
        env.update(host_env(rank, num_workers, place, grouped))
    return env


def without_host_vars(env: dict[str, str]) -> dict[str, str]:
    """``env`` less the host contract (servers and the scheduler get none of it, even when the
    launcher itself runs under torchrun or another launcher that set them)."""
    return {k: v for k, v in env.items() if k not in HOST_VARS}
