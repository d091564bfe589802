"""``hetps.torch``'s public API from a user's own script, in a real cluster: the broadcast
helpers."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


def _lines(out: str) -> list[str]:
    """The workers' output lines without the launcher's "[worker N] " prefix."""
    return [x.split("] ", 1)[1] if x.startswith("[") else x for x in out.splitlines()]


BROADCAST = """
import hashlib, torch
import hetps.torch as hps
torch.set_num_threads(1)
kv = hetps.kv.create('dist_sync')
ROOT = int(os.environ['ROOT'])
torch.manual_seed(100 + kv.rank)  # every worker starts elsewhere
model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)).double()
model[0].weight.data = model[0].weight.data.float().double()  # (any values)
model(torch.randn(8, 4, dtype=torch.float64) * (kv.rank + 1))  # running stats differ too
opt = torch.optim.Adam(model.parameters(), lr=0.01 * (kv.rank + 1))
if kv.rank == ROOT:  # only the root has optimizer state (two steps), and odd values
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(8, 4, dtype=torch.float64)).square().sum().backward()
        opt.step()
    with torch.no_grad():
        model[0].bias[0] = -0.0
        model[0].bias[1] = float('nan')

def digest():
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode() + v.numpy().tobytes())
    sd = opt.state_dict()
    for i, st in sorted(sd['state'].items()):
        for k, v in sorted(st.items()):
            h.update(f'{i}{k}'.encode() + torch.as_tensor(v).numpy().tobytes())
    h.update(repr(sd['param_groups']).encode())
    return h.hexdigest()[:16]

if kv.rank == ROOT:
    print('ROOT', digest(), flush=True)
hps.broadcast_parameters(model.state_dict(), kv, root_rank=ROOT)
hps.broadcast_optimizer_state(opt, kv, root_rank=ROOT)
print('AFTER', kv.rank, digest(), opt.param_groups[0]['lr'], flush=True)
# the same step everywhere from the same state: still the same (Adam's step count came too)
with torch.no_grad():
    model[0].bias[1] = 0.0
opt.zero_grad()
model(torch.ones(8, 4, dtype=torch.float64)).square().sum().backward()
opt.step()
print('STEPPED', kv.rank, digest(), flush=True)
"""


@pytest.mark.parametrize("root", [0, 2])
def test_broadcast_parameters_and_optimizer_state_give_everyone_the_roots(cluster, root):
    rc, out = cluster(BROADCAST, workers=3, env={"ROOT": str(root)})
    assert rc == 0, out
    lines = _lines(out)
    (root_digest,) = [x.split()[-1] for x in lines if x.startswith("ROOT ")]
    after = [x.split() for x in lines if x.startswith("AFTER ")]
    assert sorted(int(a[1]) for a in after) == [0, 1, 2], out
    # bit for bit the root's (-0.0 and NaN included), the learning rate too
    assert {a[2] for a in after} == {root_digest}, out
    assert {float(a[3]) for a in after} == {0.01 * (root + 1)}, out
    stepped = {x.split()[-1] for x in lines if x.startswith("STEPPED ")}
    assert len(stepped) == 1, out
