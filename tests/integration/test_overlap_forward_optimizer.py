"""``overlap_forward=True`` on a real cluster (2 workers, 1 server, SGD with momentum on the
server, or on each worker with servers that only sum): the same weights, bit for bit, as the
same training whose ``step()`` waits for every pull. Both run side by side in one job under
different key prefixes. The CUDA variant skips without a GPU."""

from __future__ import annotations

import pytest

CODE = """
import torch
from hetps.torch import DistributedOptimizer
DEV, UPDATE_ON = {dev!r}, {update_on!r}
kv = hetps.kv.create('dist_sync')
def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16),
                               torch.nn.ReLU(), torch.nn.Linear(16, 3)).to(DEV)
g = torch.Generator().manual_seed(kv.rank)
data = [(torch.randn(12, 8, generator=g).to(DEV), torch.randint(0, 3, (12,), generator=g).to(DEV))
        for _ in range(5)]
runs = []
for overlap in (False, True):
    model = net()
    opt = DistributedOptimizer(None, model.named_parameters(), kvstore=kv, update_on=UPDATE_ON,
                               server_optimizer=optim.SGD(learning_rate=0.1, momentum=0.9),
                               prefix=f'o{{int(overlap)}}/', model=model,
                               overlap_forward=overlap)
    runs.append((model, opt))
for x, y in data:
    for model, opt in runs:
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
for model, opt in runs:
    opt.synchronize()  # reading p by hand: wait for what is in flight
for a, b in zip(runs[0][0].parameters(), runs[1][0].parameters()):
    assert b.device.type == DEV
    assert torch.equal(a, b), (a - b).abs().max()
for _, opt in runs:
    opt.close()
print('OVERLAP-OK', flush=True)
"""


@pytest.mark.parametrize("dev,update_on", [("cpu", "server"), ("cpu", "sum"), ("cuda", "server")])
def test_overlapped_pulls_give_the_same_weights_as_waiting_for_them(cluster, dev, update_on):
    torch = pytest.importorskip("torch")
    if dev == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False here)")
    rc, out = cluster(CODE.format(dev=dev, update_on=update_on), workers=2, servers=1)
    assert rc == 0, out
    assert out.count("OVERLAP-OK") == 2, out
