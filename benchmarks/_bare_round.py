#!/usr/bin/env python
"""A role of benchmarks/message_floor.py's bare rounds: no hetps, only the messages.

    python benchmarks/_bare_round.py MODE ROLE INDEX BASE ROUNDS

``MODE``: ``zmq`` (pyzmq ROUTER servers and DEALER workers over loopback TCP, as hetps's
connections are), ``curve`` (the same with CURVE: encrypted and authenticated, as hetps's are
by default; keys in BARE_SERVER_SECRET and BARE_SERVER_PUBLIC, z85), ``handoff`` (``curve``,
each worker's answers read by a receive thread that hands the round to the caller through a
lock, as hetps's worker does) or ``unix`` (AF_UNIX SOCK_SEQPACKET: one system call a message
each way, no I/O thread). ``ROLE``: ``server`` or
``worker``; ``INDEX`` its rank (2 of each); ``BASE``: the first of 4 ports (servers'
``BASE``, ``BASE + 1``, workers' ``BASE + 2``, ``BASE + 3``; ``unix``: the abstract socket
names' tag). Over ZeroMQ each process binds a ROUTER it receives on and sends on a DEALER to
each peer's, as hetps's nodes do. A round, on each worker: a message
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
import threading
import time

import zmq

WORKERS = SERVERS = 2
PAYLOAD = b"x" * 120
WARM = 100


def unix_name(base: int, s: int) -> str:
    return f"\0hetps-bare-{os.getuid()}-{base}-{s}"


def zmq_socket(mode: str, kind: int):
    sock = zmq.Context.instance().socket(kind)
    # a server's last answers leave after its loop ends: they have 5 s to go before it exits
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


def server(mode: str, s: int, base: int, rounds: int) -> None:
    total = rounds * WORKERS
    if mode != "unix":  # ports: the servers' base, base + 1, the workers' base + 2, base + 3
        router, dealers = zmq_peers(mode, s, base, [SERVERS + w for w in range(WORKERS)])
        got = []
        for _ in range(total):
            got.append(router.recv_multipart()[0][1] - SERVERS)  # (the worker's rank)
            if len(got) == WORKERS:
                for w in got:
                    dealers[w].send(PAYLOAD)
                got = []
        # the last answers may still be queued: closing waits for them (LINGER), an exit
        # without it would drop them
        for sock in [router, *dealers]:
            sock.close()
        zmq.Context.instance().term()
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
    if mode != "unix":
        router, socks = zmq_peers(mode, SERVERS + w, base, list(range(SERVERS)))

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
            sock.send(PAYLOAD)
        answers()
        times.append(time.perf_counter() - t0)
    cpu = (time.process_time() - cpu0) / rounds
    if w == 0:
        print(f"BARE {mode} {statistics.median(times[WARM:]):.9f} {cpu:.9f}", flush=True)


def main() -> None:
    mode, role, index, base, rounds = sys.argv[1:6]
    if mode not in ("zmq", "curve", "handoff", "unix"):
        raise SystemExit(f"_bare_round: mode {mode!r} is not zmq, curve, handoff or unix")
    run = server if role == "server" else worker
    # the servers answer WARM more rounds than are timed
    run(mode, int(index), int(base), int(rounds) + (WARM if role == "server" else 0))


if __name__ == "__main__":
    main()
