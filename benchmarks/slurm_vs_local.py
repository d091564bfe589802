"""Wall time of one small job through ``hetps launch --launcher slurm`` against
``--launcher local``: the linear-regression example (2 workers, 1 server, 1 epoch of 2,000
samples), the two launchers alternated run by run (A B A B).

    # inside an allocation of 4 tasks on a Slurm cluster:
    salloc -n 4 .venv/bin/python benchmarks/slurm_vs_local.py [--repeats 5] [--json FILE]
    # on one machine, as root, with Debian's slurm-wlm and munge: a one-node Slurm of its own
    .venv/bin/python benchmarks/slurm_vs_local.py --test-slurm [--repeats 5] [--json FILE]

Each run is the whole ``hetps launch`` command, from start to exit: for Slurm that is one
``srun`` step in the existing allocation (the allocation itself is made once and not timed).
Prints both medians and the ratio slurm / local.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import git_head, machine_info, median, print_table, write_json  # noqa: E402

JOB = ["-n", "2", "-s", "1", "--", sys.executable, str(ROOT / "examples" / "linear_regression.py")]
JOB_ARGS = ["--epochs", "1", "--num-samples", "2000"]


def run_once(launcher: str, env: dict[str, str]) -> float:
    cmd = [sys.executable, "-m", "hetps.cli", "launch", "--launcher", launcher, *JOB, *JOB_ARGS]
    t = time.perf_counter()
    res = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    wall = time.perf_counter() - t
    if res.returncode != 0 or not re.search(r"Worker\[1\] done", res.stdout):
        raise SystemExit(
            f"{launcher} run failed (exit {res.returncode}):\n{res.stdout}{res.stderr}"
        )
    return wall


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    p.add_argument(
        "--test-slurm",
        action="store_true",
        help="bring up a one-node Slurm on this machine (root, slurm-wlm, munge) for the run",
    )
    args = p.parse_args()

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    cluster = job = None
    if args.test_slurm:
        sys.path.insert(0, str(ROOT / "tests"))
        import slurm_cluster

        reason = slurm_cluster.why_not()
        if reason:
            raise SystemExit(f"slurm_vs_local: --test-slurm: {reason}")
        cluster = slurm_cluster.start(Path(tempfile.mkdtemp(prefix="hetps-slurm-")))
        env = cluster.env(env)
    elif not env.get("SLURM_JOB_ID"):
        raise SystemExit(
            "slurm_vs_local: run it inside an allocation (salloc -n 4 python "
            "benchmarks/slurm_vs_local.py) or pass --test-slurm (root, one machine)"
        )
    try:
        if cluster is not None:
            alloc = subprocess.run(
                ["salloc", "-n", "4", "--no-shell"],
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            m = re.search(r"Granted job allocation (\d+)", alloc.stdout + alloc.stderr)
            if m is None:
                raise SystemExit(f"slurm_vs_local: salloc failed: {alloc.stderr}")
            job = m.group(1)
            env.update(SLURM_JOB_ID=job, SLURM_JOB_NODELIST=slurm_cluster.NODE, SLURM_NTASKS="4")
        local_env = {k: v for k, v in env.items() if not k.startswith("SLURM_")}
        runs = []
        for i in range(args.repeats):
            for launcher in ("local", "slurm"):
                wall = run_once(launcher, env if launcher == "slurm" else local_env)
                runs.append({"repeat": i, "launcher": launcher, "wall_s": wall})
                print(f"  {launcher:<6} run {i + 1}: {wall:.2f} s", flush=True)
    finally:
        if cluster is not None:
            if job:
                subprocess.run(["scancel", job], env=env, timeout=30)
            cluster.stop()
    local = median(r["wall_s"] for r in runs if r["launcher"] == "local")
    slurm = median(r["wall_s"] for r in runs if r["launcher"] == "slurm")
    print_table(
        ["launcher", "median wall (s)", "runs"],
        [["local", f"{local:.2f}", args.repeats], ["slurm", f"{slurm:.2f}", args.repeats]],
    )
    print(f"slurm/local: {slurm / local:.2f}")
    if args.json:
        write_json(
            args.json,
            {
                "job": " ".join(
                    ["hetps launch", *JOB[:4], "python examples/linear_regression.py", *JOB_ARGS]
                ),
                "repeats": args.repeats,
                "local_s": local,
                "slurm_s": slurm,
                "ratio": slurm / local,
                "test_slurm": bool(args.test_slurm),
                "runs": runs,
                "commit": git_head(str(ROOT)),
                "machine": machine_info(),
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
