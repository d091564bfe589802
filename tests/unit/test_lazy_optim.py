"""Lazy (row-sparse) optimizer rules against MXNet's documented update rules, row by row."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hetps.optim import DCASGD, SGD, AdaGrad, Adam
from hetps.tables import lazy
from hetps.tables.lazy import LazyUnsupported, create_table_state, grow_state, update_rows


def table():
    return np.array([[1, 2], [3, 4], [5, 6], [7, 8]], np.float32)


def test_sgd_exact_vector():
    # MXNet sgd_update, lazy: for row in grad.indices: w[row] -= lr * (grad[row] + wd * w[row])
    w = table()
    opt = SGD(learning_rate=0.5)
    update_rows(opt, "k", w, np.array([0, 2]), np.array([[1, 1], [2, -2]], np.float32), {})
    assert w.tolist() == [[0.5, 1.5], [3, 4], [4, 7], [7, 8]]


def test_sgd_momentum_exact_vector_and_untouched_state():
    # v[row] = momentum * v[row] - lr * (grad[row] + wd * w[row]); w[row] += v[row]
    w = table()
    opt = SGD(learning_rate=0.5, momentum=0.5, wd=0.25)
    st = create_table_state(opt, 4, 2, np.float32)
    st["mom"][:] = [[1, 1], [2, 2], [4, 4], [8, 8]]
    update_rows(opt, "k", w, np.array([1]), np.array([[1, 0]], np.float32), st)
    # g = [1 + 0.25*3, 0 + 0.25*4] = [1.75, 1]; v = 0.5*[2,2] - 0.5*g = [0.125, 0.5]
    assert st["mom"].tolist() == [[1, 1], [0.125, 0.5], [4, 4], [8, 8]]
    assert w.tolist() == [[1, 2], [3.125, 4.5], [5, 6], [7, 8]]


def reference(kind, opt, w, st, rows, grad, t):
    """MXNet's documented rules in float64, one touched row at a time."""
    w, st = w.astype(np.float64), {k: v.astype(np.float64) for k, v in st.items()}
    for r, g0 in zip(rows, grad.astype(np.float64), strict=True):
        g = g0 * opt.rescale_grad
        if kind == "sgd":
            if opt.clip_gradient:
                g = np.clip(g, -opt.clip_gradient, opt.clip_gradient)
            g = g + opt.wd * w[r]
            st["mom"][r] = opt.momentum * st["mom"][r] - opt.learning_rate * g
            w[r] += st["mom"][r]
        elif kind == "adam":
            g = g + opt.wd * w[r]
            if opt.clip_gradient:
                g = np.clip(g, -opt.clip_gradient, opt.clip_gradient)
            lr_t = opt.learning_rate * math.sqrt(1 - opt.beta2**t) / (1 - opt.beta1**t)
            st["mean"][r] = opt.beta1 * st["mean"][r] + (1 - opt.beta1) * g
            st["var"][r] = opt.beta2 * st["var"][r] + (1 - opt.beta2) * g * g
            w[r] -= lr_t * st["mean"][r] / (np.sqrt(st["var"][r]) + opt.epsilon)
        else:  # adagrad
            if opt.clip_gradient:
                g = np.clip(g, -opt.clip_gradient, opt.clip_gradient)
            st["history"][r] += g * g
            w[r] += (g / np.sqrt(st["history"][r] + opt.eps) + opt.wd * w[r]) * -opt.learning_rate
    return w, st


