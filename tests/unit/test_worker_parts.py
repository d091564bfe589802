"""A worker's fault parts come from above: ``hetps.kv.create`` gives its store the Node's
recovery and the store's joining (:mod:`hetps.faults`), and ``hetps.kvstore.create`` makes no
distributed store without them."""

from __future__ import annotations

import pytest

import hetps.kv
import hetps.kvstore
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


def test_kv_create_gives_a_workers_store_its_fault_parts(monkeypatch):
    made = {}

    def create(name, env=None, **parts):
        made.update(parts, name=name)
        return "store"

    monkeypatch.setattr(hetps.kvstore, "create", create)
    assert hetps.kv.create("dist_sync", env=WORKER) == "store"
    assert made == {"name": "dist_sync", "recovery": Recovery, "joining": Joining}


@pytest.mark.parametrize(
    "parts, missing",
    [({}, "recovery and joining are missing"), ({"recovery": Recovery}, "joining is missing")],
)
def test_kvstore_create_refuses_a_dist_store_without_its_fault_parts(parts, missing):
    with pytest.raises(TypeError, match=missing) as info:
        hetps.kvstore.create("dist_sync", env=WORKER, **parts)
    assert "call hetps.kv.create('dist_sync')" in str(info.value)


def test_a_local_store_needs_no_fault_parts():
    assert isinstance(hetps.kvstore.create("local", env=WORKER), hetps.kvstore.LocalKVStore)


def test_distributed_optimizer_gives_the_store_it_makes_its_fault_parts(monkeypatch):
    """DistributedOptimizer(kvstore="dist_sync") makes a worker's store as hetps.kv.create
    does: with both fault parts."""
    torch = pytest.importorskip("torch")
    from hetps.torch import DistributedOptimizer

    made = {}

    class Made(Exception):
        pass

    def create(name, env=None, **parts):
        made.update(parts, name=name)
        raise Made  # (the store is all this test looks at)

    monkeypatch.setattr(hetps.kvstore, "create", create)
    model = torch.nn.Linear(2, 1)
    with pytest.raises(Made):
        DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            model.named_parameters(),
            kvstore="dist_sync",
        )
    assert made == {"name": "dist_sync", "recovery": Recovery, "joining": Joining}
