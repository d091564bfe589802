"""Identity during ``--recover``: a process that holds the cluster secret but is no node of
the job asks the restarted scheduler to take it back as worker 0 (node 9), with a node table
of its own making, and later sends ``leave`` as that node. It is refused (it cannot present
worker 0's credential), its ``leave`` is refused as a stranger's, and the job ends as an
undisturbed run."""

from __future__ import annotations

import importlib.util
import io
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from hetps.launch.contract import LaunchSpec
from hetps.launch.local import Launcher

TESTS = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# tests/conftest.py by its path: the module named "conftest" may be another directory's
# (tests/netem has one) when the whole suite is collected
_root = _load("_hetps_tests_conftest", TESTS / "conftest.py")
PRELUDE = _root.PRELUDE
# the job of the scheduler restart test (tests/integration is no package), which imports
# "conftest" itself
_saved = sys.modules.get("conftest")
sys.modules["conftest"] = _root
try:
    _restart = _load("_sched_restart", TESTS / "integration" / "test_scheduler_restart.py")
finally:
    if _saved is not None:
        sys.modules["conftest"] = _saved
ENV, SCRIPT, _finals = _restart.ENV, _restart.SCRIPT, _restart._finals

FORGER = Path(__file__).with_name("readmit_forger.py")
SECRET = "f" * 64


def _wait_for(out: io.StringIO, text: str, runner: threading.Thread, timeout: float = 30):
    deadline = time.monotonic() + timeout
    while not re.search(text, out.getvalue()):
        assert runner.is_alive(), out.getvalue()
        assert time.monotonic() < deadline, f"no {text!r} in {timeout} s:\n{out.getvalue()}"
        time.sleep(0.02)  # polls the launcher's output


def _launcher(tmp_path: Path, kill: bool) -> tuple[Launcher, io.StringIO, Path]:
    flags = tmp_path / ("killed" if kill else "ref")
    flags.mkdir()
    script = tmp_path / "script.py"
    script.write_text(PRELUDE + textwrap.dedent(SCRIPT))
    out = io.StringIO()
    # (a generous timeout: every node is silent from the kill until the job is taken back)
    env = {**ENV, "PS_HEARTBEAT_TIMEOUT": "60", "HETPS_SECRET": SECRET}
    spec = LaunchSpec(
        num_workers=2,
        num_servers=1,
        command=[sys.executable, str(script)],
        env={
            **env,
            "FLAGS": str(flags),
            "KILL": "1" if kill else "0",
            "HOLD": "1" if kill else "0",
        },
        max_restarts=1 if kill else 0,
        failure_grace=5.0,
    )
    return Launcher(spec, out=out), out, flags


