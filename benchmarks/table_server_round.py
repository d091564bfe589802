#!/usr/bin/env python
"""A server's handling of row-sparse table rounds, in one process, without the wire.

    .venv/bin/python benchmarks/table_server_round.py [--cols 16,64] [--fracs 0.01,0.001]
        [--opts sgd,adam] [--rounds 200] [--quick]

One server of two holds its part of a 1M-row float32 table (rows of even ids). Each round,
two workers' requests are handled as the server's receive thread handles them: each
worker's push of its rows here (the ids and rows of benchmarks/sparse_tables.py) and its
``row_sparse_pull`` of them. The round's sum, the optimizer step and the two replies (encoded
as for the wire, rows gathered into one array) run in the handler. The table gives each
cell's median and best milliseconds per round, after 8 rounds of warm-up. Run it in two
trees to compare them: the machine's load moves the medians, the best moves less.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import median, print_table  # noqa: E402
from _sparse_mx import ids_for  # noqa: E402

from hetps import optim  # noqa: E402
from hetps.roles import new_server  # noqa: E402
from hetps.transport.codec import Message, encode  # noqa: E402
from hetps.transport.heap import keep_buffers  # noqa: E402

ROWS = 1_000_000
SERVER, W0, W1 = 8, 9, 11


class _Node:
    """The server's node, less the wire: its answers are encoded and dropped."""

    id, replicas, redirect, on_failover = SERVER, 1, {}, None

    def role_of(self, nid: int) -> str | None:
        return {SERVER: "server", W0: "worker", W1: "worker"}.get(nid)

    def workers(self) -> list[int]:
        return [W0, W1]

    def live_servers(self) -> list:
        return [SimpleNamespace(id=SERVER)]

    def describe(self, nid: int) -> str:
        return f"node {nid}"

    def reply(self, msg: Message, body=None, arrays=None, track=False) -> None:
        encode(Message(msg.cmd, req=msg.req, reply=True, body=body or {}, arrays=arrays or []))

    def send_replies(self, peer: int, replies: list, track=False) -> None:
        for m in replies:
            encode(m)

    def send(self, peer: int, msg: Message) -> bool:
        return True


def cell(cols: int, frac: float, opt: str, rounds: int) -> tuple[float, float]:
    """(median, best) seconds per round of one table."""
    srv = new_server(_Node())
    srv.optimizer = (
        optim.Adam(learning_rate=0.001) if opt == "adam" else optim.SGD(learning_rate=0.01)
    )
    body = {"k": "t", "part": 0, "nparts": 2, "rows": ROWS, "cols": cols, "dtype": "float32"}
    srv.handle(
        Message("sinit", sender=W0, req=1, body={**body, "scale": 0.0, "seed": 0, "bound": 0})
    )
    sets = []
    for s in range(4):
        per = []
        for rank, wid in ((0, W0), (1, W1)):
            ids = ids_for(ROWS, frac, rank, s)
            ids = ids[ids % 2 == 0]
            rows = np.random.default_rng(s).standard_normal((ids.size, cols), np.float32)
            per.append((wid, ids, rows.reshape(-1)))
        sets.append(per)
    req = 10
    times = []
    for i in range(8 + rounds):
        t0 = time.perf_counter()
        for wid, ids, rows in sets[i % 4]:
            req += 2
            part = {"k": "t", "part": 0}
            srv.handle(
                Message(
                    "spush", sender=wid, req=req, body={**part, "sync": True}, arrays=[ids, rows]
                )
            )
            srv.handle(Message("spull", sender=wid, req=req + 1, body=part, arrays=[ids]))
        if i >= 8:
            times.append(time.perf_counter() - t0)
    return median(times), min(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cols", default="16,64")
    ap.add_argument("--fracs", default="0.01,0.001")
    ap.add_argument("--opts", default="sgd,adam")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--quick", action="store_true", help="20 rounds of 1M x 16 at 0.1%%")
    args = ap.parse_args()
    if args.quick:
        args.cols, args.fracs, args.rounds = "16", "0.001", 20
    keep_buffers()  # (as a server does: a round reuses the pages of the last)
    rows = []
    for opt in args.opts.split(","):
        for cols in (int(c) for c in args.cols.split(",")):
            for frac in (float(f) for f in args.fracs.split(",")):
                med, best = cell(cols, frac, opt, args.rounds)
                rows.append(
                    [opt, f"1M x {cols}", f"{frac:.1%}", f"{med * 1e3:.3f}", f"{best * 1e3:.3f}"]
                )
    print_table(["optimizer", "table", "rows/worker", "median ms", "best ms"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
