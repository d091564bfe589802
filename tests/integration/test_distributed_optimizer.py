"""DistributedOptimizer gives the same weights as single-process training on the same batch."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

CODE = """
import json, torch
from hetps.torch.optimizer import DistributedOptimizer
torch.set_num_threads(1)
torch.manual_seed(0)
kv = hetps.kv.create('dist_sync')
r, W = kv.rank, kv.num_workers
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).double()
if r != 0:                       # other ranks start elsewhere: the broadcast must fix that
    for p in model.parameters():
        torch.nn.init.normal_(p)
extra = torch.zeros(2, dtype=torch.float64)   # rides with the gradients when it can
opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                           model.named_parameters(), kvstore=kv, op='average', extra=extra)
g = torch.Generator().manual_seed(1)
X = torch.randn(6, 16, 8, generator=g, dtype=torch.float64)   # 6 steps, global batch 16
Y = torch.randint(0, 3, (6, 16), generator=g)
per = 16 // W
for step in range(6):
    x, y = X[step, r * per:(r + 1) * per], Y[step, r * per:(r + 1) * per]
    opt.zero_grad()
    extra.copy_(torch.tensor([r + 1.0, step]))  # before backward: it leaves with the hooks
    torch.nn.functional.cross_entropy(model(x), y).backward()
    if step == 3:
        opt.synchronize()                                    # clip between sync and step
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    opt.step()
    if opt.extra_rides:  # summed over the workers, not averaged
        assert extra.tolist() == [W * (W + 1) / 2, W * step], (extra, step)
print('RIDES', opt.extra_rides, flush=True)
print('GROUPS ' + json.dumps([g.names for g in opt.groups]), flush=True)
print('WEIGHTS ' + json.dumps([p.detach().flatten().tolist() for p in model.parameters()]), flush=True)
"""

REFERENCE = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).double()
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
g = torch.Generator().manual_seed(1)
X = torch.randn(6, 16, 8, generator=g, dtype=torch.float64)
Y = torch.randint(0, 3, (6, 16), generator=g)
for step in range(6):
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(X[step]), Y[step]).backward()
    if step == 3:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    opt.step()
ref = [p.detach().flatten().tolist() for p in model.parameters()]
"""


def _assert_weights_match(out: str, ref: list, workers: int) -> None:
    """Every worker printed WEIGHTS equal to the single-process reference ``ref``."""
    got = [
        json.loads(line.split("WEIGHTS ", 1)[1]) for line in out.splitlines() if "WEIGHTS " in line
    ]
    assert len(got) == workers, out
    for weights in got:
        for a, b in zip(weights, ref, strict=True):
            assert a == pytest.approx(b, rel=1e-9, abs=1e-12)


# parameter bytes (float64): 0.weight 1024, 0.bias 128, 2.weight 384, 2.bias 24
GROUPS = {
    None: [["0.weight", "0.bias", "2.weight", "2.bias"]],  # default 256 KiB: all fused
    "0": [["0.weight"], ["0.bias"], ["2.weight"], ["2.bias"]],  # no fusion
    "600": [["0.weight"], ["0.bias", "2.weight", "2.bias"]],  # mixed: the big one alone
}


@pytest.mark.parametrize(
    ("workers", "fusion"),
    [(1, None), (2, None), pytest.param(4, None, marks=pytest.mark.slow), (2, "0"), (2, "600")],
)
def test_matches_single_process_training(cluster, workers, fusion):
    """4 workers is slow: the (2, None) case takes the same path in the default run."""
    env = {} if fusion is None else {"HETPS_FUSION_BYTES": fusion}
    rc, out = cluster(CODE, workers=workers, servers=min(workers, 2), env=env)
    assert rc == 0, out
    groups = [
        json.loads(line.split("GROUPS ", 1)[1]) for line in out.splitlines() if "GROUPS " in line
    ]
    assert groups and all(g == GROUPS[fusion] for g in groups), groups
    # the extra tensor rides in the first parameters' fused group, when that group is fused
    rides = len(GROUPS[fusion][0]) > 1
    assert out.count(f"RIDES {rides}") == workers, out
    scope: dict = {}
    exec(REFERENCE, scope)  # the same model, data and steps, in this process
    ref = scope["ref"]
    _assert_weights_match(out, ref, workers)


