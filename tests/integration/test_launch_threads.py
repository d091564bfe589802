"""Threads that fit the machine: what OMP_NUM_THREADS each process `hetps launch` starts gets.

Unless the user sets OMP_NUM_THREADS (then every process gets it unchanged), a worker gets
cores // processes on its host (at least 1), a server and the scheduler 1.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

from hetps.launch.contract import thread_share, usable_cores
from hetps.launch.wrappers import processes_per_host, ssh_wrapper

THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")

#: every worker of the job: join, then print what it and its scheduler and servers were given
PROBE = textwrap.dedent("""
    import os, torch
    import hetps.kv
    kv = hetps.kv.create('dist_sync')
    kv.barrier()
    me = os.environ.get('HETPS_SECRET')
    for pid in os.listdir('/proc'):
        if not pid.isdigit():
            continue
        try:
            raw = open(f'/proc/{pid}/environ', 'rb').read()
        except OSError:
            continue
        env = dict(i.decode().split('=', 1) for i in raw.split(b'\\0') if b'=' in i)
        if env.get('HETPS_SECRET') == me and env.get('DMLC_ROLE') in ('server', 'scheduler'):
            print('THREADS', env['DMLC_ROLE'], env.get('OMP_NUM_THREADS', '-'), flush=True)
    print('THREADS worker', os.environ.get('OMP_NUM_THREADS', '-'),
          'torch', torch.get_num_threads(), flush=True)
    kv.barrier()
""")


def _launch(extra_env: dict[str, str]) -> dict[str, set[str]]:
    """`hetps launch -n 2 -s 1 -- python -c PROBE`; the values each role reported."""
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}  # conftest sets one
    env.update(extra_env)
    res = subprocess.run(
        [sys.executable, "-m", "hetps.cli", "launch", "-n", "2", "-s", "1", "--"]
        + [sys.executable, "-c", PROBE],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    seen: dict[str, set[str]] = {}
    for role, value in re.findall(r"THREADS (\w+) (.+)$", res.stdout, re.M):
        seen.setdefault(role, set()).add(value.strip())
    return seen


def test_launch_gives_each_role_its_share_of_the_cores():
    share = max(1, usable_cores() // 4)  # 1 scheduler + 1 server + 2 workers on this host
    assert _launch({}) == {
        "scheduler": {"1"},
        "server": {"1"},
        "worker": {f"{share} torch {share}"},  # torch follows it: one pool size per process
    }


def test_launch_keeps_the_users_omp_num_threads():
    # 2, not the share (1 for a server, and for a worker below 8 cores); torch takes no more
    # threads than the machine has cores
    torch_threads = min(2, usable_cores())
    assert _launch({"OMP_NUM_THREADS": "2"}) == {
        "scheduler": {"2"},
        "server": {"2"},
        "worker": {f"2 torch {torch_threads}"},
    }


@pytest.mark.parametrize(
    ("cores", "processes", "worker"),
    [(2, 4, 1), (16, 4, 4), (16, 5, 3), (64, 3, 21), (1, 1, 1), (8, 20, 1)],
)
def test_thread_share(cores, processes, worker):
    assert thread_share("worker", cores, processes) == worker
    assert thread_share("server", cores, processes) == 1
    assert thread_share("scheduler", cores, processes) == 1


def test_processes_per_host_follows_the_ssh_placement():
    # scheduler on a; servers 0,1,2 on a,b,a; workers 0..3 on a,b,a,b
    assert processes_per_host(["a", "b"], 4, 3) == {"a": 5, "b": 3}
    # a host named twice is one machine
    assert processes_per_host(["a", "a"], 2, 2) == {"a": 5}


@pytest.mark.parametrize(("nproc", "worker"), [(16, 3), (4, 1), (40, 8)])
def test_ssh_roles_take_their_share_of_the_remote_host(tmp_path, nproc, worker):
    """The remote shell counts the host's cores (nproc) and divides by its processes."""
    fake = tmp_path / "nproc"
    fake.write_text(f"#!/bin/sh\necho {nproc}\n")
    fake.chmod(0o755)
    show = [sys.executable, "-c", "import os; print(os.environ['OMP_NUM_THREADS'])"]

    def remote(wrap, role, rank, env):
        argv = wrap(role, rank, show, env)[0]
        line = argv[-1]  # what ssh hands the remote shell
        out = subprocess.run(
            ["sh", "-c", line],
            env={**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"},
            input=f"{'x' * 64}\n",  # the secret, as the launcher writes it
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    base = {"HETPS_SECRET": "x" * 64, "OMP_NUM_THREADS": "99"}  # 99: the local share
    wrap = ssh_wrapper(["a", "b"], num_workers=4, num_servers=3, auto_threads=True)
    # host a holds 5 processes, host b 3
    assert remote(wrap, "worker", 0, base) == str(max(1, nproc // 5))
    assert remote(wrap, "worker", 1, base) == str(max(1, nproc // 3))
    assert remote(wrap, "server", 1, base) == "1"
    assert remote(wrap, "scheduler", 0, base) == "1"
    assert max(1, nproc // 5) == worker
    # the user's own value reaches every host unchanged
    wrap = ssh_wrapper(["a", "b"], num_workers=4, num_servers=3, auto_threads=False)
    assert remote(wrap, "worker", 0, {**base, "OMP_NUM_THREADS": "7"}) == "7"


def test_train_leaves_threads_to_the_launcher(monkeypatch):
    """`hetps train --workers W` starts its cluster through the same launcher rule: it adds
    no OMP_NUM_THREADS of its own (the user's reaches the workers through the environment)."""
    import hetps.launch.local as local
    from hetps.app.train import launch_cluster
    from hetps.cli import build_parser

    seen = {}

    def fake_run_cluster(spec, **kw):
        seen["env"] = dict(spec.env)
        return 0

    monkeypatch.setattr(local, "run_cluster", fake_run_cluster)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    args = build_parser().parse_args(["train", "--workers", "2", "--servers", "1"])
    assert launch_cluster(args) == 0
    assert "OMP_NUM_THREADS" not in seen["env"]
