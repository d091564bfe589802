"""``hetps launch --launcher slurm``: a whole cluster as one Slurm job step.

The launcher runs one ``srun --ntasks 1+S+W`` whose tasks start this module's task entry
(``python -m hetps.launch.slurm task ...``); each turns its ``SLURM_PROCID`` into a role
(docs/LAUNCHERS.md has the table and what the local launcher's promises become here)."""

from __future__ import annotations

import argparse
import logging
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading

from hetps.config import ConfigError, route_address, user_threads
from hetps.launch import contract
from hetps.launch.contract import (
    PORT_LINE,
    LaunchSpec,
    Place,
    after_dashes,
    give_secret,
    places_by_host,
    role_env,
    usable_cores,
    without_host_vars,
)
from hetps.launch.processes import (
    CAUSE_WAIT_S,
    Output,
    dies_with_launcher,
    ended_within,
    forward_signals,
    raise_interrupt,
    role_argv,
    shell_code,
    signal_group,
    start_piped,
)

#: a task's role still there this long after the signal that stops it gets SIGKILL
TASK_KILL_S = 10.0
#: what a task entry prints (and the launcher hides) when its role ends: ``PROCID CODE``
EXIT_LINE = re.compile(r"^hetps-slurm-exit (\d+) (-?\d+)$")
#: what task 0 prints first: the step to cancel if srun itself cannot stop it
STEP_LINE = re.compile(r"^hetps-slurm-step (\S+)$")
#: one line of ``srun --label`` output: ``TASK: text`` (the id padded to a common width)
LABELLED = re.compile(r"^\s*(\d+): ?(.*)$")

log = logging.getLogger("hetps.launch")


class SlurmError(RuntimeError):
    """The launcher cannot run here; the message names the cause and the fix."""


# -- host lists ------------------------------------------------------------------------------
def expand_nodelist(nodelist: str) -> list[str]:
    """The host names of a Slurm host list (``SLURM_JOB_NODELIST``), in order, as
    ``scontrol show hostnames`` prints them: ``node[01-03,7],gpu[1-2]-ib`` ->
    node01, node02, node03, node7, gpu1-ib, gpu2-ib. Zero padding is kept; a name may have
    several bracket groups (every combination, the last group varying fastest)."""
    hosts: list[str] = []
    for item in re.split(r",(?![^\[]*\])", nodelist.strip()):  # (commas outside brackets)
        if item:
            hosts.extend(_expand_one(item, nodelist))
    return hosts


def _expand_one(item: str, whole: str) -> list[str]:
    m = re.search(r"\[([^\[\]]*)\]", item)
    if m is None:
        if "[" in item or "]" in item:
            raise SlurmError(f"cannot read the Slurm host list {whole!r}: unbalanced brackets")
        return [item]
    head, tail = item[: m.start()], item[m.end() :]
    out = []
    for rng in m.group(1).split(","):
        lo, sep, hi = rng.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise SlurmError(f"cannot read the Slurm host list {whole!r}: bad range {rng!r}")
        width = len(lo)
        start, stop = int(lo), int(hi) if sep else int(lo)
        if stop < start:
            raise SlurmError(f"cannot read the Slurm host list {whole!r}: range {rng!r} runs down")
        for n in range(start, stop + 1):
            out.extend(_expand_one(f"{head}{n:0{width}d}{tail}", whole))
    return out


def tasks_per_node(value: str) -> list[int]:
    """``SLURM_STEP_TASKS_PER_NODE`` (``3(x2),1``) as one count per node: [3, 3, 1]."""
    counts: list[int] = []
    for part in value.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            raise SlurmError(f"cannot read the task counts {value!r} Slurm gave this step")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


def step_counts(env: dict[str, str]) -> list[int]:
    """The step's tasks on each node (:func:`tasks_per_node` of what Slurm set)."""
    return tasks_per_node(
        env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "1"
    )


