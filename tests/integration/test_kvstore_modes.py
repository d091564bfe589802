"""dist_async, compression, user-defined optimizers, optimizer states: real processes."""

from __future__ import annotations


def test_async_applies_each_push_and_refuses_without_optimizer(cluster):
    code = """
kv = hetps.kv.create('dist_async')
r, W = kv.rank, kv.num_workers
kv.init('w', np.zeros(8, np.float32))
try:
    kv.push('w', np.ones(8, np.float32))
    raise SystemExit('a dist_async push without an optimizer was accepted')
except RequestError as e:
    assert 'set_optimizer' in str(e), e
kv.barrier()                     # every worker saw the refusal before an optimizer exists
kv.set_optimizer(optim.SGD(learning_rate=1.0))
for i in range(5):
    kv.push('w', np.full(8, r + 1, np.float32))      # acknowledged after it is applied
    mine = kv.pull('w')
    assert (mine <= -(r + 1) * (i + 1)).all(), mine  # at least my own pushes are in
kv.barrier()                                          # waits for my pushes, then everyone's
final = kv.pull('w')
expect = -5 * sum(range(1, W + 1))
assert (final == expect).all(), (final, expect)
print('ASYNC-OK', flush=True)
"""
    rc, out = cluster(code, workers=3, servers=2)
    assert rc == 0, out
    assert out.count("ASYNC-OK") == 3, out


def test_two_bit_compression_matches_mxnet_rule(cluster):
    code = """
from hetps.kvstore.compression import TwoBitCompressor
kv = hetps.kv.create('dist_sync')
r, W = kv.rank, kv.num_workers
n = 3000
kv.init('g', np.zeros(n, np.float32))             # init is not compressed
kv.init('plain', np.arange(n, dtype=np.float32))
assert (kv.pull('plain') == np.arange(n)).all()
kv.set_gradient_compression({'type': '2bit', 'threshold': 0.5})
ref = TwoBitCompressor(0.5)
rng = [np.random.default_rng(w) for w in range(W)]
res = [np.zeros(n, np.float32) for _ in range(W)]
for rnd in range(3):
    grads = [g.uniform(-1, 1, n).astype(np.float32) for g in rng]
    kv.push('g', grads[r])
    got = kv.pull('g')
    expect = sum(ref.decompress(ref.compress(grads[w], res[w]), n, np.float32) for w in range(W))
    assert np.array_equal(got, expect), (rnd, got[:8], expect[:8])
    assert set(np.unique(got)) <= {-0.5 * k for k in range(-W, W + 1)}
kv.barrier()
print('COMP-OK', flush=True)
"""
    rc, out = cluster(
        code,
        workers=2,
        servers=2,
        env={"HETPS_BIGARRAY_BOUND": "1000", "HETPS_CHUNK_BYTES": "4096"},
    )
    assert rc == 0, out
    assert out.count("COMP-OK") == 2, out


def test_optimizer_defined_in_user_script_and_state_save_load(cluster, tmp_path):
    path = tmp_path / "states.bin"
    code = f"""
class HalfStep(optim.Optimizer):
    '''A user optimizer defined in __main__: ships to the servers by value.'''
    def create_state(self, key, weight):
        return np.zeros_like(weight)
    def update(self, key, weight, grad, state):
        state += 1
        weight -= 0.5 * self.learning_rate * grad * state

kv = hetps.kv.create('dist_sync')
kv.init('a', np.zeros(4, np.float32))
kv.set_optimizer(HalfStep(learning_rate=2.0))
kv.push('a', np.ones(4, np.float32))
assert (kv.pull('a') == -1.0 * kv.num_workers).all(), kv.pull('a')
if kv.rank == 0:
    kv.save_optimizer_states({str(path)!r})
kv.barrier()
kv.push('a', np.ones(4, np.float32))                  # state becomes 2
kv.load_optimizer_states({str(path)!r})               # back to 1
kv.barrier()
before = kv.pull('a')
kv.push('a', np.ones(4, np.float32))                  # state 2 again, not 3
after = kv.pull('a')
assert np.allclose(before - after, 2.0 * kv.num_workers), (before, after)
kv.barrier()
print('USEROPT-OK', flush=True)
"""
    rc, out = cluster(code, workers=2, servers=1)
    assert rc == 0, out
    assert out.count("USEROPT-OK") == 2, out
    assert path.exists()


def test_dcasgd_on_servers_knows_the_worker(cluster):
    code = """
kv = hetps.kv.create('dist_async')
kv.init('w', np.ones(5, np.float64))
kv.set_optimizer(optim.DCASGD(learning_rate=0.1, lamda=0.5))
for _ in range(4):
    w = kv.pull('w')
    kv.push('w', np.full(5, 0.2))
kv.barrier()
final = kv.pull('w')
assert np.isfinite(final).all() and (final < 1).all(), final
print('DCASGD-OK', flush=True)
"""
    rc, out = cluster(code, workers=2, servers=1)
    assert rc == 0, out
    assert out.count("DCASGD-OK") == 2, out
