"""Start a whole cluster (scheduler, servers, workers) and watch it, like MXNet's launch.py
(docs/LAUNCHERS.md, "What the local launcher promises")."""

from __future__ import annotations

import contextlib
import errno
import os
import queue
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from hetps.cluster import launcher_link
from hetps.config import user_threads
from hetps.launch.contract import (
    PORT_LINE,
    UP_LINE,
    LaunchSpec,
    Place,
    balance_env,
    give_secret,
    places_by_host,
    role_env,
    thread_share,
    usable_cores,
    without_host_vars,
)
from hetps.launch.liveness import Liveness, ended
from hetps.launch.processes import Child, Output, role_argv, shell_code, signal_group, start_piped
from hetps.launch.supervise import Supervision
from hetps.launch.tracebacks import TracebackLines
from hetps.launch.wrappers import netem_wrapper


class Launcher(Supervision, Liveness, Output):
    """Runs a :class:`LaunchSpec` to completion; ``run()`` returns the job's exit code."""

    def __init__(self, spec: LaunchSpec, out=None) -> None:
        self.spec = spec
        self.out = out or sys.stdout
        self._print_lock = threading.Lock()
        # what the scheduler's lines to this launcher carry (HETPS_LAUNCHER_TOKEN)
        self._token = secrets.token_hex(16)
        self._signum: int | None = None
        self.restarts = 0  # how many times the job was started again after a failure
        self.respawns = 0  # servers started again alone (--replicas), out of max_restarts
        self._server_start: dict[int, tuple[list[str], dict[str, str]]] = {}
        self._worker_start: dict[int, tuple[list[str], dict[str, str]]] = {}
        self._failed: Child | None = None  # the child whose failure ended the last start
        self._reset()

    # -- output -----------------------------------------------------------------------------
    def _pump(self, child: Child) -> None:
        assert child.proc.stdout is not None
        held = TracebackLines()  # a traceback is printed as one block, not between others
        for raw in iter(child.proc.stdout.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            if child.role == "scheduler":
                m = PORT_LINE.search(line)
                if m and not self._port.is_set():
                    self._port_value = int(m.group(1))
                    self._port.set()
                if m:
                    continue
                said = launcher_link.untag(line, self._token)  # (None: an ordinary line)
                if said == UP_LINE:
                    self._up.set()
                    continue
                if said is not None and self._scheduler_says(child, said):
                    continue
            self._print(child, held.feed(line))
        self._print(child, held.flush())
        child.proc.stdout.close()

    def _start(
        self, role: str, rank: int, argv: list[str], env: dict[str, str], keep_stdin: bool = False
    ) -> Child:
        """Start one role. ``keep_stdin``: its standard input stays an open pipe after what the
        wrapper writes there (the scheduler's, for :meth:`_notify`)."""
        stdin_data = None
        if self.spec.wrap is not None:
            wrapped = self.spec.wrap(role, rank, argv, env)
            argv, env = wrapped[0], wrapped[1]
            stdin_data = wrapped[2] if len(wrapped) > 2 else None  # e.g. ssh: the secret
        if shutil.which(argv[0], path=env.get("PATH")) is None:
            # as Popen would say it, before setpriv (which would say it in the child's output)
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), argv[0])
        proc = start_piped(
            argv,
            env,
            stdin=subprocess.DEVNULL if stdin_data is None and not keep_stdin else subprocess.PIPE,
        )
        if stdin_data is not None:
            assert proc.stdin is not None
            with contextlib.suppress(BrokenPipeError):  # (it died at once: its exit code tells)
                proc.stdin.write(stdin_data)
                proc.stdin.flush() if keep_stdin else proc.stdin.close()
        label = "scheduler" if role == "scheduler" else f"{role} {rank}"
        child = Child(role, rank, proc, label)
        child.reader = threading.Thread(target=self._pump, args=(child,), daemon=True)
        child.reader.start()
        self.children.append(child)
        return child

    def _base_env(self) -> dict[str, str]:
        env = without_host_vars(dict(os.environ))
        env.update(without_host_vars(self.spec.env))
        env.update(HETPS_RESTART=str(self.restarts), HETPS_ELASTIC=str(self.spec.elastic_min))
        if self.spec.replicas > 1:
            env["HETPS_REPLICAS"] = str(self.spec.replicas)
        env.setdefault(
            "DMLC_NODE_HOST", self.spec.host if self.spec.host != "0.0.0.0" else "127.0.0.1"
        )
        give_secret(env)
        return env

    def _role_env(
        self, role: str, rank: int, port: int, place: Place | None = None
    ) -> dict[str, str]:
        """:func:`role_env` of this job (the scheduler at ``spec.host``:``port``)."""
        spec = self.spec
        root = (spec.host, port)
        return role_env(role, rank, spec.num_servers, spec.num_workers, root, place, spec.grouped)

    # -- run --------------------------------------------------------------------------------
    def run(self) -> int:
        """Start everything, wait for the end, stop everything. Returns the exit code."""
        old = {}
        if threading.current_thread() is threading.main_thread():
            # SIGHUP (the terminal or ssh session that started it closed) stops the job as
            # SIGTERM does: the workers first, a checkpoint after their round
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                old[sig] = signal.signal(sig, self._on_signal)
        try:
            code = self._run()
            while code not in (0, 127) and self._again():
                # a child failed: stop the rest, then start the whole job again; a job that
                # checkpoints goes on from its last checkpoint (hetps train --checkpoint-dir)
                self.stop_all(kill=True)  # the job starts again: nobody needs to say why
                self._reset()
                code = self._run()
            return code
        except OSError as exc:  # e.g. the worker command does not exist
            self._log(f"cannot start {exc.filename or 'a process'}: {exc.strerror or exc}")
            return 127
        except KeyboardInterrupt:
            signum = self._signum or signal.SIGINT
            self._log(f"{signal.Signals(signum).name}: stopping every process (the workers first)")
            return 128 + signum
        finally:
            for sig in old:  # a second Ctrl-C must not cut the clean-up short
                signal.signal(sig, signal.SIG_IGN)
            self.stop_all(workers_first=self._signum is not None)
            for sig, handler in old.items():
                signal.signal(sig, handler)

    def _reset(self) -> None:
        """A start's state (the first, or again with the stopped job's processes forgotten)."""
        self.children: list[Child] = []
        self._respawned: list[Child] = []  # servers started again alone
        self._ended_ok = False  # the scheduler ended the job, exit 0
        self._port = threading.Event()
        self._port_value = 0
        self._up = threading.Event()  # every node registered (hetps's own scheduler says so)
        self._stopping = False
        self._scheduler: Child | None = None
        # nodes the scheduler declared dead for their silence, to stop (role, rank, why)
        self._declared: queue.SimpleQueue[tuple[str, int, str]] = queue.SimpleQueue()
        self._cause: tuple[str, int, str] | None = None  # whose death ended the job

    def _on_signal(self, signum: int, frame) -> None:  # type: ignore[no-untyped-def]
        self._signum = signum
        raise KeyboardInterrupt

    def _threads(self, env: dict[str, str]) -> dict[str, dict[str, str]]:
        """The thread variable each role gets: nothing when the environment sets
        ``OMP_NUM_THREADS`` (it reaches every child unchanged), else each role's share of this
        machine's cores among every process of the job (a wrapper that runs roles on other
        hosts, like :func:`ssh_wrapper`, sets each host's share there)."""
        cores, processes = usable_cores(), 1 + self.spec.num_servers + self.spec.num_workers
        auto = user_threads(env=env) is None
        return {
            role: {"OMP_NUM_THREADS": str(thread_share(role, cores, processes))} if auto else {}
            for role in ("scheduler", "server", "worker")
        }

    def _run(self) -> int:
        spec = self.spec
        env = self._base_env()
        threads = self._threads(env)
        # hetps's own scheduler takes the launcher's notices of dead children on its stdin
        notices = spec.scheduler_command is None
        sched_argv = spec.scheduler_command or [*role_argv("scheduler"), "--launcher-notices"]
        sched_env = {
            **env,
            **threads["scheduler"],
            **self._role_env("scheduler", 0, spec.port),
            # its lines to this launcher carry it: no other line is acted on
            "HETPS_LAUNCHER_TOKEN": self._token,
        }
        self._sched_start = (sched_argv, sched_env)
        sched = self._start("scheduler", 0, sched_argv, sched_env, keep_stdin=notices)
        self._scheduler = sched if notices else None
        deadline = time.monotonic() + spec.start_timeout
        while not self._port.wait(0.2):
            if sched.proc.poll() is not None:
                code = shell_code(sched.proc.returncode)
                self._log(f"the scheduler exited with code {code} before it was up")
                return code or 1
            if time.monotonic() > deadline:
                self._log(f"the scheduler did not report its port within {spec.start_timeout:g} s")
                return 1
        server_argv = spec.server_command or role_argv("server")
        port = self._port_value  # (malloc: each node sets its own, transport/heap.py)
        for r in range(spec.num_servers):
            server_env = {**env, **threads["server"], **self._role_env("server", r, port)}
            self._server_start[r] = (server_argv, server_env)
            self._start("server", r, *self._server_start[r])
        places = spec.worker_places()
        for r in range(spec.num_workers):
            worker_env = {
                **env,
                **threads["worker"],
                **self._role_env("worker", r, port, places[r]),
            }
            self._worker_start[r] = (list(spec.command), worker_env)
            self._start("worker", r, *self._worker_start[r])
        return self._watch()

    def _watch(self) -> int:
        """Wait for every child; on the first failure stop the rest and return its code."""
        remaining = list(self.children)
        while remaining:
            self._stop_hung(remaining)
            # the processes stopped for hanging first: their hang caused what followed
            for child in sorted(remaining, key=lambda c: c.hung is None):
                code = child.proc.poll()
                if code is None:
                    continue
                remaining.remove(child)
                if child.reader is not None:
                    child.reader.join(timeout=2)
                if child is self._scheduler:
                    self._stop_hung(remaining)  # what it said last (read up to its end)
                if code == 0 and child is self._scheduler:
                    # the job is over: a server started again that had not joined yet never
                    # will (it would wait for a scheduler that is gone)
                    self._ended_ok = True
                    for c in remaining:
                        if c in self._respawned and c.proc.poll() is None:
                            signal_group(c.proc, signal.SIGTERM)
                if code != 0 and self._ended_ok and child in self._respawned:
                    self._log(f"{child.label}, started again, stopped: the job is over")
                    continue
                if code != 0 and self._ended_ok and child.hung:
                    continue  # declared dead, the job went on and ended without it
                if code != 0:
                    how, code = ended(child)
                    if self._scheduler_again(child, remaining, how, code):
                        continue
                    if self._let_go(child, remaining, how, code):
                        continue
                    if self._taken_over(child, remaining):
                        self._notify(child, f"{how} (code {code})")
                        self._log(
                            f"{child.label} {how} (code {code}); its keys live on the next "
                            "server (--replicas), the job goes on"
                        )
                        self._respawn(child, remaining, "it rejoins as a replica")
                        continue
                    self._notify(child, f"{how} (code {code})")
                    # the failure that ended the job may be another's, seen later
                    child = self._first_failure(child, remaining)
                    how, code = ended(child)
                    self._failed = child
                    self._log(f"{child.label} {how} (code {code}); stopping the others")
                    if self._used() < self.spec.max_restarts:
                        return code  # run() kills the rest at once and starts the job again
                    self._drain(remaining)
                    return code
            if remaining:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    remaining[0].proc.wait(timeout=0.2)
        return 0

    def _drain(self, remaining: list[Child]) -> None:
        """Give the survivors ``failure_grace`` seconds to exit on their own (they learn of the
        failure from the scheduler and print a clear error), then stop them."""
        _wait_all(remaining, self.spec.failure_grace)
        for c in remaining:
            if c.proc.poll() is None:
                self._log(f"stopping {c.label}")
        self.stop_all()

    def stop_all(self, workers_first: bool = False, kill: bool = False) -> None:
        """SIGTERM every child's process group, then SIGKILL what is left after the grace.
        ``workers_first`` (a stop asked for with Ctrl-C or SIGTERM): the workers get SIGTERM
        first and ``worker_grace`` to end on their own, then the rest. ``kill``: SIGKILL at
        once (a job about to be started again)."""
        if self._stopping:
            return
        self._stopping = True
        # workers first: one that takes SIGTERM as "stop after this round" (hetps train with
        # --checkpoint-dir) needs its servers and scheduler to finish that round and save
        workers = [
            c
            for c in self.children
            if workers_first and c.role == "worker" and c.proc.poll() is None
        ]
        for c in workers:
            signal_group(c.proc, signal.SIGTERM)
        _wait_all(workers, self.spec.worker_grace)
        live = [c for c in self.children if c.proc.poll() is None and not kill]
        for c in live:
            signal_group(c.proc, signal.SIGTERM)
        _wait_all(live, self.spec.stop_grace)
        for c in self.children:
            # the group may hold grandchildren even when the child itself is gone
            signal_group(c.proc, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.proc.wait(timeout=5)
            if c.reader is not None:
                c.reader.join(timeout=2)


def _wait_all(children: list[Child], grace: float) -> None:
    """Wait until every child has exited or ``grace`` seconds have passed."""
    deadline = time.monotonic() + grace
    for c in children:
        try:
            c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return


def run_cluster(
    spec: LaunchSpec,
    netem: str | None = None,
    colocate: bool = False,
    balance: str | None = None,
    slice_elems: int | None = None,
    out=None,
    metrics_port: int | None = None,
) -> int:
    """Run a launch spec, optionally on emulated links (``netem`` = a scenario file) with
    co-located servers and a load-balance scheme, and live metrics served by the scheduler
    (``metrics_port``, docs/LIVE.md). Everything the emulator made is removed at
    the end, on error and on Ctrl-C."""
    if colocate:
        spec.num_servers = spec.num_workers
        spec.env["HETPS_COLOCATE"] = "1"
    balance_env(spec.env, balance, slice_elems)
    if metrics_port is not None:
        if not 0 <= metrics_port <= 65535:
            raise SystemExit(
                f"--metrics-port {metrics_port}: give a TCP port from 1 to 65535, or 0 for a "
                "free one (printed by the scheduler)"
            )
        spec.env["HETPS_METRICS_PORT"] = str(metrics_port)
    if not netem:
        return Launcher(spec, out=out).run()
    from hetps.netem import Netem, load_scenario

    # each emulated node is a host: a worker alone on its node, or --nproc-per-node K workers
    # to a node (not with co-located servers: node r holds server r and worker r)
    per_node = 1 if colocate else spec.nproc_per_node or 1
    hosts = -(-spec.num_workers // per_node)
    nodes = spec.num_workers if colocate else hosts + spec.num_servers
    spec.places = places_by_host([str(r // per_node) for r in range(spec.num_workers)])
    scenario = load_scenario(netem, nodes=nodes)
    spec.env["HETPS_NETEM_SCENARIO"] = str(netem)
    with Netem(scenario) as net:
        spec.host = net.node_ip(0)
        spec.wrap = netem_wrapper(net, spec.num_servers, colocate, per_node)
        if scenario.kind == "dynamic":
            net.start_dynamic()
        return Launcher(spec, out=out).run()


def run_cluster_from(spec: LaunchSpec, args: Any) -> int:
    """:func:`run_cluster` with the flags ``hetps launch`` and ``hetps train`` share
    (:func:`hetps.cli.add_cluster_arguments`)."""
    return run_cluster(
        spec,
        netem=args.netem,
        colocate=args.colocate,
        balance=args.balance,
        slice_elems=args.slice_size,
        metrics_port=args.metrics_port,
    )
