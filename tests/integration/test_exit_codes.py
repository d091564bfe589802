"""A worker's script that ends with ``raise SystemExit(N)`` written out (not ``sys.exit``)
fails the job with N, naming that worker, as ``sys.exit(N)`` does."""

from __future__ import annotations

import subprocess
import sys


def test_raise_system_exit_3_in_a_worker_fails_the_job_with_code_3(cluster):
    """Worker 1 raises SystemExit(3) mid-job: the launcher returns 3 and names worker 1, and
    the other worker, healthy, is told why instead of being blamed for the rounds left."""
    code = """
kv = hetps.kv.create('dist_sync')
kv.init('w', np.zeros(10, np.float32))
for r in range(20):
    if kv.rank == 1 and r == 5:
        raise SystemExit(3)
    try:
        kv.push('w', np.ones(10, np.float32))
        kv.pull('w')
    except (NodeFailure, RequestError) as exc:
        print(f'SURVIVOR {type(exc).__name__} {exc}', flush=True)
        os._exit(1)
"""
    rc, out = cluster(code, workers=2, servers=1, env={"PS_HEARTBEAT_TIMEOUT": "60"})
    assert rc == 3, out
    assert "[launcher] worker 1 exited (code 3); stopping the others" in out, out
    assert "[launcher] worker 0 exited" not in out, out
    (line,) = [x for x in out.splitlines() if "SURVIVOR" in x]
    assert "NodeFailure" in line and "worker rank 1" in line, out
    assert "exited with code 3" in line and "already finished" not in line, out


EXITS = """
import atexit, sys
from hetps.kvstore import exits
exits.watch()
atexit.register(lambda: print("FAILING", exits.failing()))
how = sys.argv[1]
if how == "caught":
    try:
        raise SystemExit(4)
    except SystemExit as e:
        assert e.code == 4
elif how == "code":
    raise SystemExit(3)
elif how == "message":
    raise SystemExit("no data")
"""


def test_the_exit_hook_reads_a_system_exit_raised_by_name(tmp_path):
    script = tmp_path / "exits.py"
    script.write_text(EXITS)
    want = {
        "caught": (0, "FAILING None"),
        "code": (3, "FAILING the script exited with code 3 (sys.exit)"),
        "message": (1, "FAILING the script exited with an error (sys.exit): no data"),
    }
    for how, (rc, line) in want.items():
        res = subprocess.run(
            [sys.executable, str(script), how], capture_output=True, text=True, timeout=60
        )
        assert (res.returncode, res.stdout.strip()) == (rc, line), (how, res.stdout, res.stderr)
