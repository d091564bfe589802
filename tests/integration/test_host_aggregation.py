"""Host-local aggregation: two hosts of two workers (the host contract set per worker, as a
launcher sets it) train with DistributedOptimizer to the same weights, bit for bit, with the
host's sum pushed once and with every worker pushing its own; each host's workers together
send one push of the model per round. A local worker killed with SIGKILL mid-round ends the
job naming it, or, with --elastic, the others go on; nothing hangs and nothing is left in
/dev/shm."""

from __future__ import annotations

import io
import json
import os
import re
import sys
import textwrap

import pytest

from conftest import PRELUDE, TEST_ENV, run_cluster
from hetps.launch.contract import LaunchSpec
from hetps.launch.local import Launcher
from roles import HOSTS

pytest.importorskip("torch")


TRAIN = """
import json, torch
from hetps.torch.optimizer import DistributedOptimizer
torch.set_num_threads(1)
torch.manual_seed(0)
kv = hetps.kv.create('dist_sync')
g, lr = kv.cfg.host_group, kv.cfg.local_rank
me = 2 * g + lr                       # this worker's place in the global batch
model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.Tanh(),
                            torch.nn.Linear(512, 10)).float()
opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                           model.named_parameters(), kvstore=kv, op='average')
gen = torch.Generator().manual_seed(1)
X = torch.randn(4, 32, 64, generator=gen)   # 4 steps, global batch 32
Y = torch.randint(0, 10, (4, 32), generator=gen)
sent0 = sum(s for s, _ in kv.link_bytes().values())
for step in range(4):
    x, y = X[step, me * 8:(me + 1) * 8], Y[step, me * 8:(me + 1) * 8]
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
sent = sum(s for s, _ in kv.link_bytes().values()) - sent0
model_bytes = sum(p.numel() * 4 for p in model.parameters())
# the segments' names are gone from /dev/shm once every local rank mapped them (all have,
# once every worker is past the init that made the last one: after a barrier)
kv.barrier()
named = [n for n in os.listdir('/dev/shm')
         if kv.hostagg is not None and n.startswith('hetps-host-' + kv.hostagg.job[:32])]
print('HOSTAGG', json.dumps({'me': me, 'on': kv.hostagg is not None, 'W': kv.num_workers,
      'sent': sent, 'model': model_bytes, 'named': named,
      'weights': [p.detach().flatten().tolist() for p in model.parameters()]}), flush=True)
"""


def _records(out: str) -> dict[int, dict]:
    got = [
        json.loads(line.split("HOSTAGG ", 1)[1]) for line in out.splitlines() if "HOSTAGG " in line
    ]
    return {r["me"]: r for r in got}


def _shm_left() -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith("hetps-host-")]


def test_two_hosts_train_to_the_flat_jobs_weights_with_one_push_per_host(tmp_path):
    before = set(_shm_left())
    runs = {}
    for agg in ("1", "0"):
        env = {"HETPS_HOST_AGGREGATION": agg}
        rc, out = run_cluster(tmp_path, TRAIN, workers=4, servers=2, env=env, node_env=HOSTS)
        assert rc == 0, out
        runs[agg] = _records(out)
        assert sorted(runs[agg]) == [0, 1, 2, 3], out
    on, off = runs["1"], runs["0"]
    for me in range(4):
        assert on[me]["on"] and not off[me]["on"]
        assert on[me]["W"] == off[me]["W"] == 4  # counts stay per process
        assert on[me]["named"] == [], on[me]["named"]
        # bit for bit: every worker of both runs holds the same weights
        assert on[me]["weights"] == on[0]["weights"] == off[me]["weights"]
    model = on[0]["model"]
    for host in (0, 1):
        mine = [on[2 * host + lr]["sent"] for lr in (0, 1)]
        flat = [off[2 * host + lr]["sent"] for lr in (0, 1)]
        # aggregated: the host's two workers together send one push of the model per step
        # (each its own servers' part), not one each
        assert 4 * model <= sum(mine) <= 1.1 * 4 * model, (mine, model)
        assert all(4 * model <= s <= 1.1 * 4 * model for s in flat), (flat, model)
    assert set(_shm_left()) <= before


