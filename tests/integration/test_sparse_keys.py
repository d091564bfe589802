"""Row-sparse keys through real processes: MXNet's row_sparse_pull semantics, row-sparse pushes
summed per row across workers, empty pushes, ids out of range, lazy server optimizers, tables
that grow and their memory bound."""

from __future__ import annotations

import pytest

from conftest import PRELUDE, TEST_ENV  # (at collection: tests/conftest.py)

SEMANTICS = """
import torch
from hetps.tables.rowsparse import RowSparse, Table
kv = hetps.kv.create('dist_sync')
r, W = kv.rank, kv.num_workers
dense = np.arange(30, dtype=np.float32).reshape(10, 3)
kv.init('emb', Table(10, 3, value=dense))
assert kv.is_row_sparse('emb')
# MXNet: out holds the distinct ids, sorted, and their rows; ids may repeat and be unsorted
got = kv.row_sparse_pull('emb', row_ids=np.array([7, 2, 2, 7, 0]))
assert got.indices.tolist() == [0, 2, 7], got.indices
assert np.array_equal(got.data, dense[[0, 2, 7]])
full = np.full((10, 3), -1, np.float32)             # dense out of the table's shape: others zeroed
kv.row_sparse_pull('emb', out=full, row_ids=np.array([2, 2]))
expect = np.zeros((10, 3), np.float32); expect[2] = dense[2]
assert np.array_equal(full, expect), full
look = torch.zeros(4, 3)                             # a smaller out: each id's row, in order
kv.row_sparse_pull('emb', out=look, row_ids=torch.tensor([9, 1, 9, 5]))
assert np.array_equal(look.numpy(), dense[[9, 1, 9, 5]])
rs = RowSparse([], np.zeros((0, 3), np.float32), (10, 3))
kv.row_sparse_pull('emb', out=rs, row_ids=[4])
assert rs.indices.tolist() == [4] and np.array_equal(rs.asnumpy()[4], dense[4])
try:
    kv.pull('emb')
    raise SystemExit('pull of a row-sparse key passed')
except TypeError as e:
    assert 'row_sparse_pull' in str(e), e

# pushes without an optimizer: the touched rows become the workers' sum (duplicates summed first)
kv.push('emb', (np.array([1, 1, 4 + r]), np.ones((3, 3), np.float32) * (r + 1)))
out = kv.row_sparse_pull('emb', row_ids=np.arange(10)).asnumpy()
assert np.array_equal(out[1], np.full(3, sum(2 * (w + 1) for w in range(W)))), out[1]
for w in range(W):
    assert np.array_equal(out[4 + w], np.full(3, w + 1.0)), (w, out[4 + w])
assert np.array_equal(out[9], dense[9])              # untouched rows keep their value
# an empty push is a worker's part of the round
if r == 0:
    kv.push('emb', (np.zeros(0, np.int64), np.zeros((0, 3), np.float32)))
else:
    kv.push('emb', torch.sparse_coo_tensor([[8, 8]], torch.ones(2, 3), (10, 3)))
out2 = kv.row_sparse_pull('emb', row_ids=[8, 9]).data
assert np.array_equal(out2[0], np.full(3, 2.0)), out2       # worker 1's two ones, summed
kv.push('emb', (np.zeros(0, np.int64), np.zeros((0, 3), np.float32)))   # every worker empty
assert np.array_equal(kv.row_sparse_pull('emb', row_ids=[9]).data[0], dense[9])

# an id out of range: a clear error naming the key and the id (worker side) ...
for bad in ([3, 10], [-1]):
    try:
        kv.push('emb', (np.array(bad), np.ones((len(bad), 3), np.float32)))
        raise SystemExit('out-of-range push passed')
    except ValueError as e:
        assert "'emb'" in str(e) and f'row id {bad[-1]}' in str(e), e
try:
    kv.row_sparse_pull('emb', row_ids=[12])
    raise SystemExit('out-of-range pull passed')
except ValueError as e:
    assert "'emb'" in str(e) and 'row id 12' in str(e), e
# ... and the server checks again what a broken worker sends
from hetps.cluster import protocol as P
from hetps.transport.codec import Message
m = Message(P.SPULL, body={'k': 'emb', 'part': 0}, arrays=[np.array([10 * kv.num_servers], np.int64)])
f = kv.request('emb', 0, 0, m)
try:
    f.wait(30)
    raise SystemExit('server took an out-of-range id')
except RequestError as e:
    assert "'emb'" in str(e) and f'row id {10 * kv.num_servers}' in str(e), e
kv.barrier()

# lazy SGD with momentum on the servers: only the rows touched move, momentum included
kv.init('t2', Table(6, 2, value=np.ones((6, 2), np.float32)))
kv.set_optimizer(optim.SGD(learning_rate=0.5, momentum=0.5))
for rnd in range(2):
    kv.push('t2', (np.array([0, 3]), np.ones((2, 2), np.float32)))
vals = kv.row_sparse_pull('t2', row_ids=np.arange(6)).asnumpy()
g = W * 1.0                                          # per-row sum over the workers
v1 = -0.5 * g; w1 = 1 + v1; v2 = 0.5 * v1 - 0.5 * g; w2 = w1 + v2
assert np.allclose(vals[[0, 3]], w2) and np.array_equal(vals[[1, 2, 4, 5]], np.ones((4, 2))), vals
# seeded initial rows: the same values whatever the number of servers holding them
from hetps.tables.rowsparse import initial_rows
kv.init('seeded', Table(1000, 4, scale=0.5, seed=3))
ids = np.array([999, 0, 501, 2])
assert np.array_equal(kv.row_sparse_pull('seeded', row_ids=ids).data,
                      initial_rows(0.5, 3, np.sort(ids), 4, np.float32))
kv.barrier()
print('SPARSE-OK', r, flush=True)
"""


