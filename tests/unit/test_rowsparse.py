"""Row-sparse values on the worker: coalescing gradients (sums equal nn.Embedding's dense
backward bit for bit), the seeded initial rows, ids, and Table's checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hetps.tables.rowsparse import RowSparse, Table, coalesce, initial_rows, row_ids


def embedding_grads(seed: int):
    torch.manual_seed(seed)
    w = torch.randn(40, 4)
    sparse = torch.nn.Embedding(40, 4, sparse=True, _weight=w.clone())
    dense = torch.nn.Embedding(40, 4, _weight=w.clone())
    ids = torch.randint(0, 40, (96, 2))  # ~5 entries per row: the order of their sum matters
    up = torch.randn(96, 2, 4)
    (sparse(ids) * up).sum().backward()
    (dense(ids) * up).sum().backward()
    return sparse.weight.grad, dense.weight.grad.numpy()


@pytest.mark.parametrize("seed", range(5))
def test_sparse_gradient_sums_equal_the_dense_backward_bit_for_bit(seed):
    g, dense = embedding_grads(seed)
    for value in (g, (g._indices()[0], g._values())):  # a COO tensor, or (ids, rows)
        ids, rows = coalesce(value, 4, np.dtype(np.float32), "push")
        assert np.all(ids[1:] > ids[:-1])
        assert np.array_equal(rows, dense[ids])
        untouched = np.setdiff1d(np.arange(40), ids)
        assert not dense[untouched].any()


def test_coalesce_checks():
    with pytest.raises(ValueError, match="3 row ids but values of shape"):
        coalesce(([1, 2, 3], np.zeros((2, 4), np.float32)), 4, np.dtype(np.float32), "push")
    with pytest.raises(ValueError, match="dtype float64"):
        coalesce(([1], np.zeros((1, 4))), 4, np.dtype(np.float32), "push")
    with pytest.raises(TypeError, match="row_ids must be integers"):
        row_ids(np.array([1.5]), "pull")
    rs = RowSparse([2, 5], np.ones((2, 3), np.float32), (6, 3))
    assert coalesce(rs, 3, np.dtype(np.float32), "p")[0].tolist() == [2, 5]
    assert rs.asnumpy()[[2, 5]].sum() == 6 and rs.asnumpy().sum() == 6


def test_initial_rows_depend_on_seed_and_id_only():
    a = initial_rows(0.5, 3, np.array([7, 1_000_003]), 8, np.float32)
    b = initial_rows(0.5, 3, np.array([1_000_003]), 8, np.float32)
    assert np.array_equal(a[1], b[0])  # the same row wherever (and with whatever) it is made
    assert np.abs(a).max() < 0.5 and a.std() > 0.1
    assert not np.array_equal(a, initial_rows(0.5, 4, np.array([7, 1_000_003]), 8, np.float32))
    assert not initial_rows(0.0, 3, np.array([1]), 8, np.float32).any()


def test_table_checks():
    with pytest.raises(ValueError, match="cols must be"):
        Table(10, 0)
    with pytest.raises(ValueError, match="growing table"):
        Table(None, 4, value=np.zeros((1, 4)))
    with pytest.raises(ValueError, match="does not match"):
        Table(3, 4, value=np.zeros((4, 3)))
    assert Table(None, 4).bound == 1 << 30 and Table(10, 4).bound == 0
