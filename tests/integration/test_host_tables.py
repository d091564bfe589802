"""Row-sparse tables through host-local aggregation: two hosts of two workers (the host
contract set per worker, as a launcher sets it) push and pull a table with overlapping ids;
with the ids merged per host every worker's pulled rows and every server's rows equal the
job's with every worker pushing its own, bit for bit, and a host's workers together send one
copy of the host's merged ids, not one each. A local worker killed under --elastic: the
others go on (the tables per process there) and every value is checked."""

from __future__ import annotations

import json
import os

from conftest import PRELUDE, TEST_ENV, run_cluster
from roles import HOSTS

#: each worker's ids of a round: the host's two workers share half of theirs, and the hosts
#: share some; rows are random float32, so another order of a sum changes its bits
ROUNDS = """
import json
from hetps.tables.rowsparse import Table
kv = hetps.kv.create('dist_sync')
g, lr = kv.cfg.host_group, kv.cfg.local_rank
me = 2 * g + lr
R, C, N = 4000, 8, 1200
kv.init('t', Table(R, C, scale=0.5, seed=3))
kv.set_optimizer(optim.SGD(learning_rate=0.1))
kv.barrier()

def ids_of(rnd, who):
    rng = np.random.default_rng(1000 * rnd + who // 2)
    shared = rng.choice(R, 3 * N // 4, replace=False)      # the host's common ids
    own = np.random.default_rng(1000 * rnd + 10 + who).choice(R, N // 4, replace=False)
    return np.concatenate([shared, own])

def grad_of(rnd, who, n):
    return np.random.default_rng(7 + 100 * rnd + who).standard_normal((n, C)).astype(np.float32)

pulled, sent = [], []
# the payload of a round: ids (8 bytes) and rows (4 C) pushed, ids pulled; a host's union
# of ids against each worker's own
host = [(len(np.union1d(ids_of(r, 2 * g), ids_of(r, 2 * g + 1))),
         len(np.union1d(ids_of(r + 1, 2 * g), ids_of(r + 1, 2 * g + 1)))) for r in range(5)]
own = [(len(np.unique(ids_of(r, me))), len(np.unique(ids_of(r + 1, me)))) for r in range(5)]
payload = {'on': [p * (8 + 4 * C) + q * 8 for p, q in host],
           'off': [p * (8 + 4 * C) + q * 8 for p, q in own]}
for rnd in range(5):
    ids = ids_of(rnd, me)
    before = sum(s for s, _ in kv.link_bytes().values())
    kv.push('t', (ids, grad_of(rnd, me, ids.size)))
    rows = kv.row_sparse_pull('t', row_ids=ids_of(rnd + 1, me))
    sent.append(sum(s for s, _ in kv.link_bytes().values()) - before)
    pulled.append(rows.data.tobytes().hex())
# a round whose pull only local rank 0 makes (an evaluation), the others at the barrier
ids = ids_of(5, me)
kv.push('t', (ids, grad_of(5, me, ids.size)))
if lr == 0:
    pulled.append(kv.row_sparse_pull('t', row_ids=np.arange(R)).data.tobytes().hex())
kv.barrier()
table = kv.row_sparse_pull('t', row_ids=np.arange(R)).data     # the servers' rows
ref = None
if me == 0:  # the rounds in NumPy (any order of the sums: close, not bitwise)
    from hetps.tables.rowsparse import initial_rows
    w = initial_rows(0.5, 3, np.arange(R), C, np.float32).astype(np.float64)
    for rnd in range(6):
        for who in range(4):
            ids = ids_of(rnd, who)
            np.add.at(w, ids, -0.1 * grad_of(rnd, who, ids.size))
    ref = float(np.abs(w - table).max())
named = [n for n in os.listdir('/dev/shm') if n.startswith('hetps-host-')
         and kv.hostagg is not None and kv.hostagg.job[:32] in n]
print('TABLES', json.dumps({'me': me, 'on': kv.hostagg is not None and 't' in
      kv.hostagg.tables.tables, 'pulled': pulled, 'sent': sent, 'ref': ref,
      'table': table.tobytes().hex(), 'W': kv.num_workers, 'files': len(named),
      'payload': payload}), flush=True)
"""


