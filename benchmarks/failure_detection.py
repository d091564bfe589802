"""How long a job takes to notice a dead node: with the launcher's notice against heartbeats only.

    .venv/bin/python benchmarks/failure_detection.py [--trials 5] [--roles worker server]
                                                     [--json FILE]

Each trial starts a real cluster (``hetps launch`` in this process: 1 scheduler, 1 server,
2 workers on 127.0.0.1). When both workers are in a loop of barriers, this script kills one
process with SIGKILL (worker 1 or the server) and notes the time. The surviving worker prints
the moment its store raises the failure; detection is that moment minus the kill.

The two variants alternate trial by trial (A B A B):

* ``notice``: ``hetps launch`` as it ships: the launcher sees the child die and tells the
  scheduler on the scheduler's stdin, which declares the node dead at once.
* ``heartbeat``: the same cluster with the notices off (the scheduler started without
  ``--launcher-notices``): only the heartbeat timeout finds the dead node.

Both use the default heartbeats (``PS_HEARTBEAT_INTERVAL`` 1 s, ``PS_HEARTBEAT_TIMEOUT``
10 s) unless set in the environment. Prints medians per role and variant, and the ratio.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import signal
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import git_head, median  # noqa: E402

WORKER = """
import os, sys, time
import numpy as np
import hetps.kv
from hetps.cluster.errors import ClusterError
kv = hetps.kv.create('dist_sync')
kv.init('w', np.zeros(4, np.float32))
kv.barrier()
print(f'READY {kv.rank} {os.getpid()}', flush=True)
try:
    while True:
        kv.barrier()
except ClusterError as exc:
    print(f'DETECTED {kv.rank} {time.time():.6f}', flush=True)
    sys.exit(5)
"""


class _Out(io.TextIOBase):
    """The launcher's output: kept, and READY lines signalled as they arrive."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.ready: dict[int, int] = {}
        self.both = threading.Event()
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            for line in text.splitlines():
                self.lines.append(line)
                m = re.search(r"READY (\d+) (\d+)", line)
                if m:
                    self.ready[int(m.group(1))] = int(m.group(2))
                    if len(self.ready) == 2:
                        self.both.set()
        return len(text)


def trial(script: Path, variant: str, role: str) -> float | None:
    """One cluster, one kill; the seconds from the kill to the survivor's error."""
    from hetps.launch.contract import LaunchSpec
    from hetps.launch.local import Launcher

    spec = LaunchSpec(
        num_workers=2,
        num_servers=1,
        command=[sys.executable, str(script)],
        env={"OMP_NUM_THREADS": "1"},
        failure_grace=30.0,
    )
    if variant == "heartbeat":
        spec.scheduler_command = [sys.executable, "-m", "hetps.cli", "scheduler"]
    out = _Out()
    launcher = Launcher(spec, out=out)
    runner = threading.Thread(target=launcher.run, daemon=True)
    runner.start()
    try:
        if not out.both.wait(60):
            raise RuntimeError("the cluster did not start:\n" + "\n".join(out.lines[-20:]))
        if role == "worker":
            victim = out.ready[1]
        else:
            (server,) = [c for c in launcher.children if c.role == "server"]
            victim = server.proc.pid
        killed = time.time()
        os.kill(victim, signal.SIGKILL)
        runner.join(90)
    finally:
        launcher.stop_all()
        runner.join(30)
    seen = [float(m.group(1)) for x in out.lines if (m := re.search(r"DETECTED 0 ([\d.]+)", x))]
    return seen[0] - killed if seen else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=5, help="trials per role and variant")
    ap.add_argument(
        "--roles", nargs="+", default=["worker", "server"], choices=["worker", "server"]
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    results: dict[str, dict[str, list[float | None]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "worker.py"
        script.write_text(textwrap.dedent(WORKER))
        for role in args.roles:
            results[role] = {"notice": [], "heartbeat": []}
            for i in range(args.trials):
                for variant in ("notice", "heartbeat"):
                    d = trial(script, variant, role)
                    results[role][variant].append(d)
                    shown = f"{d:.3f} s" if d is not None else "not detected"
                    print(f"{role:6s} trial {i + 1} {variant:9s}: {shown}", flush=True)
    print()
    print(f"{'killed':8s} {'notice (median)':>16s} {'heartbeat (median)':>19s} {'ratio':>7s}")
    summary = {}
    for role, by in results.items():
        n = median(x for x in by["notice"] if x is not None)
        h = median(x for x in by["heartbeat"] if x is not None)
        ratio = h / n if n and h else None
        summary[role] = {"notice_s": n, "heartbeat_s": h, "heartbeat_over_notice": ratio}
        print(
            f"{role:8s} {n if n is not None else float('nan'):15.3f}s "
            f"{h if h is not None else float('nan'):18.3f}s "
            f"{ratio if ratio is not None else float('nan'):6.1f}x"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "commit": git_head(str(ROOT)),
                    "heartbeat_interval": os.environ.get("PS_HEARTBEAT_INTERVAL", "default"),
                    "heartbeat_timeout": os.environ.get("PS_HEARTBEAT_TIMEOUT", "default"),
                    "trials": results,
                    "summary": summary,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
