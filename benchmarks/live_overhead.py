"""The cost of live metrics: a small push/pull loop with the scheduler's endpoint off and on.

    .venv/bin/python benchmarks/live_overhead.py [--repeats 5] [--rounds 2000] [--json FILE]

Each run is ``hetps launch -n 1 -s 1`` (1 worker, 1 server, ``dist_async``, so every push and
every pull is a request of its own, each timed by the worker's meter when metrics are on) of a
script that pushes a 1,000-float key and pulls it into a preallocated array, ``--rounds`` times
after a warm-up, and prints the median of its per-round times. Variants, alternated run by run
(A B C A B C ...):

* ``off``: no ``--metrics-port`` (the worker has no meter: one ``is None`` test per request);
* ``on``: ``--metrics-port 0``, reports every second (``HETPS_METRICS_INTERVAL=1``, the default);
* ``on-fast``: ``--metrics-port 0`` and a report every 0.05 s (twenty times the default rate).

Prints each variant's median over ``--repeats`` runs of the per-run medians and its ratio to
``off``. No test asserts on these numbers.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PINNED_THREADS, git_head, machine_info, median, print_table, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import statistics, sys, time
import numpy as np
import hetps.kv
from hetps import optim
kv = hetps.kv.create('dist_async')
a = np.ones(1000, np.float32)
kv.init('k', a)
kv.set_optimizer(optim.SGD(learning_rate=0.0))
rounds = int(sys.argv[1])
times = []
for i in range(rounds + 200):
    t = time.perf_counter()
    kv.push('k', a)
    kv.pull('k', out=a)
    if i >= 200:
        times.append(time.perf_counter() - t)
print(f'ROUND {statistics.median(times):.9f} METER {kv.meter is not None}', flush=True)
kv.close()
"""

VARIANTS = {
    "off": ([], {}),
    "on": (["--metrics-port", "0"], {"HETPS_METRICS_INTERVAL": "1"}),
    "on-fast": (["--metrics-port", "0"], {"HETPS_METRICS_INTERVAL": "0.05"}),
}


def run(variant: str, rounds: int, timeout: float) -> float:
    flags, extra = VARIANTS[variant]
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "loop.py"
        script.write_text(textwrap.dedent(SCRIPT))
        env = {**os.environ, **PINNED_THREADS, **extra}
        env.pop("HETPS_METRICS_PORT", None)
        out = subprocess.run(
            [sys.executable, "-m", "hetps.cli", "launch", "-n", "1", "-s", "1", *flags, "--",
             sys.executable, str(script), str(rounds)],
            capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env,
        )  # fmt: skip
    match = re.search(r"ROUND ([0-9.]+) METER (\w+)", out.stdout + out.stderr)
    if out.returncode != 0 or match is None:
        raise SystemExit(
            f"{variant}: run failed (exit {out.returncode}):\n{out.stdout}{out.stderr}"
        )
    metered = match.group(2) == "True"
    if metered != (variant != "off"):
        raise SystemExit(f"{variant}: the worker's meter is {'on' if metered else 'off'}")
    return float(match.group(1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2000)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(args.repeats):
        for v in VARIANTS:
            times[v].append(run(v, args.rounds, args.timeout))
    base = median(times["off"])
    rows = []
    for v, ts in times.items():
        m = median(ts)
        rows.append(
            [v, f"{1e6 * m:.1f}", f"{m / base:.3f}", " ".join(f"{1e6 * t:.0f}" for t in ts)]
        )
    print_table(["variant", "median round µs", "ratio to off", "per-run medians µs"], rows)
    print(f"commit {git_head(str(ROOT))}, {args.repeats} repeats x {args.rounds} rounds")
    if args.json:
        write_json(
            args.json,
            {
                "commit": git_head(str(ROOT)),
                "machine": machine_info(),
                "rounds": args.rounds,
                "seconds": times,
                "median": {v: median(ts) for v, ts in times.items()},
            },
        )


if __name__ == "__main__":
    main()
