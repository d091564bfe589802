"""Host-local aggregation under HETPS_BALANCE with ESync's rounds and a row-sparse table: two
hosts of two workers, three servers (one slow, so that the planner moves slices during the
run). Every round each worker runs ESync's round on a model of several slices (its local
step adds a pattern of its own, once a round) and pushes and pulls rows of a table with ids
its host's workers share. Compared with the same job with every worker pushing its own
(``HETPS_HOST_AGGREGATION=0``, the flat job, balanced too): every worker's weights of every
round and every pulled row, bit for bit (the sums in one order: each host's workers in
local-rank order, then the hosts in host-group order), and the servers' whole table."""

from __future__ import annotations

import json

import pytest

from conftest import run_cluster
from roles import HOSTS

CODE = """
import hashlib, json, torch
from hetps.esync import ESyncTrainer
from hetps.tables.rowsparse import Table
kv = hetps.kv.create('dist_sync')
g, lr = kv.cfg.host_group, kv.cfg.local_rank
me = 2 * g + lr
R, C, N = 2000, 8, 600
model = torch.nn.Linear(32768, 6, bias=False)  # 6 slices of 32768 weights
torch.nn.init.zeros_(model.weight)
trainer = ESyncTrainer(model, kv)
kv.init('t', Table(R, C, scale=0.5, seed=3))
kv.set_optimizer(optim.SGD(learning_rate=0.1))

def ids_of(rnd, who):  # the host's workers share 3/4 of their ids, the hosts some
    shared = np.random.default_rng(1000 * rnd + who // 2).choice(R, 3 * N // 4, replace=False)
    own = np.random.default_rng(1000 * rnd + 10 + who).choice(R, N // 4, replace=False)
    return np.concatenate([shared, own])

def grad_of(rnd, who, n):
    return np.random.default_rng(7 + 100 * rnd + who).standard_normal((n, C)).astype(np.float32)

rounds, plans = [], []
for rnd in range(ROUNDS):
    added = []

    def step():
        if not added:  # (ESync's local steps are as many as its state server says: one counts)
            d = np.random.default_rng(50 + 10 * rnd + me).standard_normal((6, 32768))
            with torch.no_grad():
                model.weight.add_(torch.from_numpy(d.astype(np.float32)))
            added.append(1)
        return 0.0

    trainer.round(step)
    plans.append([p.server for k in kv.order if k != 't' for p in kv.meta[k].parts])
    ids = ids_of(rnd, me)
    kv.push('t', (ids, grad_of(rnd, me, ids.size)))
    rows = kv.row_sparse_pull('t', row_ids=ids_of(rnd + 1, me)).data
    rounds.append([hashlib.sha256(model.weight.detach().numpy().tobytes()).hexdigest(),
                   hashlib.sha256(rows.tobytes()).hexdigest()])
kv.barrier()
table = kv.row_sparse_pull('t', row_ids=np.arange(R)).data
print('COMBO', json.dumps({'me': me, 'on': kv.hostagg is not None, 'W': kv.num_workers,
      'rounds': rounds, 'plans': plans, 'table': hashlib.sha256(table.tobytes()).hexdigest()}),
      flush=True)
"""

#: server 2 sends at 24 Mbit/s (the in-process shaper): the planner moves slices off it
SLOW = {("server", 2): {"HETPS_SHAPE_MBIT": "24"}}
ENV = {"HETPS_BALANCE": "aware", "HETPS_SLICE_ELEMS": "32768", "HETPS_PROBE_PROB": "1"}


def _run(tmp_path, agg: str, rounds: int) -> dict[int, dict]:
    env = {**ENV, "HETPS_HOST_AGGREGATION": agg}
    code = CODE.replace("ROUNDS", str(rounds))
    rc, out = run_cluster(tmp_path, code, workers=4, servers=3, env=env, node_env={**HOSTS, **SLOW})
    assert rc == 0, out
    got = [json.loads(line.split("COMBO ", 1)[1]) for line in out.splitlines() if "COMBO " in line]
    assert sorted(r["me"] for r in got) == [0, 1, 2, 3], out
    return {r["me"]: r for r in got}


@pytest.mark.slow  # (two jobs; each combination alone has its default-run test)
def test_balanced_hosts_esync_rounds_and_tables_equal_the_flat_job(tmp_path):
    rounds = 8
    on, off = _run(tmp_path, "1", rounds), _run(tmp_path, "0", rounds)
    for me in range(4):
        assert on[me]["on"] and not off[me]["on"]
        assert on[me]["W"] == off[me]["W"] == 4  # counts stay per process
        # every round: the weights and the pulled rows of every worker, bit for bit
        assert on[me]["rounds"] == off[me]["rounds"], me
        assert on[me]["table"] == off[me]["table"] == on[0]["table"], me
        # one plan on every worker of a job, every round
        assert on[me]["plans"] == on[0]["plans"] and off[me]["plans"] == off[0]["plans"]
    moved = {tuple(p) for p in on[0]["plans"]}
    assert len(moved) > 1, f"the plan never moved a slice: {on[0]['plans']}"