def test_server_side_update_async(cluster):
    code = """
import torch
from hetps.torch.optimizer import DistributedOptimizer
torch.manual_seed(0)
kv = hetps.kv.create('dist_async')
model = torch.nn.Linear(4, 1)
opt = DistributedOptimizer(None, model.named_parameters(), kvstore=kv, update_on='server',
                           server_optimizer=optim.SGD(learning_rate=0.05))
x = torch.ones(8, 4); y = torch.full((8, 1), 3.0)
for _ in range(30):
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()                    # pushes went out during backward; weights pulled
kv.barrier()
loss = float(torch.nn.functional.mse_loss(model(x), y))
assert loss < 0.5, loss
print('ASYNC-DOPT-OK', flush=True)
"""
    rc, out = cluster(code, workers=2, servers=1)
    assert rc == 0, out
    assert out.count("ASYNC-DOPT-OK") == 2


@pytest.mark.parametrize("fusion", [pytest.param("0", marks=pytest.mark.slow), "262144"])
def test_parameter_without_gradient_is_left_alone(cluster, fusion):
    """A parameter the forward pass does not use keeps p.grad None and is not moved by
    momentum or weight decay, alone or inside a fused group (where it adds zeros)."""
    code = """
import torch
from hetps.torch.optimizer import DistributedOptimizer
torch.manual_seed(0)
kv = hetps.kv.create('dist_sync')
used = torch.nn.Linear(4, 3).double(); unused = torch.nn.Linear(4, 3).double()
model = torch.nn.ModuleDict({'a': used, 'b': unused})
opt = DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1),
    model.named_parameters(), kvstore=kv, op='average')
before = unused.weight.detach().clone()
w0 = used.weight.detach().clone()
for step in range(3):
    opt.zero_grad()
    used(torch.ones(2, 4, dtype=torch.float64)).sum().backward()
    opt.step()
assert unused.weight.grad is None and torch.equal(before, unused.weight.detach())
assert not torch.equal(w0, used.weight.detach())
print('UNUSED-OK', len(opt.groups), flush=True)
"""
    rc, out = cluster(code, workers=2, servers=1, env={"HETPS_FUSION_BYTES": fusion})
    assert rc == 0, out
    assert out.count("UNUSED-OK") == 2, out
    # with fusion, all four small parameters travel as one group
    assert ("UNUSED-OK 1" in out) == (fusion != "0"), out


PAUSED = """
import json, time, torch
from hetps.torch.optimizer import DistributedOptimizer
torch.set_num_threads(1)
torch.manual_seed(0)

class SlowBackward(torch.autograd.Function):
    # an expensive layer below the head: its backward takes 5 ms (emulated compute)
    @staticmethod
    def forward(ctx, x):
        return x.clone()
    @staticmethod
    def backward(ctx, g):
        time.sleep(0.005)
        return g

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Linear(8, 8).double()      # 576 B: ready last
        self.head = torch.nn.Linear(8, 1500).double()   # 108 KB: ready first
    def forward(self, x):
        return self.head(SlowBackward.apply(torch.tanh(self.stem(x))))

kv = hetps.kv.create('dist_sync')
r, W = kv.rank, kv.num_workers
model = Net()
extra = torch.zeros(1, dtype=torch.float64)
opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                           model.named_parameters(), kvstore=kv, extra=extra)
before = [g.names for g in opt.groups]
g = torch.Generator().manual_seed(3)
X = torch.randn(8, 4, 8, generator=g, dtype=torch.float64)
Y = torch.randn(8, 4, 1500, generator=g, dtype=torch.float64)
per = 4 // W
for step in range(8):
    opt.zero_grad()
    extra.fill_(step + r)
    x, y = X[step, r * per:(r + 1) * per], Y[step, r * per:(r + 1) * per]
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    assert opt.extra_rides and extra.item() == W * step + W * (W - 1) / 2, (step, extra)
print('GROUPS ' + json.dumps([before, [g.names for g in opt.groups]]), flush=True)
print('WEIGHTS ' + json.dumps([p.detach().flatten().tolist() for p in model.parameters()]), flush=True)
"""


