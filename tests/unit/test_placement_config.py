"""Placement (exact vectors) and configuration errors."""

from __future__ import annotations

import pytest

from hetps.config import ConfigError, node_config_from_env
from hetps.kvstore.placement import Part, chunk_elems, chunks, key_hash, parts_of, server_of


def test_key_hash_is_fixed_across_runs():
    # CRC-32 of the typed text form: these numbers must never change (placement is persistent)
    assert key_hash(0) == __import__("zlib").crc32(b"i:0")
    assert key_hash("fc1.weight") == __import__("zlib").crc32(b"s:fc1.weight")
    assert key_hash(1) != key_hash("1")
    assert [server_of(k, 3) for k in range(6)] == [
        __import__("zlib").crc32(f"i:{k}".encode()) % 3 for k in range(6)
    ]


def test_bad_keys_are_refused():
    for bad in (1.5, None, True, (1,)):
        with pytest.raises(TypeError, match="int or a str"):
            key_hash(bad)


def test_small_key_whole_on_one_server_big_key_split_evenly():
    assert parts_of("w", 999, 3, 1000) == [Part(server_of("w", 3), 0, 0, 999)]
    assert parts_of("w", 1000, 3, 1000) == [
        Part(0, 0, 0, 333),
        Part(1, 1, 333, 666),
        Part(2, 2, 666, 1000),
    ]
    assert parts_of("w", 10**7, 1, 1000) == [Part(server_of("w", 1), 0, 0, 10**7)]


def test_chunks_cover_exactly():
    assert chunks(0, 10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert chunks(5, 5, 4) == [(5, 5)]
    assert chunk_elems(4 << 20, 4) == 1 << 20
    assert chunk_elems(100, 8) == 16


BASE = {
    "DMLC_ROLE": "worker",
    "DMLC_PS_ROOT_URI": "127.0.0.1",
    "DMLC_PS_ROOT_PORT": "9000",
    "DMLC_NUM_SERVER": "2",
    "DMLC_NUM_WORKER": "3",
}


def test_config_reads_dmlc_variables():
    cfg = node_config_from_env({**BASE, "PS_VERBOSE": "2", "MXNET_KVSTORE_BIGARRAY_BOUND": "77"})
    assert (cfg.role, cfg.num_server, cfg.num_worker, cfg.verbose) == ("worker", 2, 3, 2)
    assert cfg.bigarray_bound == 77 and cfg.node_host == "127.0.0.1"
    assert node_config_from_env({**BASE, "HETPS_BIGARRAY_BOUND": "5"}).bigarray_bound == 5


@pytest.mark.parametrize(
    "over,match",
    [
        ({"DMLC_NUM_WORKER": "-1"}, "DMLC_NUM_WORKER=-1 is below 1"),
        ({"DMLC_PS_ROOT_PORT": "70000"}, "above 65535"),
        ({"PS_HEARTBEAT_INTERVAL": "5", "PS_HEARTBEAT_TIMEOUT": "2"}, "must exceed"),
        ({"DMLC_PS_ROOT_URI": "10.1.2.3"}, "DMLC_NODE_HOST"),
        (
            {"DMLC_PS_ROOT_URI": "10.1.2.3", "DMLC_INTERFACE": "nosuchif0"},
            "DMLC_INTERFACE='nosuchif0'",
        ),
        ({"HETPS_CONNECT_TIMEOUT": "soon"}, "HETPS_CONNECT_TIMEOUT='soon'"),
        ({"HETPS_PUSH_WINDOW": "-5"}, "HETPS_PUSH_WINDOW=-5 is below 0"),
        ({"HETPS_REPLAN_MARGIN": "abc"}, "HETPS_REPLAN_MARGIN='abc' is not a number"),
        ({"HETPS_FUSION_BYTES": "-1"}, "HETPS_FUSION_BYTES=-1 is below 0"),
    ],
)
def test_config_errors_name_the_variable_and_fix(over, match):
    with pytest.raises(ConfigError, match=match):
        node_config_from_env({**BASE, **over})


def test_scheduler_may_bind_an_ephemeral_port_but_others_may_not():
    assert (
        node_config_from_env({**BASE, "DMLC_ROLE": "scheduler", "DMLC_PS_ROOT_PORT": "0"}).root_port
        == 0
    )
    with pytest.raises(ConfigError, match="DMLC_PS_ROOT_PORT=0 is below 1"):
        node_config_from_env({**BASE, "DMLC_PS_ROOT_PORT": "0"})


def test_balancing_defaults():
    cfg = node_config_from_env({**BASE, "HETPS_BALANCE": "aware"})
    assert (cfg.push_window, cfg.replan_margin, cfg.probe_prob) == (1 << 19, 0.10, 0.25)
    assert cfg.probe_bytes == 128 * 1024


def test_fusion_default_and_override():
    assert node_config_from_env(BASE).fusion_bytes == 256 * 1024
    assert node_config_from_env({**BASE, "HETPS_FUSION_BYTES": "0"}).fusion_bytes == 0
