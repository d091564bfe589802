"""What a request may make a server build, through real processes: a row_sparse_pull's reply
is sized from its distinct ids and refused over HETPS_TABLE_PULL_BYTES before anything is
built (a server's peak memory, read from /proc, stays within the cap plus one request's
bound), repeated ids are refused, and every table's fixed cost counts against
HETPS_TABLE_MAX_BYTES; each refusal leaves the tables as they were and the job going."""

from __future__ import annotations

import uuid

MIB = 1 << 20

HOSTILE = """
from hetps.cluster import protocol as P
from hetps.tables.rowsparse import Table
from hetps.transport.codec import Message

def server_pid():
    tag = os.environ['TABLE_BOUNDS_TAG']
    for d in os.listdir('/proc'):
        if not d.isdigit():
            continue
        try:
            env = open(f'/proc/{d}/environ', 'rb').read().split(b'\\0')
        except OSError:
            continue
        if f'TABLE_BOUNDS_TAG={tag}'.encode() in env and b'DMLC_ROLE=server' in env:
            return int(d)
    raise SystemExit('no server process found')

def status(pid, field):
    for line in open(f'/proc/{pid}/status'):
        if line.startswith(field + ':'):
            return int(line.split()[1]) * 1024
    raise SystemExit(f'no {field}')

def refused(key, ids):
    m = Message(P.SPULL, body={'k': key, 'part': 0}, arrays=[np.asarray(ids, np.int64)])
    try:
        kv.request(key, 0, 0, m).wait(60)
    except RequestError as e:
        return str(e)
    raise SystemExit(f'a pull of {len(ids)} ids of {key!r} was answered')

kv = hetps.kv.create('dist_sync')
cap, bound = int(os.environ['HETPS_TABLE_MAX_BYTES']), int(os.environ['HETPS_TABLE_PULL_BYTES'])
kv.init('wide', Table(1, 65536))          # one row of 256 KiB
kv.init('big', Table(3072, 4096))         # 48 MiB, within the cap
kv.push('big', (np.array([0, 1500, 3071]), np.arange(3 * 4096, dtype=np.float32).reshape(3, 4096)))
kv.push('wide', (np.array([0]), np.full((1, 65536), 7.0, np.float32)))
pid = server_pid()
base = status(pid, 'VmRSS')
# 6,144 copies of one 256 KiB row (a 1.5 GiB reply if it were built): refused at once
e = refused('wide', np.zeros(6144))
assert "'wide'" in e and 'sorted and distinct' in e, e
# every row of 'big' in one request: 48 MiB, over the bound on one reply
e = refused('big', np.arange(3072))
assert "'big'" in e and '3072 row ids (0 to 3071)' in e and f'{bound} bytes' in e, e
assert 'HETPS_TABLE_PULL_BYTES' in e, e
peak = status(pid, 'VmHWM')
assert peak <= base + cap + bound, (peak, base, cap, bound)
# the tables are as they were, and a worker's own pull of every row is split by the bound
got = kv.row_sparse_pull('big', row_ids=np.arange(3072))
expect = np.zeros((3072, 4096), np.float32)
expect[[0, 1500, 3071]] = np.arange(3 * 4096, dtype=np.float32).reshape(3, 4096)
assert np.array_equal(got.indices, np.arange(3072)) and np.array_equal(got.data, expect)
got = kv.row_sparse_pull('wide', row_ids=[0, 0, 0])
assert got.indices.tolist() == [0] and np.array_equal(got.data, np.full((1, 65536), 7.0)), got
print('HOSTILE-OK', peak - base, flush=True)
"""


def test_a_hostile_pull_is_refused_before_the_reply_is_built(cluster):
    """A pull of repeated ids and a pull over HETPS_TABLE_PULL_BYTES are refused naming the
    key, the ids and the bound; the server's peak resident memory (/proc VmHWM) stays within
    its memory before them plus the cap and one request's bound; the tables answer as before,
    and a worker's pull of more than the bound is split into requests within it."""
    env = {
        "HETPS_TABLE_MAX_BYTES": str(64 * MIB),
        "HETPS_TABLE_PULL_BYTES": str(8 * MIB),
        "TABLE_BOUNDS_TAG": uuid.uuid4().hex,
    }
    rc, out = cluster(HOSTILE, workers=1, servers=1, env=env)
    assert rc == 0, out
    assert "HOSTILE-OK" in out, out


DECLARATIONS = """
from hetps.tables.rowsparse import Table
from hetps.tables.server import TABLE_BYTES
kv = hetps.kv.create('dist_sync')
cap = int(os.environ['HETPS_TABLE_MAX_BYTES'])
kv.init('t0', Table(None, 4))
kv.push('t0', (np.arange(3), np.ones((3, 4), np.float32)))
made = 1
while True:                                  # empty tables are not free: the cap ends them
    try:
        kv.init(f't{made}', Table(None, 4))
    except RequestError as e:
        assert f"'t{made}'" in str(e) and 'HETPS_TABLE_MAX_BYTES' in str(e), e
        break
    made += 1
    assert made < 10_000, 'empty tables were declared without end'
assert cap // (TABLE_BYTES + 5) - 2 <= made <= cap // TABLE_BYTES, made
got = kv.row_sparse_pull('t0', row_ids=[0, 2, 5]).data     # the job goes on, nothing changed
assert got.tolist() == [[1.0] * 4, [1.0] * 4, [0.0] * 4], got
kv.push(f't{made - 1}', (np.arange(0), np.zeros((0, 4), np.float32)))
print('DECL-OK', made, flush=True)
"""


def test_every_table_counts_against_the_servers_cap(cluster):
    """Declarations of empty growing tables are refused once their fixed cost reaches
    HETPS_TABLE_MAX_BYTES, naming the table and the variable; the tables made still work."""
    rc, out = cluster(DECLARATIONS, workers=1, servers=1, env={"HETPS_TABLE_MAX_BYTES": "40000"})
    assert rc == 0, out
    assert "DECL-OK" in out, out
