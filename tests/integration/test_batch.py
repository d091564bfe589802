"""One message per server per call (ps-lite's KVPairs), on real processes: a list's small
requests go to each server as one batch, and the server answers what is ready together as
one message per worker. The values are those of the same calls made key by key."""

from __future__ import annotations

from conftest import PER_PROCESS

# keys split over both servers and cut into several chunks
SMALL_PARTS = {"HETPS_BIGARRAY_BOUND": "1000", "HETPS_CHUNK_BYTES": "4096"}

COUNT = """
def sent():
    return sum(s.msgs_sent for p, s in kv.node.van.counters.links.items() if p in kv.server_ids)
def recv():
    return sum(s.msgs_recv for p, s in kv.node.van.counters.links.items() if p in kv.server_ids)
def counted(call):
    kv.wait_outstanding()
    m, n = sent(), recv()
    out = call()
    kv.wait_outstanding()
    return out, sent() - m, recv() - n
"""


def test_list_calls_send_one_message_per_server_with_the_values_of_per_key_calls(cluster):
    """Keys of every kind (whole on one server, split over both, several chunks per part):
    each list init/push/pull/pushpull sends one message to each server; the values equal
    those of the same rounds done with one call per key (no optimizer: a round's sum
    replaces the value)."""
    code = (
        COUNT
        + """
kv = hetps.kv.create('dist_sync')
r, W = kv.rank, kv.num_workers
sizes = [3, 700, 3000, 2500, 1]      # 3000, 2500: two parts, 1024-element chunks
keys = ['a', 'b', 'c', 'd', 'e']
per = ['pa', 'pb', 'pc', 'pd', 'pe']  # the same keys, called one by one
init = [np.arange(n, dtype=np.float32) for n in sizes]
w = np.zeros(3000, np.float32)  # (chunks of 4 KiB to both servers: each ring offered here)
kv.init('w', w)
kv.push('w', w)
kv.pull('w')
kv.barrier()
_, s, _ = counted(lambda: kv.init(keys, init))
if r == 0:
    assert s == 2, s                    # one batch per server (rank 0 stores the values)
for k, v in zip(per, init):
    kv.init(k, v)
S = sum(range(1, W + 1))
for rnd in range(3):
    g = [np.arange(n, dtype=np.float32) * (r + 1) + rnd for n in sizes]
    _, s, _ = counted(lambda: kv.push(keys, g))
    assert s == 2, ('push', rnd, s)
    for k, v in zip(per, g):
        kv.push(k, v)
    out = [np.zeros(n, np.float32) for n in sizes]
    _, s, _ = counted(lambda: kv.pull(keys, out=out))
    assert s == (2 if rnd == 0 else 0), ('pull', rnd, s)   # later: answered by the push
    ref = [kv.pull(k) for k in per]
    for o, f, n in zip(out, ref, sizes):
        want = np.arange(n, dtype=np.float32) * S + W * rnd
        assert np.array_equal(o, want) and np.array_equal(f, want), (n, o[:3], f[:3], want[:3])
g = [np.full(n, r + 1, np.float32) for n in sizes]
out = [np.zeros(n, np.float32) for n in sizes]
_, s, _ = counted(lambda: kv.pushpull(keys, g, out=out))
assert s == 2, ('pushpull', s)
ref = [np.zeros(n, np.float32) for n in sizes]
for k, v, o in zip(per, g, ref):
    kv.pushpull(k, v, out=o)
for o, f in zip(out, ref):
    assert (o == S).all() and np.array_equal(o, f), (o[:3], f[:3])
kv.barrier()
print('BATCH-OK', flush=True)
"""
    )
    rc, out = cluster(code, workers=2, servers=2, env={**SMALL_PARTS, **PER_PROCESS})
    assert rc == 0, out
    assert out.count("BATCH-OK") == 2, out


