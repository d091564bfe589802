"""A server's row-sparse tables against a broken or hostile peer: a table's optimizer is
unpickled only from a worker, and bad ids or rows are refused without changing the table."""

from __future__ import annotations

import numpy as np

from hetps import optim
from hetps.roles import new_server
from hetps.transport.codec import Message

from .test_checks import _Node

DECL = {"k": "t", "part": 0, "nparts": 1, "rows": 4, "cols": 2, "dtype": "float32"}


def test_a_tables_optimizer_is_unpickled_only_from_a_worker():
    node = _Node({9: "worker", 8: "server", 1: "scheduler"})
    srv = new_server(node)
    blob = optim.dumps(optim.SGD(learning_rate=0.5))
    for sender in (0, 1, 8, 12345):  # nobody, the scheduler, a server, an unknown id
        srv.handle(Message("sinit", sender=sender, req=1, body={**DECL, "opt": blob}))
        assert "comes from a worker" in node.replies[-1][1]["error"]
        assert srv.tables.shards["t", 0].optimizer is None
    srv.handle(Message("sinit", sender=9, req=2, body={**DECL, "opt": blob}))
    assert node.replies[-1][1] is None
    assert isinstance(srv.tables.shards["t", 0].optimizer, optim.SGD)


def test_bad_ids_and_rows_are_refused_and_change_nothing():
    node = _Node({9: "worker"})
    srv = new_server(node)
    srv.handle(Message("sinit", sender=9, req=1, body=DECL))
    sh = srv.tables.shards["t", 0]
    bad = [
        ([np.array([4], np.int64), np.ones(2, np.float32)], "row id 4 is out of range"),
        ([np.array([-1], np.int64), np.ones(2, np.float32)], "row id -1 is out of range"),
        ([np.array([2, 1], np.int64), np.ones(4, np.float32)], "sorted and distinct"),
        ([np.array([1], np.int32), np.ones(2, np.float32)], "1-D int64"),
        ([np.array([1], np.int64), np.ones(3, np.float32)], "3 values of float32 for 1 rows"),
        ([np.array([1], np.int64), np.ones(2, np.float64)], "of float64"),
        ([np.array([1], np.int64)], "expected row ids and rows"),
    ]
    for i, (arrays, text) in enumerate(bad):
        body = {"k": "t", "part": 0, "sync": True}
        srv.handle(Message("spush", sender=9, req=10 + i, body=body, arrays=arrays))
        assert text in node.replies[-1][1]["error"], (text, node.replies[-1][1])
    assert not sh.pending and not sh.value.any()
    srv.handle(Message("spull", sender=9, req=30, body={"k": "t", "part": 1},
                       arrays=[np.array([0], np.int64)]))  # fmt: skip
    assert "part 1, this server holds 0" in node.replies[-1][1]["error"]


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        return int(next(ln for ln in f if ln.startswith("VmRSS:")).split()[1])


def test_declaring_a_big_table_does_not_fill_the_servers_memory():
    """A fixed table's rows take their seeded value when first used: declaring 1M x 64
    float32 (256 MB) with random initial rows costs the server about a byte per row."""
    node = _Node({9: "worker"})
    srv = new_server(node)
    before = _rss_kb()
    body = {**DECL, "rows": 1_000_000, "cols": 64, "scale": 0.1, "seed": 1}
    srv.handle(Message("sinit", sender=9, req=1, body=body))
    assert node.replies[-1][1] is None
    srv.handle(Message("spull", sender=9, req=2, body={"k": "t", "part": 0},
                       arrays=[np.array([5, 999_999], np.int64)]))  # fmt: skip
    rows = node.replies[-1]
    assert rows[1] is None
    grown = (_rss_kb() - before) / 1024
    assert grown < 32, f"the server's memory grew by {grown:.0f} MB"
    assert srv.tables.shards["t", 0].made.sum() == 2


