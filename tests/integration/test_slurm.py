"""``hetps launch --launcher slurm`` on a real one-node Slurm (munged, slurmctld, slurmd) that
the module fixture starts on this machine and stops again; skipped with the reason where it
cannot (not root, Slurm not installed)."""

from __future__ import annotations

import os
import re
import signal
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


@pytest.fixture(scope="module")
def slurm():
    reason = slurm_cluster.why_not()
    if reason:
        pytest.skip(reason)
    # a short path of our own: munged's socket path must fit a sockaddr_un
    root = Path(tempfile.mkdtemp(prefix="hetps-slurm-"))
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
    env.update(PS_HEARTBEAT_INTERVAL="0.5", PS_HEARTBEAT_TIMEOUT="5", HETPS_CONNECT_TIMEOUT="30")
    for k in list(env):
        if k.startswith(("DMLC_", "HETPS_SECRET", "HETPS_INSECURE")):
            del env[k]
    env.update(extra)
    return env


def _launch(*args: str) -> list[str]:
    return [PY, "-m", "hetps.cli", "launch", "--launcher", "slurm", *args]


def test_linear_regression_example_through_salloc(slurm):
    res = subprocess.run(
        [
            "salloc",
            "-n",
            "4",
            *_launch("-n", "2", "-s", "1", "--"),
            PY,
            str(ROOT / "examples" / "linear_regression.py"),
            "--epochs",
            "1",
            "--num-samples",
            "2000",
        ],
        env=_env(slurm),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0, out + slurm.logs()
    mse = re.findall(r"^\[worker (\d)\] Worker\[(\d)\] Epoch\[0\] Train-mse=([\d.]+)$", out, re.M)
    assert {(a, b) for a, b, _ in mse} == {("0", "0"), ("1", "1")}, out
    assert len({m for *_, m in mse}) == 1, out  # one model: synchronous training
    assert float(mse[0][2]) < 3.0, out
    assert re.search(r"^\[worker 1\] Worker\[1\] done$", out, re.M), out
    # the launcher's own lines stay hidden; no unlabelled or blank task lines
    assert "hetps-slurm-" not in out and "hetps scheduler port" not in out, out
    assert not re.search(r"^\[(worker|server|scheduler)[^\]]*\] $", out, re.M), out


ROLE_SCRIPT = """
import os, sys
import numpy as np
import hetps.kv
kv = hetps.kv.create('dist_sync')
secret = os.environ.get('HETPS_SECRET', '')
seen = 0
for d in os.listdir('/proc'):
    if d.isdigit():
        try:
            with open(f'/proc/{d}/cmdline', 'rb') as f:
                seen += secret.encode() in f.read()
        except OSError:
            pass
print(f"ROLE rank={kv.rank} procid={os.environ['SLURM_PROCID']} "
      f"launch_rank={os.environ['HETPS_LAUNCH_RANK']} threads={os.environ.get('OMP_NUM_THREADS')} "
      f"secret={len(secret)} on_cmdline={seen}", flush=True)
names = ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'GROUP_RANK', 'HETPS_HOST_GROUP',
         'MASTER_ADDR')
groups = ','.join(str(n.group) for n in kv.node.workers())  # the scheduler's node table
print("HOSTVARS", kv.rank, *[os.environ.get(k, '-') for k in names], groups, flush=True)
for d in os.listdir('/proc'):  # the job's servers and scheduler get none of them
    try:
        raw = open(f'/proc/{d}/environ', 'rb').read()
    except OSError:
        continue
    env = dict(i.decode().split('=', 1) for i in raw.split(b'\\0') if b'=' in i)
    if env.get('HETPS_SECRET') == secret and env.get('DMLC_ROLE') in ('server', 'scheduler'):
        print('OTHER', env['DMLC_ROLE'], [k for k in names if k in env], flush=True)
kv.init(0, np.zeros(5, dtype=np.float32))
kv.push(0, np.full(5, kv.rank + 1, dtype=np.float32))
out = np.zeros(5, dtype=np.float32)
kv.pull(0, out=out)
print(f"SUM rank={kv.rank} {out.tolist()}", flush=True)
kv.barrier()
"""


def test_sbatch_roles_ranks_secret_and_threads(slurm, tmp_path):
    script = tmp_path / "roles.py"
    script.write_text(ROLE_SCRIPT)
    batch = tmp_path / "job.sbatch"
    batch.write_text(
        # one node of 5 tasks (--ntasks-per-node): the workers share one host; a RANK
        # left in the batch shell reaches no role
        "#!/bin/bash\n#SBATCH --nodes=1\n#SBATCH --ntasks-per-node=5\n"
        f"RANK=99 hetps launch --launcher slurm -n 3 -s 1 -- python {script}\n"
    )
    log = tmp_path / "job.out"
    res = subprocess.run(
        ["sbatch", "--wait", "-o", str(log), str(batch)],
        env=_env(slurm),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    out = log.read_text() if log.exists() else ""
    assert res.returncode == 0, res.stdout + res.stderr + out + slurm.logs()
    roles = re.findall(
        r"^\[worker (\d)\] ROLE rank=(\d) procid=(\d) launch_rank=(\d) threads=(\d+) "
        r"secret=(\d+) on_cmdline=(\d+)$",
        out,
        re.M,
    )
    assert len(roles) == 3, out
    for label, rank, procid, launch_rank, threads, secret, on_cmdline in roles:
        # worker r is Slurm task 1 + S + r and takes rank r
        assert label == rank == launch_rank and int(procid) == 2 + int(rank), out
        assert int(secret) == 64 and on_cmdline == "0", out
        # five processes share this node: cores // 5, at least 1
        assert threads == str(max(1, min(os.cpu_count() or 1, 5) // 5)), out
    sums = re.findall(r"^\[worker \d\] SUM rank=\d \[(.*)\]$", out, re.M)
    assert sums == ["6.0, 6.0, 6.0, 6.0, 6.0"] * 3, out
    # torchrun's variables: the three workers on the allocation's one node, local ranks in
    # task order; the node table carries the group; no MASTER_ADDR
    hostvars = sorted(re.findall(r"^\[worker \d\] HOSTVARS (.*)$", out, re.M))
    assert hostvars == [f"{r} {r} 3 {r} 3 0 0 - 0,0,0" for r in range(3)], out
    others = re.findall(r"^\[worker \d\] OTHER (\w+) (.*)$", out, re.M)
    assert {role for role, _ in others} == {"server", "scheduler"}, out
    assert all(found == "[]" for _, found in others), out


def test_the_example_sbatch_script_runs(slurm, tmp_path):
    log = tmp_path / "linreg.out"
    res = subprocess.run(
        ["sbatch", "--wait", "-o", str(log), str(ROOT / "examples" / "slurm" / "linreg.sbatch")],
        env=_env(slurm),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    out = log.read_text() if log.exists() else ""
    assert res.returncode == 0, res.stdout + res.stderr + out
    assert re.search(r"^\[worker 0\] Worker\[0\] Epoch\[0\] Train-mse=", out, re.M), out


FAIL_SCRIPT = """
import os, sys, subprocess
import hetps.kv
kv = hetps.kv.create('dist_sync')
child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])
print(f'PIDS {os.getpid()} {child.pid}', flush=True)
kv.barrier()
if os.environ.get('MODE') == 'fail' and kv.rank == 0:
    sys.exit(3)
print('READY', flush=True)
kv.node.exited.wait(600)
"""


def test_a_failing_worker_gives_its_code_and_stops_the_step(slurm, tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(FAIL_SCRIPT)
    res = subprocess.run(
        ["salloc", "-n", "4", *_launch("-n", "2", "-s", "1", "--"), PY, str(script)],
        env=_env(slurm, MODE="fail", PS_HEARTBEAT_TIMEOUT="60"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    out = res.stdout + res.stderr
    assert res.returncode == 3, out
    assert re.search(r"^\[launcher\] worker 0 exited \(code 3\); stopping the others$", out, re.M)
    pids = [int(p) for m in re.findall(r"PIDS (\d+) (\d+)", out) for p in m]
    assert len(pids) == 4, out
    assert wait_gone(pids, timeout=15) == [], out


def test_ctrl_c_stops_the_step(slurm, tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(FAIL_SCRIPT)
    env = _env(slurm, MODE="hang")
    alloc = subprocess.run(
        ["salloc", "-n", "4", "--no-shell"], env=env, capture_output=True, text=True, timeout=60
    )
    job = re.search(r"Granted job allocation (\d+)", alloc.stderr + alloc.stdout)
    assert job, alloc.stderr
    job_id = job.group(1)
    try:
        env.update(SLURM_JOB_ID=job_id, SLURM_JOB_NODELIST=slurm_cluster.NODE, SLURM_NTASKS="4")
        proc = subprocess.Popen(
            [*_launch("-n", "2", "-s", "1", "--"), PY, str(script)],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        lines: list[str] = []
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append(line)
                if sum("READY" in x for x in lines) == 2:
                    break
            proc.send_signal(signal.SIGINT)
            rest, _ = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        out = "".join(lines) + rest
        assert proc.returncode == 130, out
        pids = [int(p) for m in re.findall(r"PIDS (\d+) (\d+)", out) for p in m]
        assert len(pids) == 4, out
        assert wait_gone(pids, timeout=15) == [], out
        steps = subprocess.run(
            ["squeue", "-s", "-h", "-j", job_id], env=env, capture_output=True, text=True
        )
        assert f"{job_id}.0" not in steps.stdout, steps.stdout
    finally:
        subprocess.run(["scancel", job_id], env=slurm.env(), timeout=30)


def test_outside_an_allocation_is_one_clear_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PYTHONPATH"] = str(ROOT / "src")
    res = subprocess.run(
        [*_launch("-n", "1", "-s", "1", "--"), "true"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 1
    lines = (res.stdout + res.stderr).strip().splitlines()
    assert len(lines) == 1 and "SLURM_JOB_ID is not set" in lines[0] and "salloc" in lines[0]


def test_without_srun_is_one_clear_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(
        PYTHONPATH=str(ROOT / "src"),
        SLURM_JOB_ID="7",
        SLURM_JOB_NODELIST="n1",
        PATH=str(tmp_path),  # no srun here
    )
    res = subprocess.run(
        [*_launch("-n", "1", "-s", "1", "--"), "true"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 1
    lines = (res.stdout + res.stderr).strip().splitlines()
    assert len(lines) == 1 and "needs srun" in lines[0] and "module load slurm" in lines[0]


def test_the_host_list_parser_agrees_with_scontrol(slurm):
    from hetps.launch.slurm import expand_nodelist

    # (Slurm 22.05's scontrol calls a one-bracket name with a suffix, gpu[1-2]-ib, invalid;
    # the parser reads it anyway)
    for nodelist in ("n[1-3]", "node[08-11,20],gpu[1-2]", "r[1-2]-n[01-02]", "a,b[7],c"):
        res = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist],
            env=slurm.env(),
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert res.returncode == 0 and not res.stderr, res.stderr
        assert expand_nodelist(nodelist) == res.stdout.split(), nodelist


def test_a_taken_scheduler_port_is_one_clear_error(slurm, tmp_path):
    import socket

    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        port = held.getsockname()[1]
        res = subprocess.run(
            [
                "salloc",
                "-n",
                "3",
                *_launch("-n", "1", "-s", "1", "--port", str(port), "--"),
                PY,
                "-c",
                "import hetps.kv; hetps.kv.create('dist_sync')",
            ],
            env=_env(slurm, HETPS_CONNECT_TIMEOUT="3"),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
    out = res.stdout + res.stderr
    assert res.returncode == 1, out
    assert re.search(
        rf"^\[scheduler\] hetps scheduler: cannot listen on port {port} .*--port", out, re.M
    ), out
    assert "[launcher] scheduler exited (code 1)" in out, out
    assert "Traceback" not in out.split("[launcher] scheduler exited")[0], out


@pytest.mark.slow
def test_the_benchmark_runs_inside_an_allocation(slurm, tmp_path):
    """The benchmark runs the example under each launcher; in the default run
    test_linear_regression_example_through_salloc runs it through salloc."""
    out = tmp_path / "bench.json"
    res = subprocess.run(
        [
            "salloc",
            "-n",
            "4",
            PY,
            str(ROOT / "benchmarks" / "slurm_vs_local.py"),
            "--repeats",
            "1",
            "--json",
            str(out),
        ],
        env=_env(slurm),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "slurm/local:" in res.stdout, res.stdout
    import json

    data = json.loads(out.read_text())
    assert data["repeats"] == 1 and data["local_s"] > 0 and data["slurm_s"] > 0
    assert {r["launcher"] for r in data["runs"]} == {"local", "slurm"}