def _records(out: str, tag: str) -> dict[int, dict]:
    got = [
        json.loads(line.split(tag + " ", 1)[1]) for line in out.splitlines() if tag + " " in line
    ]
    return {r["me"]: r for r in got}


def _shm_left() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("hetps-host-")}


def test_merged_per_host_the_rows_equal_the_flat_jobs_and_a_host_sends_one_copy(tmp_path):
    before = _shm_left()
    runs = {}
    for agg in ("1", "0"):
        # (a pull's reply bound of 512 rows: a host's union of ids is asked in several)
        env = {"HETPS_HOST_AGGREGATION": agg, "HETPS_TABLE_PULL_BYTES": str(16 << 10)}
        rc, out = run_cluster(tmp_path, ROUNDS, workers=4, servers=2, env=env, node_env=HOSTS)
        assert rc == 0, out
        runs[agg] = _records(out, "TABLES")
        assert sorted(runs[agg]) == [0, 1, 2, 3], out
    on, off = runs["1"], runs["0"]
    assert on[0]["ref"] < 1e-4 and off[0]["ref"] < 1e-4, (on[0]["ref"], off[0]["ref"])
    for me in range(4):
        assert on[me]["on"] and not off[me]["on"]
        assert on[me]["W"] == off[me]["W"] == 4  # counts stay per process
        # bit for bit: every round's pulled rows of every worker, every server's rows
        assert on[me]["pulled"] == off[me]["pulled"], me
        assert on[me]["table"] == off[me]["table"] == on[0]["table"], me
        # a file goes once every local rank read it: of the 5 rounds' 60 files (a round's:
        # each local rank's push and pull, each part's rows, per host) the last two rounds'
        # at most are left (the rest go at close)
        assert on[me]["files"] <= 2 * 12, on[me]["files"]
    # a round's bytes to the servers: a host's workers together send the host's merged push
    # and its merged pull's ids once (about 1.25 x N distinct ids), not each its own (2 x N)
    for host in (0, 1):
        for r in range(5):
            merged = sum(on[2 * host + lr]["sent"][r] for lr in (0, 1))
            want = on[2 * host]["payload"]["on"][r]
            assert want <= merged <= 1.05 * want, (host, r, merged, want)
            flat = sum(off[2 * host + lr]["sent"][r] for lr in (0, 1))
            want = sum(off[2 * host + lr]["payload"]["off"][r] for lr in (0, 1))
            assert want <= flat <= 1.05 * want, (host, r, flat, want)
            assert merged < 0.7 * flat, (host, r, merged, flat)
    assert _shm_left() <= before


# Worker VICTIM (host group, local rank) kills itself before its push of round 2.
KILL = """
import json
from hetps.tables.rowsparse import Table
kv = hetps.kv.create('dist_sync')
g, lr = kv.cfg.host_group, kv.cfg.local_rank
me = 2 * g + lr
kv.init('t', Table(8, 2))
seen = []
for r in range(5):
    if r == 2 and (g, lr) == VICTIM:
        os.kill(os.getpid(), signal.SIGKILL)
    kv.push('t', (np.array([0, 4 + me]), np.full((2, 2), r + 1.0, np.float32)))
    seen.append(kv.row_sparse_pull('t', row_ids=np.arange(8)).asnumpy()[:, 0].tolist())
print('KILLED', json.dumps({'me': me, 'seen': seen}), flush=True)
"""


def _launch(tmp_path, elastic: int, victim: tuple[int, int]) -> tuple[int, str]:
    import io
    import sys
    import textwrap

    from hetps.launch.contract import LaunchSpec
    from hetps.launch.local import Launcher

    script = tmp_path / "kill_tables.py"
    script.write_text(PRELUDE + f"VICTIM = {victim!r}\n" + textwrap.dedent(KILL))
    out = io.StringIO()
    spec = LaunchSpec(
        num_workers=4,
        num_servers=2,
        command=[sys.executable, str(script)],
        env=dict(TEST_ENV),
        start_timeout=30.0,
        failure_grace=5.0,
        elastic_min=elastic,
    )
    spec.wrap = lambda role, rank, argv, env: (argv, {**env, **HOSTS.get((role, rank), {})})
    launcher = Launcher(spec, out=out)
    try:
        code = launcher.run()
    finally:
        launcher.stop_all(kill=True)
    return code, out.getvalue()


