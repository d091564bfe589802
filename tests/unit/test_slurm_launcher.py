"""The Slurm launcher's pure parts: host lists, task counts, task -> role, thread shares and
the refusals that need no cluster (the real runs are in tests/integration/test_slurm.py)."""

from __future__ import annotations

import argparse

import pytest

from hetps.launch.contract import LaunchSpec
from hetps.launch.slurm import (
    SlurmError,
    _task_main,
    check_allocation,
    expand_nodelist,
    free_port,
    srun_argv,
    task_env,
    task_role,
    task_threads,
    tasks_per_node,
)


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("n1", ["n1"]),
        ("n[1-3]", ["n1", "n2", "n3"]),
        ("node[08-11,20]", ["node08", "node09", "node10", "node11", "node20"]),
        ("a,b[1-2],c", ["a", "b1", "b2", "c"]),
        ("gpu[1-2]-ib", ["gpu1-ib", "gpu2-ib"]),
        ("r[1-2]-n[01-02]", ["r1-n01", "r1-n02", "r2-n01", "r2-n02"]),
        ("x[7]", ["x7"]),
    ],
)
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["n[1-3", "n1-3]", "n[a-b]", "n[3-1]", "n[1-]"])
def test_a_malformed_nodelist_is_an_error_naming_it(bad):
    with pytest.raises(SlurmError, match="cannot read the Slurm host list"):
        expand_nodelist(bad)


def test_tasks_per_node():
    assert tasks_per_node("3(x2),1") == [3, 3, 1]
    assert tasks_per_node("4") == [4]
    with pytest.raises(SlurmError, match="task counts"):
        tasks_per_node("3(x)")


def test_task_roles_scheduler_servers_then_workers():
    roles = [task_role(i, 2, 3) for i in range(6)]
    assert roles == [
        ("scheduler", 0),
        ("server", 0),
        ("server", 1),
        ("worker", 0),
        ("worker", 1),
        ("worker", 2),
    ]
    with pytest.raises(SlurmError, match="has no role"):
        task_role(6, 2, 3)


def _args(**kw) -> argparse.Namespace:
    base = dict(
        servers=1,
        workers=2,
        scheduler_node="n1",
        root_uri="127.0.0.1",
        port=9000,
        auto_threads=False,
    )
    base.update(kw)
    return argparse.Namespace(**base)


def test_task_env_sets_the_dmlc_contract_of_its_role():
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURMD_NODENAME": "n1", "X": "y"}
    role, rank, out = task_env(env, _args())
    assert (role, rank) == ("worker", 1)
    assert out["DMLC_ROLE"] == "worker" and out["HETPS_LAUNCH_RANK"] == "1"
    assert out["DMLC_PS_ROOT_URI"] == "127.0.0.1" and out["DMLC_PS_ROOT_PORT"] == "9000"
    assert out["DMLC_NUM_SERVER"] == "1" and out["DMLC_NUM_WORKER"] == "2"
    assert out["DMLC_NODE_HOST"] == "127.0.0.1"  # the route to a loopback scheduler
    assert out["X"] == "y" and "OMP_NUM_THREADS" not in out
    _, _, sched = task_env({**env, "SLURM_PROCID": "0"}, _args())
    assert sched["DMLC_ROLE"] == "scheduler" and "HETPS_LAUNCH_RANK" not in sched


def test_task_env_keeps_a_users_interface_choice():
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "DMLC_INTERFACE": "ib0"}
    _, _, out = task_env(env, _args())
    assert "DMLC_NODE_HOST" not in out


def test_task_env_refusals():
    with pytest.raises(SlurmError, match="SLURM_PROCID is not set"):
        task_env({}, _args())
    with pytest.raises(SlurmError, match="has 5 tasks"):
        task_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "5"}, _args())
    with pytest.raises(SlurmError, match="landed on n2"):
        task_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURMD_NODENAME": "n2"}, _args())


