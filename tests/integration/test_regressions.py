"""Regressions found in review: each once hung a node, killed a job or lost an error."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from hetps.cluster.errors import ClusterError, NodeFailure
from hetps.cluster.scheduler import Scheduler
from hetps.esync.service import EsyncService
from hetps.roles import new_scheduler
from roles import loopback_config, role_env, worker_store

# short heartbeats: a dead peer is noticed within 2 s
FAST = dict(heartbeat_interval=0.2, heartbeat_timeout=2.0, connect_timeout=10)


def _server_env(port: int, workers: int = 1) -> dict:
    return role_env(
        "server", port, workers=workers, PS_HEARTBEAT_INTERVAL=0.2, PS_HEARTBEAT_TIMEOUT=2
    )


def test_dead_server_with_full_send_queue_does_not_hang_the_worker():
    sch = new_scheduler(loopback_config("scheduler", **FAST)).start()
    srv = subprocess.Popen(
        [sys.executable, "-m", "hetps.cli", "server"],
        env=_server_env(sch.van.port),
        start_new_session=True,
    )
    kv = None
    try:
        kv = worker_store("dist_sync", loopback_config("worker", sch.van.port, **FAST))
        keys = list(range(400))  # more requests than the 256-message send queue holds
        kv.init(keys, [np.ones(8, np.float32)] * 400)
        srv.kill()
        srv.wait()
        kv.push(keys, [np.ones(8, np.float32)] * 400)  # returns once captured ...
        with pytest.raises(NodeFailure, match="server rank 0"):
            kv.wait_outstanding()  # ... and the requests fail when the server is declared dead
        closer = threading.Thread(target=kv.close, kwargs={"error": "push failed"}, daemon=True)
        closer.start()
        closer.join(15)
        assert not closer.is_alive(), "kv.close() hung on a send to the dead server"
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait()
        sch.stop()
        sch.join(5)


def test_empty_key_push_completes():
    sch = new_scheduler(loopback_config("scheduler", **FAST)).start()
    srv = subprocess.Popen(
        [sys.executable, "-m", "hetps.cli", "server"],
        env=_server_env(sch.van.port),
        start_new_session=True,
    )
    try:
        kv = worker_store(
            "dist_sync",
            loopback_config("worker", sch.van.port, **FAST, request_timeout=10),
        )
        kv.init("e", np.zeros(0, np.float32))
        kv.push("e", np.zeros(0, np.float32))
        assert kv.pull("e").shape == (0,)
        kv.close()
        assert srv.wait(timeout=15) == 0
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait()
        sch.stop()
        sch.join(5)


def test_surplus_node_gets_the_refusal_not_a_timeout():
    sch = new_scheduler(loopback_config("scheduler", **FAST)).start()
    srv = subprocess.Popen(
        [sys.executable, "-m", "hetps.cli", "server"],
        env=_server_env(sch.van.port),
        start_new_session=True,
    )
    kv = None
    try:
        cfg = loopback_config("worker", sch.van.port, **FAST)
        kv = worker_store("dist_sync", cfg)
        t0 = time.monotonic()
        with pytest.raises(
            ClusterError, match="refused this worker: the cluster is already complete"
        ):
            worker_store("dist_sync", cfg)
        assert time.monotonic() - t0 < 5
    finally:
        if kv is not None:
            kv.close()
        if srv.wait(timeout=15) is None:
            srv.kill()
        sch.stop()
        sch.join(5)


def test_finished_worker_is_never_declared_dead():
    """A heartbeat that leaves after `finish` must not bring a finished worker back."""
    from hetps.transport.codec import Message

    sch = new_scheduler(loopback_config("scheduler", **FAST, num_worker=2)).start()
    srv = subprocess.Popen(
        [sys.executable, "-m", "hetps.cli", "server"],
        env=_server_env(sch.van.port, workers=2),
        start_new_session=True,
    )
    kvs: list = [None, None]
    try:
        wcfg = loopback_config("worker", sch.van.port, **FAST, num_worker=2)

        def make(i: int) -> None:
            kvs[i] = worker_store("dist_sync", wcfg)

        ts = [threading.Thread(target=make, args=(i,)) for i in range(2)]
        [t.start() for t in ts]
        [t.join() for t in ts]
        a, b = sorted(kvs, key=lambda k: k.rank)
        a.node.finish()
        a.node.van.send(1, Message("heartbeat"))  # the late heartbeat
        a.close()
        deadline = time.monotonic() + 3.0  # > PS_HEARTBEAT_TIMEOUT: the scheduler looks again
        while time.monotonic() < deadline:
            b.node.exited.wait(0.2)
        assert b.node.failure is None and not sch.dead
        b.close()
        assert srv.wait(timeout=15) == 0 and sch.join(10) == 0
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait()
        sch.stop()
        sch.join(5)


def test_esync_report_with_a_huge_round_is_refused_at_once():
    svc = EsyncService(2)
    # round 1 runs in lockstep (no step time known yet): one step and the worker is ready
    assert svc.decide(0, 1, 0.1, 0.1, 1.0) == {"ready": True, "round": 1, "steps": 1}
    with pytest.raises(ValueError, match="one at a time"):
        svc.decide(0, 2**40, 0.1, 0.1, 2.0)


def test_standalone_state_server_survives_a_bad_endpoint():
    import zmq

    from hetps.esync.service import StateServer
    from hetps.transport.codec import Message, encode

    srv = StateServer(1, host="127.0.0.1")
    stop = threading.Event()
    t = threading.Thread(target=srv.serve, args=(stop,), daemon=True)
    t.start()
    ctx = zmq.Context()
    rx = ctx.socket(zmq.ROUTER)
    rx.bind("tcp://127.0.0.1:*")
    ep = rx.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit("/", 1)[1]
    tx = ctx.socket(zmq.DEALER)
    tx.connect(f"tcp://127.0.0.1:{srv.port}")
    try:
        bad = Message(
            "esync_report",
            req=1,
            body={"rank": 0, "round": 1, "step_s": 0.1, "elapsed_s": 0.1, "ep": "x"},
        )
        good = Message(
            "esync_report",
            req=2,
            body={"rank": 0, "round": 1, "step_s": 0.1, "elapsed_s": 0.1, "ep": ep},
        )
        for m in (bad, good):
            tx.send_multipart([bytes(f) if not isinstance(f, bytes) else f for f in encode(m)])
        assert rx.poll(5000), "the state server stopped answering after a bad endpoint"
        frames = rx.recv_multipart()
        assert b"ready" in frames[1]
    finally:
        stop.set()
        t.join(5)
        assert not t.is_alive()
        tx.close(0)
        rx.close(0)
        ctx.term()


def test_a_long_service_does_not_make_anyone_look_dead():
    """A scheduler plug-in that takes twice the heartbeat timeout (a big plan, say) runs off
    the scheduler's loop: heartbeats are still answered, nobody is declared dead, and its
    answer still arrives."""
    from hetps.transport.codec import Message

    sch = new_scheduler(loopback_config("scheduler", **FAST))
    started = threading.Event()

    def slow(scheduler: Scheduler, msg: Message) -> None:
        started.set()
        time.sleep(4.0)  # the work itself: 2 x PS_HEARTBEAT_TIMEOUT
        scheduler.reply(msg, {"done": True})

    sch.register("slow_plan", slow)
    sch.start()
    srv = subprocess.Popen(
        [sys.executable, "-m", "hetps.cli", "server"],
        env=_server_env(sch.van.port),
        start_new_session=True,
    )
    kv = None
    try:
        kv = worker_store("dist_sync", loopback_config("worker", sch.van.port, **FAST))
        kv.init("w", np.zeros(4, np.float32))
        fut = kv.node.request(1, Message("slow_plan"))
        assert started.wait(10)
        reply = fut.wait(timeout=15)
        assert reply.body == {"done": True}
        kv.push("w", np.ones(4, np.float32))
        assert (kv.pull("w") == 1).all()
        assert not sch.dead and kv.node.failure is None, (sch.dead, kv.node.failure)
        kv.close()
        assert srv.wait(timeout=15) == 0 and sch.join(10) == 0
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait()
        sch.stop()
        sch.join(5)