@pytest.mark.parametrize("tune", ["4", "0"])
def test_groups_are_remade_where_backward_pauses(cluster, tune):
    """After the timed steps every worker takes rank 0's groups: the head's gradients, ready
    5 ms before the stem's, leave on their own; training stays exact across the switch."""
    rc, out = cluster(PAUSED, workers=2, servers=1, env={"HETPS_FUSION_TUNE_STEPS": tune})
    assert rc == 0, out
    groups = [
        json.loads(line.split("GROUPS ", 1)[1]) for line in out.splitlines() if "GROUPS " in line
    ]
    fused = [["stem.weight", "stem.bias", "head.weight", "head.bias"]]
    split = [["stem.weight", "stem.bias"], ["head.weight", "head.bias"]]
    assert groups == [[fused, split if tune == "4" else fused]] * 2, groups
    # the same steps in one process, on the global batch
    scope: dict = {}
    ref_code = (
        PAUSED.split("kv = hetps")[0]
        + """
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
g = torch.Generator().manual_seed(3)
X = torch.randn(8, 4, 8, generator=g, dtype=torch.float64)
Y = torch.randn(8, 4, 1500, generator=g, dtype=torch.float64)
for step in range(8):
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(X[step]), Y[step]).backward()
    opt.step()
ref = [p.detach().flatten().tolist() for p in model.parameters()]
"""
    )
    exec(ref_code, scope)
    _assert_weights_match(out, scope["ref"], 2)


def test_a_launch_that_fails_raises_in_step_not_in_the_launcher(cluster):
    """Pushes leave from a launcher thread; when one fails (here the store was closed), the
    training thread gets the error from step() instead of waiting forever."""
    code = """
import torch
from hetps.torch.optimizer import DistributedOptimizer
kv = hetps.kv.create('dist_sync')
model = torch.nn.Sequential(torch.nn.Linear(4, 300), torch.nn.Linear(300, 2))
opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                           model.named_parameters(), kvstore=kv, fusion_bytes=1024)
assert len(opt.groups) == 4 and opt._launches._thread is not None
opt.zero_grad(); model(torch.ones(2, 4)).sum().backward(); opt.step()
kv.close()
opt.zero_grad(); model(torch.ones(2, 4)).sum().backward()
try:
    opt.step()
except Exception as exc:
    print('STEP-RAISED', type(exc).__name__, flush=True)
opt.close()
assert not any(t.name == 'hetps-launcher' for t in __import__('threading').enumerate())
"""
    rc, out = cluster(code, workers=1, servers=1)
    assert "STEP-RAISED NodeClosed" in out, out


def test_gradient_accumulation_over_two_backward_passes(cluster):
    """Two backward passes before each step(): every pass that completes a group sends it
    again (the launcher first sends the copy still queued), and step() applies the average
    over the workers of each worker's accumulated gradient, as one process would."""
    code = CODE.replace(
        "    torch.nn.functional.cross_entropy(model(x), y).backward()\n",
        "    for m in range(2):\n"
        "        h = per // 2\n"
        "        loss = torch.nn.functional.cross_entropy(model(x[m*h:(m+1)*h]), y[m*h:(m+1)*h])\n"
        "        loss.backward()\n",
    ).replace("    if opt.extra_rides:", "    if False:")  # two sends per step: 2x the flag
    assert code != CODE
    rc, out = cluster(code, workers=2, servers=1, env={"HETPS_FUSION_BYTES": "600"})
    assert rc == 0, out
    reference = REFERENCE.replace(
        "    torch.nn.functional.cross_entropy(model(X[step]), Y[step]).backward()\n",
        "    for m in range(2):\n"
        "        idx = torch.cat([torch.arange(r * 8 + m * 4, r * 8 + m * 4 + 4) for r in range(2)])\n"
        "        (torch.nn.functional.cross_entropy(model(X[step][idx]), Y[step][idx])).backward()\n",
    )
    assert reference != REFERENCE
    scope: dict = {}
    exec(reference, scope)
    _assert_weights_match(out, scope["ref"], 2)
