"""Host-local aggregation under HETPS_BALANCE: two hosts of two workers, three servers, one
of them slow, so that the planner moves slices during the run. Each host's workers sum
through shared memory and the host pushes its sum once, by the plan every worker of the job
adopted at the same round; every worker's values of every round are the flat job's bit for
bit: the sum in its order (each host's workers in local-rank order, then the hosts in host
group order), and with an optimizer (its state moving with the slices) the values of every
worker pushing its own (``HETPS_HOST_AGGREGATION=0``)."""

from __future__ import annotations

import json

import pytest

from conftest import run_cluster
from roles import HOSTS

N = 6 * 32768  # float32 elements of the model: 6 slices of HETPS_SLICE_ELEMS

CODE = f"""
import hashlib, json
kv = hetps.kv.create('dist_sync')
me = 2 * kv.cfg.host_group + kv.cfg.local_rank
kv.init('w', np.arange({N}, dtype=np.float32) / 1e5)
if OPT:
    kv.set_optimizer(optim.SGD(learning_rate=0.1, momentum=0.9))
rngs = [np.random.default_rng(r) for r in range(4)]  # every worker's gradients, known to all
rounds = []
for step in range(ROUNDS):
    kv.rebalance()
    where = [p.server for p in kv.meta['w'].parts]  # the plan this round is pushed by
    g = [r.standard_normal({N}).astype(np.float32) for r in rngs]
    sent0 = sum(s for s, _ in kv.link_bytes().values())
    kv.push('w', g[me])
    w = kv.pull('w')
    sent = sum(s for s, _ in kv.link_bytes().values()) - sent0
    flat = (g[0] + g[1]) + (g[2] + g[3])  # the flat job's sum (no optimizer: the value)
    rounds.append([where, sent, hashlib.sha256(w.tobytes()).hexdigest(),
                   OPT or bool((w.view(np.uint32) == flat.view(np.uint32)).all())])
print('HBAL ' + json.dumps({{'me': me, 'on': kv.hostagg is not None, 'W': kv.num_workers,
                            'rounds': rounds}}), flush=True)
"""

#: server 2 sends at 24 Mbit/s (the in-process shaper): the planner moves slices off it
SLOW = {("server", 2): {"HETPS_SHAPE_MBIT": "24"}}
ENV = {"HETPS_BALANCE": "aware", "HETPS_SLICE_ELEMS": "32768", "HETPS_PROBE_PROB": "1"}


def _run(tmp_path, agg: str, rounds: int, opt: bool = False) -> dict[int, dict]:
    code = CODE.replace("ROUNDS", str(rounds)).replace("OPT", str(opt))
    env = {**ENV, "HETPS_HOST_AGGREGATION": agg}
    rc, out = run_cluster(tmp_path, code, workers=4, servers=3, env=env, node_env={**HOSTS, **SLOW})
    assert rc == 0, out
    got = [json.loads(line.split("HBAL ", 1)[1]) for line in out.splitlines() if "HBAL " in line]
    assert sorted(r["me"] for r in got) == [0, 1, 2, 3], out
    return {r["me"]: r for r in got}


def _same_plan_and_one_push_per_host(on: dict[int, dict], rounds: int) -> None:
    for me in range(4):
        assert on[me]["on"] and on[me]["W"] == 4  # aggregated; counts stay per process
        # every round: one plan on every worker (a re-plan reaches a host whole) and the
        # same values
        assert [r[0] for r in on[me]["rounds"]] == [r[0] for r in on[0]["rounds"]]
        assert [r[2] for r in on[me]["rounds"]] == [r[2] for r in on[0]["rounds"]]
    plans = [tuple(r[0]) for r in on[0]["rounds"]]
    assert len(set(plans)) > 1, f"the plan never moved a slice: {plans}"
    for host in (0, 1):
        for t in range(rounds):
            mine = [on[2 * host + lr]["rounds"][t][1] for lr in (0, 1)]
            # the host's two workers together push the model once a round (each the slices
            # it owns), not once each
            assert 4 * N <= sum(mine) <= 1.1 * 4 * N, (t, mine)


def test_balanced_hosts_push_once_by_one_plan_to_the_flat_jobs_sum(tmp_path):
    on = _run(tmp_path, "1", 10)
    _same_plan_and_one_push_per_host(on, 10)
    for me in range(4):  # every worker's every round: the flat job's sum, bit for bit
        assert [r[3] for r in on[me]["rounds"]] == [True] * 10, on[me]["rounds"]


@pytest.mark.slow  # (the default run: the test above; this adds the optimizer's state moving)
def test_balanced_hosts_train_to_the_weights_of_every_worker_pushing_its_own(tmp_path):
    on, off = _run(tmp_path, "1", 8, opt=True), _run(tmp_path, "0", 8, opt=True)
    _same_plan_and_one_push_per_host(on, 8)
    for me in range(4):
        assert not off[me]["on"] and off[me]["W"] == 4
        assert [r[2] for r in on[me]["rounds"]] == [r[2] for r in off[me]["rounds"]]
    for host in (0, 1):
        for t in range(8):
            flat = [off[2 * host + lr]["rounds"][t][1] for lr in (0, 1)]
            assert all(4 * N <= s <= 1.1 * 4 * N for s in flat), (t, flat)
