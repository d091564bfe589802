"""Host-local aggregation across emulated hosts: two namespaces of two workers each and a
servers' namespace, secured as `hetps launch` runs it. With aggregation each worker host's
interface carries one push and one pull of the model per round (TCP/IP framing aside), half
of what it carries when its two workers push and pull their own; the values pulled are the
same bit for bit either way."""

from __future__ import annotations

import io
import json
import re
import sys

import pytest

from hetps.launch.contract import LaunchSpec
from hetps.launch.local import Launcher
from hetps.netem import Netem

pytestmark = [pytest.mark.netem, pytest.mark.slow, pytest.mark.timeout(240)]

N = 1_200_000  # float32: 4.8 MB, split over the two servers
ROUNDS = 3

SCRIPT = f"""
import hashlib, json
import numpy as np
import hetps.kv

def nic():
    base = '/sys/class/net/eth0/statistics/'
    return sum(int(open(base + f).read()) for f in ('tx_bytes', 'rx_bytes'))

kv = hetps.kv.create('dist_sync')
g, lr = kv.cfg.host_group, kv.cfg.local_rank
kv.init('w', np.zeros({N}, np.float32))
kv.barrier()
b0 = nic()
out = np.empty({N}, np.float32)
digest = hashlib.sha256()
for r in range({ROUNDS}):
    x = np.random.default_rng(100 * r + 10 * g + lr).standard_normal({N}).astype(np.float32)
    kv.push('w', x)
    kv.pull('w', out=out)
    digest.update(out.tobytes())
kv.barrier()
print('NETHOST ' + json.dumps({{'host': g, 'local': lr, 'on': kv.hostagg is not None,
      'secured': kv.node.van.keys is not None, 'bytes': nic() - b0,
      'values': digest.hexdigest()}}), flush=True)
"""


def _run(tmp_path, agg: str) -> list[dict]:
    script = tmp_path / "w.py"
    script.write_text(SCRIPT)
    out = io.StringIO()
    with Netem([1000.0, 1000.0, 1000.0]) as net:
        spec = LaunchSpec(
            num_workers=4,
            num_servers=2,
            command=[sys.executable, str(script)],
            env={
                "PS_HEARTBEAT_TIMEOUT": "30",
                "OMP_NUM_THREADS": "1",
                "HETPS_HOST_AGGREGATION": agg,
            },
            start_timeout=60,
        )
        spec.host = net.node_ip(0)

        def wrap(role: str, rank: int, argv: list[str], env: dict[str, str]):
            node = 1 + rank // 2 if role == "worker" else 0
            env = {**env, "DMLC_NODE_HOST": net.node_ip(node), "DMLC_PS_ROOT_URI": net.node_ip(0)}
            if role == "worker":
                env.update(
                    HETPS_HOST_GROUP=str(rank // 2), LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2"
                )
            return net.exec_argv(node, argv), env

        spec.wrap = wrap
        launcher = Launcher(spec, out=out)
        try:
            rc = launcher.run()
        finally:
            launcher.stop_all(kill=True)
    text = out.getvalue()
    assert rc == 0, text
    recs = [json.loads(m) for m in re.findall(r"NETHOST (\{.*\})", text)]
    assert len(recs) == 4, text
    return recs


def test_each_worker_host_moves_one_push_and_one_pull_per_round(tmp_path):
    on, off = _run(tmp_path, "1"), _run(tmp_path, "0")
    push_pull = 2 * N * 4 * ROUNDS
    for recs, agg in ((on, True), (off, False)):
        assert all(r["on"] == agg and r["secured"] for r in recs), recs
        for host in (0, 1):
            # (each worker of a host reads the same interface, between the same barriers)
            per_host = max(r["bytes"] for r in recs if r["host"] == host)
            if agg:
                assert push_pull <= per_host <= 1.1 * push_pull, (host, per_host, push_pull)
            else:
                assert 2 * push_pull <= per_host <= 2.2 * push_pull, (host, per_host, push_pull)
    # the same values, bit for bit, on every worker of both runs
    assert len({r["values"] for r in on + off}) == 1, on + off
