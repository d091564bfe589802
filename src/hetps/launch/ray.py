"""Run a hetps job on a Ray cluster: every role in a Ray actor, as a real process.
(docs/MODULES.md, "hetps.launch.ray")"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from hetps.config import env_value
from hetps.launch.contract import (
    FORWARDED_PREFIXES,
    PORT_LINE,
    balance_env,
    give_secret,
    places_by_host,
    role_env,
    usable_cores,
    without_host_vars,
)
from hetps.launch.processes import CAUSE_WAIT_S, Output, raise_interrupt, role_argv, shell_code
from hetps.launch.ray_actor import RoleProcess

INSTALL_HINT = (
    "the ray launcher needs Ray: install it with pip install 'hetps[ray]' "
    "(or pip install 'ray==2.60.0')"
)
#: the resource only the head node has (a tiny amount of it pins an actor there)
HEAD_RESOURCE = "node:__internal_head__"
#: the object store of a local Ray started for a job: hetps moves no data through it
LOCAL_OBJECT_STORE_BYTES = 128 << 20


def import_ray():
    """The ``ray`` module, or SystemExit with one line saying how to install it."""
    try:
        import ray
    except ImportError:
        raise SystemExit(f"hetps launch: {INSTALL_HINT}") from None
    return ray


@dataclass
class RayJobResult:
    """What :func:`run_job` returns: the job's exit code (as the local launcher's), each
    role's exit code and where each role ran."""

    code: int
    codes: dict[str, int | None] = field(default_factory=dict)  # label -> status (None: stopped)
    nodes: dict[str, dict] = field(default_factory=dict)  # label -> {ip, node_id, cores, pid}


@dataclass
class _Role:
    role: str
    rank: int
    actor: object
    label: str
    where: dict = field(default_factory=dict)
    code: int | None = None
    started: bool = False


