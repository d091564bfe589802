"""Bounds before allocation, on a real server process over real sockets.

A frame announcing 512 MiB is refused by ZeroMQ at the socket (``ZMQ_MAXMSGSIZE`` is the
codec's :data:`~hetps.transport.codec.FRAME_MAX` plus CURVE's box), before anything is
allocated: the server's peak memory does not move while the sender streams 64 MiB after the
announcement. Within the frame bound, a payload larger than its key's part is refused and
logged before it is kept, and the server goes on serving.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from hetps.cluster.errors import RequestError
from hetps.roles import new_scheduler
from hetps.transport.codec import FRAME_MAX, Message
from roles import loopback_config, role_env, worker_store

from .zmtp import Peer, frame_header


def _hwm_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmHWM for {pid}")


def test_a_frame_above_the_bound_costs_the_server_no_memory(tmp_path):
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
        kv.init("w", np.zeros(8, np.float32))
        info = kv.node.servers()[0]
        before = _hwm_kb(srv.pid)
        peer = Peer(info.host, info.port)
        try:
            peer.handshake()
            peer.send_raw(frame_header(512 << 20))  # announces 512 MiB...
            chunk = bytes(1 << 20)
            streamed = 0
            try:
                for _ in range(64):  # ...and streams 64 MiB of it
                    peer.send_raw(chunk)
                    streamed += len(chunk)
            except (BrokenPipeError, ConnectionResetError):
                pass
            assert peer.closed_by_peer(), "the server kept reading a frame above the bound"
        finally:
            peer.close()
        grown_mb = (_hwm_kb(srv.pid) - before) / 1024
        assert grown_mb < 8, f"the server's peak memory rose by {grown_mb:.0f} MB"
        assert streamed < 64 << 20, "the whole 64 MiB went in"
        # within the frame bound: a push bigger than its key's part is refused and logged
        sid = kv.server_ids[0]
        body = {"k": "w", "part": 0, "off": 0, "n": 8, "sync": True}
        fut = kv.node.request(sid, Message("push", body=body, arrays=[np.ones(16, np.float32)]))
        with pytest.raises(RequestError, match="got 16 values"):
            fut.wait(10)
        # and the server goes on serving
        kv.push("w", np.ones(8, np.float32))
        assert (kv.pull("w") == 1).all()
        kv.close()
        kv = None
        assert srv.wait(timeout=20) == 0
        log.seek(0)
        text = log.read()
        assert text.count("refused push from node") == 1, text
    finally:
        if kv is not None:
            kv.close()
        if srv.poll() is None:
            srv.kill()
            srv.wait()
        sch.stop()
        sch.join(5)
        log.close()


def test_the_socket_bound_is_the_codecs_frame_bound():
    """What the test above relies on: no frame exceeds FRAME_MAX on the wire, so the socket
    may refuse anything bigger (the codec splits a bigger array, and joins it again)."""
    from hetps.transport.codec import decode, encode

    big = np.arange((FRAME_MAX // 4) * 2 + 5, dtype=np.float32)  # 2 full frames and a bit
    frames = encode(Message("set_states", arrays=[big, np.ones(3, np.float32)]))
    sizes = [len(memoryview(f)) if not isinstance(f, bytes) else len(f) for f in frames[1:]]
    assert sizes == [FRAME_MAX, FRAME_MAX, 20, 12]
    out = decode(frames, 1 << 30)
    np.testing.assert_array_equal(out.arrays[0], big)
    np.testing.assert_array_equal(out.arrays[1], np.ones(3, np.float32))
