"""A standalone ESync state server (real sockets) takes the reporter's rank from its
connection: a worker cannot report for another worker, by writing another rank into its
report or from a second connection."""

from __future__ import annotations

import contextlib
import threading

import msgpack
import zmq

from hetps.esync.service import StateServer
from hetps.transport.codec import Message, encode


def _report(sock, rx, ep: str, rank: int, req: int) -> dict:
    msg = Message(
        "esync_report",
        req=req,
        body={"rank": rank, "round": 1, "step_s": 0.1, "elapsed_s": 0.1, "ep": ep},
    )
    sock.send_multipart([bytes(f) if not isinstance(f, bytes) else f for f in encode(msg)])
    assert rx.poll(10000), "no answer from the state server"
    frames = rx.recv_multipart()
    return msgpack.unpackb(frames[1], raw=False)["b"]


@contextlib.contextmanager
def _serving(workers: int, dealers: int):
    """A state server of ``workers`` on its own thread; (server, the ROUTER its answers come
    to, that ROUTER's host:port, ``dealers`` DEALERs connected to the server). All of it is
    closed at the end, and its thread must have ended."""
    srv = StateServer(workers, host="127.0.0.1")
    stop = threading.Event()
    t = threading.Thread(target=srv.serve, args=(stop,), daemon=True)
    t.start()
    ctx = zmq.Context()
    socks = []
    try:
        rx = ctx.socket(zmq.ROUTER)  # where the answers come (one endpoint for all)
        socks.append(rx)
        rx.bind("tcp://127.0.0.1:*")
        ep = rx.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit("/", 1)[1]
        for _ in range(dealers):
            socks.append(ctx.socket(zmq.DEALER))
            socks[-1].connect(f"tcp://127.0.0.1:{srv.port}")
        yield srv, rx, ep, socks[1:]
    finally:
        stop.set()
        t.join(5)
        for s in socks:
            s.close(0)
        ctx.term()
    assert not t.is_alive()


def test_a_report_counts_for_its_connections_rank_only():
    srv = StateServer(2, host="127.0.0.1")
    stop = threading.Event()
    t = threading.Thread(target=srv.serve, args=(stop,), daemon=True)
    t.start()
    ctx = zmq.Context()
    socks = []
    try:
        rx = ctx.socket(zmq.ROUTER)  # where the answers come (one endpoint for both)
        rx.bind("tcp://127.0.0.1:*")
        ep = rx.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit("/", 1)[1]
        worker0, other = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        socks = [rx, worker0, other]
        for s in (worker0, other):
            s.connect(f"tcp://127.0.0.1:{srv.port}")
        assert "error" not in _report(worker0, rx, ep, 0, 1)
        # the same connection writes rank 1: it still reports as worker 0
        assert "error" not in _report(worker0, rx, ep, 1, 2)
        # another connection claims worker 0: refused
        answer = _report(other, rx, ep, 0, 3)
        assert "reports on another connection" in answer.get("error", ""), answer
        assert srv.service.steps_total == [2, 0]
    finally:
        stop.set()
        t.join(5)
        for s in socks:
            s.close(0)
        ctx.term()
    assert not t.is_alive()


def test_in_the_scheduler_a_report_counts_for_the_senders_rank():
    """The scheduler's service (the default state server): the rank is the sending worker's
    (its connection's node), whatever the report says; a report from no worker is refused."""
    from hetps.cluster import commands
    from hetps.cluster.protocol import NodeInfo
    from hetps.esync.service import EsyncService

    svc = EsyncService(2)
    answers = []

    class Sched:  # what the service reads of the scheduler
        nodes = {
            9: NodeInfo(9, "worker", 0, "127.0.0.1", 1),
            11: NodeInfo(11, "worker", 1, "127.0.0.1", 1),
            8: NodeInfo(8, "server", 0, "127.0.0.1", 1),
        }

        def reply(self, msg, body):
            answers.append(body)

    service = svc.as_scheduler_service()
    body = {"rank": 1, "round": 1, "step_s": 0.1, "elapsed_s": 0.1}  # worker 0 writes rank 1
    msg = Message("esync_report", req=1, body=dict(body))
    msg.sender = 9
    assert commands.decode(msg) is None  # (as the scheduler's dispatch does first)
    service(Sched(), msg)
    assert "error" not in answers[-1] and svc.steps_total == [1, 0]
    server = Message("esync_report", req=2, body=dict(body))
    server.sender = 8
    assert commands.decode(server) is None
    service(Sched(), server)
    assert "error" in answers[-1] and svc.steps_total == [1, 0]


def test_a_malformed_report_is_refused_at_the_address_it_gives():
    """A report that is no EsyncReport (a negative round, an unknown field) is not counted,
    and its refusal, naming the field, goes back to the ``ep`` it gives; a good report of the
    same connection after it still counts."""
    with _serving(1, 1) as (srv, rx, ep, (worker,)):
        good = {"rank": 0, "round": 1, "step_s": 0.1, "elapsed_s": 0.1, "ep": ep}
        for req, (bad, says) in enumerate(
            [({**good, "round": -1}, "field 'round'"), ({**good, "x": 1}, "unknown field 'x'")],
            start=1,
        ):
            msg = Message("esync_report", req=req, body=bad)
            worker.send_multipart([bytes(f) for f in encode(msg)])
            assert rx.poll(10000), "a refused report got no answer at its ep"
            answer = msgpack.unpackb(rx.recv_multipart()[1], raw=False)["b"]
            assert says in answer.get("error", ""), answer
        assert srv.service.steps_total == [0]
        assert "error" not in _report(worker, rx, ep, 0, 3)
        assert srv.service.steps_total == [1]