@dataclass(eq=False, repr=False)  # (no repr: env may hold the cluster secret)
class RayLauncher(Output):
    """Runs one job on a Ray cluster; :meth:`run` returns a :class:`RayJobResult`."""

    command: Sequence[str]
    num_workers: int
    num_servers: int
    _: KW_ONLY
    address: str | None = None  # None: RAY_ADDRESS when set, else a local Ray ("local": one)
    env: dict[str, str] | None = None
    cpus_per_worker: float = 1
    cpus_per_server: float = 1
    start_timeout: float = 60.0
    stop_grace: float = 5.0
    failure_grace: float = 15.0
    cwd: str | None = None
    init_kwargs: dict | None = None
    port: int = 0
    out: Any = None

    def __post_init__(self) -> None:
        if self.num_workers < 1 or self.num_servers < 1:
            raise ValueError("a job needs at least one worker and one server")
        if not self.command:
            raise ValueError("give the worker command")
        self.command = list(self.command)
        self.address = self.address if self.address is not None else env_value("RAY_ADDRESS")
        self.env = dict(self.env or {})
        self.cwd = self.cwd or os.getcwd()
        self.init_kwargs = dict(self.init_kwargs or {})
        self.out = self.out or sys.stdout
        self.roles: list[_Role] = []
        self.pg = None
        self._ray = None
        self._connected = False
        self._print_lock = threading.Lock()

    # -- run --------------------------------------------------------------------------------
    def run(self) -> RayJobResult:
        """Connect (or start a local Ray), run the job, clean everything up."""
        ray = self._ray = import_ray()
        old = {}
        code = 1
        try:
            self._connect()
            if threading.current_thread() is threading.main_thread():
                # after ray.init, which sets its own SIGTERM handler
                for sig in (signal.SIGINT, signal.SIGTERM):
                    old[sig] = signal.signal(sig, raise_interrupt)
            code = self._run()
        except KeyboardInterrupt:
            self._log("interrupted: stopping every process")
            code = 130
        except ray.exceptions.GetTimeoutError as exc:
            self._log(str(exc))
            code = 1
        finally:
            for sig in old:  # a second Ctrl-C must not cut the clean-up short
                signal.signal(sig, signal.SIG_IGN)
            try:
                self.cleanup()
            finally:
                for sig, handler in old.items():
                    signal.signal(sig, handler)
        return RayJobResult(
            code=code,
            codes={r.label: r.code for r in self.roles},
            nodes={r.label: r.where for r in self.roles},
        )

    def _connect(self) -> None:
        ray = self._ray
        kwargs = {
            "include_dashboard": False,
            "log_to_driver": False,
            "logging_level": logging.WARNING,
            **self.init_kwargs,
        }
        running = None if self.address else running_cluster()
        if self.address and self.address != "local":
            kwargs["address"] = self.address
        elif running is not None:  # as ray.init() does: join the cluster `ray start` made
            kwargs["address"] = running
            self.address = running
        else:  # a Ray of our own, sized for the job (its CPUs are Ray's logical ones)
            kwargs["address"] = "local"
            kwargs.setdefault("num_cpus", max(usable_cores(), self._cpus_needed()))
            kwargs.setdefault("object_store_memory", LOCAL_OBJECT_STORE_BYTES)
        try:
            ray.init(**kwargs)
        except ConnectionError as exc:
            raise SystemExit(
                f"hetps launch: cannot reach the Ray cluster at {self.address or 'RAY_ADDRESS'}: "
                f"{exc}; start one with `ray start --head` or give --ray-address HOST:PORT"
            ) from None
        self._connected = True

    def _cpus_needed(self) -> float:
        return self.num_workers * self.cpus_per_worker + self.num_servers * self.cpus_per_server

    def _check_resources(self) -> None:
        """A clear error when the placement group can never fit, before waiting for it."""
        ray = self._ray
        total = ray.cluster_resources()
        need = self._cpus_needed()
        have = total.get("CPU", 0)
        if need > have:
            raise SystemExit(
                f"hetps launch: the job needs {need:g} CPUs on the Ray cluster "
                f"({self.num_workers} workers x {self.cpus_per_worker:g} + {self.num_servers} "
                f"servers x {self.cpus_per_server:g}) and the cluster has {have:g}: add nodes, "
                "or lower --ray-cpus-per-worker / --ray-cpus-per-server"
            )
        if total.get(HEAD_RESOURCE, 0) <= 0:
            raise SystemExit(
                "hetps launch: this Ray cluster has no head node resource "
                f"({HEAD_RESOURCE}), so the scheduler cannot be placed on the head node"
            )

    def _run(self) -> int:
        ray = self._ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._check_resources()
        bundles = [{"CPU": self.cpus_per_server} for _ in range(self.num_servers)] + [
            {"CPU": self.cpus_per_worker} for _ in range(self.num_workers)
        ]
        self.pg = placement_group(bundles, strategy="SPREAD", name=f"hetps-{os.getpid()}")
        try:
            ray.get(self.pg.ready(), timeout=self.start_timeout)
        except ray.exceptions.GetTimeoutError:
            self._log(
                f"the placement group ({len(bundles)} bundles: {bundles[0]} per server, "
                f"{bundles[-1]} per worker) was not placed within {self.start_timeout:g} s: "
                "the cluster's free CPUs are taken by other jobs"
            )
            return 1
        Actor = self._ray.remote(RoleProcess)
        sched = Actor.options(
            num_cpus=0, resources={HEAD_RESOURCE: 0.001}, max_concurrency=4
        ).remote()
        self.roles.append(_Role("scheduler", 0, sched, "scheduler"))
        for i in range(self.num_servers + self.num_workers):
            role, rank = ("server", i) if i < self.num_servers else ("worker", i - self.num_servers)
            cpus = self.cpus_per_server if role == "server" else self.cpus_per_worker
            actor = Actor.options(
                num_cpus=cpus,
                max_concurrency=4,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=i
                ),
            ).remote()
            self.roles.append(_Role(role, rank, actor, f"{role} {rank}"))
        wheres = ray.get([r.actor.where.remote() for r in self.roles], timeout=self.start_timeout)
        for r, w in zip(self.roles, wheres, strict=True):
            r.where = w

        env = self._forwarded_env()
        give_secret(env)
        head_ip = self.roles[0].where["ip"]
        # a worker's host is the Ray node its actor runs on (torchrun's variables from it)
        workers = sorted((r for r in self.roles if r.role == "worker"), key=lambda r: r.rank)
        places = places_by_host([str(r.where["node_id"]) for r in workers])

        def overlay(r: _Role, port: int) -> dict[str, str]:
            place = places[r.rank] if r.role == "worker" else None
            job = (self.num_servers, self.num_workers, (head_ip, port), place)
            return {
                **env,
                **self._threads(r.role, r),
                **role_env(r.role, r.rank, *job),
                "DMLC_NODE_HOST": r.where["ip"],
            }

        sched_role = self.roles[0]
        code = self._start(sched_role, role_argv("scheduler"), overlay(sched_role, self.port))
        if code is not None:
            return code
        port = self._scheduler_port(sched_role)
        if isinstance(port, tuple):  # (exit code,)
            return port[0]
        for r in self.roles[1:]:
            argv = role_argv("server") if r.role == "server" else self.command
            code = self._start(r, argv, overlay(r, port))
            if code is not None:
                return code
        return self._watch(self.roles)

    def _forwarded_env(self) -> dict[str, str]:
        env = {k: v for k, v in dict(os.environ).items() if k.startswith(FORWARDED_PREFIXES)}
        env.update(self.env)
        return without_host_vars(env)  # (a worker's own are set for it alone)

    def _threads(self, role: str, r: _Role) -> dict[str, str]:
        """``OMP_NUM_THREADS`` for a role: the user's (forwarded) when set; else a worker gets
        its actor's CPUs (at least 1), a server or the scheduler 1."""
        if "OMP_NUM_THREADS" in self._forwarded_env():
            return {}
        threads = max(1, int(self.cpus_per_worker)) if role == "worker" else 1
        return {"OMP_NUM_THREADS": str(threads)}

    def _start(self, r: _Role, argv: list[str], overlay: dict[str, str]) -> int | None:
        """Start a role's process; an exit code when it cannot be started, else None."""
        ray = self._ray
        try:
            ray.get(r.actor.start.remote(argv, overlay, self.cwd), timeout=self.start_timeout)
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            self._log(f"cannot start {r.label} on {r.where.get('ip', '?')}: {cause}")
            r.code = 127
            return 127
        r.started = True
        return None

    def _scheduler_port(self, r: _Role) -> int | tuple[int]:
        """The port the scheduler reports (its other lines are printed), or (exit code,)."""
        ray = self._ray
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            lines, code = ray.get(r.actor.poll.remote(0.5), timeout=self.start_timeout)
            port = None
            rest = []
            for line in lines:
                m = PORT_LINE.search(line)
                if m and port is None:
                    port = int(m.group(1))
                else:
                    rest.append(line)
            self._print(r, rest)
            if port is not None:
                return port
            if code is not None:
                r.code = shell_code(code)
                self._log(f"the scheduler exited with code {r.code} before it was up")
                return (r.code or 1,)
        self._log(f"the scheduler did not report its port within {self.start_timeout:g} s")
        return (1,)

    def _watch(self, roles: list[_Role], deadline: float | None = None) -> int:
        """Print every role's output until each has exited; on the first failure give the
        others ``failure_grace`` s to exit on their own, then stop them. Returns the code."""
        ray = self._ray
        pending = {r.actor.poll.remote(0.5): r for r in roles if r.started and r.code is None}
        # the scheduler and the servers exit 1 when another node's failure ends the job: such
        # a failure may be a consequence; a worker's own code (not 1) that follows within
        # CAUSE_WAIT_S names the cause
        consequence: _Role | None = None
        until = 0.0
        while pending:
            if deadline is not None and time.monotonic() > deadline:
                return 0
            if consequence is not None and time.monotonic() > until:
                return self._failed(consequence, consequence.code or 1, pending)
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=0.2 if consequence else 1.0)
            for ref in ready:
                r = pending.pop(ref)
                try:
                    lines, code = ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    self._log(f"{r.label}'s actor died ({type(exc).__name__}): its node is lost?")
                    lines, code = [], 1
                self._print(r, lines)
                if code is None:
                    pending[r.actor.poll.remote(0.5)] = r
                    continue
                r.code = shell_code(code)
                if r.role == "scheduler" and r.code == 0 and deadline is None and pending:
                    return self._ended(pending)
                if r.code != 0 and deadline is None:
                    if r.code == 1 and (consequence is not None or r.role != "worker"):
                        # (a worker's 1 may be its own error or another node's; a code of
                        # its own, such as sys.exit(3), is the cause)
                        if consequence is None:
                            consequence, until = r, time.monotonic() + CAUSE_WAIT_S
                        continue
                    return self._failed(r, code, pending)
        if consequence is not None:
            return self._failed(consequence, consequence.code or 1, pending)
        return 0

    def _ended(self, pending: dict) -> int:
        """The scheduler ended well, and the job with it: the others get ``failure_grace``
        s to end (they were told); one still there then (hung, or stopped with SIGSTOP) is
        named and left to :meth:`cleanup` to stop. The code: 0, or a role's failure."""
        rest = list(pending.values())
        self._watch(rest, deadline=time.monotonic() + self.failure_grace)
        failed = next((x for x in rest if x.code not in (None, 0)), None)
        if failed is not None:
            self._log(f"{failed.label} exited (code {failed.code}) after the job ended")
            return failed.code
        left = [x.label for x in rest if x.code is None]
        if left:
            self._log(
                f"the job ended, but {', '.join(left)} did not end with it within "
                f"{self.failure_grace:g} s (hung or stopped): stopping it"
            )
        return 0

    def _failed(self, r: _Role, code: int, pending: dict) -> int:
        """``r`` failed first (or caused the failure): say so, give the others
        ``failure_grace`` s to end, and return its code."""
        how = f"was killed by signal {-code}" if code < 0 else "exited"
        self._log(f"{r.label} {how} (code {shell_code(code)}); stopping the others")
        rest = list(pending.values())
        self._watch(rest, deadline=time.monotonic() + self.failure_grace)
        return shell_code(code)

    def cleanup(self) -> None:
        """Stop every process, kill every actor, remove the placement group, disconnect (a
        local Ray started for the job stops with it). Safe to call twice."""
        ray = self._ray
        if ray is None or not self._connected:
            return
        live = [r for r in self.roles if r.started]
        stops = [r.actor.stop.remote(self.stop_grace) for r in live]
        for r, ref in zip(live, stops, strict=True):
            try:
                status = ray.get(ref, timeout=self.stop_grace + 10)
            except Exception:  # noqa: BLE001 - the actor is gone: its process died with it
                status = None
            if r.code is None:
                self._log(f"stopped {r.label}")
                r.code = None if status is None else shell_code(status)
        for r in self.roles:
            with contextlib.suppress(Exception):  # (already dead)
                ray.kill(r.actor)
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):  # (the cluster is gone)
                remove_placement_group(self.pg)
            self.pg = None
        ray.shutdown()
        self._connected = False


