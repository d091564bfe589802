"""hetps started from exactly the environment MXNet's launchers give each process: dmlc-core's
tracker (``local`` and ``ssh``, what MXNet's ``tools/launch.py`` runs) and Kubeflow's MXJob.
Each test builds the variables the launcher's source sets (docs/LAUNCHERS.md cites them), starts
real processes with them (the scheduler, the servers and the workers all run the user's
script, as the tracker does), and checks that they form one cluster and push/pull correctly.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import os
import numpy as np
import hetps.kv
kv = hetps.kv.create('dist_sync')  # the scheduler and the servers serve here and exit
keys = list(range(6))
for k in keys:
    kv.init(k, np.zeros(16, dtype=np.float32))
sums = []
for step in range(3):
    kv.push(keys, [np.full(16, (kv.rank + 1) * (step + 1), dtype=np.float32)] * len(keys))
    out = [np.zeros(16, dtype=np.float32) for _ in keys]
    kv.pull(keys, out=out)
    sums.append(sorted({float(v) for o in out for v in o}))
print(f"RESULT rank={kv.rank} id={os.environ.get('DMLC_WORKER_ID', '-')} sums={sums}", flush=True)
kv.barrier()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def tracker_host_ip() -> str:
    """What dmlc-core's ``tracker.get_host_ip('auto')`` gives: this host's name resolved,
    and when that is loopback the source address of a route to 10.255.255.255."""
    ip = socket.gethostbyname(socket.getfqdn())
    if ip.startswith("127."):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.connect(("10.255.255.255", 1))
            except OSError:
                pytest.skip("this machine has no route off loopback (dmlc's tracker needs one)")
            ip = s.getsockname()[0]
    return ip


def _bare_env() -> dict[str, str]:
    """What a fresh login shell or a container starts with: no DMLC_*/HETPS_* of ours."""
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR")}
    env.update(
        PYTHONPATH=str(ROOT / "src"),
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
        PS_HEARTBEAT_INTERVAL="0.5",
        PS_HEARTBEAT_TIMEOUT="10",
        HETPS_CONNECT_TIMEOUT="30",
    )
    return env


def _run_all(tmp_path: Path, envs: list[tuple[str, dict[str, str]]], timeout: float = 120):
    """Start one process per (name, env), each running SCRIPT; wait for all; return
    {name: (exit code, output)}. Every process group is killed at the end, even on failure."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    procs = {}
    try:
        for name, env in envs:
            log = open(tmp_path / f"{name}.log", "wb")
            procs[name] = (
                subprocess.Popen(
                    [sys.executable, str(script)],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                ),
                log,
            )
        # wait for all; once one has failed the others get a few seconds to say why
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            codes = [p.poll() for p, _ in procs.values()]
            if all(c is not None for c in codes):
                break
            if any(c not in (None, 0) for c in codes):
                deadline = min(deadline, time.monotonic() + 5)
            try:
                next(p for p, _ in procs.values() if p.poll() is None).wait(timeout=0.2)
            except (subprocess.TimeoutExpired, StopIteration):
                pass
        results = {}
        for name, (proc, log) in procs.items():
            log.flush()
            results[name] = (proc.poll(), (tmp_path / f"{name}.log").read_text(errors="replace"))
        return results
    finally:
        for proc, log in procs.values():
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            log.close()


def _check_training(results: dict, workers: int) -> dict[int, str]:
    """Every process exited 0 and every worker pulled the sum of all workers' pushes;
    returns {rank: DMLC_WORKER_ID it saw}."""
    everything = "\n".join(f"--- {n} (exit {c})\n{o}" for n, (c, o) in results.items())
    assert all(c == 0 for c, _ in results.values()), everything
    total = workers * (workers + 1) / 2
    ranks = {}
    for name, (_, out) in results.items():
        m = re.search(r"RESULT rank=(\d+) id=(\S+) sums=(.*)", out)
        if name.startswith("worker"):
            assert m, everything
            assert m.group(3) == str([[total * s] for s in (1, 2, 3)]), everything
            ranks[int(m.group(1))] = m.group(2)
        else:
            assert m is None, everything  # a scheduler or server never reaches the loop
    assert sorted(ranks) == list(range(workers)), everything
    return ranks


