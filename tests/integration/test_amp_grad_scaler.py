"""AMP's GradScaler with the DistributedOptimizer (2 workers, 1 server): unscaled and
checked for inf/NaN after the reduction, so the wrapped optimizer steps on the unscaled
average and every worker skips the step one worker's overflow spoiled, both as
``scaler.step(opt)`` alone and as Horovod documents it (``opt.synchronize()``,
``scaler.unscale_(opt)``, clipping, ``with opt.skip_synchronize(): scaler.step(opt)``). The
weights and the scale equal one process's with the same global batch and scaler."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

SETUP = """
import json, torch
from hetps.torch.optimizer import DistributedOptimizer
torch.set_num_threads(1)
def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 3)).double()
g = torch.Generator().manual_seed(1)
X = torch.randn(5, 16, 8, generator=g, dtype=torch.float64)
Y = torch.randint(0, 3, (5, 16), generator=g)
"""

WORKER = (
    SETUP
    + """
kv = hetps.kv.create('dist_sync')
r, W = kv.rank, kv.num_workers
per = 16 // W
for flow in ('scaler-step', 'horovod'):
    model = net()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               model.named_parameters(), kvstore=kv, prefix=flow + '/',
                               fusion_bytes=600)
    scaler = torch.amp.GradScaler('cpu', init_scale=2.0 ** 10, growth_interval=2)
    for step in range(5):
        x, y = X[step, r * per:(r + 1) * per], Y[step, r * per:(r + 1) * per]
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        if step == 2 and r == W - 1:
            loss = loss * float('inf')  # this worker's gradients overflow: all skip the step
        scaler.scale(loss).backward()
        if flow == 'horovod':
            opt.synchronize()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            with opt.skip_synchronize():
                scaler.step(opt)
        else:
            scaler.step(opt)
        scaler.update()
    print('RESULT ' + json.dumps([flow, scaler.get_scale(),
          [p.detach().flatten().tolist() for p in model.parameters()]]), flush=True)
    opt.close()
"""
)

REFERENCE = (
    SETUP
    + """
ref = {}
for flow in ('scaler-step', 'horovod'):
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler('cpu', init_scale=2.0 ** 10, growth_interval=2)
    for step in range(5):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(X[step]), Y[step])
        if step == 2:
            loss = loss * float('inf')
        scaler.scale(loss).backward()
        if flow == 'horovod':
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()
    ref[flow] = (scaler.get_scale(), [p.detach().flatten().tolist() for p in model.parameters()])
"""
)


def test_grad_scaler_unscales_the_reduced_sum_and_every_worker_skips_an_overflow(cluster):
    rc, out = cluster(WORKER, workers=2, servers=1)
    assert rc == 0, out
    scope: dict = {}
    exec(REFERENCE, scope)
    ref = scope["ref"]
    got = [json.loads(ln.split("RESULT ", 1)[1]) for ln in out.splitlines() if "RESULT " in ln]
    assert len(got) == 4, out  # two flows on each of the two workers
    for flow, scale, weights in got:
        want_scale, want = ref[flow]
        # grown after steps 0-1, halved by the overflow at 2, grown after 3-4 (no skip: 4096)
        assert scale == want_scale == 2.0**11, (flow, scale)
        for a, b in zip(weights, want, strict=True):
            assert a == pytest.approx(b, rel=1e-9, abs=1e-12), flow
