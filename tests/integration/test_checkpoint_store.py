"""The store-level checkpoint API (hetps.kvstore.checkpoint) on real clusters: a checkpoint
restored into a new cluster gives the servers' values and optimizer states back exactly."""

from __future__ import annotations

import json
import re

CODE = """
import json
from hetps.kvstore import checkpoint
ck_dir, phase = {ck!r}, {phase!r}
kv = hetps.kv.create('dist_sync')
r = kv.rank
opt = optim.SGD(learning_rate=0.1, momentum=0.9)
def grad(step, n):
    return np.random.default_rng(100 * step + r).standard_normal(n).astype(np.float32)
if phase == 'first':
    kv.init('big', np.linspace(0, 1, 3000, dtype=np.float32))
    kv.init(7, np.ones(5, np.float32))
    kv.set_optimizer(opt)
    start = 0
else:
    ck = checkpoint.latest(ck_dir)
    kv.set_optimizer(opt)
    ck.restore(kv)
    start = ck.step
    assert ck.state(r) == {{'rank': r, 'step': ck.step}}, ck.state(r)
for step in range(start + 1, 7):
    kv.push('big', grad(step, 3000))
    kv.push(7, grad(step, 5))
    if phase == 'first' and step == 3:
        checkpoint.save(kv, ck_dir, step, state={{'rank': r, 'step': step}})
big, seven = kv.pull('big'), kv.pull(7)
kv.barrier()
print('RESULT ' + json.dumps({{'big': big.tolist(), 'seven': seven.tolist()}}), flush=True)
"""

ENV = {"HETPS_BIGARRAY_BOUND": "1000"}  # 'big' is split over both servers


def _result(out: str) -> dict:
    return json.loads(re.findall(r"RESULT (\{.*\})", out)[0])


def test_a_restored_checkpoint_goes_on_exactly(cluster, tmp_path):
    """Rounds 1-6 with SGD momentum on two servers, a checkpoint after round 3; a new cluster
    restores it and does rounds 4-6 again: the values equal the first run's bit for bit (the
    momentum came back too: without it they differ)."""
    ck = str(tmp_path / "ck")
    rc, out = cluster(CODE.format(ck=ck, phase="first"), workers=2, servers=2, env=ENV)
    assert rc == 0, out
    first = _result(out)
    rc, out = cluster(CODE.format(ck=ck, phase="again"), workers=2, servers=2, env=ENV)
    assert rc == 0, out
    assert _result(out) == first
    assert (tmp_path / "ck" / "latest").read_text() == "ckpt-00000003"
