"""A server's dist_sync rounds of a row-sparse table from workers whose hosts are known
(tables/server.py): summed per host in local-rank order, then the hosts in group order,
whatever the arrival order, and the same bytes when each host pushes its merged sum (host
aggregation's); a push that contradicts its round is refused and changes nothing."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hetps.roles import new_server
from hetps.tables.lazy import sum_rows
from hetps.transport.codec import Message
from roles import ServerNodeStub

WORKERS = (9, 11, 13, 15)  # two hosts of two: 9, 11 on group 0; 13, 15 on group 1
HOST = {9: (0, 0), 11: (0, 1), 13: (1, 0), 15: (1, 1)}
ROWS, COLS = 50, 3
_req = itertools.count(100)


def _server():
    node = ServerNodeStub(WORKERS)
    srv = new_server(node)
    body = {"k": "t", "part": 0, "nparts": 1, "rows": ROWS, "cols": COLS, "dtype": "float32",
            "scale": 0.0, "seed": 0, "bound": 0}  # fmt: skip
    srv.handle(Message("sinit", sender=9, req=1, body=body))
    return srv, node


def _push(srv, worker, ids, rows, hg):
    body = {"k": "t", "part": 0, "sync": True}
    if hg is not None:
        body["hg"] = list(hg)
    msg = Message("spush", sender=worker, req=next(_req), body=body, arrays=[ids, rows.ravel()])
    srv.handle(msg)


def _errors(node) -> list[str]:
    return [b["error"] for _, _, b in node.replies if b and "error" in b]


def _grads(seed: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Overlapping ids; magnitudes far apart, so that the order of a sum shows in its bits."""
    rng = np.random.default_rng(seed)
    out = {}
    for i, w in enumerate(WORKERS):
        ids = np.sort(rng.choice(ROWS, 30, replace=False)).astype(np.int64)
        out[w] = (ids, (rng.standard_normal((30, COLS)) * 10.0 ** (2 * i)).astype(np.float32))
    return out


def _expected(x) -> np.ndarray:
    hosts = [sum_rows([x[9], x[11]], COLS, np.float32), sum_rows([x[13], x[15]], COLS, np.float32)]
    ids, rows = sum_rows(hosts, COLS, np.float32)
    table = np.zeros((ROWS, COLS), np.float32)
    table[ids] = rows  # (no optimizer: a round's sums replace the rows pushed)
    return table


def _table(srv) -> np.ndarray:
    return srv.tables.shards[("t", 0)].read(np.arange(ROWS, dtype=np.int64))


@pytest.mark.parametrize("order", [(9, 11, 13, 15), (15, 13, 11, 9), (13, 9, 15, 11)])
def test_a_round_is_summed_per_host_whatever_the_arrival_and_a_hosts_sum_the_same(order):
    srv, node = _server()
    x = _grads(0)
    for w in order:
        _push(srv, w, *x[w], (*HOST[w], 1))
    assert not _errors(node)
    flat = _table(srv)
    assert flat.tobytes() == _expected(x).tobytes()
    # the other order (worker order, no hosts) gives other bits: the test can tell
    srv2, _ = _server()
    for w in WORKERS:
        _push(srv2, w, *x[w], None)
    assert _table(srv2).tobytes() != flat.tobytes()
    # each host pushes its merged sum once, standing for its two workers
    srv3, node3 = _server()
    for g, (a, b) in ((1, (13, 15)), (0, (9, 11))):
        _push(srv3, a, *sum_rows([x[a], x[b]], COLS, np.float32), (g, 0, 2))
    assert not _errors(node3)
    assert _table(srv3).tobytes() == flat.tobytes()


def test_pushes_that_contradict_the_round_are_refused_and_change_nothing():
    srv, node = _server()
    x = _grads(2)
    _push(srv, 9, *x[9], (0, 0, 1))
    _push(srv, 13, *x[13], (0, 0, 1))  # a second "local rank 0 of host 0"
    _push(srv, 11, *x[11], (0, 1, 4))  # 1 + 4 workers of a job of 4
    _push(srv, 15, *x[15], None)  # no host in a round of hosts
    errors = _errors(node)
    assert len(errors) == 3, errors
    assert "LOCAL_RANK" in errors[0] and "local rank 0 of host group 0" in errors[0]
    assert "more workers than the job's 4" in errors[1]
    assert "HETPS_HOST_GROUP" in errors[2]
    assert not _table(srv).any()  # nothing applied
    for w in (11, 13, 15):  # the round completes with the right pushes
        _push(srv, w, *x[w], (*HOST[w], 1))
    assert len(_errors(node)) == 3
    assert _table(srv).tobytes() == _expected(x).tobytes()
