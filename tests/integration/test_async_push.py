"""MXNet's asynchrony on real processes: a push returns once its values are captured, a pull
sees this worker's earlier pushes, and in the training loop's push-then-pull the pull is
answered by the push (no request of its own). Errors of a push that already returned reach
the next pull, wait_outstanding and barrier."""

from __future__ import annotations

import pytest

# a key split over both servers and cut into several chunks
SMALL_PARTS = {"HETPS_BIGARRAY_BOUND": "1000", "HETPS_CHUNK_BYTES": "4096"}


@pytest.mark.parametrize(
    "n, env",
    [
        (3000, {**SMALL_PARTS, "HETPS_SHM_BYTES": "0"}),  # frames ZeroMQ copies
        (3000, SMALL_PARTS),  # chunks of 4 KiB ring-borne, the short last ones copied by ZeroMQ
        (4_000_000, {"HETPS_BIGARRAY_BOUND": "1000", "HETPS_SHM_BYTES": "0"}),  # zero-copy frames
        (4_000_000, {"HETPS_BIGARRAY_BOUND": "1000", "HETPS_CHUNK_BYTES": "3000000"}),  # rings
    ],
    ids=["small", "small-rings", "zero-copy", "rings"],
)
def test_push_returns_before_its_round_and_captures_the_values(cluster, n, env):
    """Rank 0 pushes while rank 1 has not: the push returns, not done, and rank 0 then
    overwrites its array. The round (released when rank 1 pushes, after a node barrier that
    rank 0 reaches only after the overwrite) sums the values as they were when pushed.
    Through open shared-memory rings the push copies the values into the rings as it sends
    them (no staging copy, the chunks of 3 MB ring-borne, the last short one copied by
    ZeroMQ); over TCP it captures them first."""
    rings = n * 4 >= 4 << 10 and "HETPS_SHM_BYTES" not in env  # (the bound, with a secret)
    code = f"""
from hetps.kvstore.base import Handle
kv = hetps.kv.create('dist_sync')
r, W = kv.rank, kv.num_workers
n = {n}
kv.init('w', np.zeros(n, np.float32))
kv.push('w', np.zeros(n, np.float32))   # a round first: the rings to the servers open
kv.pull('w')
kv.barrier()
grad = np.full(n, r + 1, np.float32)
if r == 0:
    captures = kv.meta['w'].captures
    h = kv.push('w', grad)
    assert isinstance(h, Handle) and not h.done(), 'push waited for the round'
    assert kv.meta['w'].captures == captures + {0 if rings else 1}, 'staging copies'
    grad[:] = 1000                      # after push returned: must not be what is sent
    kv.node.barrier('worker')           # only now does rank 1 push
else:
    kv.node.barrier('worker')
    kv.push('w', grad)
got = kv.pull('w')                      # waits for this worker's push: the round
assert (got == sum(range(1, W + 1))).all(), got[:4]
kv.barrier()
print('CAPTURE-OK', flush=True)
"""
    rc, out = cluster(code, workers=2, servers=2, env=env)
    assert rc == 0, out
    assert out.count("CAPTURE-OK") == 2, out


def test_a_pull_after_a_push_is_answered_by_the_push(cluster):
    """After the first push-then-pull of a key, its pushes bring the value back and its pulls
    send nothing; every pull still sees its own round. Pushing twice before a pull turns
    the fusion off for that key (the pull then asks, and sees the second round)."""
    code = """
kv = hetps.kv.create('dist_sync')
r, W = kv.rank, kv.num_workers
n = 3000
kv.init('w', np.zeros(n, np.float32))
def sent():
    return sum(s.msgs_sent for p, s in kv.node.van.counters.links.items() if p in kv.server_ids)
pulls = []  # no optimizer: a round's sum replaces the value
for rnd in range(4):
    g = np.arange(n, dtype=np.float32) * (r + 1) + rnd
    kv.push('w', g)
    kv.wait_outstanding()               # the push's requests are out: count the pull alone
    m = sent()
    got = kv.pull('w')
    pulls.append(sent() - m)
    want = np.arange(n) * sum(range(1, W + 1)) + W * rnd
    assert np.array_equal(got, want.astype(np.float32)), (rnd, got[:4], want[:4])
assert pulls[0] > 0 and pulls[1:] == [0, 0, 0], pulls
# two pushes, then a pull: it sees the second round
for rnd in (4, 5):
    kv.push('w', np.full(n, rnd, np.float32))
kv.wait_outstanding()
m = sent()
got = kv.pull('w')
assert sent() - m > 0, 'a pushed-twice key was still answered by a push'
assert (got == 5 * W).all(), got[:4]
kv.barrier()
print('FUSED-OK', flush=True)
"""
    rc, out = cluster(code, workers=2, servers=2, env=SMALL_PARTS)
    assert rc == 0, out
    assert out.count("FUSED-OK") == 2, out


def test_a_refused_push_is_reported_by_the_barrier(cluster):
    """A dist_async push with no server optimizer is refused after push returned; a pull of
    another key does not raise it, the barrier does, once (the next one goes through)."""
    code = """
kv = hetps.kv.create('dist_async')
kv.init(['w', 'other'], [np.zeros(8, np.float32)] * 2)
h = kv.push('w', np.ones(8, np.float32))
kv.pull('other')        # answered after the push (one server, in order): the refusal is in
assert h.done()
try:
    kv.barrier()
    raise SystemExit('the refused push was not reported')
except RequestError as e:
    assert 'set_optimizer' in str(e), e
kv.barrier()                            # reported once: not raised again
print('REFUSED-OK', flush=True)
"""
    rc, out = cluster(code, workers=1, servers=1)
    assert rc == 0, out
    assert "REFUSED-OK" in out, out


def test_a_worker_waits_instead_of_running_more_rounds_ahead(cluster, tmp_path):
    """HETPS_ROUNDS_AHEAD=2: rank 0 pushes 4 rounds of a key before rank 1 pushed any. The
    first two return at once; the third waits until round 1 was applied. Rank 1 starts
    pushing only once rank 0 waits (a flag file written from inside that wait), so without
    the credit rank 1 would see no flag, and the values still sum every round."""
    flag = tmp_path / "waiting"
    code = f"""
from pathlib import Path
from hetps.cluster.requests import Future
flag = Path({str(flag)!r})
kv = hetps.kv.create('dist_sync')
r = kv.rank
kv.init('w', np.zeros(8, np.float32))
kv.node.barrier('worker')
if r == 0:
    settle = Future.settle
    def waiting(self, timeout=None):
        if not self.done():
            flag.touch()                # in the credit's wait: rank 1 may go on now
        return settle(self, timeout)
    Future.settle = waiting
    for i in range(4):
        kv.push('w', np.full(8, i + 1, np.float32))
    print('WAITED', flag.exists(), flush=True)
else:
    deadline = time.monotonic() + 20
    while not flag.exists() and time.monotonic() < deadline:
        time.sleep(0.01)                # polls for rank 0's flag
    print('FLAG', flag.exists(), flush=True)
    for i in range(4):
        kv.push('w', np.full(8, 10 * (i + 1), np.float32))
got = kv.pull('w')
assert (got == 4 + 40).all(), got       # the last round: 4 from rank 0, 40 from rank 1
kv.barrier()
print('AHEAD-OK', flush=True)
"""
    rc, out = cluster(code, workers=2, servers=1, env={"HETPS_ROUNDS_AHEAD": "2"})
    assert rc == 0, out
    assert "WAITED True" in out and "FLAG True" in out, out
    assert out.count("AHEAD-OK") == 2, out