def test_the_server_answers_a_batch_with_one_message_per_worker(cluster):
    """The linear-regression loop (push a list, pull it): every iteration each worker gets
    one message from the server, also the worker whose batch came first (its answers are
    made while the other worker's batch completes the rounds)."""
    code = (
        COUNT
        + """
kv = hetps.kv.create('dist_sync')
r, W = kv.rank, kv.num_workers
shapes = [(256, 1), (256,), (64, 256), (64,), (1, 64), (1,)]
keys = list(range(6))
kv.init(keys, [np.zeros(s, np.float32) for s in shapes])
grads = [np.full(s, r + 1, np.float32) for s in shapes]
params = [np.zeros(s, np.float32) for s in shapes]
got = []
for it in range(12):
    _, s, n = counted(lambda: (kv.push(keys, grads), kv.pull(keys, out=params)))
    got.append((s, n))
    assert all((p == sum(range(1, W + 1))).all() for p in params)
assert got[2:] == [(1, 1)] * 10, got
kv.barrier()
print('ONE-ANSWER-OK', flush=True)
"""
    )
    rc, out = cluster(code, workers=2, servers=1, env=PER_PROCESS)
    assert rc == 0, out
    assert out.count("ONE-ANSWER-OK") == 2, out


def test_no_batches_with_batch_bytes_zero(cluster):
    """HETPS_BATCH_BYTES=0: every request alone (the earlier wire behaviour)."""
    code = (
        COUNT
        + """
kv = hetps.kv.create('dist_sync')
kv.init(list(range(4)), [np.zeros(5, np.float32)] * 4)
_, s, n = counted(lambda: kv.push(list(range(4)), [np.ones(5, np.float32)] * 4))
assert s == 4, s
print('ALONE-OK', flush=True)
"""
    )
    rc, out = cluster(code, workers=1, servers=1, env={"HETPS_BATCH_BYTES": "0"})
    assert rc == 0, out
    assert "ALONE-OK" in out, out


def test_a_per_key_push_loop_is_coalesced(cluster):
    """MXNet's Module style: one push call per key, then one pull per key. A push returns
    once captured and the sender thread sends it, so the pushes queued behind a send in
    progress leave with it in one message (over 40 steps some must have); every pull still
    sees its round."""
    code = """
kv = hetps.kv.create('dist_sync')
r, W = kv.rank, kv.num_workers
shapes = [(256, 1), (256,), (64, 256), (64,), (1, 64), (1,)]
keys = list(range(len(shapes)))
kv.init(keys, [np.zeros(s, np.float32) for s in shapes])
params = [np.zeros(s, np.float32) for s in shapes]
for step in range(40):
    for k, s in zip(keys, shapes):
        kv.push(k, np.full(s, (r + 1) * (step + 1) + k, np.float32), priority=-k)
    for k, p in zip(keys, params):
        kv.pull(k, out=p, priority=-k)
    for k, p in zip(keys, params):  # no optimizer: the round's sum replaces the value
        want = sum((q + 1) * (step + 1) + k for q in range(W))
        assert (p == want).all(), (step, k, p.flat[0], want)
assert kv._sender.merged > 0, 'no push ever joined another one'
kv.barrier()
print('COALESCED-OK', kv._sender.merged, flush=True)
"""
    rc, out = cluster(code, workers=2, servers=1, env=PER_PROCESS)
    assert rc == 0, out
    assert out.count("COALESCED-OK") == 2, out


