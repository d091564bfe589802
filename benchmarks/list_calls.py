"""ms per iteration of list calls: MXNet's linear-regression model's 6 keys, pushed and pulled
as one list each per iteration (2 workers, 1 server, dist_sync, 127.0.0.1).

    PYTHONPATH=src .venv/bin/python benchmarks/list_calls.py [--iters 300] [--runs 3]

Per iteration: ``kv.push(list(range(6)), grads); kv.pull(list(range(6)), out=params)``. Per
run: the median iteration time over the iterations after a warm-up, averaged over the
workers; printed: every run's figure and the median over the runs. Also prints the messages
each worker sent to the servers per iteration.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKER = """
import json, time
import numpy as np
import hetps.kv
SHAPES = [(256, 1), (256,), (64, 256), (64,), (1, 64), (1,)]
kv = hetps.kv.create('dist_sync')
keys = list(range(len(SHAPES)))
kv.init(keys, [np.zeros(s, np.float32) for s in SHAPES])
grads = [np.full(s, kv.rank + 1, np.float32) for s in SHAPES]
params = [np.zeros(s, np.float32) for s in SHAPES]
def sent():
    return sum(s.msgs_sent for p, s in kv.node.van.counters.links.items() if p in kv.server_ids)
times = []
for it in range({warmup} + {iters}):
    if it == {warmup}:
        m0 = sent()
    t0 = time.perf_counter()
    kv.push(keys, grads)
    kv.pull(keys, out=params)
    times.append(time.perf_counter() - t0)
msgs = (sent() - m0) / {iters}
expect = sum(range(1, kv.num_workers + 1))
assert all((p == expect).all() for p in params), [p.ravel()[:2] for p in params]
kv.barrier()
print('RESULT ' + json.dumps({{'rank': kv.rank, 'median_s': float(np.median(times[{warmup}:])),
                              'msgs': msgs}}), flush=True)
"""


def run_once(iters: int, warmup: int, env: dict[str, str]) -> tuple[float, float]:
    from hetps.launch.contract import LaunchSpec
    from hetps.launch.local import Launcher

    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "w.py")
        with open(script, "w") as f:
            f.write(textwrap.dedent(WORKER.format(iters=iters, warmup=warmup)))
        out = io.StringIO()
        spec = LaunchSpec(
            num_workers=2,
            num_servers=1,
            command=[sys.executable, script],
            env={"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", **env},
        )
        launcher = Launcher(spec, out=out)
        try:
            rc = launcher.run()
        finally:
            launcher.stop_all()
        text = out.getvalue()
        if rc != 0:
            raise SystemExit(f"run failed (rc {rc}):\n{text[-3000:]}")
        res = [
            json.loads(line.split("RESULT ", 1)[1])
            for line in text.splitlines()
            if "RESULT " in line
        ]
        return statistics.mean(r["median_s"] for r in res), statistics.mean(r["msgs"] for r in res)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--runs", type=int, default=3)
    a = p.parse_args()
    figs, msgs = [], 0.0
    for _ in range(a.runs):
        t, msgs = run_once(a.iters, a.warmup, {})
        figs.append(t * 1e3)
        print(f"run: {t * 1e3:.3f} ms/iteration, {msgs:.1f} messages to the servers per iteration")
    print(f"median over {a.runs} runs: {statistics.median(figs):.3f} ms/iteration")
    return 0


if __name__ == "__main__":
    sys.exit(main())