def test_a_worker_far_ahead_is_refused_and_a_table_is_not_redeclared_mid_round():
    """One worker pushes on while the other has not: its requests wait for later rounds up
    to MAX_AHEAD, then are refused (its memory stays bounded); a sinit that would replace
    the table while a round is open is refused, and the round still completes."""
    from hetps.tables.server import MAX_AHEAD

    node = _Node({9: "worker", 11: "worker"})
    srv = new_server(node)
    srv.handle(Message("sinit", sender=9, req=1, body=DECL))
    sh = srv.tables.shards["t", 0]
    body = {"k": "t", "part": 0, "sync": True}
    row = [np.array([1], np.int64), np.ones(2, np.float32)]
    for i in range(MAX_AHEAD + 5):
        srv.handle(Message("spush", sender=9, req=100 + i, body=body, arrays=list(row)))
    assert len(sh.backlog) == MAX_AHEAD
    refused = [r for r in node.replies if r[1] and "requests ahead" in r[1].get("error", "")]
    assert len(refused) == 4
    srv.handle(Message("sinit", sender=11, req=2, body={**DECL, "rows": 8}))
    assert "a round of this table is under way" in node.replies[-1][1]["error"]
    assert srv.tables.shards["t", 0] is sh
    srv.handle(Message("spush", sender=11, req=3, body=body, arrays=list(row)))
    assert sh.rounds >= 1 and sh.value[1].tolist() == [2.0, 2.0]  # the two workers' sum


def test_a_tables_checkpoint_load_is_checked_and_taken_from_a_worker_only():
    """sload (a restore writing a table's rows back) from anyone but a worker, with bad ids,
    rows or state, or with no optimizer for the state it carries, is refused and changes
    nothing; sdump reads only the rows used, in chunks."""
    node = _Node({9: "worker", 8: "server"})
    answers: list = []
    node.reply = lambda msg, body=None, arrays=None, track=False: (
        node.replies.append((msg, body)),
        answers.append(arrays),
    )
    srv = new_server(node)
    srv.handle(Message("sinit", sender=9, req=1, body={**DECL, "scale": 0.5}))
    ids, one = np.array([1, 3], np.int64), np.ones(4, np.float32)
    load = {"k": "t", "part": 0, "fresh": True, "state": ["mom"], "numbers": {}}
    srv.handle(Message("sload", sender=8, req=2, body=load, arrays=[ids, one, one]))
    assert "only a worker" in node.replies[-1][1]["error"]
    srv.handle(Message("sload", sender=9, req=3, body=load, arrays=[ids, one, one]))
    assert "set_optimizer" in node.replies[-1][1]["error"]
    srv.optimizer = optim.SGD(learning_rate=0.1, momentum=0.9)
    bad = [
        ({**load, "state": ["mean"]}, [ids, one, one], "keeps ['mom']"),
        ({**load, "numbers": {"t": True}}, [ids, one, one], "field 'numbers' (the optimizer"),
        (load, [np.array([3, 1], np.int64), one, one], "sorted and distinct"),
        (load, [np.array([1, 4], np.int64), one, one], "row id 4 is out of range"),
        (load, [ids, one, np.ones(3, np.float32)], "state 'mom': got 3 values"),
        (load, [ids, one], "expected ids, rows and 1 state arrays"),
    ]
    for i, (body, arrays, text) in enumerate(bad):
        srv.handle(Message("sload", sender=9, req=10 + i, body=body, arrays=arrays))
        assert text in node.replies[-1][1]["error"], (text, node.replies[-1][1])
        sh = srv.tables.shards["t", 0]
        assert not sh.made.any() and not sh.has_state
    srv.handle(Message("sload", sender=9, req=30, body=load, arrays=[ids, one, one * 2]))
    assert node.replies[-1][1] is None
    sh = srv.tables.shards["t", 0]
    assert sh.made.tolist() == [False, True, False, True] and sh.state["mom"][[1, 3]].min() == 2
    srv.handle(Message("sdump", sender=9, req=31, body={"k": "t", "part": 0, "n": 0}))
    assert node.replies[-1][1]["count"] == 2 and node.replies[-1][1]["state"] == [
        ["mom", "float32", 2]
    ]
    srv.handle(Message("sdump", sender=9, req=32, body={"k": "t", "part": 0, "off": 1, "n": 5}))
    got = answers[-1]
    assert got[0].tolist() == [3] and got[1].tolist() == [1, 1] and got[2].tolist() == [2, 2]