def task_role(procid: int, num_servers: int, num_workers: int) -> tuple[str, int]:
    """(role, rank) of Slurm task ``procid``: 0 the scheduler, 1..S servers, then workers."""
    if procid == 0:
        return "scheduler", 0
    if procid <= num_servers:
        return "server", procid - 1
    rank = procid - 1 - num_servers
    if rank >= num_workers:
        raise SlurmError(
            f"Slurm task {procid} has no role: the job has 1 scheduler, {num_servers} servers "
            f"and {num_workers} workers ({1 + num_servers + num_workers} tasks)"
        )
    return "worker", rank


def worker_places(counts: list[int], num_servers: int, num_workers: int) -> list[Place]:
    """Each worker's host (:class:`Place`) in a step of ``counts`` tasks per node
    (``SLURM_STEP_TASKS_PER_NODE``) laid out in blocks (``--distribution=block``: task 0 and
    the first ones on the first node): a worker's host is its Slurm node, groups numbered over
    the nodes that run workers, local ranks in task order."""
    nodes = [str(i) for i, n in enumerate(counts) for _ in range(n)]
    first = 1 + num_servers
    if len(nodes) < first + num_workers:  # (a count Slurm did not give: one node holds all)
        nodes += [nodes[-1] if nodes else "0"] * (first + num_workers - len(nodes))
    return places_by_host(nodes[first : first + num_workers])


def label(role: str, rank: int) -> str:
    return "scheduler" if role == "scheduler" else f"{role} {rank}"


# -- the launcher ----------------------------------------------------------------------------
def check_allocation(env: dict[str, str], needed: int) -> list[str]:
    """The allocation's hosts; raises SlurmError (cause and fix) when this is no allocation,
    srun is missing or the allocation has too few tasks for the job."""
    if not env.get("SLURM_JOB_ID"):
        raise SlurmError(
            "--launcher slurm runs inside a Slurm allocation and SLURM_JOB_ID is not set: "
            f"run it in an sbatch script or under salloc, e.g. salloc -n {needed} hetps launch "
            "--launcher slurm ..."
        )
    if shutil.which("srun", path=env.get("PATH")) is None:
        raise SlurmError(
            "--launcher slurm needs srun and it is not on PATH: load your site's Slurm module "
            "(module load slurm) or install Slurm's client commands"
        )
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise SlurmError(
            "SLURM_JOB_NODELIST is not set although SLURM_JOB_ID is: run hetps launch in the "
            "allocation's own shell (sbatch script or salloc), not with a copied SLURM_JOB_ID"
        )
    ntasks = env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS")
    if ntasks and ntasks.isdigit() and int(ntasks) < needed:
        raise SlurmError(
            f"the allocation has {ntasks} tasks (SLURM_NTASKS) and the job needs {needed} "
            "(1 scheduler, the servers and the workers, one task each): allocate with "
            f"-n {needed}, or pass fewer -n/-s"
        )
    return expand_nodelist(nodelist)


