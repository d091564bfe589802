"""Where a role runs when not here: over ssh on the hosts of a hostfile, or in its emulated
node's network namespace (netem). Each is a :class:`~hetps.launch.contract.LaunchSpec`
``wrap``: (role, rank, argv, env) -> the argv and env that run it there."""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Sequence

from hetps.launch.contract import (
    FORWARDED_PREFIXES,
    HOST_VARS,
    NOT_ON_COMMAND_LINE,
    thread_share,
)


def read_hostfile_slots(path: str) -> list[tuple[str, int | None]]:
    """Hosts from a hostfile, each with its ``slots=N`` (how many workers it runs, as MPI's and
    DeepSpeed's hostfiles say it; None where the line gives none): one host per line, ``#``
    comments and blank lines ignored."""
    try:
        with open(path) as f:
            lines = [ln.split("#", 1)[0].split() for ln in f]
    except OSError as exc:
        raise SystemExit(f"hetps launch: cannot read hostfile {path!r}: {exc}") from None
    out: list[tuple[str, int | None]] = []
    for words in filter(None, lines):
        slots = None
        for w in words[1:]:
            key, _, val = w.partition("=")
            if key not in ("slots", "max_slots") or not val.isdigit() or int(val) < 1:
                raise SystemExit(
                    f"hetps launch: hostfile {path!r}: cannot read {' '.join(words)!r}: a line "
                    "is a host, optionally followed by slots=N (N >= 1 workers on that host)"
                )
            if key == "slots":
                slots = int(val)
        out.append((words[0], slots))
    if not out:
        raise SystemExit(f"hetps launch: hostfile {path!r} lists no hosts")
    return out