def test_row_sparse_semantics(cluster):
    rc, out = cluster(SEMANTICS, workers=2, servers=2)
    assert rc == 0, out
    assert out.count("SPARSE-OK") == 2, out


GROWING = """
from hetps.tables.rowsparse import Table, initial_rows
from hetps.tables.server import INDEX_ROW_BYTES
kv = hetps.kv.create('dist_sync')
# a table that grows: any id >= 0, rows made on first push; 4 cols float32 = 16 bytes a row
# and its entry in the id index; bound 20 rows per server
bound = 20 * (16 + INDEX_ROW_BYTES)
kv.init('h', Table(None, 4, scale=0.5, seed=7, server_bytes=bound))
ids = np.array([3, 10**12 + 5, 77])
first = kv.row_sparse_pull('h', row_ids=ids)        # never pushed: their initial values
assert np.array_equal(first.data, initial_rows(0.5, 7, np.sort(ids), 4, np.float32))
assert np.abs(first.data).max() <= 0.5 and first.data.std() > 0
kv.push('h', (ids, np.ones((3, 4), np.float32)))    # no optimizer: the rows become the push
assert np.array_equal(kv.row_sparse_pull('h', row_ids=ids).data, np.ones((3, 4)))
kv.push('h', (np.arange(100, 117), np.zeros((17, 4), np.float32)))   # 20 rows: at the bound
try:
    kv.push('h', (np.array([5000]), np.zeros((1, 4), np.float32)), block=True)
    raise SystemExit('push over the bound passed')
except RequestError as e:
    assert "'h'" in str(e) and 'over the table' in str(e) and f'{bound} bytes' in str(e), e
# the refused round changed nothing; rows made before it are still there
assert np.array_equal(kv.row_sparse_pull('h', row_ids=[3]).data, np.ones((1, 4)))
print('GROW-OK', flush=True)
"""


def test_growing_table_and_memory_bound(cluster):
    rc, out = cluster(GROWING, workers=1, servers=1)
    assert rc == 0, out
    assert "GROW-OK" in out, out


