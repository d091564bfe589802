"""The chunked, threaded optimizers (hetps.optim.kernels) give bit for bit the results of the
whole-array NumPy code they replaced, and allocate no temporary the size of the key."""

from __future__ import annotations

import threading
import tracemalloc

import numpy as np
import pytest

from hetps import optim
from hetps.optim import kernels
from hetps.optim.dcasgd import dcasgd_delta

# more than MIN_PARALLEL elements (so the spans run on two threads), not a multiple of CHUNK
N = kernels.MIN_PARALLEL + 3 * kernels.CHUNK + 17


@pytest.fixture(autouse=True)
def two_threads():
    kernels.set_threads(2)
    yield
    kernels.set_threads(0)


# -- the whole-array code the optimizers ran before (the reference) -------------------------
def ref_sgd(opt, weight, grad, state):
    dtype = optim.compute_dtype(weight)
    g = opt.preprocess_grad(grad, dtype)
    if opt.wd != 0.0:
        g += np.multiply(weight, opt.wd, dtype=dtype)
    if opt.momentum == 0.0:
        g *= -opt.learning_rate
        np.add(weight, g, out=weight, casting="same_kind")
        return
    mom = state["mom"]
    mom *= opt.momentum
    g *= opt.learning_rate
    mom -= g
    np.add(weight, mom, out=weight, casting="same_kind")


def ref_adam(opt, weight, grad, state):
    import math

    dtype = optim.compute_dtype(weight)
    state["t"] += 1
    t = state["t"]
    lr_t = opt.learning_rate * math.sqrt(1.0 - opt.beta2**t) / (1.0 - opt.beta1**t)
    g = np.multiply(grad, opt.rescale_grad, dtype=dtype)
    if opt.wd != 0.0:
        g += np.multiply(weight, opt.wd, dtype=dtype)
    clip = opt.clip_gradient
    if clip is not None and clip > 0:
        np.clip(g, -clip, clip, out=g)
    mean, var = state["mean"], state["var"]
    mean *= opt.beta1
    mean += (1.0 - opt.beta1) * g
    g *= g
    var *= opt.beta2
    var += (1.0 - opt.beta2) * g
    np.sqrt(var, out=g)
    g += opt.epsilon
    np.divide(mean, g, out=g)
    g *= -lr_t
    np.add(weight, g, out=weight, casting="same_kind")


def ref_dcasgd(opt, weight, grad, state, sender):
    dtype = optim.compute_dtype(weight)
    g = opt.preprocess_grad(grad, dtype)
    w = weight.astype(dtype, copy=False)
    backup, mom = state["backup"], state["mom"]
    step, new_mom = dcasgd_delta(
        w, g, backup.get(sender), opt.learning_rate, opt.lamda, opt.wd, opt.momentum, mom
    )
    if new_mom is not None:
        np.copyto(mom, new_mom)
    np.add(weight, step, out=weight, casting="same_kind")
    backup[sender] = weight.copy()


def _copy_state(state):
    if isinstance(state, dict):
        return {k: _copy_state(v) for k, v in state.items()}
    return state.copy() if isinstance(state, np.ndarray) else state


def _run_both(opt, ref, dtype, steps=3, senders=(0,), shape=(N,)):
    rng = np.random.default_rng(7)
    w = (rng.standard_normal(shape) * 2).astype(dtype)
    w_ref = w.copy()
    state = opt.create_state("k", w)
    state_ref = _copy_state(state)
    for i in range(steps):
        grad = (rng.standard_normal(shape) * 3).astype(dtype)
        grad_before = grad.copy()
        sender = senders[i % len(senders)]
        if isinstance(opt, optim.DCASGD):
            opt.apply_update("k", w, grad, state, sender)
            ref(opt, w_ref, grad, state_ref, sender)
        else:
            opt.update("k", w, grad, state)
            ref(opt, w_ref, grad, state_ref)
        np.testing.assert_array_equal(grad, grad_before)  # the gradient is not touched
        assert w.dtype == np.dtype(dtype)
        # bit for bit: compare the raw bytes, not the values
        assert w.tobytes() == w_ref.tobytes(), f"step {i}: weights differ"
    return state, state_ref


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize(
    "kw",
    [
        {"momentum": 0.0},
        {"momentum": 0.9},
        {"momentum": 0.9, "wd": 1e-3, "rescale_grad": 0.125, "clip_gradient": 2.5},
        {"momentum": 0.0, "wd": 0.01, "clip_gradient": 1.0},
    ],
)
def test_sgd_is_bit_for_bit_the_whole_array_code(dtype, kw):
    opt = optim.SGD(learning_rate=0.05, **kw)
    state, state_ref = _run_both(opt, ref_sgd, dtype)
    if state is not None:
        assert state["mom"].tobytes() == state_ref["mom"].tobytes()


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize(
    "kw", [{}, {"wd": 1e-2, "rescale_grad": 0.5, "clip_gradient": 1.5, "epsilon": 1e-6}]
)
def test_adam_is_bit_for_bit_the_whole_array_code(dtype, kw):
    opt = optim.Adam(learning_rate=0.01, **kw)
    state, state_ref = _run_both(opt, ref_adam, dtype)
    for name in ("mean", "var"):
        assert state[name].tobytes() == state_ref[name].tobytes()
    assert state["t"] == state_ref["t"] == 3


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize(
    "kw",
    [
        {"momentum": 0.0},
        {"momentum": 0.5, "wd": 1e-3, "rescale_grad": 0.25, "clip_gradient": 3.0},
        {"momentum": 0.0, "lamda": 0.0},
        {"momentum": 0.0, "wd": 0.1},
    ],
)
def test_dcasgd_is_bit_for_bit_the_whole_array_code(dtype, kw):
    opt = optim.DCASGD(learning_rate=0.05, **kw)
    # two workers: the second push of each is compensated against its own backup
    state, state_ref = _run_both(opt, ref_dcasgd, dtype, steps=5, senders=(1, 2))
    assert sorted(state["backup"]) == [1, 2]
    for s in (1, 2):
        assert state["backup"][s].tobytes() == state_ref["backup"][s].tobytes()