def test_a_forged_readmit_during_recover_is_refused_and_the_job_goes_on(tmp_path):
    ref, ref_out, _ = _launcher(tmp_path, kill=False)
    try:
        assert ref.run() == 0, ref_out.getvalue()
    finally:
        ref.stop_all(kill=True)
    undisturbed = _finals(ref_out.getvalue())

    launcher, out, flags = _launcher(tmp_path, kill=True)
    result: dict = {}
    runner = threading.Thread(target=lambda: result.setdefault("code", launcher.run()))
    runner.start()
    forger = None
    stopped = None
    try:
        deadline = time.monotonic() + 90
        while not ((flags / "at-0").exists() and (flags / "at-1").exists()):
            assert runner.is_alive(), out.getvalue()
            assert time.monotonic() < deadline, out.getvalue()
            time.sleep(0.02)  # polls files the job writes
        # worker 1 cannot come back until the forger had its try: the restarted scheduler
        # is still taking the job back when the forger asks
        stopped = next(c for c in launcher.children if c.role == "worker" and c.rank == 1)
        stopped.proc.send_signal(signal.SIGSTOP)
        sched = launcher._scheduler
        assert sched is not None
        sched.proc.send_signal(signal.SIGKILL)
        sched.proc.wait(10)
        (flags / "killed").touch()
        _wait_for(out, "starting it again at port", runner)
        forger = subprocess.Popen(
            [sys.executable, str(FORGER), str(launcher._port_value)],
            env={**os.environ, "HETPS_SECRET": SECRET},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert forger.stdout is not None and forger.stdin is not None
        assert forger.stdout.readline().strip() == "FORGER readmit sent"
        _wait_for(
            out,
            r"refused a readmit as node 9 \(worker rank 0\) from 127\.0\.0\.1:\d+: its "
            "credential is not the one this node id was given",
            runner,
        )
        stopped.proc.send_signal(signal.SIGCONT)
        stopped = None
        _wait_for(out, r"started again, it took back 3 nodes", runner)
        # (the job holds at its end until the forger's leave was refused)
        forger.stdin.write("leave\n")
        forger.stdin.flush()
        assert forger.stdout.readline().strip() == "FORGER leave sent"
        assert forger.wait(30) == 0
        _wait_for(out, "refused leave from a connection of no node", runner)
        (flags / "release").touch()
        runner.join(120)
        assert not runner.is_alive(), "the job hung: " + out.getvalue()
    finally:
        if stopped is not None:
            stopped.proc.send_signal(signal.SIGCONT)
        if forger is not None and forger.poll() is None:
            forger.kill()
            forger.wait()
        launcher.stop_all(kill=True)
        runner.join(30)
    text = out.getvalue()
    assert result.get("code") == 0, text
    assert "FORGED" not in text.replace("refused leave", ""), text
    assert _finals(text) == undisturbed, text


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _readmit(ctx, port: int, cred: dict) -> tuple:
    """A connection that asks to be taken back as worker 0 (node 9) with ``cred``."""
    import secrets

    import msgpack
    import zmq

    back = ctx.socket(zmq.ROUTER)
    back.setsockopt(zmq.LINGER, 0)
    back.bind("tcp://127.0.0.1:*")
    my_port = int(back.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"tcp://127.0.0.1:{port}")
    table = [
        [8, "server", 0, "127.0.0.1", 1],
        [9, "worker", 0, "127.0.0.1", my_port],
        [11, "worker", 1, "127.0.0.1", 1],
    ]
    body = {
        "id": 9,
        "role": "worker",
        "rank": 0,
        "host": "127.0.0.1",
        "port": my_port,
        "back": b"h" + secrets.token_bytes(15),
        "view": {"nodes": table, "down": [], "redirect": [], "done": [], "barriers": {}},
        **cred,
    }
    head = {"v": 1, "c": "readmit", "r": 5, "p": False, "b": body, "a": []}
    s.send_multipart([msgpack.packb(head, use_bin_type=True)])
    return s, back


def test_a_second_connection_for_a_node_that_is_back_is_refused(tmp_path, monkeypatch, caplog):
    """Even with node 9's own credential (a stale copy of the process, say), a second
    connection cannot be taken back as node 9 while the first is: it is refused and logged,
    and node 9 stays the first connection's."""
    import logging

    import zmq

    from hetps.cluster.credentials import Credentials
    from hetps.roles import new_scheduler
    from hetps.transport import handshakes
    from roles import loopback_config

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setattr(handshakes, "LOG_WINDOW_S", 3600.0)  # one window for the whole test
    port = _free_port()
    before = Credentials(port)  # the scheduler that died: it gave node 9 its credential
    cred = before.issue(9)
    before.keep_table(  # and kept the job's node table beside its key
        {
            "nodes": [
                [8, "server", 0, "127.0.0.1", 1],
                [9, "worker", 0, "127.0.0.1", 1],
                [11, "worker", 1, "127.0.0.1", 1],
            ],
            "down": [],
            "redirect": [],
            "done": [],
        }
    )
    assert before.path.stat().st_mode & 0o777 == 0o600 and str(tmp_path) in str(before.path)
    caplog.set_level(logging.WARNING, logger="hetps.scheduler")
    sched = new_scheduler(
        loopback_config("scheduler", port=port, num_worker=2, heartbeat_timeout=30),
        recover=True,
    )
    runner = threading.Thread(target=sched.run, daemon=True)
    runner.start()
    ctx = zmq.Context()
    socks = []
    try:
        socks += _readmit(ctx, port, {"cred": b"x" * 32, "gen": 0})  # a guess
        deadline = time.monotonic() + 20
        while "credential is not the one" not in caplog.text:
            assert time.monotonic() < deadline, caplog.text
            time.sleep(0.02)  # polls the scheduler's log
        socks += _readmit(ctx, port, cred)
        while 9 not in sched.takeover.back:
            assert time.monotonic() < deadline, caplog.text
            time.sleep(0.02)  # polls the scheduler's state
        socks += _readmit(ctx, port, cred)
        while "that node is back already, on another connection" not in caplog.text:
            assert time.monotonic() < deadline, caplog.text
            time.sleep(0.02)  # polls the scheduler's log
        assert list(sched.takeover.view["nodes"]) == [8, 9, 11]
        for _ in range(20):  # guesses in a loop: each counted, a few logged
            socks += _readmit(ctx, port, {"cred": os.urandom(32), "gen": 0})
        while sched.creds.refusals.total < 22:
            assert time.monotonic() < deadline + 20, caplog.text
            time.sleep(0.02)  # polls the scheduler's count
        lines = caplog.text.count("refused a readmit")
        assert lines == handshakes.LOG_BURST, caplog.text
    finally:
        sched.stop()
        runner.join(10)
        for s in socks:
            s.close(linger=0)
        ctx.term()
    assert not before.path.exists()  # the job ended: its key went with it
    assert not before.table.exists()  # and its node table
