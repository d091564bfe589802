"""An answer of a declared type (hetps.cluster.commands.REPLIES) is decoded by the node that
gets it, as a request is: a scheduler's malformed barrier answer fails that barrier with a
text naming the answer and the field, and the worker goes on (its next barrier, push and
pull complete against the same live scheduler and server; seconds). A body once made is
never changed by the layers it passes through."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from hetps.cluster import bodies
from hetps.cluster import protocol as P
from hetps.cluster.errors import RequestError
from hetps.roles import new_scheduler
from hetps.transport.codec import Message
from roles import loopback_config, role_env, worker_store


def _server(sch, tmp_path):
    """A server process of ``sch``'s job, and its log file."""
    log = open(tmp_path / "server.log", "w+")
    srv = subprocess.Popen(
        [sys.executable, "-m", "hetps.cli", "server"],
        env=role_env("server", sch.van.port, PS_HEARTBEAT_INTERVAL=0.5),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return srv, log


def test_a_malformed_barrier_answer_fails_the_barrier_and_the_worker_goes_on(tmp_path):
    sch = new_scheduler(loopback_config("scheduler")).start()
    send_to, armed = sch.send_to, []

    def forge(peer, msg: Message) -> None:
        if msg.cmd == P.BARRIER_DONE and armed:  # this answer once: members that are no ids
            armed.clear()
            msg = Message(msg.cmd, req=msg.req, reply=True, body={"members": ["x"]})
        send_to(peer, msg)

    sch.send_to = forge
    srv, log = _server(sch, tmp_path)
    kv = None
    try:
        kv = worker_store("dist_sync", loopback_config("worker", sch.van.port))
        kv.init("w", np.full(4, 3, np.float32))
        armed.append(True)
        with pytest.raises(RequestError) as err:
            kv.barrier()
        text = str(err.value)
        assert "barrier_done: field 'members' (HETPS_ELASTIC: the ids of" in text, text
        assert "expected `int`, got `str` at members[0]" in text, text
        kv.barrier()  # the next answer is a good one: the worker goes on
        # a push the pipeline paces (the push window) asks for a receipt in a body of its
        # own: the one its caller made is never changed
        kv.pipeline.sender.window = 1 << 19  # (as with HETPS_BALANCE on)
        body = bodies.chunk("w", 0, 0, 4, (4,), "float32", sync=True, chunk=4)
        push = Message(P.PUSH, body=body, arrays=[np.full(4, 2, np.float32)])
        kv.request("w", 0, 0, push).wait(10)
        assert push.body["rcpt"] is True and "rcpt" not in body
        assert (kv.pull("w") == 2).all()
        kv.push("w", np.ones(4, np.float32))
        assert (kv.pull("w") == 1).all()
        kv.close()
        kv = None
        assert srv.wait(timeout=20) == 0
    finally:
        if kv is not None:
            kv.close()
        if srv.poll() is None:
            srv.kill()
            srv.wait()
        sch.stop()
        sch.join(5)
        log.close()


def test_a_malformed_node_table_fails_the_registration_naming_the_field(tmp_path):
    """The scheduler's node table is a declared answer (NodeTable): a worker that gets one whose
    replica count is 0 refuses it at once, naming the field, and joins nothing."""
    from hetps.cluster.errors import ClusterError

    sch = new_scheduler(loopback_config("scheduler")).start()
    send_to = sch.send_to

    def forge(peer, msg: Message) -> None:
        if msg.cmd == P.NODES and P.role_of(peer) == "worker":
            msg = Message(msg.cmd, req=msg.req, reply=True, body={**msg.body, "replicas": 0})
        send_to(peer, msg)

    sch.send_to = forge
    srv, log = _server(sch, tmp_path)
    kv = None
    try:
        with pytest.raises(ClusterError) as err:
            kv = worker_store("dist_sync", loopback_config("worker", sch.van.port))
        text = str(err.value)
        assert "malformed node table" in text and "field 'replicas'" in text, text
        assert "expected `int` >= 1" in text, text
    finally:
        if kv is not None:  # (a table taken after all)
            kv.close()
        srv.kill()
        srv.wait()
        sch.stop()
        sch.join(5)
        log.close()
