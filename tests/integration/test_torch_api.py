"""``hetps.torch``'s public API from a user's own script, in a real cluster: the broadcast
helpers and ESync's worker loop (``ESyncTrainer``)."""

from __future__ import annotations

import json

import numpy as np
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


@pytest.mark.parametrize("root", [pytest.param(0, marks=pytest.mark.slow), 2])
def test_broadcast_parameters_and_optimizer_state_give_everyone_the_roots(cluster, root):
    """Root 0 is slow: root 2 takes the same path in the default run (a root other than the
    first worker, the harder case)."""
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


ESYNC = """
import json, torch
import hetps.torch as hps
torch.set_num_threads(1)
kv = hetps.kv.create('dist_sync')
out = os.environ['OUT_DIR']
torch.manual_seed(kv.rank)  # every worker starts elsewhere: the trainer starts them at rank 0's
model = torch.nn.Sequential(
    torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2)
)
flat = lambda: {k: v.clone() for k, v in model.state_dict().items()}
torch.save(flat(), f'{out}/init-{kv.rank}.pt')
opt = torch.optim.SGD(model.parameters(), lr=0.1)
from hetps.esync import ESyncTrainer
trainer = ESyncTrainer(model, kv, global_lr=0.7)
g = torch.Generator().manual_seed(1000 + kv.rank)
X = torch.randn(64, 6, generator=g)
Y = (X[:, 0] > 0).long()

def step():
    i = torch.randint(0, 64, (16,), generator=g)
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(X[i]), Y[i])
    loss.backward()
    opt.step()
    return loss.item()

rounds = []
while True:
    start = flat()
    local = {}
    def stop():  # asked after the local steps, before the aggregation
        local.update(flat())
        return kv.rank == 0 and len(rounds) == 3  # rank 0 ends the job after round 4
    r = trainer.round(step, stop=stop)
    rounds.append(r.local_steps)
    torch.save({'start': start, 'local': local, 'end': flat(), 'round': r.round,
                'steps': r.local_steps, 'outputs': r.outputs}, f'{out}/round-{kv.rank}-{r.round}.pt')
    if r.stop:
        break
print('ROUNDS', kv.rank, json.dumps(rounds), flush=True)
"""


def _expected(r: list[dict], start: dict, order: tuple, params: tuple, stats: tuple) -> dict:
    """Every tensor's bytes after the round by the ESync rules, summing in ``order``."""
    from hetps.sync.rules import average_from_sum, esync_update_from_sum, model_delta

    def total(vals):
        return (vals[order[0]] + vals[order[1]]) + vals[order[2]]

    want = {}
    for n in params:
        deltas = [model_delta(x["local"][n].numpy(), start[n]) for x in r]
        want[n] = esync_update_from_sum(start[n], total(deltas), 3, 0.7).tobytes()
    for n in stats:  # BatchNorm statistics: averaged
        want[n] = average_from_sum(total([x["local"][n].numpy() for x in r]), 3).tobytes()
    return want


def test_esync_trainer_from_a_user_script_moves_every_worker_alike(cluster, tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    rc, out = cluster(ESYNC, workers=3, env={"OUT_DIR": str(out_dir)})
    assert rc == 0, out
    # rank 0 asked to stop after round 4: every worker stopped there
    per_rank = {
        int(x.split()[1]): json.loads(x.split(None, 2)[2])
        for x in _lines(out)
        if x.startswith("ROUNDS ")
    }
    assert sorted(per_rank) == [0, 1, 2] and all(len(s) == 4 for s in per_rank.values()), out
    inits = [torch.load(out_dir / f"init-{k}.pt") for k in range(3)]
    assert not torch.equal(inits[0]["0.weight"], inits[1]["0.weight"])  # they started apart
    params = ("0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias")
    stats = ("1.running_mean", "1.running_var")
    for rnd in range(1, 5):
        r = [torch.load(out_dir / f"round-{k}-{rnd}.pt") for k in range(3)]
        assert [x["round"] for x in r] == [rnd] * 3
        for x in r:
            assert x["steps"] == len(x["outputs"]) >= 1
            assert all(isinstance(v, float) for v in x["outputs"])
        start = {n: r[0]["start"][n].numpy() for n in params + stats}
        for n in params:
            if rnd == 1:  # rank 0's initial weights, everywhere
                np.testing.assert_array_equal(start[n], inits[0][n].numpy())
            for x in r:  # every worker starts the round from the same weights
                assert x["start"][n].numpy().tobytes() == start[n].tobytes(), (rnd, n)

        ends = [{n: x["end"][n].numpy().tobytes() for n in params + stats} for x in r]
        assert ends[0] == ends[1] == ends[2], rnd  # every worker moved alike ...
        orders = [(0, 1, 2), (0, 2, 1), (1, 2, 0)]
        # ... by the rule, bit for bit (the servers add the pushes as they come: (a + b) + c)
        assert any(ends[0] == _expected(r, start, o, params, stats) for o in orders), rnd
        moved = sum(ends[0][n] != start[n].tobytes() for n in params)
        assert moved >= 5, rnd  # (the bias before BatchNorm has no gradient to speak of)