def test_a_killed_local_worker_ends_the_job_naming_it(tmp_path):
    before = _shm_left()
    code, out = _launch(tmp_path, elastic=0, victim=(0, 1))
    assert code == 137, out
    assert "KILLED" not in out, out
    # its host's other worker saw it die itself (waiting for its table push), and said which
    assert "local rank 1 (pid " in out and " of host group 0 died" in out, out
    assert _shm_left() <= before


def test_with_elastic_a_killed_local_worker_is_let_go_and_the_others_go_on(tmp_path):
    """Under --elastic the tables go per process (said once); every survivor reads every
    row of every round: a row's round sum of the workers that pushed it."""
    before = _shm_left()
    code, out = _launch(tmp_path, elastic=3, victim=(1, 0))
    assert code == 0, out
    assert "row-sparse keys go per process under HETPS_ELASTIC" in out, out
    recs = _records(out, "KILLED")
    assert sorted(recs) == [0, 1, 3], out
    for r in range(5):
        live = [0, 1, 2, 3] if r < 2 else [0, 1, 3]
        want = [len(live) * (r + 1.0), 0.0, 0.0, 0.0] + [
            r + 1.0 if w in live else 2.0 for w in range(4)
        ]
        for me, rec in recs.items():
            assert rec["seen"][r] == want, (me, r, rec["seen"][r], want)
    assert _shm_left() <= before


#: one host of two workers: the host's merged pull of ~250 KiB per server comes back through
#: the shared-memory rings and its rows land straight from them (every value checked)
RING = """
from hetps.kvstore import hostagg_tables as hat
from hetps.tables import worker as tw
from hetps.tables.rowsparse import Table, initial_rows
hosts, landed, make, land = set(), [0], hat._land, tw._Landing.land
def made(*a):  # (a host's pull's landing)
    got = make(*a)
    hosts.add(id(got))
    return got
def counted(self, view):  # (its reply rows copied straight out of the ring)
    landed[0] += id(self) in hosts
    return land(self, view)
hat._land, tw._Landing.land = made, counted
kv = hetps.kv.create('dist_sync')
R, C = 4096, 64
kv.init('t', Table(R, C, scale=0.5, seed=3))
kv.set_optimizer(optim.SGD(learning_rate=0.5))
kv.barrier()
rng = np.random.default_rng(2)  # the same draws on both workers
ref = initial_rows(0.5, 3, np.arange(R), C, np.float32)
for rnd in range(3):  # (the rings open on the first rounds)
    ids = [np.sort(rng.choice(R, 1500, replace=False)) for _ in range(2)]
    grads = [rng.standard_normal((1500, C)).astype(np.float32) for _ in range(2)]
    kv.push('t', (ids[kv.rank], grads[kv.rank]))
    got = kv.row_sparse_pull('t', row_ids=ids[kv.rank])
    for w in range(2):
        np.add.at(ref, ids[w], -0.5 * grads[w])
    assert got.indices.tolist() == ids[kv.rank].tolist()
    want = ref[ids[kv.rank]]
    assert np.allclose(got.data, want, atol=1e-5), np.abs(got.data - want).max()
assert kv.hostagg is not None and 't' in kv.hostagg.tables.tables
print('HOST-RING', kv.cfg.local_rank, landed[0], flush=True)
"""


def test_a_hosts_merged_pull_lands_from_the_rings(tmp_path):
    rc, out = run_cluster(tmp_path, RING, workers=2, servers=2, node_env=HOSTS)
    assert rc == 0, out
    got = [line.split("HOST-RING ")[1].split() for line in out.splitlines() if "HOST-RING " in line]
    assert sorted(lr for lr, _ in got) == ["0", "1"], out
    assert sum(int(n) for _, n in got) >= 2, out  # (one reply per server, at least)
