"""benchmarks/chaos.py --hosts: real jobs on 2 hosts of 2 workers, one SIGKILL each (a worker
without and with --elastic, a server with --replicas 2) and one SIGSTOP each (a worker
without and with --elastic), every trial as expected: the job without --elastic fails fast
naming the worker with its host's segments mapped, nothing left behind (processes,
/dev/shm), under --elastic its host's other worker takes its parts over, and the elastic
survivors and the replicated job's every worker, server value and optimizer state equal bit
for bit (slow: five jobs and a reference)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_kill_trials_on_two_hosts_of_two_workers(tmp_path):
    out = tmp_path / "hosts.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "chaos.py"), "--hosts", "5",
         "--rounds", "150", "--seed", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=1500, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = {r["scenario"]: r for r in json.loads(out.read_text())["hosts_trials"]}
    assert set(rows) == {
        "worker", "worker, elastic", "server, replicas", "worker stopped",
        "worker stopped, elastic",
    }, rows  # fmt: skip
    for r in rows.values():
        assert r["as_expected"] and r["orphans"] == 0 and r["shm_left"] == 0, r
    w = rows["worker"]
    assert w["outcome"] == "failed" and w["hostagg"] and w["named"], w
    assert w["victim"].split()[1] in w["cause"], w
    for name in ("worker, elastic", "worker stopped, elastic"):
        e = rows[name]
        assert e["outcome"] == "completed" and e["agree"] and e["survivors"] == 3, e
        assert e["taken_over"] and e["named"], e
    h = rows["worker stopped"]
    assert h["outcome"] == "failed" and h["named"] and "declared dead" in h["cause"], h
    s = rows["server, replicas"]
    assert s["bit_for_bit"] and s["workers_equal"] == s["workers"] == 4, s
    assert s["stale_values"] == 0 and s["states_equal"], s
