"""A server sums and updates big keys on HETPS_SERVER_THREADS kernel threads (real
processes): the weights every worker pulls are bit for bit what one thread computes."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "2bit"])
def test_a_threaded_server_update_is_bit_for_bit_one_thread(cluster, compress):
    """2 workers push 3 rounds of a 600,000-value key (over the kernel's threaded size) to one
    server running Adam on 2 kernel threads; each worker recomputes the rounds on 1 thread.
    Both workers push the same gradient, so the sum is the same in any arrival order."""
    code = f"""
from hetps.kvstore.compression import TwoBitCompressor
from hetps.optim import kernels
kv = hetps.kv.create('dist_sync')
r, W = kv.rank, kv.num_workers
n = 600_000
w0 = np.random.default_rng(0).standard_normal(n).astype(np.float32)
kv.init('w', w0)
opt = optim.Adam(learning_rate=0.01, wd=1e-3, clip_gradient=5.0, rescale_grad=0.5)
kv.set_optimizer(opt)
compress = {compress}
if compress:
    kv.set_gradient_compression({{'type': '2bit', 'threshold': 0.25}})
    ref_c, res = TwoBitCompressor(0.25), np.zeros(n, np.float32)
kernels.set_threads(1)                    # the reference: one thread, in this worker
ref, state = w0.copy(), opt.create_state(('w', 0), w0)
for rnd in range(3):
    g = np.random.default_rng(100 + rnd).standard_normal(n).astype(np.float32)
    kv.push('w', g)                       # every worker pushes the same gradient
    got = kv.pull('w')
    if compress:
        g = ref_c.decompress(ref_c.compress(g, res), n)
    opt.update(('w', 0), ref, g + g, state)
    assert got.tobytes() == ref.tobytes(), ('round', rnd, np.abs(got - ref).max())
kv.barrier()
print('KERNELS-OK', flush=True)
"""
    env = {"HETPS_SERVER_THREADS": "2", "HETPS_BIGARRAY_BOUND": "10000000"}
    rc, out = cluster(code, workers=2, servers=1, env=env)
    assert rc == 0, out
    assert out.count("KERNELS-OK") == 2, out