@pytest.mark.parametrize(
    "kind,opt",
    [
        ("sgd", SGD(learning_rate=0.1, momentum=0.9, wd=0.01, rescale_grad=0.5, clip_gradient=0.4)),
        ("adam", Adam(learning_rate=0.01, wd=0.02, rescale_grad=2.0, clip_gradient=1.5)),
        ("adagrad", AdaGrad(learning_rate=0.1, rescale_grad=0.5, clip_gradient=0.8)),
    ],
)
def test_rules_against_reference_over_rounds(kind, opt):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((50, 8)).astype(np.float32)
    st = create_table_state(opt, 50, 8, np.float32)
    ref_w = w.astype(np.float64)
    ref_st = {k: v.astype(np.float64) for k, v in st.items() if isinstance(v, np.ndarray)}
    for t in range(1, 6):
        rows = np.sort(rng.choice(50, size=12, replace=False))
        grad = rng.standard_normal((12, 8)).astype(np.float32)
        before = {k: v.copy() for k, v in st.items() if isinstance(v, np.ndarray)}
        w_before = w.copy()
        update_rows(opt, "k", w, rows, grad, st)
        ref_w, ref_st = reference(kind, opt, ref_w, ref_st, rows, grad, t)
        np.testing.assert_allclose(w, ref_w, rtol=2e-5, atol=2e-6)
        for k in ref_st:
            np.testing.assert_allclose(st[k], ref_st[k], rtol=2e-5, atol=2e-6)
        untouched = np.setdiff1d(np.arange(50), rows)
        assert np.array_equal(w[untouched], w_before[untouched])  # lazy: weights...
        for k, v in before.items():
            assert np.array_equal(st[k][untouched], v[untouched])  # ...and states unchanged
    if kind == "adam":
        assert st["t"] == 5


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize(
    "kind,make",
    [
        ("sgd", lambda: SGD(learning_rate=0.1, momentum=0.9, wd=0.01, clip_gradient=0.4)),
        ("sgd", lambda: SGD(learning_rate=0.1, momentum=0.0, wd=0.01)),
        ("sgd", lambda: SGD(learning_rate=0.1, momentum=0.9)),  # (these two: the gradient
        ("sgd", lambda: SGD(learning_rate=0.1)),  # scaled by the rate in one pass)
        ("adam", lambda: Adam(learning_rate=0.01)),  # (its gradient used as given, uncopied)
        ("adam", lambda: Adam(learning_rate=0.01, wd=0.02, rescale_grad=2.0, clip_gradient=1.5)),
        ("adagrad", lambda: AdaGrad(learning_rate=0.1, wd=0.01, rescale_grad=0.5)),
    ],
)
def test_rules_in_blocks_of_rows_equal_one_block_bit_for_bit(monkeypatch, kind, make, dtype):
    # update_rows runs its rule a block of rows at a time: 12 rows in blocks of 5, 5 and 2 give
    # every row what one block gives it, to the bit, and MXNet's rule; the gradient is unchanged
    rng = np.random.default_rng(5)
    w0 = rng.standard_normal((50, 8)).astype(dtype)
    rounds = [
        (np.sort(rng.choice(50, size=12, replace=False)), rng.standard_normal((12, 8)))
        for _ in range(4)
    ]
    out = {}
    for block in (5, 1 << 20):
        monkeypatch.setattr(lazy, "ROW_BLOCK_BYTES", block * 8 * lazy._compute(dtype).itemsize)
        opt, w = make(), w0.copy()
        st = create_table_state(opt, 50, 8, dtype)
        ref_w = w.astype(np.float64)
        ref_st = {k: v.astype(np.float64) for k, v in st.items() if isinstance(v, np.ndarray)}
        if kind == "sgd":
            ref_st.setdefault("mom", np.zeros((50, 8)))  # (momentum 0: none kept)
        for t, (rows, g64) in enumerate(rounds, 1):
            grad = g64.astype(dtype)
            update_rows(opt, "k", w, rows, grad, st)
            assert np.array_equal(grad, g64.astype(dtype))
            ref_w, ref_st = reference(kind, opt, ref_w, ref_st, rows, grad, t)
            if dtype == np.float32:
                np.testing.assert_allclose(w, ref_w, rtol=2e-5, atol=2e-6)
                for k in st.keys() & ref_st.keys():
                    np.testing.assert_allclose(st[k], ref_st[k], rtol=2e-5, atol=2e-6)
        out[block] = (w, st)
    (w5, st5), (w1, st1) = out.values()
    assert w5.tobytes() == w1.tobytes()
    for k, v in st1.items():
        assert np.asarray(st5[k]).tobytes() == np.asarray(v).tobytes(), k