def _secret_file(tmp_path: Path) -> Path:
    path = tmp_path / "job.secret"
    res = subprocess.run(
        [sys.executable, "-m", "hetps.cli", "secret", str(path)],
        env=_bare_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    return path


# -- dmlc-core tracker/dmlc_tracker/local.py (tools/launch.py --launcher local) ----------------
def dmlc_local_envs(base: dict[str, str], workers: int, servers: int, ip: str, port: int):
    """tracker.py's PSTracker (the scheduler) and local.py's exec_cmd (tasks 0..W-1 workers,
    then the servers): every process gets a copy of the tracker's own environment."""
    common = {"DMLC_NUM_WORKER": str(workers), "DMLC_NUM_SERVER": str(servers)}
    out = [
        (
            "scheduler",
            {
                **base,
                "DMLC_ROLE": "scheduler",
                "DMLC_PS_ROOT_URI": ip,
                "DMLC_PS_ROOT_PORT": str(port),
                **common,
            },
        )
    ]
    for task in range(workers + servers):
        role = "worker" if task < workers else "server"
        env = {
            **base,
            **common,
            "DMLC_PS_ROOT_URI": ip,
            "DMLC_PS_ROOT_PORT": str(port),
            "DMLC_TASK_ID": str(task),
            "DMLC_ROLE": role,
            "DMLC_JOB_CLUSTER": "local",
        }
        out.append((f"{role}{task}", env))
    return out


def test_dmlc_local_tracker_environment(tmp_path):
    ip = tracker_host_ip()
    # the user exports the secret file before `tools/launch.py --launcher local`; the local
    # tracker copies its whole environment into every process
    base = {**_bare_env(), "HETPS_SECRET_FILE": str(_secret_file(tmp_path))}
    results = _run_all(tmp_path, dmlc_local_envs(base, 2, 2, ip, _free_port()))
    _check_training(results, 2)


def test_dmlc_local_tracker_without_a_secret_says_how_to_give_one(tmp_path):
    ip = tracker_host_ip()
    results = _run_all(tmp_path, dmlc_local_envs(_bare_env(), 1, 1, ip, _free_port()))
    for name, (code, out) in results.items():
        assert code != 0, out
        assert "without a cluster secret" in out and "HETPS_SECRET_FILE" in out, (name, out)


# -- dmlc-core tracker/dmlc_tracker/ssh.py (tools/launch.py --launcher ssh -H hosts) ----------
def test_dmlc_ssh_tracker_environment(tmp_path):
    ip = tracker_host_ip()
    secret = str(_secret_file(tmp_path))
    workers, servers, port = 2, 1, _free_port()
    hosts = [ip, ip]  # the hostfile: this machine twice
    # the scheduler: PSTracker on the launching machine, a copy of its environment
    launching = {**_bare_env(), "HETPS_SECRET_FILE": secret}
    dmlc = {
        "DMLC_NUM_WORKER": str(workers),
        "DMLC_NUM_SERVER": str(servers),
        "DMLC_PS_ROOT_URI": ip,
        "DMLC_PS_ROOT_PORT": str(port),
    }
    envs = [("scheduler", {**launching, **dmlc, "DMLC_ROLE": "scheduler"})]
    # each task: `ssh host 'export K=V; ...; cd DIR; CMD'` -- the remote login environment
    # plus OMP_NUM_THREADS (and the other fixed keys when set), the dmlc variables, the role,
    # DMLC_NODE_HOST=<its hostfile entry>, and `--env HETPS_SECRET_FILE` (tools/launch.py
    # forwards a variable by name)
    for i in range(workers + servers):
        role = "server" if i < servers else "worker"
        remote = {
            **_bare_env(),
            **dmlc,
            "DMLC_ROLE": role,
            "DMLC_NODE_HOST": hosts[i % len(hosts)],
            "HETPS_SECRET_FILE": secret,
        }
        envs.append((f"{role}{i}", remote))
    _check_training(_run_all(tmp_path, envs), workers)


# -- Kubeflow MXJob (mxnet-operator pkg/controller.v1/mxnet/pod.go, training-operator
#    pkg/controller.v1/mxnet/mxnet.go) -------------------------------------------------------
def mxjob_envs(
    base: dict[str, str], job: str, scheduler: str, port: int, workers: int, servers: int
):
    """Each pod's variables: MX_CONFIG (the cluster spec as JSON), DMLC_PS_ROOT_PORT,
    DMLC_PS_ROOT_URI (the scheduler replica's Service name), DMLC_NUM_SERVER,
    DMLC_NUM_WORKER, DMLC_ROLE, DMLC_USE_KUBERNETES=1 and, on workers, DMLC_WORKER_ID."""
    import json

    cluster = {
        "scheduler": [{"url": scheduler, "port": port}],
        "server": [{"url": f"{job}-server-{i}", "port": port} for i in range(servers)],
        "worker": [{"url": f"{job}-worker-{i}", "port": port} for i in range(workers)],
    }
    out = []
    for rtype, count in (("scheduler", 1), ("server", servers), ("worker", workers)):
        for i in range(count):
            mx_config = {
                "cluster": cluster,
                "labels": {"scheduler": "", "server": "", "worker": ""},
                "task": {"type": rtype, "index": i},
            }
            env = {
                **base,
                "HOSTNAME": f"{job}-{rtype}-{i}",
                "MX_CONFIG": json.dumps(mx_config),
                "DMLC_PS_ROOT_PORT": str(port),
                "DMLC_PS_ROOT_URI": scheduler,
                "DMLC_NUM_SERVER": str(servers),
                "DMLC_NUM_WORKER": str(workers),
                "DMLC_ROLE": rtype,
                "DMLC_USE_KUBERNETES": "1",
            }
            if rtype == "worker":
                env["DMLC_WORKER_ID"] = str(i)
            out.append((f"{rtype}{i}", env))
    return out


def test_mxjob_environment(tmp_path):
    # DMLC_PS_ROOT_URI is a Service name in Kubernetes; here this machine's own name stands
    # for it (a name, not an address: hetps resolves it, as a pod resolves the Service)
    name = socket.gethostname()
    try:
        socket.gethostbyname(name)
    except OSError:
        pytest.skip(f"this machine's name {name!r} does not resolve")
    # the secret comes from a Kubernetes Secret (env valueFrom.secretKeyRef)
    secret = _secret_file(tmp_path).read_text().strip()
    base = {**_bare_env(), "HETPS_SECRET": secret}
    envs = mxjob_envs(base, "linreg", name, _free_port(), workers=3, servers=2)
    # workers start in an order unlike their indices; each still gets rank = DMLC_WORKER_ID
    sched, s0, s1, w0, w1, w2 = envs
    ranks = _check_training(_run_all(tmp_path, [w2, s1, sched, w0, s0, w1]), 3)
    assert ranks == {0: "0", 1: "1", 2: "2"}
