"""A process that holds the job's cluster secret but is no node of it, during ``--recover``.

    HETPS_SECRET=... python readmit_forger.py SCHEDULER_PORT

It asks the restarted scheduler to take it back as worker 0 (node 9), with a node table of
its own making, and prints ``FORGER readmit sent``. When a line comes on its standard input
it sends ``leave`` on the same connection (which, had it been taken for node 9, would end the
job blaming worker 0), prints ``FORGER leave sent`` and exits once ZeroMQ handed its bytes to
the kernel.
"""

from __future__ import annotations

import os
import secrets
import sys

import msgpack
import zmq

from hetps.transport.security import Keys


def frames(cmd: str, body: dict, req: int) -> list[bytes]:
    head = {"v": 1, "c": cmd, "r": req, "p": False, "o": 0, "t": 0.0, "b": body, "a": []}
    return [msgpack.packb(head, use_bin_type=True)]


def main() -> None:
    port = int(sys.argv[1])
    keys = Keys(os.environ["HETPS_SECRET"].encode())
    ctx = zmq.Context()
    back = ctx.socket(zmq.ROUTER)  # where it says it listens: a real port of its own
    keys.server(back)
    back.setsockopt(zmq.LINGER, 0)
    back.bind("tcp://127.0.0.1:*")
    my_port = int(back.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
    s = ctx.socket(zmq.DEALER)
    keys.client(s)
    s.setsockopt(zmq.ROUTING_ID, b"h" + secrets.token_bytes(15))
    s.setsockopt(zmq.LINGER, 2000)
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
        "cred": secrets.token_bytes(32),  # a guess: it was never given one
        "gen": 0,
    }
    s.send_multipart(frames("readmit", body, 1))
    print("FORGER readmit sent", flush=True)
    sys.stdin.readline()
    s.send_multipart(frames("leave", {"reason": "FORGED by a process that is no node"}, 0))
    print("FORGER leave sent", flush=True)
    s.close()
    back.close()
    ctx.term()


if __name__ == "__main__":
    main()
