"""An outsider: a process with pyzmq and msgpack and no part of the job (it imports no hetps).

    python forger.py TARGETS_JSON

``TARGETS_JSON`` names the scheduler, the servers and the workers (``host:port``), the ids of
the real nodes to impersonate, a file the forged pickles would create if unpickled, and a
``mode``: ``plain`` connects as ZeroMQ does by default; ``curve`` also tries CURVE with keys
of its own (it does not hold the job's secret), once guessing the server's key and once with
the job's public key (as if it had leaked; the secret key stays unknown). It sends every
forgery once to every target, over a new connection per target and way of connecting,
prints ``FORGER sent N`` and exits after ZeroMQ has handed its bytes to the kernel (linger).
Anything it receives back is printed as ``FORGER got ...`` lines (a refusal to its own
registration is all it may ever get, and only in plain mode).
"""

from __future__ import annotations

import json
import pickle
import sys

import msgpack
import zmq


class Payload:
    """Unpickling this runs code: it writes the marker file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('outsider code ran')",))


def frames(cmd: str, sender: int, body: dict | None = None, arrays=(), req: int = 7, reply=False):
    specs = [[str(a[0]), list(a[1])] for a in arrays]
    head = {
        "v": 1,
        "c": cmd,
        "s": sender,  # the claim a header can make: hetps must ignore it
        "r": req,
        "p": reply,
        "o": 0,
        "t": 0.0,
        "b": body or {},
        "a": specs,
    }
    return [msgpack.packb(head, use_bin_type=True), *[a[2] for a in arrays]]


def f32(n: int, value: float):
    import struct

    return ("float32", [n], struct.pack(f"<{n}f", *([value] * n)))


def blob(data: bytes):
    return ("uint8", [len(data)], data)


def forgeries(t: dict) -> dict[str, list[list[bytes]]]:
    w0, w1 = t["workers_ids"][:2]
    evil = pickle.dumps(Payload(t["marker"]))
    key = {"k": "w", "part": 0, "off": 0, "n": 8, "sync": True, "ce": 8, "shape": [8]}
    key["dtype"] = "float32"
    to_server = []
    for who in (w0, w1, 12345, 1):  # a real worker's id, another's, an unknown one, the scheduler
        to_server += [
            frames("push", who, key, [f32(8, 1000.0)]),
            frames("init", who, {**key, "size": 8}, [f32(8, 1000.0)]),
            frames("pull", who, key),
            frames("drop", who, {"slices": [["keep", 0]]}),
            frames("set_optimizer", who, {}, [blob(evil)]),
            frames("set_states", who, {}, [blob(evil)]),
        ]
    to_server += [
        frames("exit", 1),
        frames("worker_done", 1, {"node": [w0, "worker", 0, "127.0.0.1", 1]}),
        frames("node_dead", 1, {"node": [w0, "worker", 0, "127.0.0.1", 1], "error": "FORGED"}),
    ]
    to_scheduler = [
        frames("leave", w0, {"reason": "ATTACKER-TEXT"}),
        frames("leave", 8, {"reason": "ATTACKER-TEXT"}),
        frames("finish", w0),
        frames("barrier", w0, {"group": "worker"}),
        frames("heartbeat", w0),
        frames("esync_report", w0, {"rank": 0, "round": 1, "step_s": 1.0, "elapsed_s": 1.0}),
    ]
    to_worker = [
        frames("exit", 1),
        frames("node_dead", 1, {"node": [8, "server", 0, "127.0.0.1", 1], "error": "FORGED"}),
        frames("receipt", 8, {"req": 3}),
    ] + [frames("barrier_done", 1, req=r, reply=True) for r in range(1, 40)]
    return {"scheduler": to_scheduler, "server": to_server, "worker": to_worker}


def main() -> int:
    t = json.loads(sys.argv[1])
    ctx = zmq.Context()
    socks = []
    sent = 0
    got: list[str] = []
    inbox = ctx.socket(zmq.ROUTER)  # where a refusal of its registration would come
    inbox.setsockopt(zmq.LINGER, 0)
    inbox_port = inbox.bind_to_random_port("tcp://127.0.0.1")
    forged = forgeries(t)
    registration = frames(
        "add_node",
        0,
        {
            "role": "worker",
            "host": "127.0.0.1",
            "port": inbox_port,
            "back": b"hforger",
            "want_rank": 0,
        },
        req=1,
    )
    forged["scheduler"].append(registration)
    targets = [("scheduler", t["scheduler"])]
    targets += [("server", ep) for ep in t["servers"]]
    targets += [("worker", ep) for ep in t["workers"]]
    modes = ["plain"]
    if t.get("mode") == "curve":
        modes += ["curve-guess", "curve-public"]
    for mode in modes:
        for kind, ep in targets:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 3000 if mode == "plain" and len(modes) == 1 else 500)
            s.setsockopt(zmq.SNDHWM, 0)
            if mode.startswith("curve"):  # keys of its own: it cannot know the job's
                pub, sec = zmq.curve_keypair()
                srv = t["public_key"].encode() if mode == "curve-public" else zmq.curve_keypair()[0]
                s.curve_publickey, s.curve_secretkey, s.curve_serverkey = pub, sec, srv
            s.connect(f"tcp://{ep}")
            for f in forged[kind]:
                s.send_multipart(f)
                sent += 1
            socks.append(s)
    for s in socks:
        s.close()  # linger: the bytes leave (or the handshake fails) before the context ends
    if t.get("expect_refusal"):  # plain mode: its registration is refused, nothing more
        if inbox.poll(10000):
            msg = inbox.recv_multipart()
            head = msgpack.unpackb(msg[1], raw=False)
            got.append(f"{head.get('c')} {json.dumps(head.get('b'), default=str)}")
    inbox.close()
    ctx.term()
    for line in got:
        print(f"FORGER got {line}", flush=True)
    print(f"FORGER sent {sent}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
