"""An insider during ``--recover``: a node of the job, with its own valid credential, is the
first back to the restarted scheduler and describes the job with a node table of its making
(an extra node; a server it says is dead, a worker it says finished). The scheduler takes the
job back from the table the scheduler that died kept beside its key: the insider is refused,
the honest nodes are taken back with their host groups, the refused worker started again joins
with a node table as whole as the first one (host groups, the live metrics' job), and the job
goes on to its end. A server admitted again after a failover gets such a table too."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import msgpack
import msgspec
import zmq

from hetps.cluster.commands import NodeTable
from hetps.cluster.credentials import table_path
from hetps.cluster.enrol import pack_groups, unpack_groups, workers_of
from hetps.roles import make_scheduler
from roles import loopback_config, role_env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _frames(cmd: str, body: dict, req: int = 1) -> list[bytes]:
    head = {"v": 1, "c": cmd, "r": req, "p": False, "o": 0, "t": 0.0, "b": body, "a": []}
    return [msgpack.packb(head, use_bin_type=True)]


class RawNode:
    """A node speaking the protocol over its own sockets: an inbox the scheduler connects
    to, and a connection to the scheduler (a new one for each scheduler)."""

    def __init__(self, ctx: zmq.Context, role: str, rank: int) -> None:
        self.ctx, self.role, self.rank = ctx, role, rank
        self.inbox = ctx.socket(zmq.ROUTER)
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.port = self.inbox.bind_to_random_port("tcp://127.0.0.1")
        self.out: zmq.Socket | None = None
        self.table: dict = {}

    def connect(self, sched_port: int) -> None:
        if self.out is not None:
            self.out.close(0)
        self.out = self.ctx.socket(zmq.DEALER)
        self.out.setsockopt(zmq.LINGER, 0)
        self.out.connect(f"tcp://127.0.0.1:{sched_port}")

    def send(self, cmd: str, body: dict, req: int = 1) -> None:
        assert self.out is not None
        self.out.send_multipart(_frames(cmd, body, req))

    def answer(self, cmd: str, timeout: float = 20) -> dict:
        """The body of the next message ``cmd`` the scheduler sends this node."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0 and self.inbox.poll(int(left * 1000)), f"no {cmd} for {self.role}"
            head = msgpack.unpackb(self.inbox.recv_multipart()[1], raw=False)
            if head["c"] == cmd:
                body = head["b"]
                if isinstance(body.get("nodes"), bytes):  # the table, encoded once for all
                    body["nodes"] = msgpack.unpackb(body["nodes"], raw=False)
                if body.get("ports"):  # a server's first table: the workers as it makes them
                    made = workers_of(msgspec.convert(body, NodeTable))
                    body["nodes"] += [n.to_wire() for n in made]
                    body["groups"] = pack_groups([(n.id, n.group) for n in made])
                elif body.get("n_workers"):  # a worker's: the workers' host groups as runs
                    made = workers_of(msgspec.convert(body, NodeTable))
                    body["groups"] = pack_groups([(n.id, n.group) for n in made])
                return body

    def readmit(self, view: dict) -> None:
        body = {
            "id": self.table["id"],
            "role": self.role,
            "rank": self.rank,
            "host": "127.0.0.1",
            "port": self.port,
            "back": b"h" + os.urandom(15),
            "view": view,
            "cred": self.table["cred"],
            "gen": self.table["gen"],
        }
        self.send("readmit", body, req=3)

    def close(self) -> None:
        if self.out is not None:
            self.out.close(0)
        self.inbox.close(0)


