"""The CUDA branch through a real cluster, on the stand-in of torch.cuda
(tests/cuda_standin.py): gradient accumulation with fused groups while a launch waits for a
side-stream copy that has not run, and a multi-key push that fails after its first key was
sent, followed by exact pushes. The same on a GPU: tests/integration/test_cuda_paths.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

TESTS = Path(__file__).resolve().parents[1]

ACCUMULATE = f"""
import copy, json, torch
sys.path.insert(0, {str(TESTS)!r})
from cuda_standin import StandInCuda
from hetps.device import staging as devices
from hetps.torch.optimizer import DistributedOptimizer
torch.set_num_threads(1)
torch.manual_seed(0)
d = StandInCuda()  # every float tensor of this process is on its device
devices.register_backend(devices.CudaBackend(d))
kv = hetps.kv.create('dist_sync')
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                            torch.nn.Tanh(), torch.nn.Linear(16, 3)).double()
ref = copy.deepcopy(model)
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                           kvstore=kv, fusion_bytes=600, tune_steps=0)
for grp in opt.groups:
    grp.inline = False  # every group goes through the launcher thread, which the gate holds
g = torch.Generator().manual_seed(1)
X = torch.randn(2, 2, 4, 8, generator=g, dtype=torch.float64)
Y = torch.randint(0, 3, (2, 2, 4), generator=g)
loss = torch.nn.functional.cross_entropy
for step in range(2):
    ref_opt.zero_grad()
    want = []
    for m in range(2):
        loss(ref(X[step, m]), Y[step, m]).backward()
        want.append({{n: p.grad.clone() for n, p in ref.named_parameters()}})
    opt.zero_grad()
    d.log, d.held = [], __import__('threading').Event()
    d.gate.clear()  # the launcher's waits for its copies block until the gate opens
    loss(model(X[step, 0]), Y[step, 0]).backward()
    assert d.held.wait(30), 'the launcher never waited for a copy'
    loss(model(X[step, 1]), Y[step, 1]).backward()  # accumulates while pass 1's copies wait
    d.gate.set()
    opt.step()
    ref_opt.step()
    # every push carried one pass's gradients exactly: pass 1's, then both passes' sum
    expected = {{}}
    for grp in opt.groups:
        for m in range(2):
            flat = torch.cat([want[m][n].reshape(-1) for n in grp.names])
            expected[(tuple(grp.names), m)] = flat
    seen = set()
    for t in d.log:
        hit = [k for k, v in expected.items() if v.numel() == t.numel() and torch.equal(v, t)]
        assert hit, ('a push carried gradients of no single pass', step, t.numel())
        seen.update(hit)
    assert seen == set(expected), ('pushes missing', step, set(expected) - seen)
for a, b in zip(model.parameters(), ref.parameters()):
    assert torch.allclose(a, b, rtol=1e-12, atol=1e-14), (a - b).abs().max()
print('GROUPS ' + json.dumps([grp.names for grp in opt.groups]), flush=True)
opt.close()
print('ACCUMULATE-OK', flush=True)
"""


def test_accumulation_while_a_launch_waits_for_a_copy_sends_each_pass_exactly(cluster):
    """A second backward before step() writes the fused groups' buffers and adds into the
    lone gradients while the launcher still waits for the first pass's copies (held by the
    stand-in's gate; those copies run as late as a GPU may run them): each push carries one
    pass's gradients exactly, and the weights equal local training's."""
    rc, out = cluster(ACCUMULATE, workers=1, servers=1)
    assert rc == 0, out
    assert "ACCUMULATE-OK" in out, out
    groups = json.loads(out.split("GROUPS ", 1)[1].splitlines()[0])
    assert any(len(g) > 1 for g in groups) and any(len(g) == 1 for g in groups), groups


MULTI_KEY = f"""
import torch
sys.path.insert(0, {str(TESTS)!r})
from cuda_standin import StandInCuda
from hetps.device import staging as devices
d = StandInCuda(claim_all=False)  # the tensors placed on it
devices.register_backend(devices.CudaBackend(d))
kv = hetps.kv.create('dist_sync')
kv.set_optimizer(optim.SGD(learning_rate=1.0))  # every round's sum changes the value
r, W = kv.rank, kv.num_workers
n = 300_000  # several chunks
kv.init(['a', 'b'], [d.place(torch.zeros(n), 0), d.place(torch.zeros(8), 0)])
total = 0.0
for rnd in range(1, 5):
    a = d.place(torch.full((n,), float(rnd * (r + 1))), 0)
    bad = d.place(torch.zeros(5), 0)
    try:
        kv.push(['a', 'b'], [a, bad])
        raise SystemExit('a push of the wrong shape was taken')
    except ValueError as exc:
        assert "key 'b'" in str(exc), exc
    # key a's push above was sent (this round); at once the next one, into a staging buffer
    kv.push('a', d.place(torch.full((n,), -2.0 * rnd), 0))
    kv.push('b', d.place(torch.full((8,), float(r + 1)), 0))
    total += rnd * sum(range(1, W + 1)) - 2.0 * rnd * W
out_a, out_b = d.place(torch.zeros(n), 0), d.place(torch.zeros(8), 0)
kv.pull(['a', 'b'], out=[out_a, out_b])
assert torch.equal(out_a, torch.full((n,), -total)), (out_a[:4], -total)
assert torch.equal(out_b, torch.full((8,), -4.0 * sum(range(1, W + 1)))), out_b
kv.barrier()
print('MULTI-KEY-OK', devices.STAGING.buffers(), flush=True)
"""


def test_a_failed_multi_key_push_then_exact_pushes(cluster):
    """Each round a two-key push fails on its second key after the first key's push was
    sent; the next push starts at once. Every round's sum reaches the servers exactly (the
    servers' SGD makes each round count), on every worker."""
    rc, out = cluster(MULTI_KEY, workers=2, servers=1)
    assert rc == 0, out
    assert out.count("MULTI-KEY-OK") == 2, out
