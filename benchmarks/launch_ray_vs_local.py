"""Wall time of one small job through `hetps launch --launcher ray` against `--launcher local`.

    .venv/bin/python benchmarks/launch_ray_vs_local.py [--repeats 5] [--json FILE]

The job is MXNet's linear-regression example, small (2 workers, 1 server,
``examples/linear_regression.py --epochs 1 --num-samples 2000``), so what differs is the
launcher: starting the roles, wiring them, streaming their output and cleaning up. Variants,
alternated run by run (A B C A B C ...), each timed from the command's start to its exit:

* ``local``: ``hetps launch --launcher local`` (processes on this machine);
* ``ray``: ``hetps launch --launcher ray --ray-address ADDR`` on a Ray cluster that is already
  up (started once by this script with ``ray start --head``, as a user's cluster would be):
  the driver connects, places a placement group and one actor per role, and each actor starts
  its role's process;
* ``ray-fresh``: ``hetps launch --launcher ray`` with no cluster: a local Ray is started for
  the job and stopped after it (Ray's own start-up included).

Ray runs with token authentication and a token of this run's own (``RAY_AUTH_TOKEN``), so
nothing is written to ``~/.ray``. The Ray cluster is killed at the end (its process group),
whatever happens. Prints the median, min and max of each variant and its ratio to ``local``.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt, git_head, machine_info, median, print_table, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
RAY = str(Path(PY).with_name("ray"))
JOB = [PY, "examples/linear_regression.py", "--epochs", "1", "--num-samples", "2000"]


def start_ray(tmp: str, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """``ray start --head --block`` in its own session; (process, address)."""
    proc = subprocess.Popen(
        [RAY, "start", "--head", "--block", "--disable-usage-stats", "--port", "0"]
        + ["--num-cpus", "4", "--include-dashboard=false", "--object-store-memory", str(80 << 20)]
        + ["--temp-dir", os.path.join(tmp, "t")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    seen = []
    for raw in iter(proc.stdout.readline, b""):
        line = raw.decode("utf-8", "replace")
        seen.append(line)
        m = re.search(r"ray start --address='([^']+)'", line)
        if m:
            # keep reading its output (a full pipe would block it) in the background
            drain = subprocess.Popen(["cat"], stdin=proc.stdout, stdout=subprocess.DEVNULL)
            proc._drain = drain  # type: ignore[attr-defined]
            return proc, m.group(1)
    raise SystemExit("ray start failed:\n" + "".join(seen))


def stop_ray(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)
    drain = getattr(proc, "_drain", None)
    if drain is not None:
        drain.wait(timeout=30)


def run_once(argv: list[str], env: dict[str, str]) -> float:
    t = time.perf_counter()
    res = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t
    out = res.stdout + res.stderr
    if res.returncode != 0 or out.count("Train-mse=") != 2:
        raise SystemExit(f"the job failed ({res.returncode}): {argv}\n{out}")
    return wall


HEADERS = ["launcher", "median s", "min s", "max s", "x local", "paired x local"]


def table(times: dict[str, list[float]]) -> list[list[str]]:
    """Rows: median, min, max, the ratio of medians to ``local`` and the median of the
    per-repeat ratios (each run against ``local`` of the same repeat: steadier on a busy
    machine)."""
    local = times.get("local", [])
    base = median(local)
    rows = []
    for v, ts in times.items():
        med = median(ts)
        ratio = med / base if base and med else None
        paired = median(t / b for t, b in zip(ts, local, strict=False)) if local else None
        rows.append([v, *(fmt(x, ".2f") for x in (med, min(ts), max(ts), ratio, paired))])
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--variants",
        nargs="+",
        default=["local", "ray", "ray-fresh"],
        choices=["local", "ray", "ray-fresh"],
    )
    p.add_argument("--json", default=None, help="write every figure here")
    args = p.parse_args()

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    env.pop("RAY_AUTH_TOKEN_PATH", None)
    env.pop("RAY_ADDRESS", None)
    launch = [PY, "-m", "hetps.cli", "launch", "-n", "2", "-s", "1"]
    tmp = tempfile.mkdtemp(prefix="hb", dir="/tmp")
    head = None
    times: dict[str, list[float]] = {v: [] for v in args.variants}
    try:
        argvs = {}
        if "ray" in args.variants:
            head, address = start_ray(tmp, env)
            argvs["ray"] = [*launch, "--launcher", "ray", "--ray-address", address, "--", *JOB]
        argvs["local"] = [*launch, "--launcher", "local", "--", *JOB]
        argvs["ray-fresh"] = [*launch, "--launcher", "ray", "--", *JOB]
        for v in args.variants:  # warm-up: imports and page cache
            run_once(argvs[v], env)
        for r in range(args.repeats):
            for v in args.variants:
                times[v].append(run_once(argvs[v], env))
                print(f"repeat {r + 1}/{args.repeats} {v}: {times[v][-1]:.2f} s", flush=True)
    finally:
        if head is not None:
            stop_ray(head)
        shutil.rmtree(tmp, ignore_errors=True)

    print()
    print_table(HEADERS, table(times))
    if args.json:
        write_json(
            args.json,
            {
                "machine": machine_info(),
                "commit": git_head(str(ROOT)),
                "job": JOB,
                "repeats": args.repeats,
                "seconds": times,
            },
        )


if __name__ == "__main__":
    main()