ELASTIC = """
from hetps.tables.rowsparse import Table
kv = hetps.kv.create('dist_sync')
kv.init('t', Table(10, 2))
kv.init('probe', np.zeros(1, np.float32))
sgd, w = bool(os.environ.get('SGD')), 0.0
if sgd:   # the servers' mean: rescale_grad 1/3 for 3 workers
    kv.set_optimizer(optim.SGD(learning_rate=1.0, rescale_grad=1 / 3))
for r in range(6):
    v = (kv.rank + 1) * (r + 1)
    if r == 3 and kv.rank < 2:           # worker 2 pushes round 3 alone, then dies
        deadline = time.time() + 30
        while kv.live_workers > 2 and time.time() < deadline:
            time.sleep(0.01)             # (until the job is told it left)
    kv.push('t', (np.array([kv.rank, 9]), np.full((2, 2), v, np.float32)))
    if r == 3 and kv.rank == 2:
        kv.pull('probe')                 # the server has the push (same connection, in order)
        os.kill(os.getpid(), signal.SIGKILL)
    got = kv.row_sparse_pull('t', row_ids=[9]).data[0, 0]
    live = (1 + 2 + 3) if r < 3 else (1 + 2)   # its push of round 3 was dropped with it
    if sgd:   # each round moves the row by the mean of the pushes of the workers in it
        w -= live * (r + 1) / (3 if r < 3 else 2)
        assert abs(got - w) < 1e-4, (r, got, w)
    else:     # no optimizer: the survivors' sum
        assert got == live * (r + 1), (r, got)
print('ELASTIC-OK', kv.rank, kv.live_workers, flush=True)
"""


@pytest.mark.parametrize("sgd", [False, True])
def test_a_worker_leaving_finishes_the_table_rounds(tmp_path, sgd):
    """--elastic: a worker killed after its push of a round is let go; the table's round
    completes with the others' pushes, and the next rounds count only the survivors (with a
    server optimizer their sum is scaled to the job's count, so the step is their mean)."""
    import io
    import sys
    import textwrap

    from hetps.launch.contract import LaunchSpec
    from hetps.launch.local import Launcher

    script = tmp_path / "elastic.py"
    script.write_text(PRELUDE + textwrap.dedent(ELASTIC))
    out = io.StringIO()
    spec = LaunchSpec(
        num_workers=3,
        num_servers=1,
        command=[sys.executable, str(script)],
        env={**TEST_ENV, **({"SGD": "1"} if sgd else {})},
        start_timeout=30.0,
        failure_grace=5.0,
        elastic_min=2,
    )
    launcher = Launcher(spec, out=out)
    try:
        code = launcher.run()
    finally:
        launcher.stop_all(kill=True)
    text = out.getvalue()
    assert code == 0, text
    assert text.count("ELASTIC-OK") == 2 and "ELASTIC-OK 0 2" in text, text


ASYNC = """
from hetps.tables.rowsparse import Table
kv = hetps.kv.create('dist_async')
kv.init('t', Table(8, 2))
try:
    kv.push('t', ([0], np.ones((1, 2), np.float32)), block=True)
    raise SystemExit('dist_async push without an optimizer passed')
except RequestError as e:
    assert 'needs a server optimizer' in str(e), e
kv.barrier()
kv.set_optimizer(optim.SGD(learning_rate=0.5, momentum=0.5))
for i in range(3):                       # each worker its own rows: applied push by push
    kv.push('t', (np.array([kv.rank, 4 + kv.rank]), np.ones((2, 2), np.float32)), block=True)
kv.barrier()
got = kv.row_sparse_pull('t', row_ids=np.arange(8)).asnumpy()
v = w = 0.0
for i in range(3):
    v = 0.5 * v - 0.5; w += v
for row in range(8):
    want = w if row % 4 < kv.num_workers else 0.0
    assert np.allclose(got[row], want), (row, got[row], want)
print('ASYNC-OK', flush=True)
"""


def test_dist_async_row_sparse_pushes_apply_at_once(cluster):
    rc, out = cluster(ASYNC, workers=2, servers=1)
    assert rc == 0, out
    assert out.count("ASYNC-OK") == 2, out


