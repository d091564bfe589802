#!/usr/bin/env python
"""A role of benchmarks/message_floor.py's bare rounds: no hetps, only the messages.

    python benchmarks/_bare_round.py MODE ROLE INDEX BASE ROUNDS

``MODE``: ``zmq`` (pyzmq ROUTER servers and DEALER workers over loopback TCP, as hetps's
connections are), ``curve`` (the same with CURVE: encrypted and authenticated, as hetps's are
by default; keys in BARE_SERVER_SECRET and BARE_SERVER_PUBLIC, z85) or ``unix`` (AF_UNIX
SOCK_SEQPACKET: one system call a message each way, no I/O thread). ``ROLE``: ``server`` or
``worker``; ``INDEX`` its rank (2 of each); ``BASE``: the first server's port (the second
``BASE + 1``; ``unix``: the abstract socket names' tag). A round, on each worker: a message
of 120 bytes to each server, then the servers' answers; a server answers a round's messages
when it has every worker's (a ``dist_sync`` round's shape, one message each way per server as
hetps sends a table's push and pull). Worker 0 prints ``BARE mode median_s cpu_s`` (its
median round of ``ROUNDS`` after 100 warm-up ones, and its process's CPU seconds a round).
"""

import os
import select
import socket
import statistics
import sys
import time

WORKERS = SERVERS = 2
PAYLOAD = b"x" * 120
WARM = 100


def unix_name(base: int, s: int) -> str:
    return f"\0hetps-bare-{os.getuid()}-{base}-{s}"


def zmq_socket(mode: str, kind: int):
    import zmq

    sock = zmq.Context.instance().socket(kind)
    # a server's last answers leave after its loop ends: they have 5 s to go before it exits
    sock.setsockopt(zmq.LINGER, 5000 if kind == zmq.ROUTER else 0)
    if mode == "curve":
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


def server(mode: str, s: int, base: int, rounds: int) -> None:
    total = rounds * WORKERS
    if mode in ("zmq", "curve"):
        import zmq

        router = zmq_socket(mode, zmq.ROUTER)
        router.bind(f"tcp://127.0.0.1:{base + s}")
        got = []
        for _ in range(total):
            got.append(router.recv_multipart()[0])
            if len(got) == WORKERS:
                for who in got:
                    router.send_multipart([who, PAYLOAD])
                got = []
        return
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(unix_name(base, s))
    listener.listen(WORKERS)
    conns = {}
    for _ in range(WORKERS):
        conn = listener.accept()[0]
        conns[conn.fileno()] = conn
    poll = select.poll()
    for fd in conns:
        poll.register(fd, select.POLLIN)
    got, seen = [], 0
    while seen < total:
        for fd, _ in poll.poll():
            if not conns[fd].recv(65536):
                raise SystemExit(f"bare server {s}: a worker went away after {seen} of {total}")
            got.append(conns[fd])
            seen += 1
            if len(got) == WORKERS:
                for conn in got:
                    conn.send(PAYLOAD)
                got = []


def worker(mode: str, w: int, base: int, rounds: int) -> None:
    if mode in ("zmq", "curve"):
        import zmq

        socks = []
        for s in range(SERVERS):
            dealer = zmq_socket(mode, zmq.DEALER)
            dealer.connect(f"tcp://127.0.0.1:{base + s}")
            socks.append(dealer)

        def answers() -> None:  # (each server answers once a round: read each in turn)
            for dealer in socks:
                dealer.recv()

    else:
        socks = []
        for s in range(SERVERS):
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            deadline = time.monotonic() + 30
            while True:  # (the server may not listen yet)
                try:
                    conn.connect(unix_name(base, s))
                    break
                except (ConnectionRefusedError, FileNotFoundError):
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.01)
            socks.append(conn)

        def answers() -> None:
            for conn in socks:
                if not conn.recv(65536):
                    raise SystemExit(f"bare worker {w}: a server went away")

    times = []
    for i in range(WARM + rounds):
        if i == WARM:
            cpu0 = time.process_time()
        t0 = time.perf_counter()
        for sock in socks:
            sock.send(PAYLOAD)
        answers()
        times.append(time.perf_counter() - t0)
    cpu = (time.process_time() - cpu0) / rounds
    if w == 0:
        print(f"BARE {mode} {statistics.median(times[WARM:]):.9f} {cpu:.9f}", flush=True)


def main() -> None:
    mode, role, index, base, rounds = sys.argv[1:6]
    if mode not in ("zmq", "curve", "unix"):
        raise SystemExit(f"_bare_round: mode {mode!r} is not zmq, curve or unix")
    run = server if role == "server" else worker
    # the servers answer WARM more rounds than are timed
    run(mode, int(index), int(base), int(rounds) + (WARM if role == "server" else 0))


if __name__ == "__main__":
    main()
