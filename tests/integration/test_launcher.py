"""The launcher: prefixes, exit codes, no process left behind, ssh mode, MXNet-style roles."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from procs import alive, wait_gone

ROOT = Path(__file__).resolve().parents[2]


def test_failure_stops_everything_including_grandchildren(cluster):
    code = """
import subprocess
kv = hetps.kv.create('dist_sync')
child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])
print(f'PIDS {os.getpid()} {child.pid} {os.getppid()}', flush=True)
kv.barrier()
if kv.rank == 0:
    sys.exit(3)
kv.node.exited.wait(60)    # rank 1 waits: it must be stopped, not left running
"""
    rc, out = cluster(
        code, workers=2, servers=1, env={"PS_HEARTBEAT_TIMEOUT": "60"}, failure_grace=1.0
    )
    assert rc == 3, out
    pids = [int(x) for m in re.findall(r"PIDS (\d+) (\d+) \d+", out) for x in m]
    assert len(pids) == 4, out
    assert wait_gone(pids) == [], out
    assert re.search(r"^\[worker 0\] PIDS", out, re.M), out


def test_ctrl_c_stops_every_process(tmp_path):
    script = tmp_path / "w.py"
    script.write_text(
        textwrap.dedent("""
        import os, sys, subprocess
        import hetps.kv
        kv = hetps.kv.create('dist_sync')
        child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])
        print(f'PIDS {os.getpid()} {child.pid}', flush=True)
        kv.barrier()
        print('READY', flush=True)
        kv.node.exited.wait(600)
    """)
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hetps.cli",
            "launch",
            "-n",
            "2",
            "-s",
            "1",
            "--",
            sys.executable,
            str(script),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 60
        while sum("READY" in ln for ln in lines) < 2 and time.monotonic() < deadline:
            line = proc.stdout.readline().decode()
            if not line:
                break
            lines.append(line)
        assert sum("READY" in ln for ln in lines) == 2, "".join(lines)
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=30)
        lines.append(rest.decode())
        assert proc.returncode == 130, "".join(lines)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    pids = [int(x) for ln in lines for m in re.findall(r"PIDS (\d+) (\d+)", ln) for x in m]
    assert len(pids) == 4
    assert wait_gone(pids) == [], "".join(lines)


def test_mxnet_style_roles_run_the_same_script(tmp_path):
    """DMLC_ROLE=scheduler|server|worker python train.py: each becomes its role, all exit 0."""
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent("""
        import numpy as np
        import hetps.kv
        kv = hetps.kv.create('dist_sync')     # servers and the scheduler never return from here
        kv.init(0, np.zeros(3, np.float32))
        kv.push(0, np.ones(3, np.float32))
        print('WORKER', kv.rank, kv.pull(0).tolist(), flush=True)
    """)
    )
    port_file = tmp_path / "port"
    base = dict(
        os.environ,
        DMLC_PS_ROOT_URI="127.0.0.1",
        DMLC_NUM_SERVER="1",
        DMLC_NUM_WORKER="2",
        PYTHONUNBUFFERED="1",
    )
    procs = []
    try:
        sched = subprocess.Popen(
            [sys.executable, str(script)],
            start_new_session=True,
            env={
                **base,
                "DMLC_ROLE": "scheduler",
                "DMLC_PS_ROOT_PORT": "0",
                "HETPS_PORT_FILE": str(port_file),
            },
        )
        procs.append(sched)
        deadline = time.monotonic() + 30
        while not port_file.exists():
            assert sched.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        port = port_file.read_text().strip()
        for role in ("server", "worker", "worker"):
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(script)],
                    start_new_session=True,
                    stdout=subprocess.PIPE,
                    env={**base, "DMLC_ROLE": role, "DMLC_PS_ROOT_PORT": port},
                )
            )
        outs = [p.communicate(timeout=60)[0] for p in procs[1:]]
        assert sched.wait(timeout=30) == 0
        assert [p.returncode for p in procs] == [0, 0, 0, 0]
        text = b"".join(o for o in outs if o).decode()
        assert text.count("[2.0, 2.0, 2.0]") == 2, text
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def test_ssh_launcher_places_roles_over_hosts(tmp_path):
    """--launcher ssh with a stand-in ssh that runs the remote command locally."""
    fake = tmp_path / "fake-ssh"
    log = tmp_path / "ssh.log"
    fake.write_text(
        f'#!/bin/sh\n# args: -o X -o Y HOST COMMAND\necho "$5" >> {log}\nexec sh -c "$6"\n'
    )
    fake.chmod(0o755)
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1  # first host runs the scheduler\n127.0.0.1\n")
    script = tmp_path / "w.py"
    script.write_text(
        "import numpy as np, hetps.kv\nkv = hetps.kv.create('dist_sync')\n"
        "kv.init('k', np.ones(2, np.float32))\nkv.barrier()\nprint('SSH-OK', flush=True)\n"
    )
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "hetps.cli",
            "launch",
            "-n",
            "2",
            "-s",
            "2",
            "--launcher",
            "ssh",
            "-H",
            str(hosts),
            "--env",
            "MY_FLAG=1",
            "--",
            sys.executable,
            str(script),
        ],
        env=dict(os.environ, HETPS_SSH=str(fake)),
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("SSH-OK") == 2
    assert log.read_text().split() == ["127.0.0.1"] * 5  # scheduler, 2 servers, 2 workers


def test_bad_arguments_are_explained():
    res = subprocess.run(
        [sys.executable, "-m", "hetps.cli", "launch", "-n", "2"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode != 0 and "give the worker command after --" in res.stderr
    res = subprocess.run(
        [sys.executable, "-m", "hetps.cli", "launch", "-n", "1", "--env", "X", "--", "true"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert "NAME=VALUE" in res.stderr


def test_missing_worker_command_is_reported():
    res = subprocess.run(
        [sys.executable, "-m", "hetps.cli", "launch", "-n", "1", "--", "/nonexistent/trainer"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 127
    assert "cannot start /nonexistent/trainer" in res.stdout


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(x) for x in (task / "children").read_text().split()]
    return out


def test_no_child_outlives_a_killed_launcher(tmp_path):
    """SIGKILL to `hetps launch` (nothing of it can run): the scheduler, the server and the
    workers it started die with it (their parent-death signal), none is left behind."""
    script = tmp_path / "w.py"
    script.write_text(
        textwrap.dedent("""
        import os
        import hetps.kv
        kv = hetps.kv.create('dist_sync')
        kv.barrier()
        print(f'READY {os.getpid()}', flush=True)
        kv.node.exited.wait(600)
    """)
    )
    argv = [sys.executable, "-m", "hetps.cli", "launch", "-n", "2", "-s", "1", "--"]
    proc = subprocess.Popen(
        [*argv, sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    lines: list[str] = []
    children: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while sum("READY" in ln for ln in lines) < 2 and time.monotonic() < deadline:
            line = proc.stdout.readline().decode()
            if not line:
                break
            lines.append(line)
        assert sum("READY" in ln for ln in lines) == 2, "".join(lines)
        children = _children(proc.pid)
        assert len(children) == 4, children  # scheduler, server, 2 workers
        proc.kill()
        proc.wait(10)
        assert wait_gone(children) == [], f"orphans: {[p for p in children if alive(p)]}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in children:  # whatever the outcome, leave nothing behind
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_child_killed_by_a_signal_gives_the_shells_exit_code(cluster):
    """A worker killed by SIGKILL: the launcher exits 137 (128 + 9), as a shell reports it,
    not -9 (which a shell would show as 247)."""
    code = """
