"""A hung process under ``hetps launch --launcher slurm`` on a real one-node Slurm: a server
stopped with SIGSTOP mid-job is failed over (HETPS_REPLICAS=2), every round trains with
every value right, and when the job ends every process of it ends too (the stopped server
with SIGKILL), the step and the batch script with them: the job does not stay RUNNING."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import slurm_cluster  # noqa: E402
from procs import wait_gone  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable

# Each round: push, pull, and a check of the pulled value against every round applied once
# (SGD with momentum, computed here). At round 8 worker 0 stops server rank 1 with SIGSTOP.
JOB = """
import hashlib, os, signal, time
import numpy as np
import hetps.kv
from hetps import optim

def server_pid(rank):
    port = os.environ["DMLC_PS_ROOT_PORT"]
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            env = open(f"/proc/{name}/environ", "rb").read().split(b"\\0")
            cmd = open(f"/proc/{name}/cmdline", "rb").read().split(b"\\0")
        except OSError:
            continue
        if (b"hetps.cli" in cmd and b"server" in cmd and b"DMLC_ROLE=server" in env
                and f"HETPS_LAUNCH_RANK={rank}".encode() in env
                and f"DMLC_PS_ROOT_PORT={port}".encode() in env):
            return int(name)
    raise SystemExit("no server process of rank %d" % rank)

kv = hetps.kv.create("dist_sync")
kv.init("w", np.linspace(-1, 1, 4096, dtype=np.float32))
kv.set_optimizer(optim.SGD(learning_rate=0.05, momentum=0.9))
ref_opt = optim.SGD(learning_rate=0.05, momentum=0.9)
ref = np.linspace(-1, 1, 4096, dtype=np.float32)
state = ref_opt.create_state("w", ref)
out = np.zeros(4096, np.float32)
print(f"PIDS {os.getpid()} {os.getppid()}", flush=True)
for r in range(24):
    if r == 8 and kv.rank == 0:
        pid = server_pid(1)
        os.kill(pid, signal.SIGSTOP)
        while open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T":
            time.sleep(0.01)  # polls the kernel until the stop took (it is not at once)
        print(f"STOPPED {pid}", flush=True)
    kv.push("w", np.random.default_rng(100 * r + kv.rank).standard_normal(4096).astype(np.float32))
    kv.pull("w", out=out)
    grads = [np.random.default_rng(100 * r + w).standard_normal(4096).astype(np.float32)
             for w in range(kv.num_workers)]
    ref_opt.update("w", ref, sum(grads), state)
    if not np.array_equal(out, ref):
        raise SystemExit(f"WRONG VALUE: worker {kv.rank}, round {r}")
print(f"FINAL {kv.rank} {hashlib.sha256(out.tobytes()).hexdigest()}", flush=True)
"""


@pytest.fixture(scope="module")
def slurm():
    reason = slurm_cluster.why_not()
    if reason:
        pytest.skip(reason)
    root = Path(tempfile.mkdtemp(prefix="hetps-slurm-"))  # (munged's socket path: short)
    cluster = slurm_cluster.start(root)
    try:
        yield cluster
    finally:
        subprocess.run(["scancel", "--full", "-u", "root"], env=cluster.env(), timeout=30)
        cluster.stop()
    assert not root.exists()


def _env(slurm, **extra) -> dict[str, str]:
    env = slurm.env()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env["PATH"] = os.path.dirname(PY) + os.pathsep + env.get("PATH", "")
    for k in list(env):
        if k.startswith(("DMLC_", "HETPS_", "PS_")):
            del env[k]
    env.update(PS_HEARTBEAT_INTERVAL="0.5", PS_HEARTBEAT_TIMEOUT="4", HETPS_CONNECT_TIMEOUT="30")
    env.update(extra)
    return env


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_stopped_server_is_failed_over_and_killed_when_the_job_ends(slurm, tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    batch = tmp_path / "job.sbatch"
    batch.write_text(
        "#!/bin/bash\n#SBATCH --ntasks=5\n"
        f"echo BATCH $$\nhetps launch --launcher slurm -n 2 -s 2 -- {PY} {script}\n"
        "echo LAUNCH-RC $?\n"
    )
    log = tmp_path / "job.out"
    try:
        res = subprocess.run(
            ["sbatch", "--wait", "-o", str(log), str(batch)],
            env=_env(slurm, HETPS_REPLICAS="2"),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=90,  # (the job takes ~30 s; a job kept RUNNING by its hung server fails)
        )
    except subprocess.TimeoutExpired:
        out = log.read_text() if log.exists() else ""
        pytest.fail("the job stayed RUNNING after it ended:\n" + out)
    finally:
        subprocess.run(["scancel", "--full", "-u", "root"], env=slurm.env(), timeout=30)
    out = log.read_text() if log.exists() else ""
    assert res.returncode == 0, res.stdout + res.stderr + out + slurm.logs()
    assert "WRONG VALUE" not in out, out
    stopped = re.search(r"^\[worker 0\] STOPPED (\d+)$", out, re.M)
    assert stopped, out
    assert re.search(r"server rank 1 \(node 10.*takes over its keys", out), out
    finals = re.findall(r"^\[worker (\d)\] FINAL \d (\w+)$", out, re.M)
    assert sorted(r for r, _ in finals) == ["0", "1"] and finals[0][1] == finals[1][1], out
    assert re.search(r"^\[launcher\] the job ended, but server 1 did not end with it", out, re.M)
    assert re.search(r"^LAUNCH-RC 0$", out, re.M), out
    pids = [int(stopped.group(1))] + [
        int(p) for m in re.findall(r"PIDS (\d+) (\d+)", out) for p in m
    ]
    pids.append(int(re.search(r"^BATCH (\d+)$", out, re.M).group(1)))
    assert len(pids) == 6, out
    assert wait_gone(pids, timeout=15) == [], out
