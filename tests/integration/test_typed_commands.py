"""A node of the job that sends malformed bodies to a live scheduler and a live server gets
an error answer naming the command and the field, each refusal is logged, and the job goes
on: its barrier, push and pull complete, and the server exits 0 at the end (seconds)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from hetps.cluster import protocol as P
from hetps.cluster.errors import RequestError
from hetps.roles import new_scheduler
from hetps.transport.codec import Message
from roles import loopback_config, role_env, worker_store

#: (to, command, body, what the error starts with)
HOSTILE = [
    ("scheduler", P.BARRIER, {"group": "nobody"}, "barrier: field 'group' (worker, server or"),
    ("scheduler", P.BARRIER, {"group": "worker", "n": 1, "x": 0}, "barrier: unknown field 'x'"),
    ("scheduler", P.HEARTBEAT, {"beat": True}, "heartbeat: unknown field 'beat'"),
    ("server", P.GET_STATES, {"slices": "all"}, "get_states: field 'slices'"),
    ("server", P.SINIT, {"k": "t", "part": 0, "nparts": 1, "rows": 4, "cols": 0,
                         "dtype": "float32"}, "sinit of key 't': field 'cols'"),
    ("server", P.PROBE, {"reply_bytes": 1 << 40}, "probe: field 'reply_bytes'"),
    ("server", P.SDUMP, {"k": "t", "part": 0, "n": -1}, "sdump of key 't': field 'n'"),
]  # fmt: skip


def test_malformed_bodies_to_a_live_scheduler_and_server_are_refused_and_the_job_goes_on(
    tmp_path, caplog
):
    caplog.set_level("WARNING", logger="hetps")
    sch = new_scheduler(loopback_config("scheduler")).start()
    log = open(tmp_path / "server.log", "w+")
    srv = subprocess.Popen(
        [sys.executable, "-m", "hetps.cli", "server"],
        env=role_env("server", sch.van.port, PS_HEARTBEAT_INTERVAL=0.5),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    kv = None
    try:
        kv = worker_store("dist_sync", loopback_config("worker", sch.van.port))
        kv.init("w", np.full(4, 3, np.float32))
        peer = {"scheduler": P.SCHEDULER_ID, "server": kv.server_ids[0]}
        for to, cmd, body, says in HOSTILE:
            with pytest.raises(RequestError) as err:
                kv.node.request(peer[to], Message(cmd, body=body)).wait(10)
            assert says in str(err.value), (cmd, str(err.value))
        # the scheduler's notices are decoded too: a malformed one is refused, not acted on
        sch.send_to(peer["server"], Message(P.FAILOVER, body={"node": "x", "to": 10}))
        sch.send_to(kv.node.id, Message(P.WORKER_JOINING, body={"node": [11]}))
        kv.barrier()  # the scheduler goes on
        kv.push("w", np.ones(4, np.float32))
        assert (kv.pull("w") == 1).all()  # so does the server
        kv.close()
        kv = None
        assert srv.wait(timeout=20) == 0
        log.seek(0)
        text = log.read()
        refused = [h for h in HOSTILE if h[0] == "server"]
        assert text.count("server: refused ") == len(refused) + 1, text
        assert "server: refused failover from scheduler" in text, text
        assert "failover: field 'node' (the server that died (NodeInfo))" in text, text
        assert "Traceback" not in text
        said = [r.getMessage() for r in caplog.records]
        assert any("worker: refused worker_joining from scheduler" in m for m in said), said
    finally:
        if kv is not None:
            kv.close()
        if srv.poll() is None:
            srv.kill()
            srv.wait()
        sch.stop()
        sch.join(5)
        log.close()
