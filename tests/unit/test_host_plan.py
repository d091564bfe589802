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
    # the job's workers by host group, as the scheduler's node table lists them
    groups = kw.get("hosts", [0, 0, 1])
    nodes = {9 + 2 * i: SimpleNamespace(role="worker", group=g) for i, g in enumerate(groups)}
    nodes[8] = SimpleNamespace(role="server", group=-1)
    node = SimpleNamespace(elastic=elastic, replicas=kw.get("replicas", 1), nodes=nodes)
    joins = SimpleNamespace(rejoining=kw.get("rejoining", False))
    return SimpleNamespace(
        cfg=cfg, sync=sync, node=node, balance=kw.get("balance", False), joins=joins
    )


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
        # every host of one worker (a pod, a Slurm task a node): no host order to keep, the
        # servers merge pushes as they come
        ({"size": 1, "hosts": [0, 1, 2]}, (None, None)),
        ({"hosts": [0, 0, -1]}, (None, None)),  # a worker of no known host: none tags
        ({"agg": False}, (None, (0, 0, 1))),  # HETPS_HOST_AGGREGATION=0: the same order
        ({"secret": None}, (None, (0, 0, 1))),
        ({"balance": True}, ("AGG", (0, 0, 1))),  # HETPS_BALANCE: the host sums, by the plan
        ({"replicas": 2}, (None, (0, 0, 1))),
        ({"sync": False}, (None, None)),  # dist_async: per process, no rounds
        ({"elastic": 2}, ("AGG", (0, 0, 1))),  # --elastic: a rank let go, the others go on
        ({"elastic": 2, "rejoining": True}, (None, (0, 0, 1))),  # joins a host on its own
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
        head = np.zeros(hostagg.PID_SLOT + 1, np.int64)
        head[hostagg.PID_SLOT] = pid
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


def test_a_full_shared_memory_is_an_error_naming_the_fix_not_a_bus_error(tmp_path, monkeypatch):
    """A 1 MiB tmpfs cannot hold a 12 MiB segment: the store's init says so (and leaves no
    name behind) instead of a worker dying of SIGBUS at its first write."""
    import os
    import subprocess

    import numpy as np

    from hetps.kvstore.keys import KeyMeta
    from hetps.kvstore.placement import Part

    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    shm = tmp_path / "shm"
    shm.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(shm)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        monkeypatch.setattr(hostagg, "SHM_DIR", str(shm))
        cfg = SimpleNamespace(
            host_group=0, local_rank=0, local_world_size=2, secret=b"s" * 32,
            root_uri="127.0.0.1", root_port=9000, restart=0,
        )  # fmt: skip
        node = SimpleNamespace(elastic=0, id=9)
        agg = hostagg.HostAggregation(SimpleNamespace(cfg=cfg, node=node, meta={}))
        n = 1 << 20  # 4 MiB of float32 a slot, 3 slots
        meta = KeyMeta((n,), np.dtype(np.float32), [Part(8, 0, 0, n)])
        with pytest.raises(OSError, match=r"host aggregation needs \d+ bytes of shared memory"):
            agg.create("w", meta)  # (made at its first push through the host)
            agg.kv.meta["w"] = meta
            agg.takes("w")
        assert os.listdir(shm) == []
    finally:
        subprocess.run(["umount", "-l", str(shm)])
