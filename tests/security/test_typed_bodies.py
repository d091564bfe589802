"""Chunk request bodies are declared types (hetps.cluster.bodies), checked once at decode.

A body of the wrong type, out of range or with a field its command does not know is refused
with an error that names the command, the key and the field, before the server reads it;
the server keeps the key's value and goes on serving. The worker's bodies decode into their
types unchanged (the wire keys stay the short ones the protocol documents).
"""

from __future__ import annotations

import subprocess
import sys

import msgspec
import numpy as np
import pytest

from hetps.cluster import bodies
from hetps.cluster import protocol as P
from hetps.cluster.errors import RequestError
from hetps.roles import new_scheduler, new_server
from hetps.transport.codec import Message, decode, encode
from roles import loopback_config, role_env, worker_store

PUSH = {"k": "w", "part": 0, "off": 0, "n": 8, "sync": True, "ce": 8}

#: (what is wrong, the body, what the error must say)
HOSTILE = [
    ("a wrong type", {**PUSH, "n": "8"}, "field 'n' (elements in this chunk): expected `int`"),
    ("a negative offset", {**PUSH, "off": -8}, "field 'off' (offset of this chunk within"),
    ("an unknown field", {**PUSH, "ofs": 0}, "unknown field 'ofs' (a push body has ce,"),
    ("a missing field", {k: v for k, v in PUSH.items() if k != "ce"}, "field 'ce' (elements"),
    ("a bool key", {**PUSH, "k": True}, "field 'k' (the key): expected `int | str`, got `bool`"),
    ("an infinite threshold", {**PUSH, "comp": float("inf")}, "field 'comp' (2-bit"),
    ("a negative round", {**PUSH, "rnd": -1}, "field 'rnd' (with HETPS_REPLICAS"),
    ("a long key", {**PUSH, "k": "x" * 1025}, "field 'k' (the key): expected `str` of length"),
]


class _Node:
    def __init__(self) -> None:
        self.replies: list[dict | None] = []
        self.sent: list[Message] = []

    def workers(self) -> list:
        return [9]

    def reply(self, msg, body=None, arrays=None, track=False):
        self.replies.append(body)

    def send(self, peer, msg):
        self.sent.append(msg)