def test_an_insiders_table_is_refused_and_the_honest_nodes_are_taken_back(
    tmp_path, monkeypatch, caplog
):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))  # the key and table live here
    port = _free_port()
    env = role_env("scheduler", port=port, workers=2, clean=True, XDG_RUNTIME_DIR=tmp_path)
    first = subprocess.Popen(
        [sys.executable, "-m", "hetps.cli", "scheduler"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    ctx = zmq.Context()
    nodes = [RawNode(ctx, "server", 0), RawNode(ctx, "worker", 0), RawNode(ctx, "worker", 1)]
    server, honest, insider = nodes
    sched = runner = None
    try:
        # the job starts: every node registers and gets its table and credential
        # (the workers on hosts 3 and 5: HETPS_HOST_GROUP)
        hosts = {"server": {0: -1}, "worker": {0: 3, 1: 5}}
        for n in nodes:
            n.connect(port)
            body = {"role": n.role, "host": "127.0.0.1", "port": n.port}
            body["host_group"] = hosts[n.role][n.rank]
            n.send("add_node", {**body, "back": b"h" + os.urandom(15), "want_rank": n.rank})
        for n in nodes:
            n.table = n.answer("nodes")
        job = sorted(n.table["id"] for n in nodes)
        assert job == [8, 9, 11]
        assert unpack_groups(server.table["groups"]) == [(9, 3), (11, 5)]
        deadline = time.monotonic() + 20
        while not table_path(port).exists():
            assert time.monotonic() < deadline and first.poll() is None
            time.sleep(0.02)  # polls the file the scheduler writes
        os.killpg(first.pid, signal.SIGKILL)  # the scheduler dies mid-job
        first.wait(10)

        caplog.set_level(logging.WARNING)
        cfg = loopback_config(
            "scheduler", port=port, num_worker=2, heartbeat_timeout=3, elastic=1, metrics_port=0
        )
        sched = make_scheduler(cfg, recover=True)  # (with live metrics: HETPS_METRICS_PORT)
        result: dict = {}
        runner = threading.Thread(target=lambda: result.setdefault("code", sched.run()))
        runner.start()
        true_view = {"nodes": server.table["nodes"], "down": [], "redirect": [], "done": []}
        # the insider first: one node more, the server dead, the honest worker finished
        forged = server.table["nodes"] + [[13, "worker", 2, "127.0.0.1", insider.port]]
        insider.connect(port)
        insider.readmit({"nodes": forged, "down": [8], "redirect": [], "done": [9]})
        while "its node table is not the job's" not in caplog.text:
            assert time.monotonic() < deadline + 20 and runner.is_alive(), caplog.text
            time.sleep(0.02)  # polls the scheduler's log
        assert "it lists node(s) [13] the job does not have" in caplog.text
        for n in (server, honest):
            n.connect(port)
            n.readmit(true_view)
        # the job is taken back (once the insider's wait ran out) and goes on
        for n in (server, honest):
            assert n.answer("readmit") == {"restarted": True}
        assert 11 not in sched.takeover.back and set(sched.takeover.back) == {8, 9}
        while 11 not in sched.dead:  # (declared so just after the answers left)
            assert time.monotonic() < deadline + 40 and runner.is_alive(), caplog.text
            time.sleep(0.02)  # polls the scheduler's state
        assert sorted(sched.nodes) == job and 8 not in sched.dead and 9 not in sched.dead
        assert 11 in sched.dead and "did not come back" in sched.dead[11]
        assert not sched.finished
        # every node keeps its host group (the table the scheduler that died kept has them)
        assert {i: n.group for i, n in sched.nodes.items()} == {8: -1, 9: 3, 11: 5}
        # the worker let go starts again and joins: its node table is as whole as the first
        again = RawNode(ctx, "worker", 1)
        nodes.append(again)
        again.connect(port)
        body = {"role": "worker", "host": "127.0.0.1", "port": again.port, "host_group": 5}
        again.send("add_node", {**body, "back": b"h" + os.urandom(15), "want_rank": 1})
        table = again.answer("nodes")
        assert table["id"] == 11 and table["recovery"] == 1
        assert unpack_groups(table["groups"]) == [(9, 3), (11, 5)]
        assert table["metrics_job"] == sched.metrics.job and table["metrics_s"] > 0
        honest.send("finish", {}, req=4)
        assert honest.answer("exit") == {}
        assert server.answer("exit") == {}
        runner.join(20)
        assert not runner.is_alive() and result.get("code") == 0, caplog.text
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait(10)
        if sched is not None and runner is not None:
            sched.stop()
            runner.join(10)
        if sched is not None and sched.metrics is not None:
            sched.metrics.close()
        for n in nodes:
            n.close()
        ctx.term()
    assert not table_path(port).exists()  # the job ended: its table went with it


def test_a_server_admitted_again_gets_the_host_groups_and_the_metrics_job():
    """A server that left and was taken over (HETPS_REPLICAS) registers again: its node table
    carries the workers' host groups and the live metrics' job, as the first one did."""
    cfg = loopback_config(
        "scheduler", num_server=2, num_worker=2, replicas=2, heartbeat_timeout=60, metrics_port=0
    )
    sched = make_scheduler(cfg)
    port = sched.van.port
    runner = threading.Thread(target=sched.run)
    runner.start()
    ctx = zmq.Context()
    nodes = [RawNode(ctx, "server", r) for r in (0, 1)] + [
        RawNode(ctx, "worker", r) for r in (0, 1)
    ]
    hosts = {"server": {0: -1, 1: -1}, "worker": {0: 3, 1: 5}}
    try:
        for n in nodes:
            n.connect(port)
            body = {"role": n.role, "host": "127.0.0.1", "port": n.port, "want_rank": n.rank}
            body["host_group"] = hosts[n.role][n.rank]
            n.send("add_node", {**body, "back": b"h" + os.urandom(15)})
        for n in nodes:
            n.table = n.answer("nodes")
        assert unpack_groups(nodes[0].table["groups"]) == [(9, 3), (11, 5)]
        nodes[1].send("leave", {"reason": "a test stops it"}, req=0)  # server 1 (node 10)
        assert nodes[3].answer("failover")["to"] == 8
        again = RawNode(ctx, "server", 1)
        nodes.append(again)
        again.connect(port)
        body = {"role": "server", "host": "127.0.0.1", "port": again.port, "want_rank": 1}
        again.send("add_node", {**body, "back": b"h" + os.urandom(15), "host_group": -1})
        table = again.answer("nodes")
        assert table["id"] == 10 and table["recovery"] == 1
        assert unpack_groups(table["groups"]) == [(9, 3), (11, 5)]
        assert table["metrics_job"] == sched.metrics.job and table["metrics_s"] > 0
    finally:
        sched.stop()
        runner.join(10)
        sched.metrics.close()
        for n in nodes:
            n.close()
        ctx.term()
