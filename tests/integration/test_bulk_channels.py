"""Big arrays between secured nodes with no shared-memory ring (as between hosts) travel on
the bulk channels (transport/bulk.py): real processes, values exact, both directions."""

from __future__ import annotations

import json
import re


def test_secured_job_without_shared_memory_moves_big_arrays_on_bulk_channels(cluster):
    """2 workers, 2 servers, shared memory off, secured as `hetps launch` runs it: pushes
    and pulls of a key split over both servers (several frames of 16 MiB, one array over
    FRAME_MAX) and a small key; every value exact, and the big bytes went on the bulk
    channels in both directions, the small ones on the CURVE connection."""
    code = """
import json
kv = hetps.kv.create('dist_sync')
van = kv.node.van
r, W = kv.rank, kv.num_workers
n = 9_000_000  # 36 MB: 18 MB per server, over FRAME_MAX (16 MiB)
kv.init('big', np.zeros(n, np.float32))
kv.init('small', np.zeros(10, np.float32))
out, small = np.zeros(n, np.float32), np.zeros(10, np.float32)
for k in range(3):
    g = np.arange(n, dtype=np.float32) * (r + 1) + k
    kv.push('big', g)
    kv.push('small', np.full(10, r + k, np.float32))
    kv.pull('big', out=out)
    kv.pull('small', out=small)
    want = sum(np.arange(n, dtype=np.float32) * (i + 1) + k for i in range(W))
    assert np.array_equal(out, want), k
    assert np.array_equal(small, np.full(10, sum(i + k for i in range(W)), np.float32)), k
bulk = van.bulk
print('BULK ' + json.dumps({
    'secured': van.secured,
    'sent_frames': sum(c.next for c in bulk.out.values()) if bulk else 0,
    'got_channels': sum(1 for x in van._rings_in.values() if type(x).__name__ == 'InChannel'),
    'got_frames': sum(x.next for x in van._rings_in.values() if type(x).__name__ == 'InChannel'),
    'rings': sum(r.head for r in van._rings_out.values() if r is not None),
    'refused': bulk.rx.refusals.total if bulk else -1,
}), flush=True)
kv.barrier()
print('JOB-OK', flush=True)
"""
    rc, out = cluster(
        code,
        workers=2,
        servers=2,
        env={"HETPS_SHM_BYTES": "0", "HETPS_BIGARRAY_BOUND": "1000"},
    )
    assert rc == 0, out
    assert out.count("JOB-OK") == 2, out
    lines = re.findall(r"BULK (\{.*\})", out)
    assert len(lines) == 2, out
    for line in lines:
        got = json.loads(line)
        assert got["secured"] and got["rings"] == 0, got
        # 3 pushes to 2 servers, each at least 2 frames (18 MB > FRAME_MAX)
        assert got["sent_frames"] >= 12, got
        assert got["got_channels"] == 2, got  # one from each server (the pulls' answers)
        assert got["got_frames"] >= 12, got
        assert got["refused"] == 0, got