def run_job(
    command: Sequence[str], num_workers: int, num_servers: int | None = None, **options: Any
) -> RayJobResult:
    """Run ``command`` as every worker of a hetps job on Ray (``num_servers``: default one
    per worker; docs/MODULES.md, "hetps.launch.ray"). ``options`` are :class:`RayLauncher`'s
    keywords: ``address``, a Ray cluster's (``HOST:PORT``, ``auto``, ``ray://...``; None: the
    one ``RAY_ADDRESS`` names, else a local Ray started with ``init_kwargs`` and stopped at the
    end), ``env`` (added for every process), ``cpus_per_worker``, ``cpus_per_server``,
    ``start_timeout``, ``failure_grace``, ``cwd``, ``port``, ``out``. The result's ``code``
    is what ``hetps launch`` exits with."""
    servers = num_servers if num_servers is not None else num_workers
    return RayLauncher(command, num_workers, servers, **options).run()


def cli_launch(args, command: list[str], num_servers: int, env: dict[str, str]) -> int:
    """``hetps launch --launcher ray`` (the flags Ray takes: ``hetps launch`` refused others)."""
    for name, value in (
        ("--ray-cpus-per-worker", args.ray_cpus_per_worker),
        ("--ray-cpus-per-server", args.ray_cpus_per_server),
    ):
        if value <= 0:
            raise SystemExit(f"hetps launch: {name} must be > 0 (got {value:g})")
    import_ray()
    balance_env(env, args.balance, args.slice_size)
    result = run_job(
        command,
        args.num_workers,
        num_servers,
        address=args.ray_address,
        env=env,
        cpus_per_worker=args.ray_cpus_per_worker,
        cpus_per_server=args.ray_cpus_per_server,
        start_timeout=args.start_timeout,
        port=args.port,
    )
    return result.code


def running_cluster() -> str | None:
    """The address of the Ray cluster ``ray start`` runs on this machine (the one
    ``ray.init()`` joins when given no address: Ray's ``ray_current_cluster`` file in its
    temp dir, ``RAY_TMPDIR`` honoured), or None when there is none."""
    try:
        from ray._private.services import canonicalize_bootstrap_address

        return canonicalize_bootstrap_address(None)
    except Exception:  # noqa: BLE001 - no cluster to join, or a Ray without that lookup
        return None
