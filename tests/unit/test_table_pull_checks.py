"""A row-sparse pull that waits on a server for its round (its worker pushed in the round):
its ids are checked once, when it comes, and it is answered with the round's rows when the
round ends; a bad pull is refused when it comes, never kept."""

from __future__ import annotations

import itertools

import numpy as np

from hetps.roles import new_server
from hetps.tables import server as table_server
from hetps.transport.codec import Message
from roles import ServerNodeStub

W0, W1 = 9, 11
ROWS, COLS = 40, 4
_req = itertools.count(100)


def _server():
    node = ServerNodeStub((W0, W1), rows=True)
    srv = new_server(node)
    body = {"k": "t", "part": 0, "nparts": 1, "rows": ROWS, "cols": COLS, "dtype": "float32",
            "scale": 0.0, "seed": 0, "bound": 0}  # fmt: skip
    srv.handle(Message("sinit", sender=W0, req=1, body=body))
    return srv, node


def _send(srv, cmd, worker, arrays, **extra):
    req = next(_req)
    body = {"k": "t", "part": 0, **extra}
    srv.handle(Message(cmd, sender=worker, req=req, body=body, arrays=arrays))
    return req


def test_a_pull_that_waits_for_its_round_is_checked_once_and_gets_the_rounds_rows(monkeypatch):
    seen: list[int] = []
    real = table_server.checked_ids

    def counted(msg, sh, arr, sorted_distinct):
        seen.append(msg.req)
        return real(msg, sh, arr, sorted_distinct)

    monkeypatch.setattr(table_server, "checked_ids", counted)
    srv, node = _server()
    ids = np.array([1, 5, 7], np.int64)
    g0 = np.arange(3 * COLS, dtype=np.float32)
    g1 = np.arange(3 * COLS, dtype=np.float32) * 10
    _send(srv, "spush", W0, [ids, g0], sync=True)
    pull = _send(srv, "spull", W0, [ids])  # W0 pushed in this round: it waits
    assert seen.count(pull) == 1 and not [r for r in node.replies if r[1] == pull]
    _send(srv, "spush", W1, [ids, g1], sync=True)  # the round ends: the pull is answered
    assert seen.count(pull) == 1  # (checked when it came, not again)
    ((_, _, body, rows),) = [r for r in node.replies if r[1] == pull]
    assert not body  # no error
    # no optimizer: the round's sum replaces the rows pushed
    np.testing.assert_array_equal(rows[0].reshape(3, COLS), (g0 + g1).reshape(3, COLS))


def test_a_bad_pull_is_refused_when_it_comes_and_not_kept_for_the_round():
    srv, node = _server()
    ids = np.array([1, 5, 7], np.int64)
    _send(srv, "spush", W0, [ids, np.ones(3 * COLS, np.float32)], sync=True)
    bad = _send(srv, "spull", W0, [np.array([5, 1], np.int64)])  # not sorted
    ((_, _, body, _),) = [r for r in node.replies if r[1] == bad]
    assert "sorted and distinct" in body["error"]
    over = _send(srv, "spull", W0, [np.array([1, ROWS], np.int64)])
    ((_, _, body, _),) = [r for r in node.replies if r[1] == over]
    assert f"row id {ROWS} is out of range" in body["error"]
    _send(srv, "spush", W1, [ids, np.ones(3 * COLS, np.float32)], sync=True)
    assert len([r for r in node.replies if r[1] in (bad, over)]) == 2  # (answered once each)


def test_each_rounds_waiting_pull_is_answered_with_that_rounds_rows():
    srv, node = _server()
    ids = np.array([2, 3], np.int64)
    for k in range(1, 3):  # two rounds: each pull waits for its round, each is answered
        _send(srv, "spush", W0, [ids, np.full(2 * COLS, k, np.float32)], sync=True)
        pull = _send(srv, "spull", W0, [ids])
        _send(srv, "spush", W1, [ids, np.full(2 * COLS, k, np.float32)], sync=True)
        ((_, _, body, rows),) = [r for r in node.replies if r[1] == pull]
        assert not body and (rows[0] == 2 * k).all()