kv = hetps.kv.create('dist_sync')
if kv.rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
kv.barrier()
"""
    rc, out = cluster(code, workers=2, servers=1)
    assert rc == 137, (rc, out)
    assert "worker 1 was killed by signal 9 (code 137)" in out, out


def test_max_restarts_starts_the_job_again(tmp_path):
    """Worker 1 fails in the first start only: with --max-restarts 2 the launcher starts the
    whole job again (HETPS_RESTART=1), which succeeds, and returns 0. A job that fails every
    time gives up after the last restart with the failure's code."""
    script = tmp_path / "w.py"
    script.write_text(
        textwrap.dedent("""
        import os, sys
        import numpy as np
        import hetps.kv
        kv = hetps.kv.create('dist_sync')
        kv.init('w', np.zeros(2, np.float32))
        print('START', os.environ['HETPS_RESTART'], kv.rank, flush=True)
        if kv.rank == 1 and (os.environ['HETPS_RESTART'] == '0' or sys.argv[1] == 'always'):
            sys.exit(3)
        kv.barrier()
    """)
    )
    launch = [sys.executable, "-m", "hetps.cli", "launch", "-n", "2", "-s", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PS_HEARTBEAT_TIMEOUT="60")
    res = subprocess.run(
        [*launch, "--max-restarts", "2", "--", sys.executable, str(script), "once"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "restart 1 of 2" in res.stdout and "restart 2 of 2" not in res.stdout, res.stdout
    assert re.search(r"\[worker 1\] START 1 1", res.stdout), res.stdout
    res = subprocess.run(
        [*launch, "--max-restarts", "2", "--", sys.executable, str(script), "always"],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert res.returncode == 3, res.stdout + res.stderr
    assert res.stdout.count("START 2 1") == 1 and "restart 3" not in res.stdout, res.stdout