def test_list_calls_and_big_answers_go_through_the_ring_on_one_machine(cluster):
    """Secured as `hetps launch` runs it: a list call of 30 keys of 40 KB goes through the shared-memory rings both ways, and
    so do the chunks of a 40 MB answer (10 chunks of 4 MiB; a 32 MiB ring holds 8: the
    server waits for the worker to free room, and on a busy machine a chunk that waited
    RING_WAIT_S goes inline). The values are exact, and each key and element
    has its own, so an answer landing in the wrong key or place fails."""
    code = """
kv = hetps.kv.create('dist_sync')
r, W = kv.rank, kv.num_workers
S = sum(range(1, W + 1))
van, server = kv.node.van, kv.server_ids[0]
keys, n = [f'k{i}' for i in range(30)], 10000
big, nb = 'big', 10 << 20
kv.init(keys, [np.zeros(n, np.float32) for _ in keys])
kv.init(big, np.zeros(nb, np.float32))
kv.barrier()
def sent():
    ring = van._rings_out.get(server)
    return ring.head if ring is not None else 0
def taken():
    return sum(ring.tail for ring in van._rings_in.values())
# every key and element its own value (exact in float32), so an answer written into the
# wrong key, or at the wrong place of one, is seen
ramp = (np.arange(n) % 97).astype(np.float32)
for rnd in range(3):   # round 0 offers the rings; they carry everything from round 1
    g = [(r + 1) * (rnd + 1) + 1000 * i + ramp for i in range(len(keys))]
    out = [np.zeros(n, np.float32) for _ in keys]
    h, t = sent(), taken()
    kv.push(keys, g)
    kv.pull(keys, out=out)
    for i, o in enumerate(out):
        want = S * (rnd + 1) + W * (1000 * i + ramp)
        assert (o == want).all(), ('list pull', rnd, keys[i], o[:3], want[:3])
    if rnd:
        assert sent() - h >= 30 * 4 * n, ('list push', rnd, sent() - h)
        assert taken() - t >= 30 * 4 * n, ('list answers', rnd, taken() - t)
    bramp = (np.arange(nb) % 1009).astype(np.float32)  # a chunk at the wrong place is seen
    v, o = (r + 1) * (rnd + 1) + bramp, np.zeros(nb, np.float32)
    h, t = sent(), taken()
    kv.push(big, v)
    kv.pull(big, out=o)
    assert (o == S * (rnd + 1) + W * bramp).all(), ('big pull', rnd)
    if rnd:  # (at least the chunks that fit without waiting: on a busy machine a chunk
        # that waited RING_WAIT_S for room goes inline, by design)
        assert sent() - h >= 6 * (4 << 20), ('big push', rnd, sent() - h)
        assert taken() - t >= 6 * (4 << 20), ('big answer', rnd, taken() - t)
kv.barrier()
print('RING-OK', flush=True)
"""
    rc, out = cluster(code, workers=2, servers=1, env=PER_PROCESS)
    assert rc == 0, out
    assert out.count("RING-OK") == 2, out


def test_batches_are_cut_at_the_message_bound_and_one_over_it_fails_naming_it(cluster):
    """HETPS_MAX_MESSAGE_BYTES far below a batch's 8 MiB: a list call's requests, and the
    server's answers, go in as many messages as the bound needs (every value exact); a table
    push that alone exceeds it, in a batch or sent alone, fails at once with an error naming
    the variable, not a timeout, and the table is as it was."""
    code = """
from hetps.tables.rowsparse import Table
kv = hetps.kv.create('dist_sync')
n = 16384  # 64 KB a key, 1.5 MB a call: six times the bound
keys = [f'k{i}' for i in range(24)]
kv.init(keys + ['t'], [np.zeros(n, np.float32) for _ in keys] + [Table(1000, 128)])
kv.push(keys, [np.arange(n, dtype=np.float32) * (kv.rank + 1) + i for i in range(24)])
out = [np.zeros(n, np.float32) for _ in keys]
kv.pull(keys, out=out)
S = sum(range(1, kv.num_workers + 1))
for i, o in enumerate(out):
    assert np.array_equal(o, np.arange(n, dtype=np.float32) * S + i * kv.num_workers), i
for rank in range(kv.num_workers):  # (rank 1 sends every request alone: no batches)
    if kv.rank == rank:
        try:  # 600 rows of 512 bytes in one request
            kv.push('t', (np.arange(600), np.ones((600, 128), np.float32)))
            kv.wait_outstanding()
        except RequestError as exc:
            print('REFUSED', rank, exc, flush=True)
    kv.barrier()
rows = kv.row_sparse_pull('t', row_ids=np.arange(600)).data
assert not rows.any(), 'the refused push changed the table'
kv.barrier()
print('BOUND-OK', flush=True)
"""
    env = {
        "HETPS_MAX_MESSAGE_BYTES": str(256 << 10),
        "HETPS_CHUNK_BYTES": str(128 << 10),
        "HETPS_TABLE_PULL_BYTES": str(128 << 10),
        "HETPS_REQUEST_TIMEOUT": "20",
    }
    alone = {("worker", 1): {"HETPS_BATCH_BYTES": "0"}}
    rc, out = cluster(code, workers=2, servers=1, env={**env, **PER_PROCESS}, node_env=alone)
    assert rc == 0, out
    assert out.count("BOUND-OK") == 2, out
    for rank in (0, 1):
        assert f"REFUSED {rank} a spush of" in out, out
    assert out.count("exceeds HETPS_MAX_MESSAGE_BYTES=262144") >= 2, out
