"""A hung process under the Ray launcher, on a two-node Ray cluster of this machine: a server
stopped with SIGSTOP mid-job is failed over (HETPS_REPLICAS=2), every round trains with every
value right, and when the job ends the stopped server is named and killed with the rest, so
the job returns 0 and nothing of it is left."""

from __future__ import annotations

import io
import re
import sys
from pathlib import Path

import pytest

from hetps.launch.ray import run_job

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_ray_launcher import ray_cluster  # noqa: E402,F401 - the module's Ray cluster
from test_slurm_hang import JOB  # noqa: E402 - the same job: SIGSTOP of server rank 1

from procs import wait_gone  # noqa: E402


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_stopped_server_is_failed_over_and_killed_when_the_job_ends(ray_cluster, tmp_path):  # noqa: F811
    address, *_ = ray_cluster
    script = tmp_path / "job.py"
    script.write_text(JOB)
    out = io.StringIO()
    result = run_job(
        [sys.executable, str(script)],
        num_workers=2,
        num_servers=2,
        address=address,
        env={
            "HETPS_REPLICAS": "2",
            "PS_HEARTBEAT_INTERVAL": "0.5",
            "PS_HEARTBEAT_TIMEOUT": "4",
            "HETPS_CONNECT_TIMEOUT": "60",
        },
        failure_grace=3.0,
        out=out,
    )
    text = out.getvalue()
    stopped = re.search(r"^\[worker 0\] STOPPED (\d+)$", text, re.M)
    pids = [int(p) for m in re.findall(r"PIDS (\d+) (\d+)", text) for p in m]
    actors = [w["pid"] for w in result.nodes.values()]
    left = wait_gone(pids + actors + ([int(stopped.group(1))] if stopped else []), timeout=20)
    assert result.code == 0, text
    assert stopped and "WRONG VALUE" not in text, text
    assert re.search(r"server rank 1 \(node 10.*takes over its keys", text), text
    finals = re.findall(r"^\[worker (\d)\] FINAL \d (\w+)$", text, re.M)
    assert sorted(r for r, _ in finals) == ["0", "1"] and finals[0][1] == finals[1][1], text
    assert re.search(r"the job ended, but server 1 did not end with it within 3 s", text), text
    assert left == [], text
