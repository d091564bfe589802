"""The device server's aggregator (HETPS_SERVER_DEVICE, hetps.device.aggregator) against the
NumPy one, driven the way KVServer drives them, on torch's CPU device (``torch:cpu``, the
same code as on CUDA) and on a stand-in of torch.cuda (tests/cuda_standin.py: the CUDA
branch's page-locked staging, events and copies, whose misuse raises): the same rounds give
the same values, SGD bit for bit."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hetps import optim  # noqa: E402
from hetps.device import aggregator as ondevice  # noqa: E402
from hetps.kvstore.aggregate import Aggregator  # noqa: E402
from hetps.kvstore.compression import TwoBitCompressor  # noqa: E402
from hetps.kvstore.slices import Slice  # noqa: E402
from hetps.roles import DeviceAggregator  # noqa: E402
from hetps.transport.codec import Message  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cuda_standin import StandInCuda  # noqa: E402

W, N, CE = 3, 1000, 256  # workers, elements, elements per chunk (the last chunk is short)


def device(where: str) -> ondevice.Device:
    """``torch:cpu``, or the CUDA branch on the stand-in of torch.cuda (``standin``)."""
    if where == "standin":
        return ondevice.Device(torch, torch.device("cpu"), "standin", driver=StandInCuda())
    return ondevice.open_device(where)


def pair(opt, dtype=np.float32, seed=0, where="torch:cpu"):
    """A NumPy aggregator and a device one, each with a slice of the same first value."""
    w0 = np.random.default_rng(seed).standard_normal(N).astype(dtype)
    out = []
    for agg in (
        Aggregator(lambda: W, lambda: opt),
        DeviceAggregator(lambda: W, lambda: opt, device(where)),
    ):
        out.append((agg, Slice("w", 0, (N,), w0.copy())))
    return out


def round_of(agg, sl, grads, order, comp=None):
    """One dist_sync round as KVServer._add_to_round runs it: chunks in ``order``
    ((worker, offset) pairs), the round finished once every worker pushed the whole part."""
    for worker, off in order:
        n = min(CE, N - off)
        data = grads[worker][off : off + n]
        if comp is not None:
            data = TwoBitCompressor(comp).compress(
                grads[worker][off : off + n], np.zeros(n, np.float32)
            )
        msg = Message("push", sender=worker)
        if not agg.first_whole(sl, msg, data, comp, off, n, CE):
            agg.start(sl, CE)
            agg.add_chunk(sl, msg, data, comp, off, n)
        sl.seen.setdefault(worker, set()).add(off)
    agg.finish(sl)


def orders(rng):
    cells = [(w, off) for w in range(W) for off in range(0, N, CE)]
    rng.shuffle(cells)
    return cells


OPTIMIZERS = {
    "sgd": lambda: optim.SGD(learning_rate=0.1),
    "sgd-mom-wd-clip-rescale": lambda: optim.SGD(
        learning_rate=0.05, momentum=0.9, wd=1e-3, clip_gradient=0.7, rescale_grad=1 / 3
    ),
    "sgd-mom-rescale": lambda: optim.SGD(learning_rate=0.05, momentum=0.9, rescale_grad=0.25),
    "adam": lambda: optim.Adam(learning_rate=0.01, wd=1e-4, clip_gradient=2.0, rescale_grad=0.5),
    "none": lambda: None,
}


@pytest.mark.parametrize("where", ["torch:cpu", "standin"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_device_rounds_equal_the_numpy_servers(name, dtype, where):
    opt = OPTIMIZERS[name]()
    (cpu, a), (dev, b) = pair(opt, dtype, where=where)
    rng = np.random.default_rng(1)
    for rnd in range(4):
        grads = [rng.standard_normal(N).astype(dtype) for _ in range(W)]
        order = orders(rng)
        round_of(cpu, a, grads, order)
        round_of(dev, b, grads, order)
        assert b.value.dtype == a.value.dtype
        if name == "adam":
            np.testing.assert_allclose(b.value, a.value, rtol=1e-6, atol=1e-7)
        else:
            assert b.value.tobytes() == a.value.tobytes(), (rnd, np.abs(b.value - a.value).max())
    assert dev.slots[("w", 0)].weight is not None or opt is None  # it did run on the device
    # the state too (a float16 weight's float32 state shows what rounding to float16 hides)
    sa, sb = cpu.host_state(a), dev.host_state(b)
    for name_ in sa or {}:
        if name == "adam" or not isinstance(sa[name_], np.ndarray):
            np.testing.assert_allclose(sb[name_], sa[name_], rtol=1e-6, atol=1e-9)
        else:
            assert sb[name_].tobytes() == sa[name_].tobytes(), name_


@pytest.mark.parametrize("where", ["torch:cpu", "standin"])
def test_two_bit_pushes_are_decoded_on_the_host_and_summed_on_the_device(where):
    opt = optim.SGD(learning_rate=0.1, momentum=0.5)
    (cpu, a), (dev, b) = pair(opt, where=where)
    rng = np.random.default_rng(2)
    for _ in range(3):
        grads = [rng.standard_normal(N).astype(np.float32) for _ in range(W)]
        order = orders(rng)
        round_of(cpu, a, grads, order, comp=0.5)
        round_of(dev, b, grads, order, comp=0.5)
        np.testing.assert_array_equal(b.value, a.value)


@pytest.mark.parametrize("where", ["torch:cpu", "standin"])
def test_async_steps_states_out_and_in_and_an_init(where):
    """dist_async applies (whole gradients), get_states' host copy, a set_states (a new
    state object is taken to the device), an init writing the value in place."""
    opt = optim.Adam(learning_rate=0.01)
    (cpu, a), (dev, b) = pair(opt, where=where)
    rng = np.random.default_rng(3)
    for _ in range(3):
        g = rng.standard_normal(N).astype(np.float32)
        cpu.apply(a, g, 0)
        dev.apply(b, g, 0)
    np.testing.assert_allclose(b.value, a.value, rtol=1e-6, atol=1e-7)
    sa, sb = cpu.host_state(a), dev.host_state(b)
    assert isinstance(sb["mean"], np.ndarray) and sb["t"] == sa["t"] == 3
    np.testing.assert_allclose(sb["var"], sa["var"], rtol=1e-6, atol=1e-9)
    # set_states: the server puts a new state object on the slice; so does an init's value
    fresh = opt.create_state(("w", 0), a.value)
    a.state, b.state = fresh, {k: (v.copy() if hasattr(v, "copy") else v) for k, v in fresh.items()}
    a.value[:10] = 7.0
    b.value[:10] = 7.0
    dev.value_changed(b)
    g = rng.standard_normal(N).astype(np.float32)
    cpu.apply(a, g, 0)
    dev.apply(b, g, 0)
    np.testing.assert_allclose(b.value, a.value, rtol=1e-6, atol=1e-7)
    assert dev.host_state(b)["t"] == 1


@pytest.mark.parametrize("where", ["torch:cpu", "standin"])
def test_an_optimizer_without_a_device_step_runs_on_the_host(capsys, where):
    opt = optim.AdaGrad(learning_rate=0.1)
    (cpu, a), (dev, b) = pair(opt, where=where)
    rng = np.random.default_rng(4)
    for _ in range(3):
        grads = [rng.standard_normal(N).astype(np.float32) for _ in range(W)]
        order = orders(rng)
        round_of(cpu, a, grads, order)
        round_of(dev, b, grads, order)
        assert b.value.tobytes() == a.value.tobytes()
    assert dev.slots[("w", 0)].weight is None and isinstance(b.state["history"], np.ndarray)
    said = capsys.readouterr().err
    assert said.count("AdaGrad steps on the host (only SGD and Adam have a device step)") == 1


def test_the_pull_buffer_is_copied_once_per_round_and_reused():
    """The value pulls read is a host buffer the round's result is copied into; the last
    round's buffer is taken again when no reply reads it."""
    opt = optim.SGD(learning_rate=0.1)
    _, (dev, b) = pair(opt)
    rng = np.random.default_rng(5)
    seen = []
    for _ in range(4):
        grads = [rng.standard_normal(N).astype(np.float32) for _ in range(W)]
        round_of(dev, b, grads, orders(rng))
        seen.append(b.value.__array_interface__["data"][0])
    assert len(set(seen)) == 2, seen  # two buffers, alternating


