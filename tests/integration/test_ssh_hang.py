"""``hetps launch --launcher ssh``: when the job ends, every remote process ends, not only the
ssh clients. The ssh here is a stand-in that behaves as ssh and sshd do without a terminal:
the remote command runs in a session of its own with its standard streams relayed over the
"connection" (pipes), so killing the client leaves it running, as on a real host."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

from procs import wait_gone

FAKE_SSH = f"""#!{sys.executable}
# args: -o X -o Y HOST COMMAND: COMMAND runs in a session of its own (as sshd starts it),
# its streams relayed; this client's death closes them, and tells it nothing else
import os, subprocess, sys, threading
child = subprocess.Popen(["sh", "-c", sys.argv[-1]], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         start_new_session=True)
def feed():
    try:
        for chunk in iter(lambda: os.read(0, 65536), b""):
            child.stdin.write(chunk)
            child.stdin.flush()
        child.stdin.close()
    except OSError:
        pass
threading.Thread(target=feed, daemon=True).start()
for chunk in iter(lambda: os.read(child.stdout.fileno(), 65536), b""):
    os.write(1, chunk)
sys.exit(child.wait())
"""

# The worker stops the server with SIGSTOP and pushes: the scheduler declares the server
# dead (no copies: the job fails), and the launcher stops its ssh clients.
JOB = """
import os, signal, time
import numpy as np
import hetps.kv

def server_pid():
    port = os.environ["DMLC_PS_ROOT_PORT"]
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            env = open(f"/proc/{name}/environ", "rb").read().split(b"\\0")
            cmd = open(f"/proc/{name}/cmdline", "rb").read().split(b"\\0")
        except OSError:
            continue
        if (b"hetps.cli" in cmd and b"server" in cmd and b"hetps.launch.guard" not in cmd
                and b"DMLC_ROLE=server" in env and f"DMLC_PS_ROOT_PORT={port}".encode() in env):
            return int(name)
    raise SystemExit("no server process")

kv = hetps.kv.create("dist_sync")
kv.init("w", np.zeros(16, np.float32))
kv.push("w", np.ones(16, np.float32))
assert (kv.pull("w") == 1).all()
pid = server_pid()
print(f"PIDS {os.getpid()} {os.getppid()} {pid}", flush=True)
os.kill(pid, signal.SIGSTOP)
while open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T":
    time.sleep(0.01)  # polls the kernel until the stop took (it is not at once)
kv.push("w", np.ones(16, np.float32))
kv.pull("w")
print("NOT FAILED", flush=True)
"""


def test_the_remote_processes_end_with_the_job_a_stopped_one_too(tmp_path):
    fake = tmp_path / "fake-ssh"
    fake.write_text(FAKE_SSH)
    fake.chmod(0o755)
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1\n")
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "HETPS_", "PS_"))}
    env.update(HETPS_SSH=str(fake), PS_HEARTBEAT_INTERVAL="0.5", PS_HEARTBEAT_TIMEOUT="3")
    argv = [sys.executable, "-m", "hetps.cli", "launch", "-n", "1", "-s", "1"]
    argv += ["--launcher", "ssh", "-H", str(hosts), "--", sys.executable, str(script)]
    log = tmp_path / "launch.out"
    with open(log, "wb") as sink:
        proc = subprocess.Popen(
            argv, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = proc.wait(timeout=90)
        except subprocess.TimeoutExpired:  # (the launcher kept the hung job: fails below)
            os.killpg(proc.pid, 9)
            code = proc.wait()
    out = log.read_text()
    found = re.search(r"PIDS (\d+) (\d+) (\d+)", out)
    assert found, out
    pids = [int(p) for p in found.groups()]
    # the worker, its guard and the stopped server: nothing outlives the job
    left = wait_gone(pids, timeout=15)
    for pid in left:  # (the test's leftovers go, whatever it finds)
        os.kill(pid, 9)
    assert code not in (0, -9) and "NOT FAILED" not in out, (code, out)
    assert re.search(r"server rank 0 \(node 8.*stopped answering heartbeats", out), out
    assert left == [], out
