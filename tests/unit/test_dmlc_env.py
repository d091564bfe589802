"""How hetps reads the variables MXNet's launchers set (docs/LAUNCHERS.md): what each derives
and where it refuses. The processes themselves are in tests/integration/test_dmlc_contract.py."""

from __future__ import annotations

import pytest

from hetps.config import ConfigError, node_config_from_env, resolve

BASE = {
    "DMLC_PS_ROOT_URI": "192.0.2.77",
    "DMLC_PS_ROOT_PORT": "9091",
    "DMLC_NUM_SERVER": "2",
    "DMLC_NUM_WORKER": "3",
    "HETPS_SECRET": "x" * 64,
}


def test_a_scheduler_needs_no_node_host():
    cfg = node_config_from_env({**BASE, "DMLC_ROLE": "scheduler"})
    assert cfg.node_host == "192.0.2.77"
    s = resolve({**BASE, "DMLC_ROLE": "scheduler"})["DMLC_NODE_HOST"]
    assert s.source == "derived from DMLC_PS_ROOT_URI (the scheduler's own address)"


def test_a_worker_started_by_hand_still_must_say_its_address():
    with pytest.raises(ConfigError, match="set DMLC_NODE_HOST"):
        node_config_from_env({**BASE, "DMLC_ROLE": "worker"})


@pytest.mark.parametrize(
    "extra, launcher",
    [
        ({"DMLC_USE_KUBERNETES": "1"}, "DMLC_USE_KUBERNETES=1"),
        ({"DMLC_JOB_CLUSTER": "mpi"}, "DMLC_JOB_CLUSTER=mpi"),
    ],
)
def test_under_mxjob_or_dmlc_tracker_the_route_to_the_scheduler_gives_the_address(extra, launcher):
    env = {**BASE, "DMLC_ROLE": "server", "DMLC_PS_ROOT_URI": "127.0.0.2", **extra}
    # a loopback scheduler address outside LOOPBACK's names: the route says 127.0.0.1
    s = resolve(env)["DMLC_NODE_HOST"]
    assert s.value == "127.0.0.1" and s.problem is None
    assert s.source == f"derived: the route to DMLC_PS_ROOT_URI ({launcher})"


def test_an_unresolvable_scheduler_name_names_the_fix():
    env = {
        **BASE,
        "DMLC_ROLE": "worker",
        "DMLC_USE_KUBERNETES": "1",
        "DMLC_PS_ROOT_URI": "no-such-host.invalid",
    }
    with pytest.raises(ConfigError, match="status.podIP"):
        node_config_from_env(env)


def test_worker_and_server_ids_are_rank_requests_of_their_own_role():
    env = {**BASE, "DMLC_NODE_HOST": "192.0.2.1"}
    # dmlc-core's kubernetes tracker sets DMLC_SERVER_ID=0 on workers too: a worker ignores it
    worker = {**env, "DMLC_ROLE": "worker", "DMLC_WORKER_ID": "2", "DMLC_SERVER_ID": "0"}
    assert node_config_from_env(worker).launch_rank == 2
    assert resolve(worker)["HETPS_LAUNCH_RANK"].source == "derived from DMLC_WORKER_ID"
    server = {**env, "DMLC_ROLE": "server", "DMLC_WORKER_ID": "2", "DMLC_SERVER_ID": "1"}
    assert node_config_from_env(server).launch_rank == 1
    # HETPS_LAUNCH_RANK wins; nothing set: arrival order (-1)
    assert node_config_from_env({**worker, "HETPS_LAUNCH_RANK": "0"}).launch_rank == 0
    plain = {**env, "DMLC_ROLE": "worker"}
    assert node_config_from_env(plain).launch_rank == -1
    assert resolve(plain)["HETPS_LAUNCH_RANK"].source == "default"
    with pytest.raises(ConfigError, match="DMLC_WORKER_ID"):
        node_config_from_env({**worker, "DMLC_WORKER_ID": "x"})
