"""`hetps launch --launcher ray` and `hetps.launch.ray.run_job` on a real local Ray cluster.

The module's fixture starts a two-node Ray cluster on this machine (`ray start --head --block`
and `ray start --address=... --block`, each in its own session, with a small object store and
overstated CPUs) and stops it at the end whatever happened: SIGKILL of both process groups
(every Ray process, the actors' worker processes included, is in one of them), then a check
that none is left.
"""

from __future__ import annotations

import importlib.util
import io
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

if importlib.util.find_spec("ray") is None:
    pytest.skip("needs Ray: pip install 'hetps[ray]'", allow_module_level=True)

from hetps.launch.ray import run_job  # noqa: E402 (imports ray only when it runs)
from procs import wait_gone  # noqa: E402

ray = None  # imported by the fixture once the environment has the cluster's token

ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))
PY = sys.executable
ADDRESS_LINE = re.compile(r"ray start --address='([^']+)'")

pytestmark = pytest.mark.timeout(300)


def _group_pids(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(name))
    return pids


class RayNode:
    """One `ray start --block` process (its own session) and its output, read by a thread."""

    def __init__(self, args: list[str], env: dict[str, str], marker: str) -> None:
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.address: str | None = None
        self.proc = subprocess.Popen(
            [RAY, "start", "--block", "--disable-usage-stats", *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self._marker = marker
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for raw in iter(self.proc.stdout.readline, b""):
            line = raw.decode("utf-8", "replace")
            self.lines.append(line)
            m = ADDRESS_LINE.search(line)
            if m and self.address is None:
                self.address = m.group(1)
            if self._marker in line:
                self.ready.set()
        self.ready.set()  # it ended: the waiter looks at the process

    def wait_ready(self, timeout: float = 90.0) -> None:
        assert self.ready.wait(timeout), "ray start said nothing:\n" + "".join(self.lines)
        assert self.proc.poll() is None, "ray start ended:\n" + "".join(self.lines)

    def kill(self) -> list[int]:
        """SIGKILL the whole session's group; returns what is still alive after 20 s."""
        pgid = self.proc.pid
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=20)
        return wait_gone(_group_pids(pgid), timeout=20.0)


@pytest.fixture(scope="module")
def ray_cluster():
    """(head address, head node id, other node id) of a two-node Ray cluster on this machine:
    4 logical CPUs on the head, 2 on the other node; stopped at the end."""
    tmp = tempfile.mkdtemp(prefix="hr", dir="/tmp")  # short: Ray's socket paths are limited
    # Ray's token authentication with a token of this cluster's own, in the environment of
    # the test and of every process it starts (not ~/.ray/auth_token, shared by every job)
    mp = pytest.MonkeyPatch()
    mp.setenv("RAY_AUTH_MODE", "token")
    mp.setenv("RAY_AUTH_TOKEN", secrets.token_hex(32))
    mp.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    mp.delenv("RAY_ADDRESS", raising=False)
    global ray
    was_imported = "ray" in sys.modules
    import ray as ray_module

    ray = ray_module
    if was_imported:  # Ray reads RAY_AUTH_MODE into its config at import: read it again
        ray._raylet.Config.initialize("")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env["RAY_DISABLE_DOCKER_CPU_WARNING"] = "1"
    nodes: list[RayNode] = []
    try:
        head = RayNode(
            [
                "--head",
                "--port",
                "0",
                "--num-cpus",
                "4",
                "--include-dashboard=false",
                "--object-store-memory",
                str(80 << 20),
                "--temp-dir",
                os.path.join(tmp, "t"),
            ],
            env,
            marker="ray start --address=",
        )
        nodes.append(head)
        head.wait_ready()
        assert head.address, "".join(head.lines)
        other = RayNode(
            ["--address", head.address, "--num-cpus", "2", "--object-store-memory", str(80 << 20)],
            env,
            marker="Ray runtime started",
        )
        nodes.append(other)
        other.wait_ready()
        ray.init(address=head.address, logging_level="WARNING")
        try:
            deadline = time.monotonic() + 60
            while len([n for n in ray.nodes() if n["Alive"]]) < 2:
                assert time.monotonic() < deadline, "the second Ray node never joined"
                time.sleep(0.2)
            alive = [n for n in ray.nodes() if n["Alive"]]
            head_id = next(n["NodeID"] for n in alive if "node:__internal_head__" in n["Resources"])
            other_id = next(n["NodeID"] for n in alive if n["NodeID"] != head_id)
        finally:
            ray.shutdown()
        yield head.address, head_id, other_id
    finally:
        left = []
        for node in reversed(nodes):
            left += node.kill()
        shutil.rmtree(tmp, ignore_errors=True)
        mp.undo()
        assert not left, f"Ray processes left after the test: {left}"


def _placement_groups(address: str) -> dict:
    ray.init(address=address, logging_level="WARNING")
    try:
        return ray.util.placement_group_table()
    finally:
        ray.shutdown()


def test_cli_runs_the_linear_regression_example_on_ray(ray_cluster):
    address, *_ = ray_cluster
    res = subprocess.run(
        [
            PY,
            "-m",
            "hetps.cli",
            "launch",
            "--launcher",
            "ray",
            "--ray-address",
            address,
            "-n",
            "2",
            "-s",
            "1",
            "--",
            PY,
            "examples/linear_regression.py",  # relative: the actors run in the driver's cwd
            "--epochs",
            "1",
            "--num-samples",
            "2000",
            "--frequent",
            "5",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    first = {
        w: float(m)
        for w, m in re.findall(
            r"^\[worker \d\] Worker\[(\d)\] Epoch\[0\] Batch \[5\].*mse=([\d.]+)", out, re.M
        )
    }
    final = dict(
        re.findall(r"^\[worker (\d)\] Worker\[\1\] Epoch\[0\] Train-mse=([\d.]+)", out, re.M)
    )
    assert set(first) == {"0", "1"} and set(final) == {"0", "1"}, out
    # one synchronous model: both workers hold the same weights, and it learned
    assert final["0"] == final["1"], out
    assert float(final["0"]) < 0.5 * min(first.values()), out
    assert re.search(r"^\[worker 0\] Worker\[0\] done$", out, re.M), out


PROBE = textwrap.dedent("""
    import os, sys
    secret = os.environ["HETPS_SECRET"]
    on_cmdline = 0
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                on_cmdline += secret.encode() in f.read()
        except OSError:
            pass
    import hetps.kv
    kv = hetps.kv.create("dist_sync")
    print("PROBE", kv.rank, os.environ["HETPS_LAUNCH_RANK"], os.environ["DMLC_NODE_HOST"],
          os.environ["DMLC_PS_ROOT_URI"], len(secret), on_cmdline, os.getcwd(), flush=True)
    host = [os.environ.get(k, "-") for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
            "LOCAL_WORLD_SIZE", "GROUP_RANK", "HETPS_HOST_GROUP", "MASTER_ADDR")]
    table = {n.rank: n.group for n in kv.node.workers()}  # as the scheduler's table says
    print("HOSTVARS", kv.rank, *host, table[0], table[1], flush=True)
    kv.barrier()
""")


def test_run_job_places_the_scheduler_on_the_head_and_spreads_the_rest(ray_cluster, tmp_path):
    address, head_id, other_id = ray_cluster
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    out = io.StringIO()
    result = run_job(
        [PY, str(script)], num_workers=2, num_servers=2, address=address, cwd=str(tmp_path), out=out
    )
    text = out.getvalue()
    assert result.code == 0, text
    assert result.codes == {
        "scheduler": 0,
        "server 0": 0,
        "server 1": 0,
        "worker 0": 0,
        "worker 1": 0,
    }, text
    assert result.nodes["scheduler"]["node_id"] == head_id
    spread = {result.nodes[label]["node_id"] for label in result.nodes if label != "scheduler"}
    assert spread == {head_id, other_id}, result.nodes  # SPREAD: both nodes hold roles
    probes = re.findall(r"^\[worker (\d)\] PROBE (.*)$", text, re.M)
    assert len(probes) == 2, text
    head_ip = result.nodes["scheduler"]["ip"]
    for label_rank, line in probes:
        rank, launch_rank, node_host, root_uri, secret_len, on_cmdline, cwd = line.split()
        assert rank == launch_rank == label_rank  # ranks follow the launch order
        assert node_host == result.nodes[f"worker {rank}"]["ip"] and root_uri == head_ip
        assert secret_len == "64"  # a fresh secret for the job ...
        assert on_cmdline == "0"  # ... on no command line of this machine
        assert cwd == str(tmp_path)
    # torchrun's variables: a worker's host is the Ray node its actor ran on
    hostvars = {int(r): rest.split() for r, rest in re.findall(r"HOSTVARS (\d) (.*)$", text, re.M)}
    assert sorted(hostvars) == [0, 1], text
    node_of = [result.nodes[f"worker {r}"]["node_id"] for r in (0, 1)]
    for r, (rank, world, local, lsize, group, hgroup, master, g0, g1) in hostvars.items():
        assert (rank, world, master) == (str(r), "2", "-"), text
        assert group == hgroup and [g0, g1][r] == group, text  # the scheduler's table agrees
        same = node_of[0] == node_of[1]
        assert lsize == ("2" if same else "1") and local == (str(r) if same else "0"), text
    assert (hostvars[0][4] == hostvars[1][4]) == (node_of[0] == node_of[1]), text
    # the job's placement group is gone
    assert all(pg["state"] == "REMOVED" for pg in _placement_groups(address).values())


def test_a_failing_worker_stops_the_job_with_its_code_and_nothing_is_left(ray_cluster, tmp_path):
    address, *_ = ray_cluster
    script = tmp_path / "fail.py"
    script.write_text(
        textwrap.dedent("""
        import os, subprocess, sys, time
        import hetps.kv
        kv = hetps.kv.create("dist_sync")
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print("PIDS", os.getpid(), child.pid, flush=True)
        kv.barrier()
        if kv.rank == 1:
            sys.exit(3)
        kv.node.exited.wait(600)   # rank 0 waits: it must be stopped, not left running
    """)
    )
    out = io.StringIO()
    result = run_job(
        [PY, str(script)],
        num_workers=2,
        num_servers=1,
        address=address,
        env={"PS_HEARTBEAT_TIMEOUT": "600"},  # rank 0 would wait: the launcher must stop it
        failure_grace=1.0,
        out=out,
    )
    text = out.getvalue()
    assert result.code == 3, text
    assert "[launcher] worker 1 exited (code 3); stopping the others" in text, text
    pids = [int(p) for m in re.findall(r"PIDS (\d+) (\d+)", text) for p in m]
    assert len(pids) == 4, text
    actors = [w["pid"] for w in result.nodes.values()]
    assert wait_gone(pids + actors, timeout=20.0) == [], text
    assert all(pg["state"] == "REMOVED" for pg in _placement_groups(address).values())


def test_ctrl_c_stops_every_process_and_actor(ray_cluster, tmp_path):
    address, *_ = ray_cluster
    script = tmp_path / "wait.py"
    script.write_text(
        textwrap.dedent("""
        import os, subprocess, sys
        import hetps.kv
        kv = hetps.kv.create("dist_sync")
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print("PIDS", os.getpid(), child.pid, os.getppid(), flush=True)
        kv.barrier()
        print("READY", flush=True)
        kv.node.exited.wait(600)
    """)
    )
    proc = subprocess.Popen(
        [PY, "-m", "hetps.cli", "launch", "--launcher", "ray", "--ray-address", address]
        + ["-n", "2", "-s", "1", "--", PY, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while sum("READY" in ln for ln in lines) < 2 and time.monotonic() < deadline:
            line = proc.stdout.readline().decode()
            if not line:
                break
            lines.append(line)
        assert sum("READY" in ln for ln in lines) == 2, "".join(lines)
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
        lines.append(rest.decode())
        assert proc.returncode == 130, "".join(lines)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = "".join(lines)
    assert "[launcher] interrupted: stopping every process" in text, text
    # each worker, its child and its actor's process (the worker's parent through setpriv)
    pids = [int(x) for m in re.findall(r"PIDS (\d+) (\d+) (\d+)", text) for x in m]
    assert len(pids) == 6, text
    assert wait_gone(pids, timeout=20.0) == [], text
    assert all(pg["state"] == "REMOVED" for pg in _placement_groups(address).values())


def test_bad_input_is_one_clear_line(ray_cluster, tmp_path):
    address, *_ = ray_cluster
    base = [PY, "-m", "hetps.cli", "launch", "--launcher", "ray", "--ray-address", address]
    cases = [
        (["-n", "8", "-s", "1"], "the job needs 9 CPUs on the Ray cluster"),
        (["-n", "1", "--colocate"], "--colocate does not combine with --launcher ray"),
        (["-n", "1", "--ray-cpus-per-worker", "0"], "--ray-cpus-per-worker must be > 0"),
    ]
    for flags, message in cases:
        res = subprocess.run(
            [*base, *flags, "--", PY, "-c", "pass"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert res.returncode != 0 and message in res.stderr, (flags, res.stdout, res.stderr)
    res = subprocess.run(
        [*base, "-n", "1", "-s", "1", "--", "no-such-command-hetps"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert res.returncode == 127, res.stdout + res.stderr
    assert "cannot start worker 0" in res.stdout and "no-such-command-hetps" in res.stdout
