"""Identity in plain mode (no secret, loopback): a message's sender is its connection.

Every test runs real processes over real sockets. An outsider (tests/security/forger.py, a
process with pyzmq and no part of the job) forges pushes, inits, pulls, drops, pickled
optimizers, ``exit``, ``leave``, ``node_dead`` and barrier releases "from" real nodes; a
registered worker sends, over its own connections, commands only the scheduler may send; two
registrations claim one rank. Every forgery is refused where identity decides, the job's values
are those of an undisturbed run, and no code of the outsider runs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import msgpack
import numpy as np
import zmq

from hetps.transport.codec import Message, encode
from hetps.transport.van import UNKNOWN, Van
from roles import role_env

from .lines import Lines as _Lines

HERE = Path(__file__).resolve().parent
FORGER = HERE / "forger.py"

#: the workers' script: an undisturbed run's values, checked after the outsider's attack
JOB = """
import json, subprocess
from hetps.transport.codec import Message
kv = hetps.kv.create('dist_sync')
kv.init('w', np.zeros(8, np.float32))
kv.init('keep', np.ones(4, np.float32))
node = kv.node
sid = kv.server_ids[0]
# each worker's address, for the outsider to try (a worker's node table names no other's)
where = os.path.join(os.path.dirname(MARKER), 'worker-{}.addr')
with open(where.format(kv.rank), 'w') as f:
    f.write(f"{node.info.host}:{node.info.port}")
kv.barrier()
if kv.rank == 0:
    targets = {
        "scheduler": f"{node.cfg.root_uri}:{node.cfg.root_port}",
        "servers": [f"{s.host}:{s.port}" for s in node.servers()],
        "workers": [open(where.format(w.rank)).read() for w in node.workers()],
        "workers_ids": [w.id for w in node.workers()],
        "marker": MARKER,
        "mode": MODE,
        "expect_refusal": MODE == "plain",
        "public_key": node.van.keys.public_key.decode() if node.van.keys else "",
    }
    res = subprocess.run([sys.executable, FORGER, json.dumps(targets)], capture_output=True,
                         text=True, timeout=60)
    print(res.stdout, res.stderr, flush=True)
    assert res.returncode == 0, res.stderr
else:
    # a registered worker, over its own connections, sends what only the scheduler may send
    w0 = node.workers()[0]
    node.van.send(sid, Message('exit'))
    node.van.send(sid, Message('worker_done', body={'node': w0.to_wire()}))
    node.van.send(sid, Message('node_dead', body={'node': w0.to_wire(), 'error': 'INSIDER'}))
    node.van.send(1, Message('add_node', req=5, body={'role': 'worker', 'host': '127.0.0.1',
                                                      'port': 1, 'back': b'hx', 'want_rank': 0}))
    node.van.send(sid, Message('pull', req=999999, reply=True, arrays=[np.ones(8, np.float32)]))
kv.barrier()
assert (kv.pull('w') == 0).all(), kv.pull('w')        # no forged init or push took effect
for r in range(5):
    kv.push('w', np.full(8, (kv.rank + 1) * (r + 1), np.float32))
    out = kv.pull('w')
    want = sum(i + 1 for i in range(kv.num_workers)) * (r + 1)
    assert (out == want).all(), (r, out, want)
assert (kv.pull('keep') == 1).all()                    # no forged drop took effect
assert not os.path.exists(MARKER), 'the outsider ran code in this job'
print('JOB-OK', kv.rank, flush=True)
"""


def job_code(marker: Path, mode: str) -> str:
    """The workers' script, run against the given outsider mode."""
    return f"MARKER = {str(marker)!r}\nMODE = {mode!r}\nFORGER = {str(FORGER)!r}\n" + JOB.lstrip(
        "\n"
    )


def test_plain_mode_forgeries_are_refused_where_identity_decides(cluster, tmp_path):
    marker = tmp_path / "outsider-ran"
    rc, out = cluster(job_code(marker, "plain"), workers=2, servers=1, env={"HETPS_INSECURE": "1"})
    assert rc == 0, out
    assert out.count("JOB-OK") == 2, out
    assert not marker.exists()
    # the outsider's registration came after the cluster was complete: a refusal, no table
    got = re.findall(r"FORGER got (\w+)", out)
    assert got == ["refused"], out
    assert "ATTACKER-TEXT" not in out and "FORGED" not in out  # no job error is the outsider's
    # every refused message is logged on each receiver: a line each, or (past a few lines a
    # window, at the scheduler) counted in a line of its own
    sent = int(re.search(r"FORGER sent (\d+)", out).group(1))
    unknown = len(re.findall(r"from a connection of no node of this job", out))
    counted = sum(int(n) for n in re.findall(r"scheduler refused (\d+) more messages", out))
    assert unknown + counted >= sent - 1, out  # every forgery but the (refused) registration
    # the insider: commands only the scheduler sends, and a second registration
    for cmd in ("exit", "worker_done", "node_dead"):
        assert re.search(rf"\[server 0\].*refused {cmd} from worker rank 1", out), out
    assert re.search(r"\[scheduler\].*refused add_node from worker rank 1", out), out