def free_port(range_file: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    """A port free on this host now (the scheduler's port when the launcher runs on the
    scheduler's node, as in an sbatch script; elsewhere a port most likely free there).
    (docs/MODULES.md, "hetps.launch.slurm")"""
    try:
        with open(range_file) as f:
            low, high = (int(x) for x in f.read().split()[:2])
        spans = [(a, b) for a, b in ((10000, low), (high + 1, 65536)) if b - a >= 1000]
    except (OSError, ValueError):
        spans = []
    if spans:
        rng = random.Random()
        weights = [b - a for a, b in spans]
        for _ in range(64):
            a, b = rng.choices(spans, weights)[0]
            port = rng.randrange(a, b)
            with socket.socket() as s:
                try:
                    s.bind(("", port))
                except OSError:
                    continue
                return port
    log.warning(
        "hetps launch: no free port outside the ephemeral range (%s); the scheduler's port "
        "comes from it, and another program could take it before the scheduler binds it: "
        "pass --port N to choose one",
        range_file,
    )
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def node_address(node: str, env: dict[str, str]) -> str:
    """The address other nodes reach ``node`` at: its ``NodeAddr`` in Slurm (which may differ
    from its name), else the name itself."""
    try:
        res = subprocess.run(
            ["scontrol", "show", "node", "-o", node],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return node
    m = re.search(r"\bNodeAddr=(\S+)", res.stdout) if res.returncode == 0 else None
    return m.group(1) if m else node


def srun_argv(spec: LaunchSpec, scheduler_node: str, root_uri: str, port: int, auto_threads: bool):
    """The srun command line of a job (no secret on it: that travels in the environment)."""
    ntasks = 1 + spec.num_servers + spec.num_workers
    task = [sys.executable, "-m", "hetps.launch.slurm", "task"]
    task += [f"--servers={spec.num_servers}", f"--workers={spec.num_workers}"]
    task += [f"--scheduler-node={scheduler_node}", f"--root-uri={root_uri}", f"--port={port}"]
    if auto_threads:
        task.append("--auto-threads")
    return [
        "srun",
        f"--ntasks={ntasks}",
        "--distribution=block",  # task 0, the scheduler, on the allocation's first node
        "--label",
        "--export=ALL",
        "--kill-on-bad-exit=0",  # the launcher decides, after failure_grace
        *task,
        "--",
        *spec.command,
    ]


class SlurmLauncher(Output):
    """Runs a :class:`LaunchSpec` as one srun step; ``run()`` returns the job's exit code."""

    def __init__(self, spec: LaunchSpec, env: dict[str, str] | None = None, out=None) -> None:
        self.spec = spec
        self.env = dict(os.environ if env is None else env)
        self.out = out or sys.stdout
        self.proc: subprocess.Popen | None = None
        self.step: str | None = None
        self.failed: tuple[str, int] | None = None  # (label, shell code) of the first failure
        self._failed_event = threading.Event()
        # the scheduler and the servers exit 1 when another node's failure ends the job: such
        # a first failure is a consequence, and a worker's failure that follows names the cause
        self._consequence = False
        self._cause = threading.Event()
        self._up = False  # the scheduler said its port
        self._exited: set[int] = set()  # the tasks that said their exit
        self._ended = threading.Event()  # the scheduler (task 0) ended: so did the job
        self._ending = False  # the launcher stops what outlived the job: their codes are not its
        self._print_lock = threading.Lock()
        self._labels: dict[int, str] = {}

    def _note_failure(self, name: str, code: int) -> None:
        # a worker's 1 may be its own error or another node's; a code of its own (such as
        # sys.exit(3)) after the scheduler's or a server's 1 is the cause
        role = name.split(" ")[0]
        # (a scheduler that ends before it said its port failed itself: bind, secret)
        consequence = code == 1 and (role == "server" or (role == "scheduler" and self._up))
        if self.failed is None or (self._consequence and code != 1):
            self.failed, self._consequence = (name, code), consequence
            self._failed_event.set()
            if not consequence:
                self._cause.set()

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for raw in iter(self.proc.stdout.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            m = LABELLED.match(line)
            if m is None:  # srun's own messages
                self._say("srun", [line])
                continue
            task, text = int(m.group(1)), m.group(2)
            name = self._labels.get(task, f"task {task}")
            if task == 0 and PORT_LINE.search(text):
                self._up = True
                continue
            step = STEP_LINE.match(text)
            if step:
                self.step = step.group(1)
                continue
            done = EXIT_LINE.match(text)
            if done:
                code = int(done.group(2))
                self._exited.add(task)
                if self._ending:
                    if code != 0:
                        self._log(f"{name} was stopped (code {shell_code(code)})")
                elif code != 0:
                    self._note_failure(name, code)
                if task == 0:
                    self._ended.set()
                continue
            self._say(name, [text])
        self.proc.stdout.close()

    def run(self) -> int:
        old = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                old[sig] = signal.signal(sig, raise_interrupt)
        try:
            return self._run()
        except SlurmError as exc:
            self._log(str(exc))
            return 1
        except KeyboardInterrupt:
            self._log("interrupted: stopping the job step")
            return 130
        finally:
            for sig in old:
                signal.signal(sig, signal.SIG_IGN)
            self.stop()
            for sig, handler in old.items():
                signal.signal(sig, handler)

    def _run(self) -> int:
        spec = self.spec
        needed = 1 + spec.num_servers + spec.num_workers
        hosts = check_allocation(self.env, needed)
        env = {**self.env, **spec.env, "PYTHONUNBUFFERED": "1"}
        give_secret(env)
        scheduler_node = hosts[0]
        root_uri = node_address(scheduler_node, env)
        port = spec.port or free_port()
        auto = user_threads(env=env) is None
        for procid in range(needed):
            self._labels[procid] = label(*task_role(procid, spec.num_servers, spec.num_workers))
        argv = srun_argv(spec, scheduler_node, root_uri, port, auto)
        # srun's parent-death signal is SIGTERM: it forwards it to every task and ends the step
        self.proc = start_piped(argv, env, signal_name="TERM")
        reader = threading.Thread(target=self._pump, daemon=True)
        reader.start()
        while self.proc.poll() is None and not self._ended.is_set():
            if self._failed_event.wait(0.2):
                break
        if self.failed is None and self._ended.is_set() and self.proc.poll() is None:
            self._outlived(spec.failure_grace)
        if self._consequence:  # the scheduler or a server ended for a failure: whose?
            self._cause.wait(min(spec.failure_grace, CAUSE_WAIT_S))
        if self.proc.poll() is None:  # a task failed: the others get failure_grace to end
            name, code = self.failed or ("a task", 1)
            self._log(f"{name} exited (code {shell_code(code)}); stopping the others")
            if not ended_within(self.proc, spec.failure_grace):
                self._log("stopping the job step")
                self.stop()
        self.proc.wait()
        reader.join(timeout=5)
        if self.failed is not None:
            return shell_code(self.failed[1])
        if self._ending:  # (the job ended well; the step was stopped for what outlived it)
            return 0
        code = shell_code(self.proc.returncode)
        if code != 0:
            self._log(f"srun exited with code {code}")
        return code

    def _outlived(self, grace: float) -> None:
        """The scheduler ended, and the job with it: the other tasks get ``grace`` seconds
        to end (they were told); a task still there then (hung, or stopped with SIGSTOP)
        is named and the step stopped, so no process of the job outlives it."""
        assert self.proc is not None
        if ended_within(self.proc, grace):
            return
        if self.failed is not None:  # a task failed meanwhile: the failure path stops it
            return
        left = [name for task, name in sorted(self._labels.items()) if task not in self._exited]
        self._ending = True
        self._log(
            f"the job ended, but {', '.join(left) or 'a task'} did not end with it "
            f"within {grace:g} s (hung or stopped): stopping the job step"
        )
        self.stop()

    def stop(self) -> None:
        """Stop the step: SIGTERM to srun (it signals every task), SIGKILL after
        ``stop_grace``, and ``scancel`` of the step if srun had to be killed."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        signal_group(proc, signal.SIGTERM)
        if ended_within(proc, self.spec.stop_grace):
            return
        signal_group(proc, signal.SIGKILL)
        proc.wait(timeout=10)
        if self.step:
            subprocess.run(
                ["scancel", self.step],
                env=self.env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=30,
            )


def run_slurm(spec: LaunchSpec, out=None) -> int:
    """Run ``spec`` as one Slurm job step in the current allocation; the job's exit code."""
    return SlurmLauncher(spec, out=out).run()


# -- the task entry --------------------------------------------------------------------------
def task_env(env: dict[str, str], args: argparse.Namespace) -> tuple[str, int, dict[str, str]]:
    """(role, rank, environment) of this Slurm task, from its ``SLURM_*`` variables."""
    procid_s = env.get("SLURM_PROCID")
    if procid_s is None or not procid_s.isdigit():
        raise SlurmError(
            "SLURM_PROCID is not set: `python -m hetps.launch.slurm task` is started by "
            "`hetps launch --launcher slurm` through srun, not by hand"
        )
    ntasks = env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS")
    needed = 1 + args.servers + args.workers
    if ntasks and ntasks.isdigit() and int(ntasks) != needed:
        raise SlurmError(
            f"this step has {ntasks} tasks (SLURM_NTASKS) and the job needs {needed}: "
            "start it through hetps launch --launcher slurm, which asks srun for the count"
        )
    procid = int(procid_s)
    role, rank = task_role(procid, args.servers, args.workers)
    node = env.get("SLURMD_NODENAME", "")
    if role == "scheduler" and node and node != args.scheduler_node:
        raise SlurmError(
            f"the scheduler (task 0) landed on {node}, not on {args.scheduler_node} where the "
            "other tasks look for it: do not set SLURM_DISTRIBUTION to anything but block"
        )
    # (srun exports the launcher's environment: none of the host variables is this task's)
    out = without_host_vars(env)
    place = None
    if role == "worker":
        place = worker_places(step_counts(env), args.servers, args.workers)[rank]
    out.update(role_env(role, rank, args.servers, args.workers, (args.root_uri, args.port), place))
    if not env.get("DMLC_NODE_HOST") and not env.get("DMLC_INTERFACE"):
        out["DMLC_NODE_HOST"] = route_address(args.root_uri, args.port)
    if args.auto_threads:
        out["OMP_NUM_THREADS"] = str(task_threads(role, env))
    return role, rank, out


def task_threads(role: str, env: dict[str, str]) -> int:
    """A task's ``OMP_NUM_THREADS``: :func:`~hetps.launch.contract.thread_share` of its node's cores among the
    step's tasks on that node; a task Slurm bound to fewer CPUs than its node's allocation
    (task/affinity, cgroups) has those CPUs to itself."""
    cores = usable_cores()
    on_node = env.get("SLURM_CPUS_ON_NODE", "")
    if on_node.isdigit() and int(on_node) > cores:  # bound to its own CPUs
        return cores if role == "worker" else 1
    if on_node.isdigit():
        cores = min(cores, int(on_node))
    counts = step_counts(env)
    nodeid = env.get("SLURM_NODEID", "0")
    i = int(nodeid) if nodeid.isdigit() else 0
    processes = counts[i] if i < len(counts) else counts[-1]
    return contract.thread_share(role, cores, processes)


def _task_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m hetps.launch.slurm task")
    p.add_argument("--servers", type=int, required=True)  # (usage and errors: this order)
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--scheduler-node", required=True)
    p.add_argument("--root-uri", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--auto-threads", action="store_true")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    command = after_dashes(args.command)
    env = dict(os.environ)
    procid = env.get("SLURM_PROCID", "?")
    try:
        role, _rank, child_env = task_env(env, args)
    except (SlurmError, ConfigError) as exc:
        print(f"hetps launch --launcher slurm: {exc}", flush=True)
        print(f"hetps-slurm-exit {procid} 2", flush=True)
        return 2
    if role == "scheduler" and env.get("SLURM_JOB_ID") and env.get("SLURM_STEP_ID"):
        print(f"hetps-slurm-step {env['SLURM_JOB_ID']}.{env['SLURM_STEP_ID']}", flush=True)
    cmd = role_argv(role) if role in ("scheduler", "server") else command
    if shutil.which(cmd[0], path=child_env.get("PATH")) is None:
        print(f"hetps launch --launcher slurm: cannot start {shlex.join(cmd)}: no such command")
        print(f"hetps-slurm-exit {procid} 127", flush=True)
        return 127
    # its own process group, so that whatever the role starts ends with it (Slurm's
    # proctrack/linuxproc loses processes that outlive their parent)
    child = subprocess.Popen(dies_with_launcher(cmd), env=child_env, start_new_session=True)
    # a stopped role (SIGSTOP) would keep the signal pending, and the step with it: it gets
    # SIGKILL at once, and one that does not end gets it after TASK_KILL_S
    forward_signals(child.pid, TASK_KILL_S)
    code = child.wait()
    signal_group(child, signal.SIGKILL)  # the role's leftovers
    print(f"hetps-slurm-exit {procid} {code}", flush=True)
    return shell_code(code)


if __name__ == "__main__":
    if sys.argv[1:2] != ["task"]:
        sys.exit("usage: python -m hetps.launch.slurm task ... (started by hetps launch)")
    sys.exit(_task_main(sys.argv[2:]))