def test_a_task_without_its_flags_names_them_in_the_launchers_order(capsys):
    with pytest.raises(SystemExit) as exc:
        _task_main([])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (
        "python -m hetps.launch.slurm task: error: the following arguments are required: "
        "--servers, --workers, --scheduler-node, --root-uri, --port"
    )
    assert (
        "[-h] --servers SERVERS --workers WORKERS --scheduler-node SCHEDULER_NODE --root-uri "
        "ROOT_URI --port PORT [--auto-threads]"
    ) in " ".join(err.split())


def test_task_threads_share_the_node_or_use_a_binding(monkeypatch):
    import hetps.launch.slurm as slurm

    monkeypatch.setattr(slurm, "usable_cores", lambda: 16)
    shared = {"SLURM_CPUS_ON_NODE": "16", "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_NODEID": "1"}
    assert task_threads("worker", shared) == 4
    assert task_threads("server", shared) == 1
    # the allocation holds 8 CPUs of the node: the share is of those
    assert task_threads("worker", {**shared, "SLURM_CPUS_ON_NODE": "8"}) == 2
    # bound by Slurm to 2 of the node's 32 allocated CPUs: those 2 are this task's own
    monkeypatch.setattr(slurm, "usable_cores", lambda: 2)
    assert task_threads("worker", {**shared, "SLURM_CPUS_ON_NODE": "32"}) == 2


def test_check_allocation_refusals(tmp_path):
    with pytest.raises(SlurmError, match="SLURM_JOB_ID is not set.*salloc -n 4"):
        check_allocation({"PATH": str(tmp_path)}, 4)
    with pytest.raises(SlurmError, match="needs srun"):
        check_allocation({"SLURM_JOB_ID": "1", "PATH": str(tmp_path)}, 4)
    srun = tmp_path / "srun"
    srun.write_text("#!/bin/sh\n")
    srun.chmod(0o755)
    env = {"SLURM_JOB_ID": "1", "PATH": str(tmp_path), "SLURM_JOB_NODELIST": "n[1-2]"}
    assert check_allocation(env, 4) == ["n1", "n2"]
    with pytest.raises(SlurmError, match="has 3 tasks.*needs 4.*-n 4"):
        check_allocation({**env, "SLURM_NTASKS": "3"}, 4)


def test_the_srun_line_holds_no_secret_and_asks_for_every_task():
    spec = LaunchSpec(num_workers=3, num_servers=2, command=["python", "t.py"])
    spec.env["HETPS_SECRET"] = "s" * 64
    argv = srun_argv(spec, "n1", "10.0.0.1", 9000, auto_threads=True)
    assert argv[0] == "srun" and "--ntasks=6" in argv and "--export=ALL" in argv
    assert argv[-3:] == ["--", "python", "t.py"] and "--auto-threads" in argv
    assert not any("s" * 32 in a for a in argv)


def test_the_scheduler_port_is_free_and_outside_the_ephemeral_range(tmp_path, caplog):
    """srun binds its own listeners to port 0 while the scheduler has not bound its port yet;
    a port from the ephemeral range could go to srun, and the workers would greet srun."""
    import socket

    ranges = tmp_path / "range"
    for low, high in ((32768, 60999), (11000, 65535), (1024, 60000)):
        ranges.write_text(f"{low}\t{high}\n")
        ports = {free_port(str(ranges)) for _ in range(20)}
        assert all(10000 <= p < low or high < p <= 65535 for p in ports), (low, high, ports)
        for p in list(ports)[:3]:
            with socket.socket() as s:
                s.bind(("", p))
    # a range with no room outside it, or none to read: the kernel picks, and a line says so
    ranges.write_text("1024\t65535\n")
    with caplog.at_level("WARNING", logger="hetps.launch"):
        assert free_port(str(ranges)) >= 1
        assert free_port(str(tmp_path / "missing")) >= 1
    assert caplog.text.count("no free port outside the ephemeral range") == 2
