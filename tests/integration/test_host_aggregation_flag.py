"""``hetps launch --host-aggregation {auto,off}``: through the launcher's environment every
worker of a host of two sums through the host (auto) or pushes its own (off); a flag that
contradicts ``--env HETPS_HOST_AGGREGATION`` is refused before anything starts."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from conftest import TEST_ENV

PROBE = textwrap.dedent("""
    import numpy as np
    import hetps.kv
    kv = hetps.kv.create('dist_sync')
    kv.init('w', np.zeros(8, np.float32))
    got = np.full(8, kv.rank + 1.0, np.float32)
    kv.pushpull('w', got)
    print('AGG', kv.rank, kv.hostagg is not None, float(got[0]), flush=True)
    kv.barrier()
""")


def _launch(tmp_path, *flags: str) -> subprocess.CompletedProcess:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env = {**os.environ, **TEST_ENV}
    env.pop("HETPS_HOST_AGGREGATION", None)
    cmd = [sys.executable, "-m", "hetps.cli", "launch", "-n", "2", "-s", "1"]
    return subprocess.run(
        [*cmd, "--nproc-per-node", "2", *flags, "--", sys.executable, str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_launch_flag_turns_host_aggregation_on_and_off(tmp_path):
    for flag, on in (("auto", True), ("off", False)):
        r = _launch(tmp_path, "--host-aggregation", flag)
        assert r.returncode == 0, r.stdout + r.stderr
        lines = sorted(line.split("] ", 1)[1] for line in r.stdout.splitlines() if "] AGG " in line)
        # both workers of the one host: on or off together, the same sum 1 + 2 either way
        assert lines == [f"AGG 0 {on} 3.0", f"AGG 1 {on} 3.0"], r.stdout + r.stderr


def test_a_flag_that_contradicts_the_env_is_refused(tmp_path):
    r = _launch(tmp_path, "--host-aggregation", "off", "--env", "HETPS_HOST_AGGREGATION=1")
    assert r.returncode != 0
    assert "--host-aggregation off and --env HETPS_HOST_AGGREGATION=1 disagree" in r.stderr
    assert "AGG" not in r.stdout


def test_hetps_train_gives_every_role_the_setting_and_its_workers_no_flag(monkeypatch):
    """`hetps train --workers W --host-aggregation off`: the variable in every role's
    environment; the workers' own command line (this command again) goes without the flag."""
    import hetps.launch.local as local
    from hetps.app.train import launch_cluster
    from hetps.cli import build_parser

    seen = {}

    def fake_run_cluster(spec, **kw):
        seen["env"], seen["command"] = dict(spec.env), list(spec.command)
        return 0

    monkeypatch.setattr(local, "run_cluster", fake_run_cluster)
    argv = ["train", "--workers", "2", "--host-aggregation", "off"]
    monkeypatch.setattr(sys, "argv", ["hetps", *argv])
    assert launch_cluster(build_parser().parse_args(argv)) == 0
    assert seen["env"]["HETPS_HOST_AGGREGATION"] == "0"
    assert "--host-aggregation" not in seen["command"] and "off" not in seen["command"]
