"""DC-ASGD on the servers keeps one weight backup per worker: the value that worker pulled.

Two workers of a real cluster (dist_async, one server, ``optim.DCASGD``) pull and push in a
fixed interleaving (each step by one worker, then a barrier). The expected weights are
computed here from the rule itself, without hetps: when worker ``k`` pushes ``g`` while the
weight is ``w``,

    w <- w - lr * (g + lamda * g * g * (w - bak_k))

where ``bak_k`` is the weight worker ``k`` last pulled (no compensation if it never pulled).
Every push but the first follows a pull by the same worker, so the value a worker last
received is unambiguous. A second interleaving starts as training does: both workers pull the
initial weight before anyone pushes, so the second push is compensated against it.
"""

from __future__ import annotations

import numpy as np
import pytest

LR, LAMDA = 0.1, 0.5

# (op, worker, gradient index): A = worker 0, B = worker 1
STEPS = [
    ("push", 0, 0),  # the key's first push: no backup, no compensation
    ("push", 1, 1),  # B has never pulled: no compensation
    ("pull", 0, None),  # A now holds the weight after B's push ...
    ("pull", 1, None),
    ("push", 1, 2),  # B: w equals what it pulled, no compensation
    ("push", 0, 3),  # ... so A's push is compensated against it (not its own push's result)
    ("pull", 1, None),
    ("pull", 0, None),
    ("push", 0, 4),
    ("push", 1, 5),  # compensated against B's pull, not the weight after B's last push
    ("pull", 0, None),
    ("pull", 1, None),
]
# both pull the initial weight first (a pull before the key's first push), as training does
FROM_START = [
    ("pull", 0, None),
    ("pull", 1, None),
    ("push", 0, 0),  # w is still what A pulled: compensation 0
    ("push", 1, 1),  # compensated against the initial weight B pulled
    ("pull", 0, None),
    ("pull", 1, None),
    ("push", 1, 2),
    ("push", 0, 3),
    ("pull", 0, None),
    ("pull", 1, None),
]


def expected_pulls(
    w0: np.ndarray, grads: np.ndarray, steps: list = STEPS
) -> dict[int, list[np.ndarray]]:
    """What each worker pulls, step by step, by the DC-ASGD rule with per-worker backups."""
    w = w0.astype(np.float64).copy()
    backup: dict[int, np.ndarray] = {}
    pulls: dict[int, list[np.ndarray]] = {0: [], 1: []}
    for op, k, gi in steps:
        if op == "pull":
            backup[k] = w.copy()
            pulls[k].append(w.copy())
        else:
            g = grads[gi]
            comp = LAMDA * g * g * (w - backup[k]) if k in backup else 0.0
            w = w - LR * (g + comp)
    return pulls


@pytest.mark.parametrize("steps", [STEPS, FROM_START], ids=["push-first", "pull-first"])
def test_dcasgd_compensates_with_the_pushing_workers_own_pulled_weight(cluster, tmp_path, steps):
    rng = np.random.default_rng(3)
    w0 = rng.uniform(-1, 1, 6)
    grads = rng.uniform(-2, 2, (6, 6))
    np.save(tmp_path / "w0.npy", w0)
    np.save(tmp_path / "grads.npy", grads)
    code = f"""
kv = hetps.kv.create('dist_async')
r = kv.rank
grads = np.load({str(tmp_path / "grads.npy")!r})
kv.init('w', np.load({str(tmp_path / "w0.npy")!r}))
kv.set_optimizer(optim.DCASGD(learning_rate={LR}, lamda={LAMDA}))
pulls = []
for op, k, gi in {steps!r}:
    if k == r:
        if op == 'push':
            kv.push('w', grads[gi])      # acknowledged once applied
        else:
            pulls.append(kv.pull('w'))
    kv.barrier()                         # the next step starts after this one took effect
np.save({str(tmp_path)!r} + f'/pulls-{{r}}.npy', np.array(pulls))
print('DCASGD-BACKUP-OK', flush=True)
"""
    rc, out = cluster(code, workers=2, servers=1)
    assert rc == 0, out
    assert out.count("DCASGD-BACKUP-OK") == 2, out

    expect = expected_pulls(w0, grads, steps)
    for k in (0, 1):
        got = np.load(tmp_path / f"pulls-{k}.npy")
        assert got.shape == (len(expect[k]), w0.size), got.shape
        for i, (g, e) in enumerate(zip(got, expect[k], strict=True)):
            np.testing.assert_allclose(g, e, rtol=1e-12, atol=1e-14, err_msg=f"worker {k} pull {i}")
    # the compensation matters in this interleaving: plain SGD would end elsewhere
    used = sorted(gi for op, _, gi in steps if op == "push")
    sgd = w0 - LR * grads[used].sum(axis=0)
    assert np.abs(expect[0][-1] - sgd).max() > 1e-3
