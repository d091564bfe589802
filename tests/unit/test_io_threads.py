"""ZeroMQ I/O threads of a node's van: HETPS_IO_THREADS, or one per 4 cores (1 to 4)."""

from __future__ import annotations

import os

import zmq

from hetps.config import node_config_from_env
from hetps.transport.van import Van

#: a worker's environment, the least a node's configuration needs
BASE = {
    "DMLC_ROLE": "worker",
    "DMLC_PS_ROOT_URI": "127.0.0.1",
    "DMLC_PS_ROOT_PORT": "9000",
    "DMLC_NUM_SERVER": "1",
    "DMLC_NUM_WORKER": "1",
}


def test_io_threads_follow_the_setting_and_the_cores():
    cores = len(os.sched_getaffinity(0))
    for asked, want in ((3, 3), (0, min(4, max(1, cores // 4)))):
        van = Van(name="t", io_threads=asked)
        try:
            assert van.ctx.get(zmq.IO_THREADS) == want
        finally:
            van.close()
    base = BASE
    assert node_config_from_env({**base, "HETPS_IO_THREADS": "2"}).io_threads == 2
    assert node_config_from_env(base).io_threads == 0
    assert node_config_from_env(base).bulk_channels == -1  # on, unless balancing
    assert node_config_from_env({**base, "HETPS_BULK_CHANNELS": "0"}).bulk_channels == 0


def test_bulk_channels_are_on_by_default_unless_a_balancer_times_the_links():
    from hetps.config.node import bulk_channels_on

    base = BASE
    on = {
        (): True,
        (("HETPS_BALANCE", "optimal"),): False,
        (("HETPS_BALANCE", "optimal"), ("HETPS_BULK_CHANNELS", "1")): True,
        (("HETPS_BULK_CHANNELS", "0"),): False,
    }
    for extra, want in on.items():
        assert bulk_channels_on(node_config_from_env({**base, **dict(extra)})) is want, extra
