"""Live metrics of real jobs, read by the job's own worker from the scheduler's endpoint once
every worker has reported its rounds: in dist_sync, pulls answered by the push before them
(no request of their own) are timed as pulls."""

from __future__ import annotations

import socket

import pytest

pytest.importorskip("prometheus_client")


def _free_port() -> int:
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return sk.getsockname()[1]


READER = """
import json, time, urllib.request
from hetps.metrics.top import parse

def metrics_when(port, ready, what, timeout=30.0):
    deadline = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            s = parse(r.read().decode())
        if ready(s):
            return s
        assert time.monotonic() < deadline, f"{what}: not seen; last scrape {s.samples}"
        time.sleep(0.05)  # between scrapes (the condition is what is waited for)
"""


def test_pulls_that_ride_in_push_answers_count_as_pulls(cluster):
    port = _free_port()
    rounds = 12
    code, out = cluster(
        READER
        + f"""
import numpy as np
kv = hetps.kv.create("dist_sync")
kv.init("w", np.zeros(1000, np.float32))
out = np.empty(1000, np.float32)
for r in range({rounds}):
    kv.push("w", np.ones(1000, np.float32))
    kv.pull("w", out=out)
    assert out[0] == 2
kv.meter.flush()
kv.barrier()
if kv.rank == 0:
    s = metrics_when(
        {port},
        lambda s: all(s.value("hetps_worker_rounds_total", worker=str(w)) == {rounds}
                      and s.value("hetps_pull_latency_seconds_count", worker=str(w)) >= 1
                      for w in (0, 1)),
        "both workers' reports",
    )
    for w in ("0", "1"):
        n = s.value("hetps_pull_latency_seconds_count", worker=w)
        total = s.value("hetps_pull_latency_seconds_sum", worker=w)
        print(f"pulls {{w}} {{n:g}} {{total:.6f}}", flush=True)
kv.barrier()
""",
        env={"HETPS_METRICS_PORT": str(port), "HETPS_METRICS_INTERVAL": "0.1"},
    )
    assert code == 0, out
    import re

    got = re.findall(r"pulls (\d) (\d+) ([\d.]+)", out)
    assert sorted(w for w, _, _ in got) == ["0", "1"], out
    for _, n, total in got:
        assert int(n) == rounds, out  # every pull, fused into its push's answer or not
        assert 0 < float(total) < 60