# Worker VICTIM (host group, local rank) pushes key "b" of round 3 into its host's segment
# (after PAUSE seconds: its mate's is in, so it sends the host's sum of its part itself) and
# kills itself before its pull: its host's other worker waits for nothing that never comes.
KILL = """
import json
kv = hetps.kv.create('dist_sync')
g, lr = kv.cfg.host_group, kv.cfg.local_rank
kv.init(['a', 'b'], [np.zeros(5, np.float32), np.zeros(3000, np.float32)])
seen, shorts = [], []
for r in range(6):
    mine = [np.full(5, r + 1.0, np.float32), np.full(3000, r + 1.0, np.float32)]
    if r == 3 and (g, lr) == VICTIM:
        time.sleep(PAUSE)
        kv.push('b', mine[1])
        os.kill(os.getpid(), signal.SIGKILL)
    kv.pushpull(['a', 'b'], mine, out=mine)
    seen.append([sorted(set(mine[0].tolist())), sorted(set(mine[1].tolist()))])
    shorts.append([kv.short_rounds('a'), kv.short_rounds('b')])
print('KILLED', json.dumps({'me': 2 * g + lr, 'on': kv.hostagg is not None, 'seen': seen,
      'shorts': shorts}), flush=True)
"""


#: a hang of the host's wait fails after HETPS_REQUEST_TIMEOUT; a key of 3000 elements is split
FAST = {"MXNET_KVSTORE_BIGARRAY_BOUND": "1000", "HETPS_REQUEST_TIMEOUT": "20"}


def _launch(
    tmp_path,
    elastic: int,
    victim: tuple[int, int] = (0, 1),
    pause: float = 0.0,
    code: str = KILL,
    servers: int = 1,
    env: dict[str, str] | None = None,
) -> tuple[int, str]:
    script = tmp_path / "kill_script.py"
    setup = f"VICTIM, PAUSE = {victim!r}, {pause!r}\n"
    script.write_text(PRELUDE + setup + textwrap.dedent(code))
    out = io.StringIO()
    spec = LaunchSpec(
        num_workers=4,
        num_servers=servers,
        command=[sys.executable, str(script)],
        env={**TEST_ENV, **(env or {})},
        start_timeout=30.0,
        failure_grace=5.0,
        elastic_min=elastic,
    )

    def wrap(role: str, rank: int, argv: list[str], env: dict[str, str]):
        return argv, {**env, **HOSTS.get((role, rank), {})}

    spec.wrap = wrap
    launcher = Launcher(spec, out=out)
    try:
        code = launcher.run()
    finally:
        launcher.stop_all(kill=True)
    return code, out.getvalue()


def test_a_killed_local_worker_ends_the_job_naming_it(tmp_path):
    before = set(_shm_left())
    code, out = _launch(tmp_path, elastic=0)
    assert code == 137, out
    assert re.search(r"worker 1\b.*(killed by signal 9|SIGKILL)", out), out
    assert "KILLED" not in out, out
    # its host's other worker saw it die itself, and said which local rank it was
    assert re.search(r"local rank 1 \(pid \d+\) of host group 0 died", out), out
    assert set(_shm_left()) <= before


@pytest.mark.parametrize(
    "victim, pause",
    [((0, 1), 0.0), pytest.param((1, 1), 1.0, marks=pytest.mark.slow)],
    ids=["before-its-part-went", "after-its-part-went"],
)
def test_with_elastic_a_killed_local_worker_is_let_go_and_the_others_go_on(tmp_path, victim, pause):
    """Its host's other worker takes its part over: the round it died in holds its
    gradient where it gave it to its host ('b') and not where it did not ('a'), whether or
    not the host's sum of its part had left; every survivor sees every value alike."""
    before = set(_shm_left())
    code, out = _launch(tmp_path, elastic=3, victim=victim, pause=pause)
    assert code == 0, out
    # its host's other worker took its part over from the round it did not give
    assert f"local ranks [1] of host group {victim[0]} were let go" in out, out
    recs = {
        r["me"]: r
        for r in (
            json.loads(line.split("KILLED ", 1)[1])
            for line in out.splitlines()
            if "KILLED " in line
        )
    }
    dead = 2 * victim[0] + victim[1]
    assert sorted(recs) == sorted({0, 1, 2, 3} - {dead}), out
    # the same for every survivor
    assert len({json.dumps(rec["seen"][3]) for rec in recs.values()}) == 1, recs
    # 4 workers push r + 1 each; from the round the worker died in, the 3 others
    n = [4.0 if r < 3 else 3.0 for r in range(6)]
    want = [[[n[r] * (r + 1)], [n[r] * (r + 1)]] for r in range(6)]
    for rec in recs.values():
        assert rec["on"]
        assert rec["seen"][3] == [[12.0], [16.0]], rec
        # every survivor knows which sums hold fewer workers, whoever of its host sent them
        # (the mean divides by them: DistributedOptimizer, short_rounds())
        three = [[[0, 5, 3]], [[0, 3000, 3]]]
        assert rec["shorts"] == [[[], []]] * 3 + [[three[0], []]] + [three] * 2, rec
        assert rec["seen"][:3] + rec["seen"][4:] == want[:3] + want[4:], rec
    assert set(_shm_left()) <= before