@pytest.mark.parametrize("what,body,says", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_a_hostile_push_body_is_refused_naming_the_field(what, body, says):
    node = _Node()
    srv = new_server(node)
    init = bodies.chunk("w", 0, 0, 8, (8,), "float32", size=8)
    srv.handle(Message(P.INIT, sender=9, req=1, body=init, arrays=[np.ones(8, np.float32)]))
    assert node.replies == [None]
    srv.handle(Message(P.PUSH, sender=9, req=2, body=body, arrays=[np.full(8, 5, np.float32)]))
    error = node.replies[-1]["error"]
    assert error.startswith("push") and says in error, (what, error)
    assert (srv.slices[("w", 0)].value == 1).all() and not node.sent  # no receipt, no change


def test_an_init_is_refused_a_dtype_a_key_may_not_have():
    node = _Node()
    srv = new_server(node)
    body = bodies.chunk("w", 0, 0, 8, (8,), "int32", size=8)
    srv.handle(Message(P.INIT, sender=9, req=1, body=body, arrays=[np.ones(8, np.int32)]))
    error = node.replies[-1]["error"]
    assert "field 'dtype' (the key's dtype name (float16, float32 or" in error
    assert "invalid enum value 'int32'" in error
    assert not srv.slices


def test_the_workers_bodies_decode_into_their_types_through_the_codec():
    """What a worker builds (bodies.chunk, by attribute names) crosses the codec under the
    protocol's wire keys and decodes into its type with the same values."""
    cases = [
        (P.INIT, bodies.Init, bodies.chunk("w", 1, 16, 4, (2, 10), "float16", size=20, round=3)),
        (
            P.PUSH,
            bodies.Push,
            bodies.chunk(
                7,
                0,
                32,
                16,
                [48],
                "float32",
                chunk=16,
                sync=False,
                fused=True,
                threshold=0.5,
                receipt=True,
                round=None,
            ),  # fmt: skip
        ),
        (P.PULL, bodies.Pull, bodies.chunk("w", 2, 0, 5, (5,), "float64")),
    ]
    for cmd, kind, body in cases:
        assert set(body) <= set(bodies.meanings(cmd)), body  # the documented wire keys
        got = decode(encode(Message(cmd, body=body)), 1 << 20).body
        typed = bodies.decode(cmd, got, kind)
        wire = msgspec.to_builtins(typed)  # (by wire names)
        assert {k: wire[k] for k in body} == body, (cmd, wire, body)
    push = bodies.decode(P.PUSH, cases[1][2], bodies.Push)
    assert (push.key, push.offset, push.count, push.chunk) == (7, 32, 16, 16)
    assert (push.sync, push.fused, push.threshold, push.receipt, push.round) == (
        False, True, 0.5, True, None)  # fmt: skip
    init = bodies.decode(P.INIT, cases[0][2], bodies.Init)
    assert (init.size, init.round, init.shape, init.dtype) == (20, 3, [2, 10], "float16")


def test_every_declared_field_is_documented_in_the_protocol():
    for cmd, kind in bodies.TYPES.items():
        wire = {f.encode_name for f in msgspec.structs.fields(kind)}
        assert wire <= set(bodies.meanings(cmd)), (cmd, wire - set(bodies.meanings(cmd)))


def test_a_push_kept_for_the_next_round_is_not_decoded_again():
    """The second push of a worker in one round waits in the backlog and is handled again
    after the round: its receipt went once, on arrival, and its body is what was checked."""
    node = _Node()
    srv = new_server(node)
    srv.num_workers = 2
    init = bodies.chunk("w", 0, 0, 8, (8,), "float32", size=8)
    srv.handle(Message(P.INIT, sender=9, req=1, body=init, arrays=[np.zeros(8, np.float32)]))
    push = bodies.chunk("w", 0, 0, 8, (8,), "float32", chunk=8, sync=True, receipt=True)
    msgs = [
        Message(P.PUSH, sender=s, req=r, body=dict(push), arrays=[np.full(8, s, np.float32)])
        for s, r in ((9, 2), (9, 3), (11, 4))
    ]
    srv.handle(msgs[0])
    srv.handle(msgs[1])
    assert srv.slices[("w", 0)].backlog == [msgs[1]]  # 9's second push: the next round
    typed = msgs[1].typed
    srv.handle(msgs[2])  # the round 9 + 11 completes; 9's second push goes into the next
    assert (srv.slices[("w", 0)].value == 20).all() and not srv.slices[("w", 0)].backlog
    assert msgs[1].typed is typed and [m.cmd for m in node.sent] == [P.RECEIPT] * 3
    srv.handle(Message(P.PUSH, sender=11, req=5, body=dict(push), arrays=[np.ones(8, np.float32)]))
    assert len(node.sent) == 4  # the new push's receipt, and none again for the one kept
    assert (srv.slices[("w", 0)].value == 10).all()  # the next round: 9 + 1


def test_a_real_server_refuses_hostile_bodies_and_goes_on_serving(tmp_path):
    sch = new_scheduler(loopback_config("scheduler")).start()
    log = open(tmp_path / "server.log", "w+")
    env = role_env("server", sch.van.port, PS_HEARTBEAT_INTERVAL=0.5)
    srv = subprocess.Popen(
        [sys.executable, "-m", "hetps.cli", "server"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    kv = None
    try:
        kv = worker_store("dist_sync", loopback_config("worker", sch.van.port))
        kv.init("w", np.full(8, 3, np.float32))
        sid = kv.server_ids[0]
        for what, body, says in HOSTILE:
            msg = Message(P.PUSH, body=body, arrays=[np.ones(8, np.float32)])
            with pytest.raises(RequestError, match="^push") as err:
                kv.node.request(sid, msg).wait(10)
            assert says in str(err.value), (what, str(err.value))
        assert (kv.pull("w") == 3).all()  # nothing of them was kept
        kv.push("w", np.ones(8, np.float32))
        assert (kv.pull("w") == 1).all()
        kv.close()
        kv = None
        assert srv.wait(timeout=20) == 0
        log.seek(0)
        text = log.read()
        assert text.count("refused push from") == len(HOSTILE), text
        assert "Traceback" not in text
    finally:
        if kv is not None:
            kv.close()
        if srv.poll() is None:
            srv.kill()
            srv.wait()
        sch.stop()
        sch.join(5)
        log.close()
