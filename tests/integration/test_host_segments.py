"""Host-local aggregation's /dev/shm segments, counted in each worker's own mappings: none for
keys that are only initialised or broadcast from rank 0, one per key pushed through the host,
kept when the key is initialised again in the same form and reused by every call of a named
collective, and none left by unnamed collectives (each a one-shot key, named by a counter in
call order as Horovod does), while every value stays the right one, also when the local
ranks first push their keys in different orders."""

from __future__ import annotations

import json

import pytest

from conftest import run_cluster

pytest.importorskip("torch")

ONE_HOST = {
    ("worker", r): {"HETPS_HOST_GROUP": "0", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2"}
    for r in range(2)
}

SEGMENTS = """
import json, torch
import hetps.torch as hvd
kv = hetps.kv.create('dist_sync')
me = kv.cfg.local_rank

def segments():
    inodes = set()
    with open('/proc/self/maps') as f:
        for line in f:
            if '/dev/shm/hetps-host-' in line:
                inodes.add(line.split()[4])
    return sorted(inodes)

seen, values = {}, []
# the local ranks push two keys first in different orders: who sends which part is dealt
# at init (in init order), the same on both
kv.init(['p', 'q'], [np.zeros(100, np.float32), np.zeros(100, np.float32)])
for k in (['p', 'q'] if me == 0 else ['q', 'p']):
    kv.push(k, np.full(100, me + 1.0, np.float32))
values.append([sorted(set(kv.pull(k).tolist())) for k in 'pq'])
seen['p q'] = segments()
model = torch.nn.Linear(300, 20)
for _ in range(2):
    hvd.broadcast_parameters(model.state_dict(), kv, root_rank=0)
    values.append(hvd.broadcast(torch.full((50,), me + 7.0), root_rank=0).tolist())
kv.init('w', np.zeros(1000, np.float32))
seen['broadcast and init'] = segments()
for i in range(4):
    values.append(hvd.allreduce(torch.full((100,), me + i + 1.0), op=hvd.Sum,
                                name='loss', kvstore=kv).tolist())
seen['named x4'] = segments()
for i in range(4):
    values.append(hvd.allreduce(torch.full((100,), me + i + 1.0), op=hvd.Sum,
                                kvstore=kv).tolist())
    values.append(hvd.allgather(torch.full((2,), me + i + 0.0), kvstore=kv).tolist())
seen['unnamed x4'] = segments()
w = np.full(1000, me + 1.0, np.float32)
kv.pushpull('w', w)
values.append(w.tolist())
seen['w once'] = segments()
kv.init('w', np.zeros(1000, np.float32))
w = np.full(1000, me + 2.0, np.float32)
kv.pushpull('w', w)
values.append(w.tolist())
seen['w twice'] = segments()
kv.init('w', np.zeros(700, np.float32))   # another form: a new segment, the old one goes
w = np.full(700, me + 3.0, np.float32)
kv.pushpull('w', w)
values.append(w.tolist())
seen['w resized'] = segments()
kv.barrier()
print('SEGMENTS', json.dumps({'me': me, 'on': kv.hostagg is not None, 'seen': seen,
                              'values': values}), flush=True)
"""


def test_segments_per_pushed_key_reused_and_none_for_broadcasts(tmp_path):
    rc, out = run_cluster(
        tmp_path, SEGMENTS, workers=2, env={"HETPS_HOST_AGGREGATION": "1"}, node_env=ONE_HOST
    )
    assert rc == 0, out
    recs = [
        json.loads(line.split("SEGMENTS ", 1)[1])
        for line in out.splitlines()
        if "SEGMENTS " in line
    ]
    assert sorted(r["me"] for r in recs) == [0, 1], out
    for rec in recs:
        assert rec["on"], out
        seen = rec["seen"]
        assert len(seen["p q"]) == 2, seen
        assert seen["broadcast and init"] == seen["p q"], seen  # none more
        assert len(seen["named x4"]) == 3, seen  # ('p', 'q' and 'loss')
        assert seen["unnamed x4"] == seen["named x4"], seen
        assert len(seen["w once"]) == 4, seen
        assert seen["w twice"] == seen["w once"], seen  # the same segment, init again
        assert len(seen["w resized"]) == 4 and seen["w resized"] != seen["w once"], seen
    # both local ranks map the same segments
    assert recs[0]["seen"] == recs[1]["seen"]
    want = [[[3.0], [3.0]]] + [[7.0] * 50] * 2
    want += [[2.0 * i + 3.0] * 100 for i in range(4)]
    for i in range(4):
        want += [[2.0 * i + 3.0] * 100, [i + 0.0, i + 0.0, i + 1.0, i + 1.0]]
    want += [[3.0] * 1000, [5.0] * 1000, [7.0] * 700]
    assert recs[0]["values"] == recs[1]["values"] == want
