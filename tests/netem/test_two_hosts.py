"""A job across two hosts: a worker and a server in two network namespaces, so every byte
crosses a real interface (a veth through the emulator's bridge), secured as `hetps launch`
runs it, with no shared memory between them."""

from __future__ import annotations

import io
import json
import re
import sys

import pytest

from hetps.launch.contract import LaunchSpec
from hetps.launch.local import run_cluster

pytestmark = [pytest.mark.netem, pytest.mark.timeout(90)]

N = 1 << 20  # floats per key: 4 MiB, bigger than the ring's bound for one array
ROUNDS = 6

SCRIPT = f"""
import json, os
import numpy as np
import hetps.kv

def nic():
    base = '/sys/class/net/eth0/statistics/'
    return tuple(int(open(base + f).read()) for f in ('tx_bytes', 'rx_bytes'))

kv = hetps.kv.create('dist_sync')
van = kv.node.van
kv.init('w', np.zeros({N}, np.float32))
kv.barrier()
tx0, rx0 = nic()
sent0, recv0 = van.counters.totals()
out = np.zeros({N}, np.float32)
for r in range({ROUNDS}):
    g = np.arange({N}, dtype=np.float32) * (r + 1)
    kv.push('w', g)
    kv.pull('w', out=out)
    assert np.array_equal(out, g), r
tx1, rx1 = nic()
sent1, recv1 = van.counters.totals()
print('TWOHOSTS ' + json.dumps({{
    'host': os.environ['DMLC_NODE_HOST'],
    'secured': van.keys is not None,
    'rings_out': sum(r.head for r in van._rings_out.values() if r is not None),
    'rings_in': sum(getattr(r, 'tail', 0) for r in van._rings_in.values()),
    'bulk_out': sum(c.next for c in van.bulk.out.values()) if van.bulk else 0,
    'bulk_in': sum(getattr(c, 'next', 0) for c in van._rings_in.values() if hasattr(c, 'cid')),
    'nic_tx': tx1 - tx0, 'nic_rx': rx1 - rx0,
    'van_sent': sent1 - sent0, 'van_recv': recv1 - recv0,
}}), flush=True)
kv.barrier()
"""


def test_a_job_between_two_hosts_moves_its_bytes_over_the_interface(tmp_path):
    """1 worker on host 1, the scheduler and 1 server on host 0 (1 Gbit/s each way): every
    pushed and pulled byte crosses host 1's eth0, encrypted (the arrays under AES-256-GCM on
    the bulk channels, the rest under CurveZMQ: the nodes hold keys), and none goes through
    a shared-memory ring; the values are exact."""
    scen = tmp_path / "two.toml"
    scen.write_text('[network]\nkind = "static"\nrates_mbit = [1000, 1000]\n')
    script = tmp_path / "w.py"
    script.write_text(SCRIPT)
    out = io.StringIO()
    spec = LaunchSpec(
        num_workers=1,
        num_servers=1,
        command=[sys.executable, str(script)],
        env={"PS_HEARTBEAT_TIMEOUT": "30", "OMP_NUM_THREADS": "1"},
        start_timeout=60,
    )
    rc = run_cluster(spec, netem=str(scen), out=out)
    text = out.getvalue()
    assert rc == 0, text
    found = re.findall(r"TWOHOSTS (\{.*\})", text)
    assert len(found) == 1, text
    got = json.loads(found[0])
    payload = ROUNDS * N * 4  # bytes pushed, and as many pulled
    assert got["secured"], got
    assert got["host"] != "127.0.0.1", got
    # nothing through shared memory: the server is on another host
    assert got["rings_out"] == 0 and got["rings_in"] == 0, got
    # the arrays went on the bulk channels, both ways: a frame per push and per pull at least
    assert got["bulk_out"] >= ROUNDS and got["bulk_in"] >= ROUNDS, got
    # every byte the van sent and received crossed the interface (plus TCP/IP framing)
    assert got["van_sent"] >= payload and got["van_recv"] >= payload, got
    assert got["nic_tx"] >= got["van_sent"], got
    assert got["nic_rx"] >= got["van_recv"], got
    # and not much more: the interface carried this job, not a copy of it twice
    assert got["nic_tx"] < 1.3 * got["van_sent"] + (1 << 20), got