def worker_hosts(
    hosts: Sequence[tuple[str, int | None]], num_workers: int, per_node: int = 0
) -> list[str]:
    """The host each worker runs on (by rank), over ssh: ``per_node`` K consecutive ranks to a
    host (``--nproc-per-node``), else as many as each host's ``slots``, in hostfile order,
    else round-robin over the hosts. Raises SystemExit when the hosts hold too few."""
    names = [h for h, _ in hosts]
    if per_node:
        if num_workers > per_node * len(names):
            raise SystemExit(
                f"hetps launch: -n {num_workers} workers at --nproc-per-node {per_node} need "
                f"{-(-num_workers // per_node)} hosts; the hostfile lists {len(names)}"
            )
        return [names[r // per_node] for r in range(num_workers)]
    if all(n is not None for _, n in hosts):
        seats = [h for h, n in hosts for _ in range(n or 0)]
        if num_workers > len(seats):
            raise SystemExit(
                f"hetps launch: -n {num_workers} workers, and the hostfile's slots hold "
                f"{len(seats)}: raise a host's slots=N or add hosts"
            )
        return seats[:num_workers]
    return [names[r % len(names)] for r in range(num_workers)]


def processes_per_host(
    hosts: Sequence[str],
    num_workers: int,
    num_servers: int,
    workers_on: Sequence[str] | None = None,
) -> dict[str, int]:
    """How many processes :func:`ssh_wrapper` puts on each host (by name): the scheduler on the
    first, servers round-robin, workers where ``workers_on`` says (round-robin without it)."""
    counts = dict.fromkeys(hosts, 0)
    counts[hosts[0]] += 1
    for r in range(num_servers):
        counts[hosts[r % len(hosts)]] += 1
    for r in range(num_workers):
        h = workers_on[r] if workers_on is not None else hosts[r % len(hosts)]
        counts[h] = counts.get(h, 0) + 1
    return counts


def ssh_wrapper(
    hosts: Sequence[str],
    extra_keys: Sequence[str] = (),
    ssh: str = "ssh",
    cwd: str | None = None,
    num_workers: int = 0,
    num_servers: int = 0,
    auto_threads: bool = False,
    workers_on: Sequence[str] | None = None,
    python: str = sys.executable,
):
    """A ``wrap`` that runs each role over ssh, under :mod:`hetps.launch.guard` (with
    ``python``, which must be there on every host, as for the servers), which ends it when
    its ssh connection goes: the scheduler on the first host, servers round-robin over the
    hosts, workers where ``workers_on`` says (:func:`worker_hosts`; round-robin without it),
    each told its own address (DMLC_NODE_HOST) and the
    forwarded environment (DMLC_*, PS_*, HETPS_*, MXNET_* and every ``--env`` key). The
    cluster secret is not on the remote command line: the remote shell reads it from its
    standard input (the launcher writes it there) into its environment.
    (docs/MODULES.md, "hetps.launch.wrappers")"""
    cwd = cwd or os.getcwd()
    per_host = processes_per_host(hosts, num_workers, num_servers, workers_on)

    def wrap(role: str, rank: int, argv: list[str], env: dict[str, str]):
        host = hosts[0] if role == "scheduler" else hosts[rank % len(hosts)]
        if role == "worker" and workers_on is not None:
            host = workers_on[rank]
        remote = {
            k: v
            for k, v in env.items()
            # (a worker's host contract too: torchrun's variables are not DMLC_*/HETPS_*)
            if (k.startswith(FORWARDED_PREFIXES) or k in extra_keys or k in HOST_VARS)
            and k not in NOT_ON_COMMAND_LINE
        }
        remote["DMLC_NODE_HOST"] = host
        remote["DMLC_PS_ROOT_URI"] = hosts[0]
        prelude = ""
        if auto_threads:
            remote.pop("OMP_NUM_THREADS", None)  # the local machine's share: not the host's
            prelude, threads = _remote_threads(role, per_host.get(host, 1))
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(remote.items()))
        if auto_threads:
            exports += f" OMP_NUM_THREADS={threads}"
        # the guard ends the role when this ssh connection goes (the launcher stopped its
        # ssh client): a remote process must not outlive the job
        guarded = [python, "-m", "hetps.launch.guard", "--", *argv]
        line = (
            f"{prelude}cd {shlex.quote(cwd)} && env {exports} "
            f"{' '.join(shlex.quote(a) for a in guarded)}"
        )
        secret = env.get("HETPS_SECRET")
        local = {k: v for k, v in env.items() if k not in NOT_ON_COMMAND_LINE}
        argv_ssh = [ssh, "-o", "StrictHostKeyChecking=no", "-o", "BatchMode=yes", host]
        if not secret:
            return [*argv_ssh, line], local
        line = f"IFS= read -r HETPS_SECRET && export HETPS_SECRET && {line}"
        return [*argv_ssh, line], local, (secret + "\n").encode()

    return wrap


def _remote_threads(role: str, processes: int) -> tuple[str, str]:
    """(shell that computes it, the value) of a role's ``OMP_NUM_THREADS`` on a remote host:
    :func:`thread_share` with the host's ``nproc``, in POSIX shell."""
    if role != "worker":
        return "", str(thread_share(role, 1, processes))
    p = max(1, processes)
    prelude = (
        "hetps_c=$(nproc 2>/dev/null || echo 1) && "
        f"hetps_t=$(( hetps_c / {p} > 1 ? hetps_c / {p} : 1 )) && "
    )
    return prelude, "$hetps_t"


def netem_wrapper(net, num_servers: int, colocate: bool, per_node: int = 1):
    """A ``wrap`` that runs each role inside its emulated node's network namespace.
    (docs/MODULES.md, "hetps.launch.wrappers")"""

    def node_of(role: str, rank: int) -> int:
        if role == "scheduler":
            return 0
        if role == "server" or colocate:
            return rank
        return num_servers + rank // per_node

    def wrap(role: str, rank: int, argv: list[str], env: dict[str, str]):
        i = node_of(role, rank)
        env = dict(env)
        env["DMLC_NODE_HOST"] = net.node_ip(i)
        env["DMLC_PS_ROOT_URI"] = net.node_ip(0)
        env["HETPS_NETEM_NODE"] = str(i)
        return net.exec_argv(i, argv), env

    return wrap