def test_a_strided_weight_takes_the_whole_array_path_with_the_same_result():
    rng = np.random.default_rng(3)
    big = rng.standard_normal((64, 2 * 64)).astype(np.float32)
    other = big[:, 1::2].copy()
    w = big[:, ::2]  # not contiguous
    w_ref = w.copy()
    opt = optim.Adam(learning_rate=0.01, wd=1e-3)
    st, st_ref = opt.create_state("k", w), opt.create_state("k", w_ref)
    grad = rng.standard_normal((64, 64)).astype(np.float32)
    opt.update("k", w, grad, st)
    ref_adam(opt, w_ref, grad, st_ref)
    assert np.ascontiguousarray(w).tobytes() == w_ref.tobytes()
    assert big[:, 1::2].tobytes() == other.tobytes()  # the columns between are untouched


@pytest.mark.parametrize(
    "opt",
    [
        optim.SGD(learning_rate=0.1, momentum=0.9, wd=1e-4),
        optim.Adam(learning_rate=0.1, wd=1e-4),
        optim.DCASGD(learning_rate=0.1, momentum=0.9),
    ],
    ids=["sgd", "adam", "dcasgd"],
)
def test_an_update_allocates_no_array_the_size_of_the_key(opt):
    n = 1 << 20  # 4 MiB of float32
    w = np.ones(n, np.float32)
    grad = np.full(n, 0.5, np.float32)
    state = opt.create_state("k", w)
    opt.apply_update("k", w, grad, state, 1)  # warm up: scratch buffers, DC-ASGD's backup
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        opt.apply_update("k", w, grad, state, 1)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # the whole-array code allocated at least one float32 temporary of n elements (4 MiB)
    assert peak < n * 4 // 8, f"an update allocated {peak} bytes"


def test_big_updates_run_on_several_threads(monkeypatch):
    seen = set()
    span = kernels._span

    def spy(*args):
        seen.add(threading.get_ident())
        span(*args)

    monkeypatch.setattr(kernels, "_span", spy)
    w = np.zeros(N, np.float32)
    optim.SGD(learning_rate=1.0).update("k", w, np.ones(N, np.float32), None)
    assert len(seen) == 2
    np.testing.assert_array_equal(w, -1.0)
    seen.clear()
    kernels.set_threads(1)
    optim.SGD(learning_rate=1.0).update("k", w, np.ones(N, np.float32), None)
    assert len(seen) == 1


def test_add_into_sums_in_place_and_run_checks_sizes():
    a = np.arange(N, dtype=np.float32)
    b = np.full(N, 0.25, np.float32)
    expect = a + b
    out = kernels.add_into(a, a, b)
    assert out is a and a.tobytes() == expect.tobytes()
    with pytest.raises(ValueError, match="elements cannot run together"):
        kernels.add_into(a, a, b[:-1])


def test_an_error_on_a_thread_is_raised_to_the_caller():
    def body(views, scratch):
        if views[0][0] > 0:  # only the second span's chunks
            raise RuntimeError("boom in a span")

    with pytest.raises(RuntimeError, match="boom in a span"):
        kernels.run(body, [np.arange(N, dtype=np.float32)])


def test_set_threads_checks_its_argument():
    with pytest.raises(ValueError, match="integer >= 0"):
        kernels.set_threads(-1)
    with pytest.raises(ValueError, match="integer >= 0"):
        kernels.set_threads(1.5)
    assert kernels.set_threads(3) == 3 and kernels.threads() == 3


def _update_in_child(q) -> None:
    w = np.zeros(N, np.float32)
    optim.SGD(learning_rate=1.0).update("k", w, np.ones(N, np.float32), None)
    q.put(float(w.sum()))


def test_a_forked_child_gets_threads_of_its_own():
    import multiprocessing as mp

    w = np.zeros(N, np.float32)
    optim.SGD(learning_rate=1.0).update("k", w, np.ones(N, np.float32), None)  # pool started
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    child = ctx.Process(target=_update_in_child, args=(q,))
    child.start()
    try:
        assert q.get(timeout=30) == -N  # the parent's pool threads do not exist in the child
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
            child.join()
    assert child.exitcode == 0


def test_sum_into_adds_in_order_in_one_pass():
    rng = np.random.default_rng(11)
    arrs = [rng.standard_normal(N).astype(np.float32) for _ in range(4)]
    out = np.empty(N, np.float32)
    kernels.sum_into(out, arrs)
    assert out.tobytes() == (((arrs[0] + arrs[1]) + arrs[2]) + arrs[3]).tobytes()
    kernels.sum_into(out, arrs[:1])
    assert out.tobytes() == arrs[0].tobytes()
    first = arrs[0].copy()
    kernels.sum_into(first, [first, arrs[1]])  # out may be the first array
    assert first.tobytes() == (arrs[0] + arrs[1]).tobytes()
    with pytest.raises(ValueError, match="at least one array"):
        kernels.sum_into(out, [])