def test_a_rank_is_claimed_once(tmp_path):
    """Two registrations claim worker rank 0 before the cluster is complete: the second is
    refused, naming the first; a second registration on one connection is ignored."""
    env = role_env("scheduler", workers=2, clean=True, HETPS_CONNECT_TIMEOUT=30)
    sched = subprocess.Popen(
        [sys.executable, "-m", "hetps.cli", "scheduler"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    ctx = zmq.Context()
    socks: list[zmq.Socket] = []
    try:
        lines = _Lines(sched.stdout)
        port = int(lines.wait(r"hetps scheduler port (\d+)").group(1))

        def registrant(want: int) -> tuple[zmq.Socket, zmq.Socket]:
            inbox = ctx.socket(zmq.ROUTER)
            inbox_port = inbox.bind_to_random_port("tcp://127.0.0.1")
            out = ctx.socket(zmq.DEALER)
            out.connect(f"tcp://127.0.0.1:{port}")
            socks.extend([inbox, out])
            body = {
                "role": "worker",
                "host": "127.0.0.1",
                "port": inbox_port,
                "back": b"h" + os.urandom(15),
                "want_rank": want,
            }
            out.send_multipart(_raw(Message("add_node", req=1, body=body)))
            return inbox, out

        def answer(inbox: zmq.Socket) -> dict:
            assert inbox.poll(10000), "no answer from the scheduler"
            frames = inbox.recv_multipart()
            head = msgpack.unpackb(frames[1], raw=False)
            return {"cmd": head["c"], **head["b"]}

        a_in, a_out = registrant(0)
        assert answer(a_in) == {"cmd": "add_node", "registered": 1, "expected": 3}
        b_in, _ = registrant(0)
        refused = answer(b_in)
        assert refused["cmd"] == "refused", refused
        assert "worker rank 0 (HETPS_LAUNCH_RANK) is already claimed" in refused["error"]
        lines.wait(r"a second claim of worker rank 0")
        c_in, _ = registrant(7)
        assert "is not below 2" in answer(c_in)["error"]
        # the same connection registers again: ignored, with a log line
        body = {"role": "worker", "host": "127.0.0.1", "port": 1, "back": b"hy", "want_rank": 1}
        a_out.send_multipart(_raw(Message("add_node", req=2, body=body)))
        lines.wait(r"refused a second registration on one connection")
    finally:
        for s in socks:
            s.close(0)
        ctx.term()
        os.killpg(sched.pid, 9)
        sched.wait()


def test_the_van_names_the_sender_by_its_connection_never_by_the_header():
    """Two vans over real sockets: the receiver knows a connection only once it is admitted,
    whatever node id a header claims."""
    rx, tx = Van(name="rx"), Van(name="tx")
    try:
        rid = tx.connect("rx", rx.endpoint)
        tx.send("rx", Message("push", sender=9))  # a claim the wire does not carry
        got = rx.recv(timeout=10)
        assert got is not None and got.sender == UNKNOWN and got.origin == rid
        rx.admit(rid, 11)
        tx.send("rx", Message("push", sender=9))
        got = rx.recv(timeout=10)
        assert got.sender == 11
        # a raw header that says "s": 1 (the scheduler) is still its connection's
        raw = msgpack.unpackb(encode(Message("exit"))[0], raw=False)
        raw["s"] = 1
        sock = tx.ctx.socket(zmq.DEALER)
        sock.connect(f"tcp://{rx.endpoint}")
        sock.send(msgpack.packb(raw, use_bin_type=True))
        got = rx.recv(timeout=10)
        assert got.cmd == "exit" and got.sender == UNKNOWN
        sock.close(0)
    finally:
        tx.close()
        rx.close()


def _raw(msg: Message) -> list[bytes]:
    return [bytes(f) if not isinstance(f, bytes) else f for f in encode(msg)]


__all__ = ["FORGER", "job_code", "np"]
