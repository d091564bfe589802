"""A dist_sync round of a big key completes chunk by chunk on the servers (no optimizer): the
answer to chunk k (a fused push-pull's value, or a waiting pull) goes out once every worker
pushed chunk k, while the round's later chunks have not even been sent. And the values stay
exact with big keys cut into many chunks over two servers: no optimizer, SGD with momentum,
Adam, 2-bit compression."""

from __future__ import annotations

import pytest

# a key of 2.4 MB (over PREFETCH_MAX_BYTES): over both servers, 16 KiB chunks
BIG = {"HETPS_BIGARRAY_BOUND": "1000", "HETPS_CHUNK_BYTES": "16384"}


@pytest.mark.parametrize("fused", [True, False], ids=["fused-push-pull", "pull"])
def test_a_chunk_is_answered_before_the_rounds_last_chunk_is_pushed(cluster, fused):
    """Rank 1 pushes only the first chunk of each part (by hand, as the store would) and
    then waits at a node barrier; rank 0 pushes the whole key and pulls it. Rank 0 must get
    the first chunk of each part, with the round's sum, before rank 1 has pushed the rest:
    the answers of the chunks nobody else has pushed are still outstanding. ``fused``: the
    pull is answered by the push (after a warm-up round); else by pull requests of its own."""
    code = f"""
import numpy as np
from hetps.cluster import protocol as P
from hetps.kvstore.placement import chunk_elems, chunks
from hetps.transport.codec import Message
kv = hetps.kv.create('dist_sync')
r, W = kv.rank, kv.num_workers
n = 600_000
kv.init('w', np.zeros(n, np.float32))
out = np.empty(n, np.float32)
if {fused}:  # a push then a pull of the key: from now on its pushes bring the value
    kv.push('w', np.ones(n, np.float32))
    kv.pull('w', out=out)
    assert (out == W).all()
meta = kv.meta['w']
step = chunk_elems(kv.cfg.chunk_bytes, 4)
mine = np.arange(n, dtype=np.float32) if r == 0 else np.full(n, 7, np.float32)
want = np.arange(n, dtype=np.float32) + 7
pieces = [(p, a, b) for p in meta.parts for a, b in chunks(p.start, p.stop, step)]
assert len(pieces) > 20
firsts = [(p, a, b) for p, a, b in pieces if a == p.start]
rest = [(p, a, b) for p, a, b in pieces if a != p.start]

def push_by_hand(which):
    futs = []
    for p, a, b in which:
        body = dict(k='w', part=p.index, off=a - p.start, n=b - a, sync=True, ce=step,
                    shape=[n], dtype='float32')
        msg = Message(P.PUSH, body=body, arrays=[mine[a:b]])
        futs.append(kv.request('w', 0, p.server, msg))
    return futs

if r == 0:
    kv.push('w', mine)
    h = kv.pull('w', out=out, block=False)
    futs = list(meta.pushed) if {fused} else list(h.futures)[-len(pieces):]  # (pushes first)
    assert len(futs) == len(pieces), (len(futs), len(pieces))
    early = [f for f, (p, a, b) in zip(futs, pieces) if a == p.start]
    for f in early:  # rank 1 pushes the rest only after the barrier below
        f.wait(60)
    for p, a, b in firsts:
        assert np.array_equal(out[a:b], want[a:b]), (a, out[a:a + 4], want[a:a + 4])
    late = [f for f, (p, a, b) in zip(futs, pieces) if a != p.start]
    assert not any(f.done() for f in late), 'a chunk rank 1 never pushed was answered'
    print('EARLY-OK', flush=True)
    kv.node.barrier('worker')
    h.wait()
else:
    first = push_by_hand(firsts)
    for f in first:
        f.wait(60)  # acknowledged: every worker pushed it (the round is still open)
    kv.node.barrier('worker')
    for f in push_by_hand(rest):
        f.wait(60)
    kv.pull('w', out=out)
assert np.array_equal(out, want), (out[:4], want[:4])
kv.barrier()
print('PIPE-OK', flush=True)
"""
    rc, out = cluster(code, workers=2, servers=2, env=BIG)
    assert rc == 0, out
    assert out.count("EARLY-OK") == 1, out
    assert out.count("PIPE-OK") == 2, out


@pytest.mark.parametrize("case", ["none", "sgd", "adam", "2bit"])
def test_big_keys_stay_exact_round_after_round(cluster, case):
    """Push-then-pull of a big key (many chunks, two servers), a non-contiguous ``out`` for
    one key, 5 rounds: every pulled value equals, bit for bit, what NumPy computes on the
    whole array with the same optimizer (or the 2-bit codec) on every worker."""
    code = f"""
import numpy as np
from hetps import optim
from hetps.kvstore.compression import TwoBitCompressor
case = {case!r}
kv = hetps.kv.create('dist_sync')
r, W = kv.rank, kv.num_workers
n = 400_000
shape = (n // 100, 100)
init = np.linspace(-1, 1, n, dtype=np.float32).reshape(shape)
kv.init('a', init)
kv.init('b', init)
make = {{
    'sgd': lambda: optim.SGD(learning_rate=0.1, momentum=0.9, wd=1e-3),
    'adam': lambda: optim.Adam(learning_rate=0.01),
}}.get(case)
if make is not None:
    kv.set_optimizer(make())
    ref_opt, ref_state = make(), None
comp = None
if case == '2bit':
    kv.set_gradient_compression({{'type': '2bit', 'threshold': 0.5}})
    comp = TwoBitCompressor(0.5)
    residual = [np.zeros(n, np.float32) for _ in range(W)]
ref = init.copy()
out_a = np.empty(shape, np.float32)
out_b = np.empty((shape[1], shape[0]), np.float32).T  # not contiguous: a staged pull
for rnd in range(5):
    grads = [np.sin(np.arange(n, dtype=np.float32) * (w + 1) + rnd).reshape(shape) for w in range(W)]
    if comp is not None:
        total = np.zeros(n, np.float32)
        for w in range(W):
            words = comp.compress(grads[w].reshape(-1), residual[w])
            total += comp.decompress(words, n, np.float32)
        total = total.reshape(shape)
    else:
        total = grads[0].copy()
        for w in range(1, W):
            total += grads[w]
    if make is None:
        ref = total
    else:
        if ref_state is None:
            ref_state = ref_opt.create_state('a', ref)
        ref_opt.update('a', ref, total, ref_state)
    kv.push('a', grads[r])
    kv.pull('a', out=out_a)
    kv.push('b', grads[r])
    kv.pull('b', out=out_b)
    assert np.array_equal(out_a, ref), (case, rnd, np.abs(out_a - ref).max())
    assert np.array_equal(out_b, ref), (case, rnd, np.abs(out_b - ref).max())
kv.barrier()
print('EXACT-OK', flush=True)
"""
    rc, out = cluster(code, workers=2, servers=2, env=BIG)
    assert rc == 0, out
    assert out.count("EXACT-OK") == 2, out
