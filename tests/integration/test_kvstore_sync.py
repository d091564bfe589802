"""dist_sync semantics through real processes: init, push/pull rounds, placement, lists."""

from __future__ import annotations

import pytest

from conftest import PER_PROCESS

SYNC = """
kv = hetps.kv.create('dist_sync')
r, W = kv.rank, kv.num_workers
assert kv.type == 'dist_sync'
small = np.arange(6, dtype=np.float32).reshape(2, 3)
big = np.arange(5000, dtype=np.float64)          # above the bound of 1000: split over servers
half = np.ones(40, dtype=np.float16)
# every worker calls init; rank 0's value wins
kv.init([3, 'big', 'h'], [small + 100 * r, big + r, half])
out = np.zeros((2, 3), np.float32)
kv.pull(3, out=out)                                # a pull right after init sees rank 0's value
assert (out == small).all(), out
assert (kv.pull('big') == big).all()
for rnd in range(3):
    kv.push(3, np.full((2, 3), r + 1 + rnd, np.float32))
    kv.pull(3, out=out)                            # sees this round's sum (no optimizer: replaced)
    expect = sum(w + 1 + rnd for w in range(W))
    assert (out == expect).all(), (rnd, out, expect)
# a list of values for one key is summed before the push; out may be a list
kv.push('big', [np.full(5000, 1.0), np.full(5000, 2.0)])
o1, o2 = np.zeros(5000), np.zeros(5000)
kv.pull('big', out=[o1, o2])
assert (o1 == 3 * W).all() and (o2 == 3 * W).all(), (o1[:3], W)
kv.pushpull('h', np.full(40, 0.5, np.float16), out=half)
assert (half == 0.5 * W).all() and half.dtype == np.float16
# non-blocking calls return handles; per-key order holds
hs = [kv.push(3, np.ones((2, 3), np.float32), block=False)]
hp = kv.pull(3, out=out, block=False)
hs[0].wait(); hp.wait()
assert (out == W).all(), out
kv.barrier()
print('SYNC-OK', r, flush=True)
"""


@pytest.mark.parametrize(
    "workers,servers", [(1, 1), (2, 1), (2, 2), pytest.param(3, 3, marks=pytest.mark.slow)]
)
def test_sync_semantics(cluster, workers, servers):
    """(3, 3) is slow: the (2, 2) case and test_sync_four_workers_small_chunks (4 workers, 2
    servers) take the same path in the default run."""
    rc, out = cluster(SYNC, workers=workers, servers=servers, env={"HETPS_BIGARRAY_BOUND": "1000"})
    assert rc == 0, out
    assert out.count("SYNC-OK") == workers, out


def test_sync_four_workers_small_chunks(cluster):
    # 4 workers; tiny chunks force every big key through many messages per part
    rc, out = cluster(
        SYNC,
        workers=4,
        servers=2,
        env={"HETPS_BIGARRAY_BOUND": "1000", "HETPS_CHUNK_BYTES": "4096"},
    )
    assert rc == 0, out
    assert out.count("SYNC-OK") == 4, out


def test_sync_optimizer_and_torch_tensors(cluster):
    code = """
import torch
kv = hetps.kv.create('dist_sync')
r, W = kv.rank, kv.num_workers
w0 = torch.ones(10)
kv.init('w', w0)
kv.set_optimizer(optim.SGD(learning_rate=0.1))      # returns once every server has it
g = torch.full((10,), float(r + 1))
kv.push('w', g)
w = torch.zeros(10)
kv.pull('w', out=w)                                  # pull writes into the tensor in place
expect = 1 - 0.1 * sum(range(1, W + 1))
assert torch.allclose(w, torch.full((10,), expect)), (w, expect)
kv.barrier()
print('OPT-OK', flush=True)
"""
    rc, out = cluster(code, workers=2, servers=2)
    assert rc == 0, out
    assert out.count("OPT-OK") == 2, out


def test_str_and_int_keys_spread_over_servers(cluster):
    code = """
from hetps.kvstore.placement import server_of
kv = hetps.kv.create('dist_sync')
keys = list(range(20)) + [f'layer{i}.weight' for i in range(20)]
kv.init(keys, [np.full(7, i, np.float32) for i in range(len(keys))])
vals = kv.pull(keys)
for i, v in enumerate(vals):
    assert (v == i).all(), (keys[i], v)
assert len({server_of(k, 3) for k in keys}) == 3
print('KEYS-OK', flush=True)
"""
    rc, out = cluster(code, workers=1, servers=3)
    assert rc == 0, out
    assert "KEYS-OK" in out


def test_verbose_logs_in_ps_lite_style(cluster):
    code = """
kv = hetps.kv.create('dist_sync')
kv.init(1, np.zeros(2, np.float32))
kv.push(1, np.ones(2, np.float32))
"""
    rc, out = cluster(code, workers=2, servers=1, env={"PS_VERBOSE": "2"})
    assert rc == 0, out
    assert "assign rank=9 to node role=worker, ip=127.0.0.1, port=" in out
    assert "assign rank=8 to node role=server" in out and "is_recovery=0" in out
    assert "push req=" in out  # level 2: every message


RING = """
import os
kv = hetps.kv.create('dist_sync')
r, W = kv.rank, kv.num_workers
n = (5 << 20) // 4                      # 5 MiB: chunks of 4 MiB go through the shared ring
kv.init('w', np.zeros(n, np.float32))
out = np.zeros(n, np.float32)
for rnd in range(6):                    # 6 x 4 MiB through a 16 MiB ring: it wraps
    g = np.arange(n, dtype=np.float32) * (r + 1) + rnd
    kv.pushpull('w', g, out=out)
    expect = np.arange(n, dtype=np.float32) * sum(w + 1 for w in range(W)) + rnd * W
    assert (out == expect).all(), (rnd, out[:4], expect[:4])
rings = [x for x in kv.node.van._rings_out.values() if x is not None]
assert rings and all(x.ready and x.head > 0 for x in rings), 'no ring was used'
mine = f'hetps-shm-{os.getpid()}-'
assert not [f for f in os.listdir('/dev/shm') if f.startswith(mine)], 'a ring name stayed'
kv.barrier()
print('RING-OK', r, flush=True)
"""


def test_same_machine_peers_move_big_frames_through_shared_memory(cluster):
    """Workers and servers on 127.0.0.1 send big chunks through shared-memory rings (the
    worker checks its own rings were used); sums are exact over rounds that wrap a 16 MiB
    ring, and no ring name is left in /dev/shm."""
    env = {"HETPS_SHM_BYTES": str(16 << 20), **PER_PROCESS}
    rc, out = cluster(RING, workers=2, servers=1, env=env)
    assert rc == 0, out
    assert out.count("RING-OK") == 2, out
