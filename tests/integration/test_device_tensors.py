"""Device tensors through a real cluster (2 workers, 1 server, dist_sync, secured): pushes of
a list over two devices, pulls and pushpulls into device tensors, with exact values, on a
simulated device whose copies run as late as a real one's may (tests/deferred_device.py).
The same on CUDA where a GPU is present."""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]

SIMULATED = f"""
sys.path.insert(0, {str(TESTS)!r})
from deferred_device import DeferredBackend
from hetps.device import staging as devices
dev = DeferredBackend()
devices.register_backend(dev)
kv = hetps.kv.create('dist_sync_device')
r, W = kv.rank, kv.num_workers
n = 300_000  # 1.2 MB: bigger than a fused push-pull's bound, several chunks
kv.init('w', dev.array(np.zeros(n, np.float32)))
kv.init('s', np.zeros(8, np.float32))
out = dev.array(np.zeros(n, np.float32), device=1)
small = dev.array(np.zeros(8, np.float32))
for rnd in range(1, 6):
    a = dev.array(np.full(n, rnd * (r + 1), np.float32), device=0)
    b = dev.array(np.arange(n, dtype=np.float32), device=1)
    kv.push('w', [a, b])
    a.write(-1.0)  # a kernel after the push: the push sent what was there before it
    kv.pull('w', out=out)
    want = rnd * sum(range(1, W + 1)) + W * np.arange(n, dtype=np.float32)
    assert np.array_equal(out.read(), want), rnd
    small.write(rnd * (r + 1))
    kv.pushpull('s', small)  # out defaults to the pushed tensor itself
    assert np.array_equal(small.read(), np.full(8, rnd * sum(range(1, W + 1)))), rnd
kv.barrier()
# each call's buffers came back: a few per shape, not one per round
print('DEVICE-OK', devices.STAGING.buffers(), dev.to_host_copies, flush=True)
"""


def test_device_tensors_through_a_cluster_are_exact(cluster):
    rc, out = cluster(SIMULATED, workers=2, servers=1)
    assert rc == 0, out
    lines = [ln.split() for ln in out.splitlines() if "DEVICE-OK" in ln]
    assert len(lines) == 2, out
    for ln in lines:
        buffers, copies = int(ln[-2]), int(ln[-1])
        assert copies == 5 * 2 + 1, ln  # one copy per push and pushpull, plus the init
        assert buffers <= 8, ln


CUDA = """
import torch
kv = hetps.kv.create('dist_sync_device')
r, W = kv.rank, kv.num_workers
n = 1 << 20
kv.init('w', torch.zeros(n, device='cuda'))
out = torch.empty(n, device='cuda')
for rnd in range(1, 6):
    g = torch.full((n,), float(rnd * (r + 1)), device='cuda')
    g2 = torch.arange(n, dtype=torch.float32, device='cuda')
    kv.push('w', [g, g2])
    g.fill_(-1.0)  # queued after the push: must not reach the server
    kv.pull('w', out=out)
    total = out.sum()  # on the caller's stream: waits for the copy of the pulled value only
    want = rnd * sum(range(1, W + 1)) * n + W * (n * (n - 1) / 2)
    assert abs(total.item() - want) / want < 1e-5, (rnd, total.item(), want)
    assert torch.equal(out[:4].cpu(), rnd * sum(range(1, W + 1)) + W * torch.arange(4.0)), rnd
kv.barrier()
print('CUDA-OK', flush=True)
"""


def test_cuda_tensors_through_a_cluster_are_exact(cluster):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False here)")
    rc, out = cluster(CUDA, workers=2, servers=1)
    assert rc == 0, out
    assert out.count("CUDA-OK") == 2, out
