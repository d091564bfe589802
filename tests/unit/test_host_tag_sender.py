"""A server checks a push's host tag (``hg``) against the host group its sender registered
with: a worker of one host that names another host (or more workers than its host has)
is refused, for dense keys and tables, and the round completes with the real hosts' pushes,
every value the job's."""

from __future__ import annotations

import itertools

import numpy as np

from hetps.cluster import protocol as P
from hetps.roles import new_server
from hetps.tables.lazy import sum_rows
from hetps.transport.codec import Message

GROUP = {9: 0, 11: 0, 13: 1, 15: 1}  # two hosts of two workers
N, ROWS, COLS = 64, 20, 3
_req = itertools.count(100)


class _Node:
    """A server's Node as far as a round's pushes use it: the job's workers and their hosts."""

    def __init__(self) -> None:
        self.nodes = {
            w: P.NodeInfo(w, "worker", i, "", 0, g) for i, (w, g) in enumerate(GROUP.items())
        }
        self.replies: list = []

    def role_of(self, node_id: int) -> str | None:
        return "worker" if node_id in GROUP else None

    def workers(self) -> list:
        return list(GROUP)

    def reply(self, msg, body=None, arrays=None, track=False):
        self.replies.append((msg.sender, msg.req, body))


def _errors(node) -> list[str]:
    return [b["error"] for _, _, b in node.replies if b and "error" in b]


def _dense(node):
    """A server with dense key ``w`` and a push of it tagged ``hg`` from a worker."""
    srv = new_server(node)
    body = {"k": "w", "part": 0, "size": N, "shape": [N], "dtype": "float32", "off": 0, "n": N}
    srv.handle(Message("init", sender=9, req=1, body=body, arrays=[np.zeros(N, np.float32)]))

    def push(worker, arr, hg):
        body = {"k": "w", "part": 0, "off": 0, "n": N, "sync": True, "ce": N, "hg": list(hg)}
        srv.handle(Message("push", sender=worker, req=next(_req), body=body, arrays=[arr]))

    return srv, push


def test_a_dense_push_naming_another_host_is_refused():
    node = _Node()
    srv, push = _dense(node)
    rng = np.random.default_rng(0)
    x = {h: rng.standard_normal(N).astype(np.float32) for h in (0, 1)}

    push(9, x[0], (0, 0, 2))  # host 0's sum
    push(11, x[0], (1, 0, 2))  # a worker of host 0 names host 1
    push(11, x[0], (0, 1, 3))  # ... or more workers than its host has
    errors = _errors(node)
    assert len(errors) == 2, errors
    assert "host group 1" in errors[0] and "registered with host group 0" in errors[0]
    assert "3 workers" in errors[1] and "host group 0 has 2" in errors[1]
    assert srv.slices[("w", 0)].rounds == 0
    push(13, x[1], (1, 0, 2))  # host 1's real sum completes the round
    assert len(_errors(node)) == 2
    sl = srv.slices[("w", 0)]
    assert sl.rounds == 1 and sl.value.tobytes() == (x[0] + x[1]).tobytes()


def test_a_table_push_naming_another_host_is_refused():
    node = _Node()
    srv = new_server(node)
    body = {"k": "t", "part": 0, "nparts": 1, "rows": ROWS, "cols": COLS, "dtype": "float32",
            "scale": 0.0, "seed": 0, "bound": 0}  # fmt: skip
    srv.handle(Message("sinit", sender=9, req=1, body=body))
    rng = np.random.default_rng(1)
    x = {}
    for h in (0, 1):
        ids = np.sort(rng.choice(ROWS, 8, replace=False)).astype(np.int64)
        x[h] = (ids, rng.standard_normal((8, COLS)).astype(np.float32))

    def push(worker, h, hg):
        body = {"k": "t", "part": 0, "sync": True, "hg": list(hg)}
        arrays = [x[h][0], x[h][1].ravel()]
        srv.handle(Message("spush", sender=worker, req=next(_req), body=body, arrays=arrays))

    push(11, 0, (1, 0, 2))  # first: a worker of host 0 names host 1
    push(9, 0, (0, 0, 3))
    errors = _errors(node)
    assert len(errors) == 2, errors
    assert "host group 1" in errors[0] and "registered with host group 0" in errors[0]
    assert "3 workers" in errors[1] and "host group 0 has 2" in errors[1]
    push(9, 0, (0, 0, 2))
    push(13, 1, (1, 0, 2))  # host 1's real push is not refused as a second local rank 0
    assert len(_errors(node)) == 2
    ids, rows = sum_rows([x[0], x[1]], COLS, np.float32)
    want = np.zeros((ROWS, COLS), np.float32)
    want[ids] = rows
    got = srv.tables.shards[("t", 0)].read(np.arange(ROWS, dtype=np.int64))
    assert got.tobytes() == want.tobytes()


class _ElasticNode(_Node):
    """The same job under HETPS_ELASTIC: a host's sum covers the live workers of its host."""

    id, elastic, replicas = 8, 2, 1
    on_failover = on_rejoin = on_worker_left = None
    left: set[int] = set()

    def workers(self) -> list:
        return list(self.nodes.values())

    def live_workers(self) -> list:
        return self.workers()

    def describe(self, nid: int) -> str:
        return f"node {nid}"

    def send(self, peer, msg) -> bool:
        return True


def test_an_elastic_push_naming_another_host_covers_nobody():
    node = _ElasticNode()
    srv, push = _dense(node)
    rng = np.random.default_rng(2)
    x = {h: rng.standard_normal(N).astype(np.float32) for h in (0, 1)}

    push(11, x[0], (1, 0, 2))  # a worker of host 0 says its push is host 1's sum
    push(9, x[0], (0, 0, 2))
    errors = _errors(node)
    assert len(errors) == 1 and "registered with host group 0" in errors[0], errors
    assert srv.slices[("w", 0)].rounds == 0  # host 1 is not covered by it
    push(13, x[1], (1, 0, 2))
    sl = srv.slices[("w", 0)]
    assert len(_errors(node)) == 1
    assert sl.rounds == 1 and sl.value.tobytes() == (x[0] + x[1]).tobytes()