# VICTIM (host group 0, local rank 0: its host's leader) is killed before any push: a key and
# a table first pushed after it was let go go through its host without it, its part of the
# key (one of two servers') summed and sent by its host's other worker
FIRST = """
import json
from hetps.tables.rowsparse import Table
kv = hetps.kv.create('dist_sync')
g, lr = kv.cfg.host_group, kv.cfg.local_rank
me = 2 * g + lr
kv.init(['v', 't'], [np.zeros(3000, np.float32), Table(8, 2)])
kv.barrier()
if (g, lr) == VICTIM:
    os.kill(os.getpid(), signal.SIGKILL)
got = []
for r in range(2):
    kv.push('v', np.arange(3000, dtype=np.float32) * (me + 1) + r)
    got.append(kv.pull('v').tolist())
kv.barrier()
stored = kv.pull('v').tolist()  # (nothing pushed since: the servers' values)
kv.push('t', (np.array([g, 4 + lr]), np.full((2, 2), me + 1.0, np.float32)))
rows = kv.row_sparse_pull('t', row_ids=np.arange(8)).asnumpy().tolist()
print('FIRST', json.dumps({'me': me, 'on': kv.hostagg is not None, 'parts': len(kv.meta['v'].parts),
      'got': got, 'stored': stored, 'rows': rows}), flush=True)
"""


def test_with_elastic_a_key_first_pushed_after_a_local_worker_was_let_go(tmp_path):
    before = set(_shm_left())
    code, out = _launch(tmp_path, elastic=3, victim=(0, 0), code=FIRST, servers=2, env=FAST)
    assert code == 0, out  # (a hang: the host's wait fails after HETPS_REQUEST_TIMEOUT)
    recs = [json.loads(line.split("FIRST ", 1)[1]) for line in out.splitlines() if "FIRST " in line]
    assert sorted(r["me"] for r in recs) == [1, 2, 3], out
    base = [9.0 * i for i in range(3000)]  # workers 1, 2, 3 push i * (me + 1) + round
    rows = [[2.0] * 2, [7.0] * 2, [0.0] * 2, [0.0] * 2, [3.0] * 2, [6.0] * 2] + [[0.0] * 2] * 2
    for rec in recs:
        assert rec["on"] and rec["parts"] == 2, rec["me"]
        assert rec["got"] == [[x + 3.0 * r for x in base] for r in range(2)], rec["me"]
        assert rec["stored"] == [x + 3.0 for x in base], rec["me"]
        assert rec["rows"] == rows, rec
    assert set(_shm_left()) <= before


# ESync's rounds through the host: VICTIM is killed after the broadcast and the keys' init,
# before its first round; each worker's local steps add me + 1 to the weights once a round
ESYNC = """
import json, torch
from hetps.esync import ESyncTrainer
kv = hetps.kv.create('dist_sync')
g, lr = kv.cfg.host_group, kv.cfg.local_rank
me = 2 * g + lr
model = torch.nn.Linear(4, 1, bias=False)
torch.nn.init.zeros_(model.weight)
trainer = ESyncTrainer(model, kv)
if (g, lr) == VICTIM:
    os.kill(os.getpid(), signal.SIGKILL)
seen, added = [], []

def step():
    if not added:
        with torch.no_grad():
            model.weight.add_(me + 1.0)
        added.append(1)
    return 0.0

for r in range(2):
    added.clear()
    trainer.round(step)
    seen.append(model.weight.flatten().tolist())
print('ESYNC', json.dumps({'me': me, 'on': kv.hostagg is not None, 'seen': seen}), flush=True)
"""


