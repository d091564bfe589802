"""Device tensors in the KVStore (hetps.device.staging), on a simulated device whose copies
run as late as a real one's may: values and dtypes exact, lists over devices summed on a
device, no stale value when a copy is still queued, host buffers reused only when free."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from deferred_device import DeferredBackend  # noqa: E402
from hetps.device import staging as devices  # noqa: E402
from hetps.kvstore.local import LocalKVStore  # noqa: E402


@pytest.fixture
def dev():
    backend = DeferredBackend()
    devices.register_backend(backend)
    try:
        yield backend
    finally:
        devices.unregister_backend(backend)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_push_and_pull_of_device_tensors_are_exact(dev, dtype):
    kv = LocalKVStore()
    rng = np.random.default_rng(1)
    v = rng.standard_normal((3, 5)).astype(dtype)
    kv.init("w", dev.array(np.zeros((3, 5), dtype)))
    kv.push("w", dev.array(v))
    out = dev.array(np.zeros((3, 5), dtype))
    kv.pull("w", out=out)
    got = out.read()
    assert got.dtype == np.dtype(dtype)
    assert np.array_equal(got, v)
    assert dev.to_host_copies == 2 and dev.to_device_copies == 1


def test_a_list_over_devices_is_summed_on_a_device_and_lands_on_every_out(dev):
    kv = LocalKVStore()
    kv.init("w", np.zeros(4, np.float32))
    a = dev.array(np.arange(4, dtype=np.float32), device=0)
    b = dev.array(np.full(4, 10, np.float32), device=1)
    kv.push("w", [a, b, np.ones(4, np.float32)])  # two devices and the host
    assert dev.reductions == 1 and dev.to_host_copies == 1  # one copy leaves the device
    outs = [dev.array(np.zeros(4, np.float32), d) for d in (0, 1)]
    host = np.zeros(4, np.float32)
    kv.pull("w", out=[host, *outs])
    want = np.arange(4, dtype=np.float32) + 11
    assert np.array_equal(host, want)
    for o in outs:
        assert np.array_equal(o.read(), want)


def test_a_pulled_value_is_never_read_stale_and_a_busy_buffer_is_not_reused(dev):
    """Two pulls into two device tensors before either is read: the first's copy to the
    device has not run when the second lands, so the second must get another host buffer,
    and each read must wait for its own copy."""
    kv = LocalKVStore()
    kv.init("a", np.full(8, 1.0, np.float32))
    kv.init("b", np.full(8, 2.0, np.float32))
    out_a = dev.array(np.zeros(8, np.float32))
    out_b = dev.array(np.zeros(8, np.float32))
    kv.pull("a", out=out_a)
    kv.pull("b", out=out_b)
    assert np.array_equal(out_b.read(), np.full(8, 2.0))
    assert np.array_equal(out_a.read(), np.full(8, 1.0))


def test_buffers_are_reused_once_free_and_freed_when_a_call_fails(dev):
    kv = LocalKVStore()
    kv.init("w", np.zeros(16, np.float32))
    out = dev.array(np.zeros(16, np.float32))
    for i in range(5):
        kv.push("w", dev.array(np.full(16, i, np.float32)))
        kv.pull("w", out=out)
        assert np.array_equal(out.read(), np.full(16, i))
    pooled = devices.STAGING.buffers()
    # calls that fail after staging a value: the second key was never initialised
    for _ in range(3):
        with pytest.raises(KeyError, match="never initialised"):
            kv.push(["w", "nokey"], [dev.array(np.zeros(16, np.float32))] * 2)
        with pytest.raises(KeyError, match="never initialised"):
            kv.pull(["w", "nokey"], out=[dev.array(np.zeros(16, np.float32))] * 2)
    for i in range(5):
        kv.push("w", dev.array(np.full(16, i, np.float32)))
        kv.pull("w", out=out)
        assert np.array_equal(out.read(), np.full(16, i))
    # the failed calls' buffers came back to the pool: it did not grow
    assert devices.STAGING.buffers() == pooled


def test_values_on_unlike_devices_or_dtypes_are_refused_by_name(dev):
    kv = LocalKVStore()
    kv.init("w", np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="values to sum differ"):
        kv.push("w", [dev.array(np.zeros(4, np.float32)), dev.array(np.zeros(4, np.float64))])
    with pytest.raises(TypeError, match="int64 is not supported"):
        kv.init("i", dev.array(np.zeros(4, np.int64)))
    other = DeferredBackend()
    devices.register_backend(other)
    try:
        with pytest.raises(ValueError, match="different kinds of device"):
            kv.push("w", [dev.array(np.zeros(4, np.float32)), other.array(np.zeros(4, np.float32))])
    finally:
        devices.unregister_backend(other)


def test_a_tensor_on_a_device_nobody_stages_gets_a_clear_error():
    torch = pytest.importorskip("torch")
    kv = LocalKVStore()
    kv.init("w", np.zeros(4, np.float32))
    with pytest.raises(TypeError, match=r"CPU and CUDA tensors.*\.cpu\(\)"):
        kv.push("w", torch.zeros(4, device="meta"))


def test_a_value_staged_in_one_thread_is_pushed_from_another(dev):
    """The DistributedOptimizer's path: its hook queues the copy (stage), its launcher thread
    pushes; the push waits for that copy, and its buffer comes back to the pool."""
    import threading

    kv = LocalKVStore()
    kv.init("w", np.zeros(6, np.float32))
    v = dev.array(np.arange(6, dtype=np.float32))
    staged = devices.stage(v)
    errors = []

    def push():
        try:
            kv.push("w", staged)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    t = threading.Thread(target=push)
    t.start()
    t.join()
    assert not errors
    v.write(-1.0)  # (written only once the push returned: the copy may run until then)
    assert np.array_equal(kv.pull("w"), np.arange(6))
    before = devices.STAGING.buffers()
    kv.push("w", devices.stage(dev.array(np.ones(6, np.float32))))
    assert devices.STAGING.buffers() == before  # the first stage's buffer was free again
    with pytest.raises(ValueError, match="goes alone"):
        kv.push("w", [devices.stage(v), v])


def _answered():
    from hetps.cluster.requests import Future

    f = Future(1, 8, "pull", None)
    f.set_result(None)
    return f


def test_a_pulls_buffer_is_not_lent_again_before_its_copies_are_queued(dev):
    """A pull's answers are in, its handle not waited for yet (the copy to the device is
    owed): another pull of that shape gets another buffer, and each out its own value."""
    out_a = dev.array(np.zeros(4, np.float32))
    out_b = dev.array(np.zeros(4, np.float32))
    (host_a,) = devices.STAGING.pull_targets(out_a, "pull a")
    host_a[...] = 1.0  # the answer landed
    land_a = devices.STAGING.settle([_answered()])
    (host_b,) = devices.STAGING.pull_targets(out_b, "pull b")
    assert host_b is not host_a
    host_b[...] = 2.0
    land_b = devices.STAGING.settle([_answered()])
    land_b()
    land_a()
    assert np.array_equal(out_a.read(), np.full(4, 1.0))
    assert np.array_equal(out_b.read(), np.full(4, 2.0))


def test_a_buffer_copied_to_several_devices_waits_for_every_copy(dev):
    outs = [dev.array(np.zeros(4, np.float32), d) for d in (0, 1)]
    (host,) = devices.STAGING.pull_targets(outs, "pull a")
    host[...] = 1.0
    devices.STAGING.settle([_answered()])()
    assert np.array_equal(outs[1].read(), np.full(4, 1.0))  # device 1's copy ran, not 0's
    later = dev.array(np.zeros(4, np.float32), 0)
    (host2,) = devices.STAGING.pull_targets(later, "pull b")
    assert host2 is not host  # device 0 still reads the first buffer
    host2[...] = 2.0
    devices.STAGING.settle([_answered()])()
    assert np.array_equal(outs[0].read(), np.full(4, 1.0))
    assert np.array_equal(later.read(), np.full(4, 2.0))


def test_a_failed_pulls_buffer_comes_back(dev):
    from hetps.cluster.requests import Future

    out = dev.array(np.zeros(4, np.float32))
    (host,) = devices.STAGING.pull_targets(out, "pull")
    failed = Future(1, 8, "pull", None)
    failed.set_error(RuntimeError("the server died"))
    devices.STAGING.settle([failed])  # its handle raises: the copies are never queued
    (again,) = devices.STAGING.pull_targets(out, "pull")
    assert again is host
    devices.STAGING.abandon()


def test_a_staged_value_that_is_never_pushed_gives_its_buffer_back(dev):
    v = dev.array(np.zeros(5, np.float32))
    staged = devices.stage(v)
    devices.STAGING.release(staged)  # (its push never started)
    dev.wait_host(staged.event)  # its copy finished
    again = devices.stage(v)
    assert again.buffer is staged.buffer
    devices.STAGING.release(again)


def test_a_pull_whose_finisher_fails_gives_its_buffer_back_uncopied(dev):
    """A pull through the host (docs/HOSTS.md) has no requests of its own: its error is its
    finisher's. The copies to the devices are never queued, and its buffer comes back."""
    from hetps.kvstore.base import settle_after

    out = dev.array(np.full(4, 7.0, np.float32))
    (host,) = devices.STAGING.pull_targets(out, "pull")

    def fails() -> None:
        host[...] = 1.0  # (some of it landed)
        raise RuntimeError("local rank 1 died")

    with pytest.raises(RuntimeError, match="local rank 1 died"):
        settle_after([], [fails])()
    assert dev.to_device_copies == 0
    (again,) = devices.STAGING.pull_targets(out, "pull")
    assert again is host
    devices.STAGING.abandon()
    assert np.array_equal(out.read(), np.full(4, 7.0))
