"""Tiny TCP throughput meter for the netem tests (stdlib only; also a script).

Run inside namespaces with ``ip netns exec``::

    python netem_tcpbench.py recv BIND_IP NBYTES   # prints the port, then a JSON result
    python netem_tcpbench.py send HOST PORT NBYTES

The receiver times the transfer itself: from the moment it has received ``skip`` of the bytes
(default 10%, so TCP slow start and the token bucket's initial burst do not count) to the last
byte. :func:`measure_mbit` drives both ends through a :class:`hetps.netem.Netem`.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from typing import Any

SKIP = 0.10
CHUNK = 1 << 16
TIMEOUT_S = 30.0


def receive(bind_ip: str, nbytes: int, skip: float = SKIP) -> dict[str, float]:
    """Accept one connection on ``bind_ip`` (ephemeral port, printed) and time ``nbytes``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as srv:
        srv.bind((bind_ip, 0))
        srv.listen(1)
        srv.settimeout(TIMEOUT_S)
        print(srv.getsockname()[1], flush=True)
        conn, _ = srv.accept()
        conn.settimeout(TIMEOUT_S)
        buf = bytearray(CHUNK)
        got = 0
        t_first = t_mark = None
        got_mark = 0
        with conn:
            while got < nbytes:
                n = conn.recv_into(buf)
                if n == 0:
                    break
                now = time.monotonic()
                if t_first is None:
                    t_first = now
                got += n
                if t_mark is None and got >= nbytes * skip:
                    t_mark, got_mark = now, got
            t_end = time.monotonic()
    assert t_first is not None and t_mark is not None
    return {
        "bytes": got,
        "seconds": t_end - t_first,
        "mbit": (got - got_mark) * 8 / max(t_end - t_mark, 1e-9) / 1e6,
        "mbit_all": got * 8 / max(t_end - t_first, 1e-9) / 1e6,
    }


def send(host: str, port: int, nbytes: int) -> None:
    """Connect and send ``nbytes`` bytes."""
    chunk = b"\0" * CHUNK
    with socket.create_connection((host, port), timeout=TIMEOUT_S) as s:
        left = nbytes
        while left > 0:
            k = min(left, CHUNK)
            s.sendall(chunk[:k])
            left -= k


def measure(net: Any, src: int, dst: int, nbytes: int) -> dict[str, float]:
    """Throughput from node ``src`` to node ``dst`` of a started ``Netem`` (receiver-timed)."""
    rx = net.popen(
        dst,
        [sys.executable, __file__, "recv", net.node_ip(dst), str(nbytes)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert rx.stdout is not None
        port = int(rx.stdout.readline())
        net.run(
            src,
            [sys.executable, __file__, "send", net.node_ip(dst), str(port), str(nbytes)],
            check=True,
            timeout=TIMEOUT_S,
        )
        out, _ = rx.communicate(timeout=TIMEOUT_S)
    finally:
        if rx.poll() is None:
            rx.kill()
            rx.wait()
    assert rx.returncode == 0, f"receiver failed with {rx.returncode}"
    return json.loads(out.strip().splitlines()[-1])


def measure_mbit(net: Any, src: int, dst: int, nbytes: int) -> float:
    """Steady-state TCP goodput (Mbit/s) from ``src`` to ``dst``."""
    return measure(net, src, dst, nbytes)["mbit"]


def main(argv: list[str]) -> int:
    """Script entry: ``recv BIND NBYTES`` or ``send HOST PORT NBYTES``."""
    if argv[:1] == ["recv"] and len(argv) == 3:
        print(json.dumps(receive(argv[1], int(argv[2]))), flush=True)
        return 0
    if argv[:1] == ["send"] and len(argv) == 4:
        send(argv[1], int(argv[2]), int(argv[3]))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