def test_adam_counts_rounds_that_touched_no_row_here():
    # MXNet counts updates per key: a round whose rows all live on other servers still counts
    opt = Adam(learning_rate=0.1)
    w = table()
    st = create_table_state(opt, 4, 2, np.float32)
    update_rows(opt, "k", w, np.zeros(0, np.int64), np.zeros((0, 2), np.float32), st)
    assert st["t"] == 1 and np.array_equal(w, table())


def test_lazy_sgd_equals_dense_sgd_bit_for_bit():
    rng = np.random.default_rng(0)
    w_dense = rng.standard_normal((64, 16)).astype(np.float32)
    w_lazy = w_dense.copy()
    opt = SGD(learning_rate=0.05, rescale_grad=0.25)
    for _ in range(5):
        rows = np.sort(rng.choice(64, size=9, replace=False))
        grad = rng.standard_normal((9, 16)).astype(np.float32)
        dense = np.zeros_like(w_dense)
        dense[rows] = grad
        opt.update("k", w_dense, dense, None)
        update_rows(opt, "k", w_lazy, rows, grad, {})
    assert np.array_equal(w_dense, w_lazy)


def test_dense_adagrad_rule():
    opt = AdaGrad(learning_rate=0.5, eps=0.0)
    w = np.array([1.0, 2.0], np.float32)
    st = opt.create_state("k", w)
    opt.update("k", w, np.array([2.0, -4.0], np.float32), st)
    # history = [4, 16]; w += g / sqrt(history) * -lr = [1 - 0.5, 2 + 0.5]
    assert w.tolist() == [0.5, 2.5] and st["history"].tolist() == [4, 16]


def test_grow_state_and_unsupported():
    st = create_table_state(SGD(momentum=0.9), 2, 3, np.float16)
    assert st["mom"].dtype == np.float32
    grow_state(st, 5)
    assert st["mom"].shape == (5, 3)
    with pytest.raises(LazyUnsupported, match="SGD, Adam or AdaGrad"):
        create_table_state(DCASGD(), 2, 3, np.float32)


def test_lazy_adam_is_dense_adam_where_every_row_is_touched_and_differs_where_not():
    # the Adam check, as MXNet documents lazy_update: equal where a round touches
    # every row; rows a round skips keep their weight (a dense step moves them by momentum)
    rng = np.random.default_rng(5)
    w0 = rng.standard_normal((6, 3)).astype(np.float32)
    opt = Adam(learning_rate=0.01, wd=0.001)
    dense_w, lazy_w = w0.copy(), w0.copy()
    dense_st, lazy_st = opt.create_state("k", dense_w), create_table_state(opt, 6, 3, np.float32)
    rows = np.arange(6)
    for _ in range(3):
        grad = rng.standard_normal((6, 3)).astype(np.float32)
        opt.update("k", dense_w, grad, dense_st)
        update_rows(opt, "k", lazy_w, rows, grad, lazy_st)
    np.testing.assert_allclose(lazy_w, dense_w, rtol=1e-6, atol=1e-7)
    grad = np.zeros((6, 3), np.float32)
    grad[:2] = 1.0
    before = lazy_w.copy()
    opt.update("k", dense_w, grad, dense_st)
    update_rows(opt, "k", lazy_w, rows[:2], grad[:2], lazy_st)
    np.testing.assert_allclose(lazy_w[:2], dense_w[:2], rtol=1e-6, atol=1e-7)
    assert np.array_equal(lazy_w[2:], before[2:])  # lazy: untouched rows stay
    assert not np.allclose(dense_w[2:], before[2:], rtol=0, atol=1e-6)  # dense: they move
