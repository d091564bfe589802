"""Parallel TCP streams for the netem tests (stdlib only; a script run inside namespaces).

python netem_streams.py recv BIND_IP SECONDS FLOWS   # prints the port, then one line per
                                                     # 0.25 s: "elapsed Mbit/s"
python netem_streams.py send HOST PORT FLOWS         # sends on FLOWS connections until killed
"""

from __future__ import annotations

import socket
import sys
import threading
import time

CHUNK = 1 << 16


def receive(bind_ip: str, seconds: float, flows: int) -> None:
    srv = socket.socket()
    srv.bind((bind_ip, 0))
    srv.listen(flows)
    srv.settimeout(10)
    print(srv.getsockname()[1], flush=True)
    got = [0]
    lock = threading.Lock()

    def drain(conn: socket.socket) -> None:
        buf = bytearray(CHUNK)
        while True:
            try:
                n = conn.recv_into(buf)
            except OSError:
                return
            if not n:
                return
            with lock:
                got[0] += n

    for _ in range(flows):
        conn, _ = srv.accept()
        threading.Thread(target=drain, args=(conn,), daemon=True).start()
    t0 = last = time.time()
    seen = 0
    while last - t0 < seconds:
        time.sleep(0.25)  # the reporting period of this meter, not a synchronisation
        now = time.time()
        with lock:
            total = got[0]
        print(f"{now - t0:.2f} {(total - seen) * 8 / (now - last) / 1e6:.2f}", flush=True)
        last, seen = now, total


def send(host: str, port: int, flows: int) -> None:
    data = b"x" * CHUNK

    def stream() -> None:
        conn = socket.create_connection((host, port))
        try:
            while True:
                conn.sendall(data)
        except OSError:
            pass

    threads = [threading.Thread(target=stream, daemon=True) for _ in range(flows)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


if __name__ == "__main__":
    if sys.argv[1] == "recv":
        receive(sys.argv[2], float(sys.argv[3]), int(sys.argv[4]))
    else:
        send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
