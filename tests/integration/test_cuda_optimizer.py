"""The DistributedOptimizer on a CUDA model (1 worker, 1 server): the same weights as local
training of the same model, data and optimizer on the same GPU. Skips without a GPU."""

from __future__ import annotations

import pytest

CODE = """
import torch
torch.manual_seed(0)
def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 10)).cuda()
from hetps.torch import DistributedOptimizer
kv = hetps.kv.create('dist_sync')
data = [(torch.randn(16, 32, device='cuda'), torch.randint(0, 10, (16,), device='cuda'))
        for _ in range(6)]
ref, dist = model(), model()
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
opt = DistributedOptimizer(torch.optim.SGD(dist.parameters(), lr=0.1, momentum=0.9),
                           dist.named_parameters(), kvstore=kv, fusion_bytes=4096)
for x, y in data:
    for m, o in ((ref, ref_opt), (dist, opt)):
        o.zero_grad()
        torch.nn.functional.cross_entropy(m(x), y).backward()
        o.step()
for a, b in zip(ref.parameters(), dist.parameters()):
    assert a.device == b.device and b.device.type == 'cuda'
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max()
opt.close()
print('CUDA-OPT-OK', flush=True)
"""


def test_distributed_optimizer_on_a_cuda_model_matches_local_training(cluster):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False here)")
    rc, out = cluster(CODE, workers=1, servers=1)
    assert rc == 0, out
    assert "CUDA-OPT-OK" in out, out
