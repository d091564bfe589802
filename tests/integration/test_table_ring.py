"""A table round's rows through the shared-memory rings of real processes: each server's
reply is gathered into its ring and lands in the worker's rows straight from it, and every
row pulled, round after round, is the servers' SGD of every worker's pushes."""

from __future__ import annotations

from conftest import PER_PROCESS

RING_ROUNDS = """
from hetps.tables import worker as tw
from hetps.tables.rowsparse import Table
landed, in_out, outs = [0], [0], []
land = tw._Landing.land
def counted(self, view):
    landed[0] += 1
    in_out[0] += any(self.rows is o for o in outs)  # (straight into a dense out)
    return land(self, view)
tw._Landing.land = counted
gathered, gather = [0], tw.Rows.gather
def counting(self, out=None):
    gathered[0] += out is not None  # (a push's own rows, gathered into the ring)
    return gather(self, out)
tw.Rows.gather = counting
kv = hetps.kv.create('dist_sync')
r, W = kv.rank, kv.num_workers
ROWS, COLS = 4096, 32          # a server's reply of ~1,500 rows: 190 KiB, through the ring
rng = np.random.default_rng(5)  # the same draws on every worker
ref = rng.standard_normal((ROWS, COLS)).astype(np.float32)
kv.set_optimizer(optim.SGD(learning_rate=0.5))
kv.init('t', Table(ROWS, COLS, value=ref))
kv.barrier()
for rnd in range(4):
    ids = [np.sort(rng.choice(ROWS, 3000, replace=False)) for _ in range(W)]
    grads = [rng.standard_normal((3000, COLS)).astype(np.float32) for _ in range(W)]
    kv.push('t', (ids[r], grads[r]))
    got = kv.row_sparse_pull('t', row_ids=ids[r])
    step = np.zeros_like(ref)
    for w in range(W):
        step[ids[w]] += grads[w]
    ref = ref - 0.5 * step
    assert got.indices.tolist() == ids[r].tolist()
    assert np.allclose(got.data, ref[ids[r]], atol=1e-5), np.abs(got.data - ref[ids[r]]).max()
    ask = rng.integers(0, ROWS, 2500)               # a lookup: repeats, any order
    look = np.empty((ask.size, COLS), np.float32)
    kv.row_sparse_pull('t', out=look, row_ids=ask)
    assert np.allclose(look, ref[ask], atol=1e-5), np.abs(look - ref[ask]).max()
    pick = rng.permutation(ROWS)[:2000]             # distinct, any order: into out itself
    dense = np.full((pick.size, COLS), np.nan, np.float32)
    whole = np.full((ROWS, COLS), np.nan, np.float32)  # the table's shape: the rest zeroed
    outs[:] = [dense, whole]
    kv.row_sparse_pull('t', out=dense, row_ids=pick)
    kv.row_sparse_pull('t', out=whole, row_ids=pick[:1500])
    assert np.allclose(dense, ref[pick], atol=1e-5), np.abs(dense - ref[pick]).max()
    part = np.zeros_like(ref)
    part[pick[:1500]] = ref[pick[:1500]]
    assert np.allclose(whole, part, atol=1e-5), np.abs(whole - part).max()
# a push of repeated ids in any order (as autograd makes it): summed here, its own rows sent
ids = [rng.integers(0, ROWS, 4000) for _ in range(W)]
grads = [rng.standard_normal((4000, COLS)).astype(np.float32) for _ in range(W)]
kv.push('t', (ids[r], grads[r]))
for w in range(W):
    np.add.at(ref, ids[w], -0.5 * grads[w])
every = kv.row_sparse_pull('t', row_ids=np.arange(ROWS)).data
assert np.allclose(every, ref, atol=1e-5), np.abs(every - ref).max()
assert landed[0] >= 8, landed  # (the replies came through the rings)
assert in_out[0] >= 16, in_out  # (the dense outs' replies landed in them: 2 servers x 2 x 4)
assert gathered[0] == 2, gathered  # (the summed push: one gather per server, into its ring)
print('RING-ROUNDS', r, landed[0], flush=True)
"""


def test_table_rounds_through_the_rings_land_every_row(cluster):
    rc, out = cluster(RING_ROUNDS, workers=2, servers=2, env=PER_PROCESS)
    assert rc == 0, out
    assert out.count("RING-ROUNDS") == 2, out
