"""Row-sparse keys in the single-process store, and DistributedOptimizer(model=...) over it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hetps.kv
from hetps import optim
from hetps.tables.rowsparse import RowSparse, Table
from hetps.torch import DistributedOptimizer


def test_local_row_sparse_pull_push_and_lazy_sgd():
    kv = hetps.kv.create("local")
    dense = np.arange(30, dtype=np.float32).reshape(10, 3)
    kv.init("emb", Table(10, 3, value=dense))
    got = kv.row_sparse_pull("emb", row_ids=[7, 2, 2])
    assert got.indices.tolist() == [2, 7] and np.array_equal(got.data, dense[[2, 7]])
    look = np.zeros((3, 3), np.float32)
    kv.row_sparse_pull("emb", out=look, row_ids=[9, 9, 0])
    assert np.array_equal(look, dense[[9, 9, 0]])
    kv.push("emb", (np.array([1, 1]), np.ones((2, 3), np.float32)))  # no optimizer: replaced
    assert np.array_equal(kv.row_sparse_pull("emb", row_ids=[1]).data, np.full((1, 3), 2.0))
    kv.set_optimizer(optim.SGD(learning_rate=0.5))
    kv.push("emb", RowSparse([4], np.ones((1, 3), np.float32), (10, 3)))
    table = kv.row_sparse_pull("emb", row_ids=np.arange(10)).asnumpy()
    assert np.array_equal(table[4], dense[4] - 0.5) and np.array_equal(table[5], dense[5])
    with pytest.raises(ValueError, match="'emb'.*row id 10"):
        kv.push("emb", ([10], np.ones((1, 3), np.float32)))
    with pytest.raises(TypeError, match="row_sparse_pull"):
        kv.pull("emb")


def test_local_growing_table_bound():
    kv = hetps.kv.create("local")
    from hetps.tables.server import INDEX_ROW_BYTES

    bound = 8 * (8 + INDEX_ROW_BYTES)  # a row: 8 bytes of values and its index entry
    kv.init("h", Table(None, 2, server_bytes=bound))
    kv.push("h", (np.arange(8) * 1000, np.ones((8, 2), np.float32)))
    with pytest.raises(ValueError, match=f"over the table's bound of {bound} bytes"):
        kv.push("h", ([5], np.ones((1, 2), np.float32)))


def test_distributed_optimizer_tables_on_a_local_store_train_like_torch():
    torch.manual_seed(0)
    ref = torch.nn.Embedding(50, 4, sparse=True)
    emb = torch.nn.Embedding(50, 4, sparse=True, _weight=ref.weight.detach().clone())
    kv = hetps.kv.create("local")
    head = torch.nn.Linear(4, 1)
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    opt = DistributedOptimizer(
        torch.optim.SGD(head.parameters(), lr=0.1), model.named_parameters(), kv, model=model
    )
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(5):
        ids = torch.randint(0, 50, (16, 3), generator=torch.Generator().manual_seed(step))
        up = torch.randn(16, 3, 4, generator=torch.Generator().manual_seed(100 + step))
        opt.zero_grad()
        ref_opt.zero_grad()
        (emb(ids) * up).sum().backward()
        (ref(ids) * up).sum().backward()
        opt.step()
        ref_opt.step()
        assert emb.weight.shape[0] == torch.unique(ids).numel()  # only the batch's rows here
    table = kv.row_sparse_pull("table:emb", row_ids=np.arange(50)).asnumpy()
    np.testing.assert_allclose(table, ref.weight.detach().numpy(), rtol=1e-6, atol=1e-6)
    opt.close()


def test_a_fixed_tables_optimizer_state_counts_toward_its_bound():
    """100 rows of 4 float32 fit 2,000 bytes; with Adam's two state rows per row they do not:
    the first update is refused, naming the bound, and the table stays as it was."""
    from hetps import optim

    kv = hetps.kv.create("local")
    kv.set_optimizer(optim.Adam(learning_rate=0.1))
    kv.init("t", Table(100, 4, server_bytes=2000))
    before = kv.row_sparse_pull("t", row_ids=[3]).data.copy()
    with pytest.raises(ValueError, match="over the table's bound of 2000 bytes"):
        kv.push("t", ([3], np.ones((1, 4), np.float32)))
    assert np.array_equal(kv.row_sparse_pull("t", row_ids=[3]).data, before)
