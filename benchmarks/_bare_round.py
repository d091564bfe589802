#!/usr/bin/env python
"""A role of benchmarks/message_floor.py's bare rounds: no hetps, only the messages.

    python benchmarks/_bare_round.py MODE ROLE INDEX BASE ROUNDS

A round, on each worker: a request to each server, then the servers' answers; a server
answers a round's requests when it has every worker's (a ``dist_sync`` round's shape: one
message each way per server, as hetps sends a table's parked push and its pull in one batch
and gets one answer). The messages have the frames hetps's have for a round of 4 rows (a
request: an empty delimiter, a header of 200 bytes, the push's ids and rows, the pull's ids;
an answer: the delimiter, a header of 120 bytes, the pulled rows).

``MODE``: ``zmq`` (pyzmq over loopback TCP: each process binds a ROUTER it receives on and
sends on a DEALER to each peer's, as hetps's nodes do), ``curve`` (the same with CURVE:
encrypted and authenticated, as hetps's connections are by default; the ROUTERs' keys in
BARE_SERVER_SECRET and BARE_SERVER_PUBLIC, z85), ``handoff`` (``curve``, each worker's answers
read by a receive thread that hands the round to the caller through a lock, as hetps's worker
does) or ``unix`` (AF_UNIX SOCK_SEQPACKET, a message's frames in one packet: one system call
a message each way, no I/O thread; the sockets' abstract names carry BARE_TAG). ``ROLE``:
``server`` or ``worker``; ``INDEX`` its rank (2 of each); ``BASE``: the first of 4 ports (the
servers' ``BASE``, ``BASE + 1``, the workers' ``BASE + 2``, ``BASE + 3``).

Worker 0 prints ``BARE mode cpu_s t1,t2,...``: its process's CPU seconds a round and each of
``ROUNDS`` timed rounds (after 100 warm-up ones). Each server prints ``SERVED mode n``: the
requests it answered.
"""

import os
import select
import socket
import sys
import threading
import time

import zmq

WORKERS = SERVERS = 2
REQUEST = [b"", b"h" * 200, b"i" * 16, b"r" * 128, b"i" * 16]
ANSWER = [b"", b"h" * 120, b"r" * 128]
WARM = 100


def unix_name(s: int) -> str:
    return f"\0hetps-bare-{os.environ.get('BARE_TAG', os.getuid())}-{s}"


def zmq_socket(mode: str, kind: int):
    sock = zmq.Context.instance().socket(kind)
    # a server's last answers leave after its loop ends: closing waits up to 5 s for them
    sock.setsockopt(zmq.LINGER, 5000)
    if mode in ("curve", "handoff"):
        public = os.environ["BARE_SERVER_PUBLIC"].encode()
        if kind == zmq.ROUTER:
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_SECRETKEY, os.environ["BARE_SERVER_SECRET"].encode())
            sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        else:
            cpub, csec = zmq.curve_keypair()
            sock.setsockopt(zmq.CURVE_SERVERKEY, public)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, cpub)
            sock.setsockopt(zmq.CURVE_SECRETKEY, csec)
    return sock


def zmq_peers(mode: str, me: int, base: int, peers: list[int]):
    """As a hetps node: a ROUTER bound at port ``base + me`` that this process receives on,
    and a DEALER to each of ``peers``'s ROUTERs that it sends on (an answer goes back through
    the answerer's DEALER, not the asker's connection)."""
    router = zmq_socket(mode, zmq.ROUTER)
    router.bind(f"tcp://127.0.0.1:{base + me}")
    dealers = []
    for p in peers:
        dealer = zmq_socket(mode, zmq.DEALER)
        dealer.setsockopt(zmq.ROUTING_ID, bytes([1, me]))
        dealer.connect(f"tcp://127.0.0.1:{base + p}")
        dealers.append(dealer)
    return router, dealers


def server(mode: str, s: int, base: int, rounds: int) -> int:
    total = rounds * WORKERS
    served = 0
    if mode != "unix":
        router, dealers = zmq_peers(mode, s, base, [SERVERS + w for w in range(WORKERS)])
        got = []
        for _ in range(total):
            frames = router.recv_multipart()
            if len(frames) != 1 + len(REQUEST):
                raise SystemExit(f"bare server {s}: a request of {len(frames) - 1} frames")
            got.append(frames[0][1] - SERVERS)  # (the worker's rank)
            if len(got) == WORKERS:
                for w in got:
                    dealers[w].send_multipart(ANSWER)
                served += len(got)
                got = []
        # the last answers may still be queued: closing waits for them (LINGER), an exit
        # without it would drop them
        for sock in [router, *dealers]:
            sock.close()
        zmq.Context.instance().term()
        return served
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(unix_name(s))
    listener.listen(WORKERS)
    conns = {}
    for _ in range(WORKERS):
        conn = listener.accept()[0]
        conns[conn.fileno()] = conn
    poll = select.poll()
    for fd in conns:
        poll.register(fd, select.POLLIN)
    got, seen = [], 0
    size = sum(map(len, REQUEST))
    while seen < total:
        for fd, _ in poll.poll():
            n = len(conns[fd].recv(65536))
            if n != size:
                raise SystemExit(f"bare server {s}: a request of {n} bytes after {seen} of {total}")
            got.append(conns[fd])
            seen += 1
            if len(got) == WORKERS:
                for conn in got:
                    conn.sendmsg(ANSWER)
                served += len(got)
                got = []
    return served


def worker(mode: str, w: int, base: int, rounds: int) -> None:
    if mode != "unix":
        router, socks = zmq_peers(mode, SERVERS + w, base, list(range(SERVERS)))

        def send(sock) -> None:
            sock.send_multipart(REQUEST)

        def answers() -> None:  # (each server answers once a round)
            router.recv_multipart()
            router.recv_multipart()

    else:
        socks = []
        for s in range(SERVERS):
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            deadline = time.monotonic() + 30
            while True:  # (the server may not listen yet)
                try:
                    conn.connect(unix_name(s))
                    break
                except (ConnectionRefusedError, FileNotFoundError):
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.01)
            socks.append(conn)

        def send(sock) -> None:
            sock.sendmsg(REQUEST)

        def answers() -> None:
            for conn in socks:
                if not conn.recv(65536):
                    raise SystemExit(f"bare worker {w}: a server went away")

    if mode == "handoff":
        read, ended = answers, threading.Lock()
        ended.acquire()

        def receive() -> None:
            for _ in range(WARM + rounds):
                read()
                ended.release()

        threading.Thread(target=receive, daemon=True).start()
        answers = ended.acquire
    times = []
    for i in range(WARM + rounds):
        if i == WARM:
            cpu0 = time.process_time()
        t0 = time.perf_counter()
        for sock in socks:
            send(sock)
        answers()
        times.append(time.perf_counter() - t0)
    cpu = (time.process_time() - cpu0) / rounds
    if w == 0:
        print(f"BARE {mode} {cpu:.9f} " + ",".join(f"{t:.9f}" for t in times[WARM:]), flush=True)


def main() -> None:
    mode, role, index, base, rounds = sys.argv[1:6]
    if mode not in ("zmq", "curve", "handoff", "unix"):
        raise SystemExit(f"_bare_round: mode {mode!r} is not zmq, curve, handoff or unix")
    if role == "server":  # (it answers the warm-up rounds too)
        served = server(mode, int(index), int(base), int(rounds) + WARM)
        print(f"SERVED {mode} {served}", flush=True)
    else:
        worker(mode, int(index), int(base), int(rounds))


if __name__ == "__main__":
    main()
