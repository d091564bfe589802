"""``hetps netem`` as a user runs it: per-node commands, exit codes, show, cleanup."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from netem_helpers import child_env, ip_tool, namespaces_with

pytestmark = [pytest.mark.netem, pytest.mark.timeout(60)]

CLI = [sys.executable, "-m", "hetps.netem.cli"]


def _cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=timeout, env=child_env()
    )


def _holder(*args: str) -> tuple[subprocess.Popen[str], str]:
    """Start ``hetps netem ARGS`` without a command (keeps the network up); return its run id."""
    code = textwrap.dedent(
        f"""
        import signal, sys
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from hetps.netem.cli import main
        sys.exit(main({list(args)!r}))
        """
    )
    p = subprocess.Popen(
        [sys.executable, "-c", code],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=child_env(),
    )
    assert p.stderr is not None
    run_id = ""
    for line in p.stderr:
        if " ns " in line and not run_id:
            run_id = line.split(" ns ")[1].split()[0].rsplit("-", 1)[0]
        if "network up" in line:
            break
    assert run_id, "the CLI did not report its namespaces"
    return p, run_id


def test_runs_command_once_per_node_inside_its_namespace(tmp_path: Path) -> None:
    f = tmp_path / "net.toml"
    f.write_text('[network]\nkind = "static"\nrates_mbit = [20, 80, 40]\n')
    check = (
        f'{ip_tool()} -o -4 addr show dev eth0 | grep -q " $HETPS_NETEM_IP/" && '
        'echo "ok node=$HETPS_NETEM_NODE of=$HETPS_NETEM_NODES ips=$HETPS_NETEM_IPS"'
    )
    r = _cli(str(f), "--", "sh", "-c", check)
    assert r.returncode == 0, r.stderr
    lines = sorted(r.stdout.split("\n")[:-1])
    assert [ln.split()[1] for ln in lines] == ["node=0", "node=1", "node=2"]
    assert all("of=3" in ln for ln in lines)
    assert "rate 80.0 Mbit/s" in r.stderr
    run_id = r.stderr.split(" ns ")[1].split()[0].rsplit("-", 1)[0]
    assert not namespaces_with(run_id)


def test_first_failing_node_stops_the_others_and_sets_the_exit_code() -> None:
    script = 'if [ "$HETPS_NETEM_NODE" = 1 ]; then exit 3; fi; exec sleep 30'
    r = _cli("--rates", "10,10,10", "--", "sh", "-c", script, timeout=20)
    assert r.returncode == 3
    assert "node 1 exited with 3" in r.stderr


def test_bad_scenario_is_reported() -> None:
    r = _cli("--rates", "10,-5", "--", "true")
    assert r.returncode == 1
    assert "rates_mbit[1]" in r.stderr and "fix:" in r.stderr


def test_show_lists_a_live_run_and_signals_remove_it() -> None:
    holder, run_id = _holder("--rates", "25,50")
    try:
        out = _cli("show").stdout
        assert f"run {run_id}" in out and "(alive)" in out
        assert "egress 25Mbit  ingress 25Mbit" in out
        assert "egress 50Mbit  ingress 50Mbit" in out
        holder.send_signal(signal.SIGINT)
        assert holder.wait(15) == 130
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    assert not namespaces_with(run_id)
    holder, run_id = _holder("--lo", "10", "--hi", "20", "--nodes", "2", "--period", "60")
    holder.send_signal(signal.SIGTERM)
    assert holder.wait(15) == 128 + signal.SIGTERM
    assert not namespaces_with(run_id)


def test_cleanup_removes_stale_runs() -> None:
    code = textwrap.dedent(
        """
        import sys
        from hetps.netem import Netem
        net = Netem([10, 10], reaper=False, prefix="hpscli").start()
        print(net.run_id, flush=True)
        sys.stdin.read()
        """
    )
    p = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    assert p.stdout is not None
    run_id = p.stdout.readline().strip()
    p.kill()
    p.wait(5)
    assert len(namespaces_with(run_id)) == 3
    assert "STALE" in _cli("show", "--prefix", "hpscli").stdout
    r = _cli("cleanup", "--prefix", "hpscli")
    assert r.returncode == 0 and "removed 3 namespace(s)" in r.stdout
    assert not namespaces_with(run_id)
