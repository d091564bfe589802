"""A one-node Slurm on this machine, for tests: munged, slurmctld and slurmd started from a
private directory with their own configuration, ports and state, and stopped again.

Debian's ``slurm-wlm`` and ``munge`` provide the daemons; :func:`why_not` says why a cluster
cannot be brought up here (not root, packages missing), for a skip reason. Nothing under
/etc or /run is touched: the configuration is reached through ``SLURM_CONF`` and the munge
socket through ``AuthInfo=socket=...``, so the daemons of one test run never meet another's.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "sbatch", "salloc", "sinfo", "scontrol")
NODE = "hetpsnode"
#: CPUs the node claims (it has fewer; ``SlurmdParameters=config_overrides`` lets it): room
#: for a scheduler, servers and workers as separate tasks on a small machine
NODE_CPUS = 16


def why_not() -> str | None:
    """Why a test Slurm cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return "a test Slurm needs root (slurmd starts jobs as their user)"
    missing = [p for p in DAEMONS + CLIENTS if _which(p) is None]
    if missing:
        return (
            f"Slurm is not installed ({', '.join(missing)} missing): "
            "apt-get install slurm-wlm munge (scripts/setup.sh --tests does it as root)"
        )
    return None


def _which(prog: str) -> str | None:
    return shutil.which(prog, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class SlurmCluster:
    """A running one-node Slurm; :meth:`env` is the environment its client commands need."""

    root: Path
    conf: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        # an outer allocation's variables would make our commands think they run inside it
        for k in list(env):
            if k.startswith("SLURM_") and k != "SLURM_CONF":
                del env[k]
        return env

    def logs(self) -> str:
        """The daemons' logs, for a failure message."""
        out = []
        for name in ("munged.log", "slurmctld.log", "slurmd.log"):
            p = self.root / name
            if p.exists():
                out.append(f"--- {name}\n" + p.read_text(errors="replace")[-4000:])
        return "\n".join(out)

    def strays(self) -> list[int]:
        """Processes that carry this cluster's ``SLURM_CONF`` and are not its daemons: the
        job steps' slurmstepd and whatever the jobs left (srun hands its environment on)."""
        mark = f"SLURM_CONF={self.conf}".encode()
        own = {p.pid for p in self.procs.values()} | {os.getpid()}
        found = []
        for d in os.listdir("/proc"):
            if not d.isdigit() or int(d) in own:
                continue
            try:
                environ = Path(f"/proc/{d}/environ").read_bytes()
            except OSError:
                continue
            if mark in environ.split(b"\0"):
                found.append(int(d))
        return found

    def stop(self) -> None:
        """Stop every daemon this cluster started (SIGTERM, then SIGKILL after 10 s), kill
        every process its jobs left behind and remove its state."""
        for name in reversed(list(self.procs)):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for name in reversed(list(self.procs)):
            proc = self.procs[name]
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self.procs.clear()
        for pid in self.strays():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.root, ignore_errors=True)


def _write_conf(root: Path, ctld_port: int, slurmd_port: int) -> Path:
    host = socket.gethostname().split(".")[0]
    conf = root / "slurm.conf"
    conf.write_text(
        f"""\
ClusterName=hetpstest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge.socket
StateSaveLocation={root}/ctld
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge=5
InactiveLimit=0
KillWait=5
NodeName={NODE} NodeHostname={host} NodeAddr=127.0.0.1 CPUs={NODE_CPUS} State=UNKNOWN
PartitionName=debug Nodes={NODE} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""
    )
    return conf


def start(root: Path, timeout: float = 60.0) -> SlurmCluster:
    """Start munged, slurmctld and slurmd under ``root`` (created, private) and wait until
    the node is idle; on any failure everything started so far is stopped and the error says
    why (with the daemons' logs)."""
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o700)  # munged insists that nobody else can write its directories
    for d in ("ctld", "spool"):
        (root / d).mkdir(exist_ok=True)
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    os.chmod(key, 0o600)
    conf = _write_conf(root, free_port(), free_port())
    cluster = SlurmCluster(root, conf)
    try:
        cluster.procs["munged"] = subprocess.Popen(
            [
                _which("munged"),
                "--foreground",
                "--force",
                f"--socket={root}/munge.socket",
                f"--key-file={key}",
                f"--pid-file={root}/munged.pid",
                f"--log-file={root}/munged.log",
                f"--seed-file={root}/munged.seed",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        _wait(lambda: (root / "munge.socket").exists(), cluster, "munged's socket", timeout)
        env = cluster.env()
        cluster.procs["slurmctld"] = subprocess.Popen(
            [_which("slurmctld"), "-D", "-i", "-f", str(conf)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        cluster.procs["slurmd"] = subprocess.Popen(
            [_which("slurmd"), "-D", "-N", NODE, "-f", str(conf)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

        def idle() -> bool:
            res = subprocess.run(
                ["sinfo", "-h", "-n", NODE, "-o", "%t"],
                env=env,
                capture_output=True,
                text=True,
                timeout=30,
            )
            return res.returncode == 0 and res.stdout.strip() == "idle"

        _wait(idle, cluster, f"node {NODE} idle in sinfo", timeout)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _wait(ready, cluster: SlurmCluster, what: str, timeout: float) -> None:
    """Poll ``ready()`` until it holds; fail (with the logs) when a daemon died or the
    deadline passed."""
    deadline = time.monotonic() + timeout
    while not ready():
        dead = [n for n, p in cluster.procs.items() if p.poll() is not None]
        if dead:
            raise RuntimeError(f"{', '.join(dead)} exited before {what}\n{cluster.logs()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} within {timeout:g} s\n{cluster.logs()}")
        time.sleep(0.2)
