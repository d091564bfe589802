"""HETPS_KEEP_BUFFERS (transport/heap.py): a node keeps the memory of the message buffers it
freed, so a big array's frames do not fault their pages in again every round. Measured on a
real launched job: the server's minor page faults while its rounds run, read from /proc."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from conftest import ROOT

# the server of this job (its scheduler's port tells it from other tests' servers) and its
# minor page faults; 16 MiB per push over TCP (HETPS_SHM_BYTES=0), secured
CODE = """
import glob
port = os.environ["DMLC_PS_ROOT_PORT"].encode()

def server():
    for path in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            if b"hetps.cli\\x00server" not in open(path, "rb").read():
                continue
            env = open(path[:-7] + "environ", "rb").read().split(b"\\x00")
        except OSError:
            continue
        if b"DMLC_PS_ROOT_PORT=" + port in env:
            return path[:-7], env
    raise SystemExit("no server of this job in /proc")

where, env = server()
print("MALLOC_ENV", [e.decode() for e in env if e.startswith(b"MALLOC_")], flush=True)

def faults():
    return int(open(where + "stat").read().rsplit(")", 1)[1].split()[7])

kv = hetps.kv.create("dist_sync")
n = 4 << 20
kv.init(0, np.zeros(n, np.float32))
g = np.ones(n, np.float32)
out = np.empty(n, np.float32)
for r in range(5):  # (the buffers are made)
    kv.push(0, g); kv.pull(0, out=out)
f0 = faults()
for r in range(20):
    kv.push(0, g); kv.pull(0, out=out)
assert (out == kv.num_workers).all()
print("SERVER_FAULTS", faults() - f0, flush=True)
"""


def _faults(out: str) -> int:
    line = next(ln for ln in out.splitlines() if "SERVER_FAULTS" in ln)
    return int(line.rsplit(" ", 1)[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux)")
def test_a_server_keeps_its_message_buffers(tmp_path, cluster):
    """20 rounds of 16 MiB pushes and pulls: the server faults in fewer pages than one push
    holds (4,096), where a buffer mapped afresh for every frame faults 4,096 per push. The
    launcher sets no MALLOC_* variable of its own on the server."""
    code, out = cluster(CODE, workers=1, servers=1, env={"HETPS_SHM_BYTES": "0"})
    assert code == 0, out
    assert "MALLOC_ENV []" in out, out
    assert _faults(out) < 4096, out


def test_the_users_own_malloc_variables_are_left_alone():
    """A process whose environment sets glibc's malloc keeps it: keep_buffers changes
    nothing and says so; without them (on glibc) it sets it, once."""
    probe = (
        "from hetps.config.node import user_malloc; from hetps.transport import heap; "
        "u = user_malloc(); print(heap.keep_buffers(u), heap.keep_buffers(u))"
    )
    run = lambda env: subprocess.run(  # noqa: E731
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "src"), **env},
        timeout=60,
        check=True,
    ).stdout.split()
    assert run({"MALLOC_TRIM_THRESHOLD_": "1000000"}) == ["False", "False"]
    # (any of glibc's MALLOC_* variables, as HETPS_KEEP_BUFFERS says: one that caps the
    # arenas is set to keep memory down, which this would undo)
    assert run({"MALLOC_ARENA_MAX": "2"}) == ["False", "False"]
    assert run({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1000000"}) == ["False", "False"]
    if platform.libc_ver()[0] == "glibc":  # (musl and others: nothing to set)
        assert run({}) == ["True", "True"]
