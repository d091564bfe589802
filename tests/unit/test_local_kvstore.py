"""The local store follows the same semantics as the distributed one."""

from __future__ import annotations

import numpy as np
import pytest

import hetps.config
import hetps.kv
import hetps.kvstore
from hetps import optim


def test_local_semantics():
    kv = hetps.kv.create("local")
    assert kv.type == "local" and kv.rank == 0 and kv.num_workers == 1
    kv.init([1, "b"], [np.ones(3, np.float32), np.zeros((2, 2))])
    kv.push(1, [np.ones(3, np.float32), np.full(3, 2, np.float32)])  # summed, replaces
    out = [np.zeros(3, np.float32), np.zeros(3, np.float32)]
    kv.pull(1, out=out)
    assert (out[0] == 3).all() and (out[1] == 3).all()
    kv.pull(1, out=out[0], ignore_sparse=False)  # MXNet's signature
    kv.set_optimizer(optim.SGD(learning_rate=0.5))
    kv.pushpull("b", np.ones((2, 2)), out=(o := np.zeros((2, 2))))
    assert (o == -0.5).all()
    with pytest.raises(ValueError, match=r"shape \(3,\).*key's shape \(2, 2\)"):
        kv.push("b", np.ones(3))
    with pytest.raises(KeyError, match="never initialised"):
        kv.pull("nope")
    with pytest.raises(TypeError, match="float16, float32 or float64"):
        kv.init("i", np.zeros(2, np.int32))


def test_unknown_store_name():
    with pytest.raises(ValueError, match="dist_sync"):
        hetps.kv.create("dist_fast")


def test_local_compression_and_states(tmp_path):
    kv = hetps.kv.create("device")
    kv.init(0, np.zeros(4, np.float32))
    kv.set_gradient_compression({"type": "2bit", "threshold": 1.0})
    kv.push(0, np.array([0.6, 1.2, -1.5, 0.2], np.float32))
    assert kv.pull(0).tolist() == [0.0, 1.0, -1.0, 0.0]
    kv.push(0, np.array([0.6, 0.0, 0.0, 0.0], np.float32))  # residual 0.6 + 0.6 crosses 1.0
    assert kv.pull(0).tolist() == [1.0, 0.0, 0.0, 0.0]
    kv.set_optimizer(optim.Adam(learning_rate=0.1))
    kv.push(0, np.ones(4, np.float32))
    kv.save_optimizer_states(str(tmp_path / "s"))
    kv2 = hetps.kv.create("local")
    kv2.load_optimizer_states(str(tmp_path / "s"))
    assert set(kv2.states) == {0}


def test_pull_takes_mxnets_arguments():
    """A script written for MXNet passes ``ignore_sparse``; both stores take it."""
    import inspect

    from hetps.kvstore.client import DistKVStore
    from hetps.kvstore.local import LocalKVStore

    for store in (DistKVStore, LocalKVStore):
        assert "ignore_sparse" in inspect.signature(store.pull).parameters, store


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"HETPS_BALANCE": "bogus"}, r"HETPS_BALANCE='bogus'.*one of none, average, elastic"),
        ({"HETPS_BATCH_BYTES": "-1"}, r"HETPS_BATCH_BYTES=-1 is below 0"),
        ({"PS_VERBOSE": "loud"}, r"PS_VERBOSE='loud' is not an integer"),
        (  # (below what one message may carry: a table pull's rows)
            {"HETPS_MAX_MESSAGE_BYTES": str(8 << 20)},
            r"HETPS_MAX_MESSAGE_BYTES=8388608 is below.*HETPS_TABLE_PULL_BYTES=16777216",
        ),
    ],
)
def test_a_local_store_refuses_a_bad_setting_as_a_node_does(env, named):
    """A local store checks the variables a node reads: the error names the variable, the
    value and what to set it to, from either entry point; the same setting done right is
    taken."""
    for create in (hetps.kv.create, hetps.kvstore.create):
        with pytest.raises(hetps.config.ConfigError, match=named):
            create("local", env=env)
    assert hetps.kv.create("local", env={"HETPS_BALANCE": "aware"}).type == "local"