FAILED_UPDATE = """
from hetps.tables.rowsparse import Table
kv = hetps.kv.create('dist_sync')
kv.set_optimizer(optim.DCASGD(learning_rate=0.1))  # no lazy rule for tables
kv.init('emb', Table(8, 2))
try:
    kv.push('emb', (np.array([kv.rank]), np.ones((1, 2), np.float32)), block=True)
except (RequestError, ClusterError) as e:
    assert 'the update of table' in str(e), e
    print(f'UPDATE-REFUSED {kv.rank}', flush=True)
kv.barrier()
"""


def test_a_table_update_that_fails_answers_every_worker(cluster):
    """An optimizer with no lazy rule fails the round's update: every worker of the round
    gets the error (none waits for an answer that never comes)."""
    rc, out = cluster(FAILED_UPDATE, workers=2, servers=1, env={"HETPS_REQUEST_TIMEOUT": "20"})
    assert rc == 0, out
    assert "UPDATE-REFUSED 0" in out and "UPDATE-REFUSED 1" in out, out


CAP = """
from hetps.tables.rowsparse import Table
from hetps.tables.server import INDEX_ROW_BYTES, TABLE_BYTES
kv = hetps.kv.create('dist_sync')
cap = int(os.environ['HETPS_TABLE_MAX_BYTES'])
# 2 servers; a fixed row of 4 float32 takes 17 bytes here (with its use mark), a growing
# one 16 + INDEX_ROW_BYTES
kv.init('a', Table(2000, 4))                        # 1000 rows a server: 17,000 bytes
try:
    kv.init('big', Table(2000, 4))                  # 17,000 more: over the cap
    raise SystemExit('a table over the servers cap was declared')
except RequestError as e:
    assert "'big'" in str(e) and f'{cap} bytes' in str(e) and 'HETPS_TABLE_MAX_BYTES' in str(e), e
kv.init('g', Table(None, 4))
kv.push('g', (np.arange(0, 100), np.ones((100, 4), np.float32)))   # 50 rows a server
per = 16 + INDEX_ROW_BYTES
fixed = 2 * TABLE_BYTES + len("'a'") + len("'g'")     # each table's part costs this too
room = (cap - 17000 - fixed) // per                  # rows of 'g' a server may hold
over = np.arange(100, 2 * room + 2, 2)               # server 0's ids only: one over its room
try:
    kv.push('g', (over, np.ones((over.size, 4), np.float32)), block=True)
    raise SystemExit('a table grew over the servers cap')
except RequestError as e:
    assert "'g'" in str(e) and 'HETPS_TABLE_MAX_BYTES' in str(e), e
got = kv.row_sparse_pull('g', row_ids=[5, 150]).data
assert got[0].tolist() == [1] * 4 and got[1].tolist() == [0] * 4, got   # nothing changed
kv.push('g', (np.arange(100, 2 * room), np.ones((2 * room - 100, 4), np.float32)))  # fits
assert kv.row_sparse_pull('g', row_ids=[2 * room - 1]).data.tolist() == [[1] * 4]
print('CAP-OK', flush=True)
"""


def test_the_servers_cap_on_table_memory(cluster):
    """HETPS_TABLE_MAX_BYTES on the servers: a table declared over it, or a growing table's
    round that would pass it, is refused naming the table, the cap and the variable; the
    tables stay as they were and the job goes on."""
    rc, out = cluster(CAP, workers=1, servers=2, env={"HETPS_TABLE_MAX_BYTES": "30000"})
    assert rc == 0, out
    assert "CAP-OK" in out, out