def test_with_elastic_esync_rounds_go_on_after_a_local_worker_died_before_the_first(tmp_path):
    code, out = _launch(tmp_path, elastic=3, victim=(0, 0), code=ESYNC, servers=2, env=FAST)
    assert code == 0, out
    recs = [json.loads(line.split("ESYNC ", 1)[1]) for line in out.splitlines() if "ESYNC " in line]
    assert sorted(r["me"] for r in recs) == [1, 2, 3], out
    for rec in recs:  # each round: the survivors' mean difference, (2 + 3 + 4) / 3
        assert rec["on"] and rec["seen"] == [[3.0] * 4, [6.0] * 4], rec


# 2-bit compression through the host: each host's sum is compressed with the host's residual
# (kept by the local rank that sends that part), and the servers sum the hosts' decoded sums
# in host order; a row-sparse table goes per process (its rows summed over the four).
COMPRESSED = """
from hetps.kvstore.compression import TwoBitCompressor
from hetps.tables.rowsparse import Table
kv = hetps.kv.create('dist_sync')
g, lr = kv.cfg.host_group, kv.cfg.local_rank
n = 1_100_000                                       # split over the two servers
kv.init('c', np.zeros(n, np.float32))
kv.init('t', Table(8, 2))
kv.init('d', np.zeros(10, np.float32))
# push(block=True), a barrier after a push, two pushes before a pull: each waits for (or
# sends) the host's round as a worker's own push does, and none waits for ever
kv.push('d', np.full(10, 1.0, np.float32), block=True)
kv.push('d', np.full(10, 2.0, np.float32))
kv.barrier()
kv.push('d', np.full(10, 3.0, np.float32))
kv.push('d', np.full(10, 4.0, np.float32))
d = kv.pull('d').tolist()
tables = []
for r in range(2):
    kv.push('t', (np.array([g, 4 + lr]), np.ones((2, 2), np.float32)))
    rows = kv.row_sparse_pull('t', row_ids=np.arange(8)).asnumpy()
    tables.append([rows[:2, 0].tolist(), rows[4:6, 0].tolist()])
kv.set_gradient_compression({'type': '2bit', 'threshold': 0.5})
comp = TwoBitCompressor(0.5)
res = {h: np.zeros(n, np.float32) for h in (0, 1)}
ok = []
for r in range(3):
    x = {(h, l): np.random.default_rng(100 * r + 10 * h + l).uniform(-1, 1, n).astype(np.float32)
         for h in (0, 1) for l in (0, 1)}
    kv.push('c', x[(g, lr)])
    out = np.empty(n, np.float32)
    kv.pull('c', out=out)
    want = None
    for h in (0, 1):
        s = x[(h, 0)].copy(); s += x[(h, 1)]
        q = np.empty(n, np.float32)
        half = n // 2                               # (each server's part: its own chunks)
        for a, b in ((0, half), (half, n)):
            words = comp.compress(s[a:b], res[h][a:b])
            q[a:b] = comp.decompress(words, b - a, np.float32)
        if want is None:
            want = q
        else:
            want += q
    ok.append(out.tobytes() == want.tobytes())
print('COMPRESSED', json.dumps({'on': kv.hostagg is not None, 'ok': ok, 'tables': tables,
      'd': d}), flush=True)
"""


def test_compression_compresses_each_hosts_sum_and_tables_go_per_process(tmp_path):
    """(And a blocking push, a barrier after a push, two pushes before a pull.)"""
    rc, out = run_cluster(
        tmp_path,
        "import json\n" + COMPRESSED,
        workers=4,
        servers=2,
        env={"HETPS_CHUNK_BYTES": str(1 << 20)},
        node_env=HOSTS,
    )
    assert rc == 0, out
    got = [
        json.loads(line.split("COMPRESSED ", 1)[1])
        for line in out.splitlines()
        if "COMPRESSED " in line
    ]
    assert len(got) == 4, out
    for rec in got:
        assert rec["on"], rec
        assert rec["d"] == [16.0] * 10, rec  # the last round: 4 workers' 4.0
        assert rec["ok"] == [True] * 3, rec  # exact, every round (the residuals carried)
        # table rows become each round's sum: rows 0 and 1 by a host's two workers, rows 4
        # and 5 by one worker of each host
        assert rec["tables"] == [[[2.0, 2.0], [2.0, 2.0]]] * 2, rec