def test_device_values_are_checked_with_a_clear_error():
    with pytest.raises(ValueError, match="is not a device: set it to one of"):
        ondevice.parse("gpu0")
    assert ondevice.parse("cpu") is None and ondevice.parse("cuda:1") == ("cuda", 1)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="torch sees no CUDA device.*use HETPS_SERVER"):
            ondevice.open_device("cuda:0")


def test_a_key_made_again_with_another_dtype_gets_buffers_of_that_dtype():
    """An init of another dtype makes a new Slice of the same key: the device buffers kept
    for the old one (merge, value) are not reused for it."""
    opt = optim.SGD(learning_rate=0.1, momentum=0.9)
    (cpu, a), (dev, b) = pair(opt)
    rng = np.random.default_rng(6)
    for dtype in (np.float32, np.float64, np.float32):
        w0 = rng.standard_normal(N).astype(dtype)
        a, b = Slice("w", 0, (N,), w0.copy()), Slice("w", 0, (N,), w0.copy())
        for _ in range(2):
            grads = [rng.standard_normal(N).astype(dtype) for _ in range(W)]
            order = orders(rng)
            round_of(cpu, a, grads, order)
            round_of(dev, b, grads, order)
            assert b.value.dtype == dtype and b.value.tobytes() == a.value.tobytes()


def test_the_device_keeps_two_uploads_in_flight_and_waits_for_the_older():
    """The CUDA branch's staging is double-buffered: an upload waits for the copy two
    uploads back (whose host buffer it writes), not for the last one."""
    d = StandInCuda()
    dev = ondevice.Device(torch, torch.device("cpu"), "standin", driver=d)
    got = []
    for i in range(5):
        got.append(dev.upload(np.full(1000, i, np.float32)).clone())
        assert d.host_waits == max(0, i - 1), i  # the first two uploads wait for nothing
    assert [float(t.mean()) for t in got] == [0.0, 1.0, 2.0, 3.0, 4.0]
