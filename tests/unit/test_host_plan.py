"""What a worker does with its host (kvstore/hostagg.py's plan): which pushes carry the host
tag, when the host's workers aggregate, and the errors of a host contract that cannot be."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hetps.config import ConfigError
from hetps.kvstore import hostagg


def _kv(group=0, local=0, size=2, sync=True, elastic=0, agg=True, secret=b"s" * 32, **kw):
    cfg = SimpleNamespace(
        host_group=group,
        local_rank=local,
        local_world_size=size,
        host_aggregation=agg,
        secret=secret,
    )
    node = SimpleNamespace(elastic=elastic, replicas=kw.get("replicas", 1))
    return SimpleNamespace(cfg=cfg, sync=sync, node=node, balance=kw.get("balance", False))


def _plan(monkeypatch, **kw):
    made = []
    monkeypatch.setattr(hostagg, "HostAggregation", lambda kv: made.append(kv) or "AGG")
    return hostagg.plan(_kv(**kw))


@pytest.mark.parametrize(
    ("kw", "want"),
    [
        ({}, ("AGG", (0, 0, 1))),  # two workers on the host: they aggregate
        ({"group": 3, "local": 1, "size": 4}, ("AGG", (3, 1, 1))),
        ({"size": 1}, (None, (0, 0, 1))),  # alone on its host: tagged, its own push
        ({"agg": False}, (None, (0, 0, 1))),  # HETPS_HOST_AGGREGATION=0: the same order
        ({"secret": None}, (None, (0, 0, 1))),
        ({"balance": True}, (None, None)),  # HETPS_BALANCE: per process, as without hosts
        ({"replicas": 2}, (None, (0, 0, 1))),
        ({"sync": False}, (None, None)),  # dist_async: per process, no rounds
        ({"elastic": 2}, (None, None)),  # --elastic: per process, as without hosts
        ({"group": -1}, (None, None)),  # host not known
        ({"local": -1}, (None, None)),
        ({"size": 0}, (None, None)),
    ],
)
def test_which_pushes_carry_the_host_and_which_hosts_aggregate(monkeypatch, kw, want):
    assert _plan(monkeypatch, **kw) == want


def test_a_local_rank_beyond_the_hosts_workers_is_a_config_error(monkeypatch):
    with pytest.raises(ConfigError, match=r"LOCAL_RANK=2 but LOCAL_WORLD_SIZE=2"):
        _plan(monkeypatch, local=2, size=2)


def test_the_sweep_removes_only_stale_segments_of_a_dead_maker(tmp_path):
    """A segment left by a crash before every local rank mapped it is removed by the next
    job's sweep; a young one, one whose maker lives, a link or a FIFO planted under such a
    name are left alone (and never read through)."""
    import os
    import time

    import numpy as np

    def name(i: int) -> str:
        return f"hetps-host-{'a' * 32}-0-{str(i) * 24}"

    def segment(i: int, pid: int, age: float) -> None:
        head = np.zeros(hostagg._PID + 1, np.int64)
        head[hostagg._PID] = pid
        path = tmp_path / name(i)
        path.write_bytes(head.tobytes())
        os.utime(path, (time.time() - age,) * 2)

    gone = 2**22 + 4321  # above the kernel's pid_max: no such process
    segment(1, gone, 120)  # stale, its maker gone: swept
    segment(2, gone, 1)  # young: its maker may be in another PID namespace
    segment(3, os.getpid(), 120)  # its maker lives
    os.symlink("/etc/hostname", tmp_path / name(4))
    os.mkfifo(tmp_path / name(5))  # (reading it would block)
    (tmp_path / "hetps-shm-1-x").write_bytes(b"")  # not ours
    assert hostagg.sweep_stale(str(tmp_path)) == 1
    assert sorted(os.listdir(tmp_path)) == sorted(
        [name(2), name(3), name(4), name(5), "hetps-shm-1-x"]
    )
