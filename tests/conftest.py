"""Shared test harness: run a real cluster (separate processes on 127.0.0.1) around a script."""

from __future__ import annotations

import io
import os
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: what a test cluster runs with: a dead node seen within seconds, generous request bounds
TEST_ENV = {
    "PS_HEARTBEAT_INTERVAL": "0.5",
    "PS_HEARTBEAT_TIMEOUT": "5",
    "HETPS_CONNECT_TIMEOUT": "20",
    "HETPS_REQUEST_TIMEOUT": "60",
    "OMP_NUM_THREADS": "1",
}

#: for a test that checks what each worker itself sends (messages, rings, 2-bit words): its
#: workers push their own even where a launcher tells them their host (docs/HOSTS.md)
PER_PROCESS = {"HETPS_HOST_AGGREGATION": "0"}

PRELUDE = """
import os, sys, signal, time
import numpy as np
import hetps.kv
from hetps import optim
from hetps.cluster.errors import NodeFailure, RequestError, ClusterError
"""


def run_cluster(
    tmp_path: Path,
    code: str,
    workers: int = 2,
    servers: int = 1,
    env: dict[str, str] | None = None,
    start_timeout: float = 30.0,
    failure_grace: float = 10.0,
    node_env: dict[tuple[str, int], dict[str, str]] | None = None,
) -> tuple[int, str]:
    """Run ``code`` as every worker of a fresh cluster; returns (exit code, all output).

    The launcher starts the scheduler and servers as `hetps` processes, waits for the end,
    stops every process (SIGTERM then SIGKILL of each process group) even when the test fails.
    ``node_env`` adds variables for single nodes, e.g. ``{("server", 2): {...}}``.
    """
    from hetps.launch.contract import LaunchSpec
    from hetps.launch.local import Launcher

    script = tmp_path / "worker_script.py"
    script.write_text(PRELUDE + textwrap.dedent(code))
    base_env = dict(TEST_ENV)
    base_env.update(env or {})
    out = io.StringIO()
    spec = LaunchSpec(
        num_workers=workers,
        num_servers=servers,
        command=[sys.executable, str(script)],
        env=base_env,
        start_timeout=start_timeout,
        failure_grace=failure_grace,
    )
    if node_env:

        def wrap(role: str, rank: int, argv: list[str], env: dict[str, str]):
            return argv, {**env, **node_env.get((role, rank), {})}

        spec.wrap = wrap
    launcher = Launcher(spec, out=out)
    try:
        code_ = launcher.run()
    finally:
        launcher.stop_all()
    return code_, out.getvalue()


@pytest.fixture
def cluster(tmp_path):
    """``cluster(code, workers=2, servers=1, env={})`` -> (exit code, output)."""

    def run(code: str, **kw):
        return run_cluster(tmp_path, code, **kw)

    return run


def pytest_configure(config):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # the schedulers of the tests keep their credential keys (cluster/credentials.py) in a
    # directory of this run, removed at its end, not in the user's: a killed one leaves its key
    import tempfile

    config._hetps_keys = tempfile.TemporaryDirectory(prefix="hetps-test-keys-")
    os.environ["XDG_RUNTIME_DIR"] = config._hetps_keys.name


def pytest_unconfigure(config):
    keys = getattr(config, "_hetps_keys", None)
    if keys is not None:
        keys.cleanup()
