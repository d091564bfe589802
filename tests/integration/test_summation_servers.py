"""Servers that only sum (update_on="sum"): each worker runs the hetps optimizer on the sum,
and the weights equal those of the same job with the optimizer on the servers, bit for bit."""

from __future__ import annotations

import re

import pytest

CODE = """
import hashlib, torch
from hetps.torch import DistributedOptimizer
MODE, OPT = os.environ['MODE'], os.environ['OPT']
kv = hetps.kv.create('dist_sync')
W = kv.num_workers
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 5))
if OPT == 'sgd':
    sopt = optim.SGD(learning_rate=0.05, momentum=0.9, wd=1e-3, rescale_grad=1.0 / W)
else:
    sopt = optim.Adam(learning_rate=0.01, wd=1e-4, rescale_grad=1.0 / W)
opt = DistributedOptimizer(None, model.named_parameters(), kvstore=kv, update_on=MODE,
                           server_optimizer=sopt, fusion_bytes=2048)
g = torch.Generator().manual_seed(100 + kv.rank)
for step in range(8):
    x, y = torch.randn(32, 20, generator=g), torch.randint(0, 5, (32,), generator=g)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
digest = hashlib.sha256(b''.join(p.detach().numpy().tobytes() for p in model.parameters()))
print(f'WEIGHTS rank={kv.rank} {digest.hexdigest()}', flush=True)
opt.close()
kv.barrier()
"""


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_summation_only_servers_give_the_server_optimizers_weights(cluster, opt):
    digests = {}
    for mode in ("server", "sum"):
        rc, out = cluster(CODE, workers=2, servers=1, env={"MODE": mode, "OPT": opt})
        assert rc == 0, out
        found = dict(re.findall(r"WEIGHTS rank=(\d) (\w+)", out))
        assert sorted(found) == ["0", "1"], out
        assert found["0"] == found["1"], out  # every worker holds the same weights
        digests[mode] = found["0"]
    assert digests["sum"] == digests["server"], digests


def test_summation_mode_refuses_what_it_cannot_run():
    torch = pytest.importorskip("torch")
    from hetps import optim
    from hetps.torch import DistributedOptimizer

    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="pass None as the torch optimizer"):
        DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            model.named_parameters(),
            kvstore="local",
            update_on="sum",
            server_optimizer=optim.SGD(),
        )
    with pytest.raises(ValueError, match="DC-ASGD"):
        DistributedOptimizer(
            None,
            model.named_parameters(),
            kvstore="local",
            update_on="sum",
            server_optimizer=optim.DCASGD(),
        )
