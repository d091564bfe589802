"""A worker's store is built by the composition root: ``hetps.kv.create`` hands
``hetps.kvstore.create`` the builder (:func:`hetps.roles.new_worker_store`), which gives the
Node its recovery and the store its joining (:mod:`hetps.faults`); ``hetps.kvstore.create``
makes no distributed store without it."""

from __future__ import annotations

import pytest

import hetps.kv
import hetps.kvstore
import hetps.roles
from hetps.faults.joining import Joining
from hetps.faults.recovery import Recovery

WORKER = {
    "DMLC_ROLE": "worker",
    "DMLC_PS_ROOT_URI": "127.0.0.1",
    "DMLC_PS_ROOT_PORT": "9000",
    "DMLC_NUM_SERVER": "1",
    "DMLC_NUM_WORKER": "1",
    "HETPS_SECRET": "s" * 64,
}


class Made(Exception):
    pass


def capture_parts(monkeypatch) -> dict:
    """Make the composition root's Node and DistKVStore record what they are given (and
    stop there: the parts are all these tests look at)."""
    made: dict = {}

    class Node:
        def __init__(self, cfg, *, recovery):
            made["recovery"] = recovery

        def start(self):
            return self

        def servers(self):
            return []

        send_batch = close = servers
        replicas = 1

    def store(name, cfg, *, node, pipeline, joining):
        made.update(name=name, joining=joining)
        raise Made

    monkeypatch.setattr(hetps.roles, "Node", Node)
    monkeypatch.setattr(hetps.roles, "DistKVStore", store)
    return made


def test_kv_create_gives_a_workers_store_its_fault_parts(monkeypatch):
    made = capture_parts(monkeypatch)
    with pytest.raises(Made):
        hetps.kv.create("dist_sync", env=WORKER)
    assert made == {"name": "dist_sync", "recovery": Recovery, "joining": Joining}


def test_kvstore_create_refuses_a_dist_store_without_its_builder():
    with pytest.raises(TypeError, match="no builder was given") as info:
        hetps.kvstore.create("dist_sync", env=WORKER)
    assert "call hetps.kv.create('dist_sync')" in str(info.value)


def test_a_local_store_needs_no_fault_parts():
    assert isinstance(hetps.kvstore.create("local", env=WORKER), hetps.kvstore.LocalKVStore)


def test_distributed_optimizer_gives_the_store_it_makes_its_fault_parts(monkeypatch):
    """DistributedOptimizer(kvstore="dist_sync") makes a worker's store as hetps.kv.create
    does: with both fault parts."""
    torch = pytest.importorskip("torch")
    from hetps.torch import DistributedOptimizer

    made = capture_parts(monkeypatch)
    for k, v in WORKER.items():
        monkeypatch.setenv(k, v)
    model = torch.nn.Linear(2, 1)
    with pytest.raises(Made):
        DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            model.named_parameters(),
            kvstore="dist_sync",
        )
    assert made == {"name": "dist_sync", "recovery": Recovery, "joining": Joining}
