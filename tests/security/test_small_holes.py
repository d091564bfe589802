"""Small holes a user or an insider could fall into: a secret file that is a FIFO, an empty
secret given to ``hetps.kv.create``, a forger filling the scheduler's log, and registrations
that would have the scheduler connect to any host:port they name."""

from __future__ import annotations

import logging
import os
import selectors
import socket
import subprocess
import sys
import threading
import time

import msgpack
import zmq

from hetps.roles import new_scheduler
from hetps.transport import handshakes
from roles import loopback_config, role_env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _frames(cmd: str, body: dict, req: int = 1) -> list[bytes]:
    head = {"v": 1, "c": cmd, "r": req, "p": False, "o": 0, "t": 0.0, "b": body, "a": []}
    return [msgpack.packb(head, use_bin_type=True)]


def test_a_fifo_as_the_secret_file_is_refused_at_once_not_waited_on(tmp_path):
    fifo = tmp_path / "job.secret"
    os.mkfifo(fifo, 0o600)
    env = role_env("scheduler", workers=1, clean=True, HETPS_SECRET_FILE=str(fifo))
    # (opened for reading, a FIFO waits for a writer: nobody writes, so a hang is a timeout)
    res = subprocess.run(
        [sys.executable, "-m", "hetps.cli", "scheduler"],
        env=env,
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"HETPS_SECRET_FILE={fifo} is a FIFO (named pipe), not a regular file" in res.stderr
    assert "hetps secret FILE" in res.stderr and "Traceback" not in res.stderr


def test_kv_create_with_an_empty_secret_says_so_without_a_traceback():
    code = "import hetps.kv; hetps.kv.create('dist_sync'); print('NOT REFUSED')"
    for role in ("worker", "server", "scheduler"):
        env = role_env(role, port=_free_port(), workers=1, clean=True, HETPS_SECRET="")
        res = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
        )
        text = res.stdout + res.stderr
        assert res.returncode == 1, (role, text)
        assert res.stderr.startswith(
            "hetps.kv.create('dist_sync'): HETPS_SECRET is set but holds no secret"
        ), (role, text)
        assert "Traceback" not in text and "NOT REFUSED" not in text, (role, text)


def _scheduler(port: int):
    sched = new_scheduler(loopback_config("scheduler", port=port, num_worker=2))
    runner = threading.Thread(target=sched.run, daemon=True)
    runner.start()
    return sched, runner


def test_a_forger_flooding_the_scheduler_gets_a_few_lines_and_a_count(monkeypatch, caplog):
    monkeypatch.setattr(handshakes, "LOG_WINDOW_S", 1.0)
    caplog.set_level(logging.WARNING)
    port = _free_port()
    sched, runner = _scheduler(port)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port}")
        for i in range(60):  # a stranger may send none of these
            sock.send_multipart(_frames("barrier", {"group": "all"}, req=i + 1))
        deadline = time.monotonic() + 30
        while sched.refused_msgs.total < 60 or "refused 55 more messages" not in caplog.text:
            assert runner.is_alive() and time.monotonic() < deadline, caplog.text
            time.sleep(0.02)  # polls the scheduler's count and log
    finally:
        sock.close(0)
        sched.stop()
        runner.join(10)
        ctx.term()
    lines = caplog.text.count("scheduler: refused barrier from a connection of no node")
    assert lines == handshakes.LOG_BURST, caplog.text
    assert "scheduler refused 55 more messages in the last" in caplog.text


def test_registrations_cannot_make_the_scheduler_connect_anywhere_at_will(caplog):
    """30 registrations, each refused (a rank the job does not have) and naming a port of
    its own, then 5 more naming one port: the scheduler connects back (to say why) within
    its refusal budget, once to a host:port, and drops the rest with a count."""
    caplog.set_level(logging.WARNING)
    listeners = []
    sel = selectors.DefaultSelector()
    for _ in range(31):
        lst = socket.socket()
        lst.bind(("127.0.0.1", 0))
        lst.listen(16)
        lst.setblocking(False)
        sel.register(lst, selectors.EVENT_READ)
        listeners.append(lst)
    port = _free_port()
    sched, runner = _scheduler(port)
    ctx = zmq.Context()
    socks: list[zmq.Socket] = []
    accepted: list[socket.socket] = []
    try:
        start = time.monotonic()
        repeated = listeners[30].getsockname()[1]
        targets = 5 * [repeated] + [lst.getsockname()[1] for lst in listeners[:30]]
        deadline = time.monotonic() + 30
        reg = sched.registration

        def handled(n: int) -> None:
            """Until the first ``n`` registrations are answered (one connection back
            each, accepted here) or dropped."""
            while sched.refused_msgs.total + len(reg.answered) < n or len(accepted) < len(
                reg.answered
            ):
                assert runner.is_alive() and time.monotonic() < deadline, caplog.text
                for key, _ in sel.select(timeout=0.05):
                    conn, _addr = key.fileobj.accept()
                    accepted.append(conn)

        for i, target in enumerate(targets):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"tcp://127.0.0.1:{port}")
            socks.append(s)
            body = {
                "role": "worker",
                "host": "127.0.0.1",
                "port": target,
                "back": b"h" + os.urandom(15),
                "want_rank": 7,  # not below 2: refused
            }
            s.send_multipart(_frames("add_node", body))
            if i == 4:  # the five to one port first, within the burst (35 sockets race)
                handled(5)
        handled(len(targets))
        elapsed = time.monotonic() - start
        ports = [c.getsockname()[1] for c in accepted]
    finally:
        for s in socks:
            s.close(0)
        sched.stop()
        runner.join(10)
        ctx.term()
        for conn in accepted:
            conn.close()
        for lst in listeners:
            sel.unregister(lst)
            lst.close()
        sel.close()
    # a burst of 8, then 2 a second (the first second's 32 before the bound)
    assert len(accepted) <= 8 + 2 * elapsed + 1, (len(accepted), elapsed)
    assert ports.count(repeated) == 1, ports
    assert sched.refused_msgs.total >= len(targets) - len(accepted), caplog.text
    assert "unanswered (too many refusals)" in caplog.text
