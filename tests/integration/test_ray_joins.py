"""`hetps launch --launcher ray` with no --ray-address joins the Ray cluster `ray start` runs on
this machine, as `ray.init()` does, instead of starting a second Ray beside it. The cluster is
this test's own (RAY_TMPDIR in a temp dir of its own, token authentication with a token of its
own), stopped at the end."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="needs Ray: pip install 'hetps[ray]'")

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable


def test_launch_without_an_address_joins_the_running_cluster(monkeypatch):
    from test_ray_launcher import RayNode

    tmp = tempfile.mkdtemp(prefix="hj", dir="/tmp")  # short: Ray's socket paths are limited
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_AUTH_TOKEN_PATH", None)
    env.update(
        RAY_TMPDIR=tmp,  # Ray's temp dir, and where ray.init() looks for a running cluster
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=secrets.token_hex(32),
        RAY_DISABLE_DOCKER_CPU_WARNING="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")])),
    )
    head = RayNode(
        ["--head", "--port", "0", "--num-cpus", "3", "--include-dashboard=false",
         "--object-store-memory", str(80 << 20)],
        env,
        marker="ray start --address=",
    )  # fmt: skip
    left = []
    try:
        head.wait_ready()
        assert head.address, "".join(head.lines)
        script = Path(tmp) / "job.py"
        script.write_text(
            "import numpy as np, hetps.kv\n"
            "kv = hetps.kv.create('dist_sync')\n"
            "kv.init(0, np.zeros(4, np.float32))\n"
            "kv.push(0, np.ones(4, np.float32))\n"
            "out = np.empty(4, np.float32)\n"
            "kv.pull(0, out=out)\n"
            "kv.close()\n"
        )
        res = subprocess.run(
            [PY, "-m", "hetps.cli", "launch", "--launcher", "ray", "-n", "1", "-s", "1", "--",
             PY, str(script)],
            env=env, capture_output=True, text=True, timeout=240, cwd=tmp,
        )  # fmt: skip
        out = res.stdout + res.stderr
        assert res.returncode == 0, out
        # the roles ran in a placement group of the cluster `ray start` made, not of a Ray
        # of their own
        query = (
            "import json, ray\n"
            f"ray.init(address={head.address!r}, logging_level='WARNING')\n"
            "print(json.dumps([g['state'] for g in ray.util.placement_group_table().values()]))\n"
        )
        res = subprocess.run(
            [PY, "-c", query], env=env, capture_output=True, text=True, timeout=120
        )
        assert res.returncode == 0, res.stdout + res.stderr
        assert json.loads(res.stdout.strip().splitlines()[-1]) == ["REMOVED"], out
    finally:
        left = head.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    assert not left, f"Ray processes left after the test: {left}"