ONE_MESSAGE = """
from hetps.cluster import protocol as P
from hetps.tables.rowsparse import Table
kv = hetps.kv.create('dist_sync')
r, W, S, R = kv.rank, kv.num_workers, kv.num_servers, 30
kv.set_optimizer(optim.SGD(learning_rate=0.25))
start = np.arange(40 * 3, dtype=np.float32).reshape(40, 3)
kv.init('t', Table(40, 3, value=start))
kv.barrier()
ref = start.copy()
rng = np.random.default_rng(5)                     # the same draws on every worker
def links():
    snap = kv.node.counters.snapshot()
    return {p: (s.msgs_sent, s.msgs_recv) for p, s in snap.items() if p != P.SCHEDULER_ID}
before = links()
merged = kv._sender.merged
for rnd in range(R):
    ids = [np.sort(rng.choice(40, 6, replace=False)) for _ in range(W)]
    grads = [rng.standard_normal((6, 3)).astype(np.float32) for _ in range(W)]
    kv.push('t', (ids[r], grads[r]))
    got = kv.row_sparse_pull('t', row_ids=ids[r])
    for w in range(W):                             # the servers' SGD on the round's sums
        np.add.at(ref, ids[w], -0.25 * grads[w])
    assert got.indices.tolist() == ids[r].tolist(), (rnd, got.indices)
    assert np.allclose(got.data, ref[ids[r]], atol=1e-5), (rnd, got.data, ref[ids[r]])
after = links()
sent = sum(after[p][0] - before.get(p, (0, 0))[0] for p in after)
recv = sum(after[p][1] - before.get(p, (0, 0))[1] for p in after)
kv.barrier()
every = kv.row_sparse_pull('t', row_ids=np.arange(40)).asnumpy()
assert np.allclose(every, ref, atol=1e-5), np.abs(every - ref).max()
print('ONE-MESSAGE', r, sent, recv, kv._sender.merged - merged, flush=True)
"""


def test_a_round_push_and_pull_travel_together(cluster):
    """A table's push and the row_sparse_pull after it go to each server together, and each
    server answers both together: fewer messages than a push, its answer, a pull and its
    answer per server per round (the values: SGD's, every round, every row)."""
    rc, out = cluster(ONE_MESSAGE, workers=2, servers=2)
    assert rc == 0, out
    lines = [ln.split() for ln in out.splitlines() if "ONE-MESSAGE" in ln]
    assert len(lines) == 2, out
    alone = 2 * 30 * 2  # a push and a pull (and their answers) per server per round, alone
    for words in lines:
        sent, recv, merged = (int(x) for x in words[-3:])
        assert merged > 0 and sent <= 0.75 * alone, out
        assert recv <= 0.75 * alone, out


def test_a_round_push_and_pull_travel_together_whatever_their_size(cluster):
    """The same with every array over HETPS_BATCH_BYTES (the rows of a wide table): the push
    still waits for the pull and goes with it, and the server answers the push and the
    pull's rows in one message, as on a small table."""
    rc, out = cluster(ONE_MESSAGE, workers=2, servers=2, env={"HETPS_BATCH_BYTES": "16"})
    assert rc == 0, out
    lines = [ln.split() for ln in out.splitlines() if "ONE-MESSAGE" in ln]
    assert len(lines) == 2, out
    alone = 2 * 30 * 2
    for words in lines:
        sent, recv, merged = (int(x) for x in words[-3:])
        assert merged > 0 and sent <= 0.75 * alone, out
        assert recv <= 0.75 * alone, out


SEVERAL_TABLES = """
from hetps.cluster import protocol as P
from hetps.tables.rowsparse import Table
kv = hetps.kv.create('dist_sync')
r, W, S, R, K = kv.rank, kv.num_workers, kv.num_servers, 20, 3
kv.set_optimizer(optim.SGD(learning_rate=0.25))
keys = [f't{j}' for j in range(K)]
starts = [np.arange(40 * 3, dtype=np.float32).reshape(40, 3) * (j + 1) for j in range(K)]
for k, start in zip(keys, starts):
    kv.init(k, Table(40, 3, value=start))
kv.barrier()
refs = [s.copy() for s in starts]
rng = np.random.default_rng(9)                     # the same draws on every worker
def links():
    snap = kv.node.counters.snapshot()
    return {p: (s.msgs_sent, s.msgs_recv) for p, s in snap.items() if p != P.SCHEDULER_ID}
before = links()
for rnd in range(R):                               # a model's step: every table, one call each
    ids = [[np.sort(rng.choice(40, 6, replace=False)) for _ in range(W)] for _ in keys]
    grads = [[rng.standard_normal((6, 3)).astype(np.float32) for _ in range(W)] for _ in keys]
    kv.push(keys, [(ids[j][r], grads[j][r]) for j in range(K)])
    got = kv.row_sparse_pull(keys, row_ids=[ids[j][r] for j in range(K)])
    assert len(got) == K, got
    for j in range(K):
        for w in range(W):                         # the servers' SGD on the round's sums
            np.add.at(refs[j], ids[j][w], -0.25 * grads[j][w])
        assert got[j].indices.tolist() == ids[j][r].tolist(), (rnd, j, got[j].indices)
        assert np.allclose(got[j].data, refs[j][ids[j][r]], atol=1e-5), (rnd, j)
after = links()
sent = sum(after[p][0] - before.get(p, (0, 0))[0] for p in after)
recv = sum(after[p][1] - before.get(p, (0, 0))[1] for p in after)
kv.barrier()
for k, ref in zip(keys, refs):
    every = kv.row_sparse_pull(k, row_ids=np.arange(40)).asnumpy()
    assert np.allclose(every, ref, atol=1e-5), (k, np.abs(every - ref).max())
print('SEVERAL-TABLES', r, R * S, sent, recv, flush=True)
"""


def test_a_step_of_several_tables_is_one_message_each_way_per_server(cluster):
    """Three tables pushed in one call and pulled in one call, each round: every table's
    values are SGD's on the round's sums (every round, then every row), and each server gets
    one message a round from each worker and answers with one (the pushes wait for the pull
    and go with it in one batch), where the tables alone would take 2 x 3 each way."""
    rc, out = cluster(SEVERAL_TABLES, workers=2, servers=2)
    assert rc == 0, out
    lines = [ln.split() for ln in out.splitlines() if "SEVERAL-TABLES" in ln]
    assert len(lines) == 2, out
    for words in lines:
        rounds, sent, recv = (int(x) for x in words[-3:])
        assert sent <= rounds + 2 and recv <= rounds + 2, out  # (a message or two more: the
        # van's own, as a ring's offer)


LONE_PUSH = """
from hetps import optim
from hetps.tables.rowsparse import Table
kv = hetps.kv.create('dist_sync')
r, W = kv.rank, kv.num_workers
kv.set_optimizer(optim.SGD(learning_rate=0.5))
kv.init('t', Table(20, 2))
kv.barrier()
ref = np.zeros((20, 2), np.float32)
rng = np.random.default_rng(7)                     # the same draws on every worker
for rnd in range(3):                               # pushes with no pull after them: parked,
    ids = [np.sort(rng.choice(20, 4, replace=False)) for _ in range(W)]
    grads = [rng.standard_normal((4, 2)).astype(np.float32) for _ in range(W)]
    kv.push('t', (ids[r], grads[r])).wait()        # nothing drains: the sender thread sends
    for w in range(W):
        np.add.at(ref, ids[w], -0.5 * grads[w])
every = kv.row_sparse_pull('t', row_ids=np.arange(20)).data
assert np.allclose(every, ref, atol=1e-6), np.abs(every - ref).max()
print('LONE-PUSH', r, every.tolist(), flush=True)
"""


def test_a_table_push_with_no_pull_after_it_still_leaves(cluster):
    """A table's push waits for the pull after it to carry it; with none, the worker's
    sender thread sends it (else every worker's round waits forever): every row of the
    table, on both workers, is the servers' SGD over the 3 rounds of lone pushes."""
    rc, out = cluster(LONE_PUSH, workers=2, servers=2, env={"HETPS_REQUEST_TIMEOUT": "20"})
    assert rc == 0, out
    rows = [
        ln.split("LONE-PUSH ")[1].split(" ", 1)[1] for ln in out.splitlines() if "LONE-PUSH" in ln
    ]
    assert len(rows) == 2 and rows[0] == rows[1], out
