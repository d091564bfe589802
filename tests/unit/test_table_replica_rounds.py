"""Copies of embedding tables (HETPS_REPLICAS), message by message: KVServers wired by hand
(tests/unit/test_replica_rounds.py's wire), so the orders a failover makes possible are
played exactly (the processes and the kill are in tests/integration/test_table_replicas.py)."""

from __future__ import annotations

import numpy as np
from test_replica_rounds import P_ID, Q_ID, W0, W1, _pair, _set_sgd, _Wire

from hetps import optim
from hetps.kvstore.server import KVServer
from hetps.roles import new_server
from hetps.tables import server_dump
from hetps.tables.server import TABLE_BYTES
from hetps.transport.codec import Message

DECL = {"k": "t", "part": 0, "nparts": 1, "cols": 2, "dtype": "float32", "scale": 0.5,
        "seed": 1, "bound": 0}  # fmt: skip


def _sinit(srv: KVServer, rows: int | None = 8, opt=None) -> None:
    body = dict(DECL, rows=rows)
    if opt is not None:
        body["opt"] = optim.dumps(opt)
    srv.handle(Message("sinit", sender=W0, req=1, body=body))


def _spush(srv: KVServer, worker: int, rnd: int, ids, grad, req: int) -> None:
    ids = np.asarray(ids, np.int64)
    vals = np.asarray(grad, np.float32).reshape(ids.size, 2)
    body = {"k": "t", "part": 0, "sync": True, "rnd": rnd}
    srv.handle(Message("spush", sender=worker, req=req, body=body, arrays=[ids, vals.ravel()]))


def _acked(wire: _Wire, nid: int) -> list[int]:
    return [m.req for m, body, _ in wire.replies[nid] if m.cmd == "spush"]


def _errors(wire: _Wire, nid: int) -> list[str]:
    return [body["error"] for _, body, _ in wire.replies[nid] if body and "error" in body]


def _rows(srv: KVServer, ids) -> np.ndarray:
    return srv.tables.shards[("t", 0)].read(np.asarray(ids, np.int64))


def _state(srv: KVServer, ids) -> bytes:
    """The part's optimizer state of rows ``ids`` (by id: local rows may differ), with its
    numbers (Adam's t)."""
    sh = srv.tables.shards[("t", 0)]
    loc = sh.local(np.asarray(ids, np.int64))
    parts = [repr(server_dump.numbers(sh)).encode()]
    parts += [sh.state[m][loc].tobytes() for m in server_dump.per_row(sh)]
    return b"".join(parts)


def _round(wire: _Wire, srv: KVServer, rnd: int, req: int, deliver: bool = True) -> None:
    _spush(srv, W0, rnd, [1, 3, 5], np.full(6, 1.0 + rnd), req)
    _spush(srv, W1, rnd, [3, 6], np.full(4, 2.0), req + 1)
    if deliver:
        wire.deliver()


def test_a_table_round_is_answered_only_once_every_copy_applied_it():
    wire, p, q = _pair()
    _set_sgd(wire)
    _sinit(p)
    assert _acked(wire, P_ID) == [] and wire.held  # the declaration waits for its copy
    wire.deliver()
    assert not q.tables.shards[("t", 0)].primary and q.tables.shards[("t", 0)].origin == P_ID
    _round(wire, p, 0, 10, deliver=False)
    assert _acked(wire, P_ID) == []  # applied on p, not yet on q
    pull = Message("spull", sender=W0, req=12, body={"k": "t", "part": 0},
                   arrays=[np.arange(8, dtype=np.int64)])  # fmt: skip
    p.handle(pull)  # a pull of the part waits for the copy too
    assert not [m for m, _, _ in wire.replies[P_ID] if m.cmd == "spull"]
    wire.deliver()
    assert sorted(_acked(wire, P_ID)) == [10, 11]
    assert [m.req for m, _, _ in wire.replies[P_ID] if m.cmd == "spull"] == [12]
    _round(wire, p, 1, 20)
    assert p.tables.shards[("t", 0)].rounds == q.tables.shards[("t", 0)].rounds == 2
    # the copy made the rows the rounds touched (p also those the pull read: both are at
    # their seeded initial value until pushed)
    assert server_dump.used_rows(q.tables.shards[("t", 0)])[0].tolist() == [1, 3, 5, 6]
    assert _state(p, range(8)) == _state(
        q, range(8)
    )  # the momentum of the rows touched, and only those
    assert np.array_equal(_rows(p, range(8)), _rows(q, range(8)))  # bit for bit


def test_after_a_failover_a_resent_applied_table_round_is_only_acknowledged():
    """p applied round 0 and copied it, then died before its acknowledgements left: both
    workers push round 0 again to q, which acknowledges without applying it twice."""
    wire, p, q = _pair()
    _set_sgd(wire)
    _sinit(p)
    wire.deliver()
    _round(wire, p, 0, 10)
    after = _rows(q, range(8))
    wire.dead.add(P_ID)  # p is gone; what follows goes to q
    q.replication.on_failover(P_ID, Q_ID)
    assert q.tables.shards[("t", 0)].primary
    _round(wire, q, 0, 20)
    assert sorted(_acked(wire, Q_ID)) == [20, 21] and not _errors(wire, Q_ID)
    assert np.array_equal(_rows(q, range(8)), after)
    assert q.tables.shards[("t", 0)].rounds == 1
    _round(wire, q, 1, 22)  # the next round is applied as usual
    assert q.tables.shards[("t", 0)].rounds == 2
    assert not np.array_equal(_rows(q, range(8)), after)


def test_a_push_sent_twice_in_its_round_is_counted_once():
    """A worker's push of the open round again (its first went before a failover) waits
    until the round is applied, then is found applied: acknowledged, added once."""
    wire, p, _ = _pair()
    wire.dead.add(Q_ID)  # no copies to make: p alone
    _sinit(p)
    _spush(p, W0, 0, [2], [1.0, 1.0], 10)
    _spush(p, W0, 0, [2], [1.0, 1.0], 11)  # the same push again
    _spush(p, W1, 0, [2], [2.0, 2.0], 12)
    assert np.array_equal(_rows(p, [2]), [[3.0, 3.0]])  # no optimizer: the sum, W0 once
    assert sorted(_acked(wire, P_ID)) == [10, 11, 12]
    _spush(p, W1, 1, [2], [20.0, 20.0], 13)
    _spush(p, W0, 1, [2], [10.0, 10.0], 14)
    assert np.array_equal(_rows(p, [2]), [[30.0, 30.0]])


def test_a_later_rounds_push_waits_for_its_round():
    wire, p, _ = _pair()
    wire.dead.add(Q_ID)
    _sinit(p)
    _spush(p, W0, 1, [4], [10.0, 10.0], 11)  # early: round 1 before its round 0
    _spush(p, W1, 0, [4], [2.0, 2.0], 12)
    assert p.tables.shards[("t", 0)].rounds == 0
    _spush(p, W0, 0, [4], [1.0, 1.0], 10)  # round 0 complete: 3
    assert np.array_equal(_rows(p, [4]), [[3.0, 3.0]])
    _spush(p, W1, 1, [4], [20.0, 20.0], 13)
    assert np.array_equal(_rows(p, [4]), [[30.0, 30.0]])
    assert sorted(_acked(wire, P_ID)) == [10, 11, 12, 13]


def test_a_growing_tables_rows_and_adam_state_are_made_on_the_copy_and_resynced():
    """A hashed table with its own Adam: rows made on first push are made on the copy, with
    the same values and moments. A server with nothing (started again) gets the whole part
    from the primary (ssync) and can take over from it."""
    wire = _Wire((P_ID, Q_ID, 12))
    for nid in wire.ids:
        wire.servers[nid] = new_server(wire.node(nid))
    p, q, r = (wire.servers[i] for i in wire.ids)
    wire.dead.add(12)
    _sinit(p, rows=None, opt=optim.Adam(learning_rate=0.1))
    wire.deliver()
    big = 1 << 40
    for rnd in range(3):
        _spush(p, W0, rnd, [7, big + rnd], np.arange(4) + rnd, 10 + 2 * rnd)
        _spush(p, W1, rnd, [7], [1.0, -1.0], 11 + 2 * rnd)
        wire.deliver()
    ids = [7, big, big + 1, big + 2, 99]
    assert q.tables.shards[("t", 0)].n == 4  # the rows made, none for a read
    assert np.array_equal(_rows(p, ids), _rows(q, ids)) and _state(p, ids[:4]) == _state(q, ids[:4])
    # r comes back empty as q's... no: as p's replica after q died; p sends it everything
    wire.dead = {Q_ID}
    p.replication.on_failover(Q_ID, P_ID)
    wire.deliver()
    sh = r.tables.shards[("t", 0)]
    assert not sh.primary and sh.origin == P_ID and sh.rounds == 3 and sh.optimizer is not None
    assert np.array_equal(_rows(p, ids), _rows(r, ids)) and _state(p, ids[:4]) == _state(r, ids[:4])
    # p dies too: r serves the part, and the next round is applied there as it was on p
    _spush(p, W0, 3, [big + 5], [1.0, 1.0], 30)
    _spush(p, W1, 3, [7], [1.0, 1.0], 31)
    want = _rows(p, ids + [big + 5])
    wire.dead = {P_ID, Q_ID}
    r.replication.on_failover(P_ID, 12)
    _spush(r, W0, 3, [big + 5], [1.0, 1.0], 40)
    _spush(r, W1, 3, [7], [1.0, 1.0], 41)
    assert np.array_equal(_rows(r, ids + [big + 5]), want)


def test_a_replica_without_the_part_refuses_a_round_and_gets_it_all_again():
    """A copy of a round for a part the replica lacks is refused; the primary then sends
    its whole parts (ssync), behind which rounds go on."""
    wire, p, q = _pair()
    _set_sgd(wire)
    _sinit(p)
    wire.deliver()
    del q.tables.shards[("t", 0)]  # (as if it had been started again after the init)
    _spush(p, W0, 0, [1], [1.0, 1.0], 10)
    _spush(p, W1, 0, [1], [1.0, 1.0], 11)
    to, msg, callback = wire.held.pop()
    q.handle(msg)
    ((reply, body, _),) = wire.replies[Q_ID][-1:]
    assert "no copy of table 't' part 0" in body["error"]
    p.replication._copied(p.replication._copies[0], Q_ID, RuntimeError(body["error"]))
    wire.deliver()  # the ssync
    assert sorted(_acked(wire, P_ID)) == [10, 11] and not _errors(wire, P_ID)
    assert np.array_equal(_rows(p, range(8)), _rows(q, range(8)))
    assert _state(p, range(8)) == _state(q, range(8))


def test_a_replica_without_room_for_the_copy_fails_the_declaration_with_the_fix():
    """Copies count toward a server's cap on table memory: a replica that cannot hold its
    copy refuses it, and the worker's init is answered with the replica's error and the
    fix, instead of a table that would have no copy."""
    wire, p, q = _pair()
    q.tables.cap = 50  # bytes: under the 8 rows' 72
    _sinit(p)
    to, msg, _ = wire.held.pop()
    q.handle(msg)
    refusal = wire.replies[Q_ID][-1][1]["error"]
    assert "HETPS_TABLE_MAX_BYTES" in refusal
    p.replication._copied(p.replication._copies[0], Q_ID, RuntimeError(refusal))
    ((reply, body, _),) = [r for r in wire.replies[P_ID] if r[0].cmd == "sinit"]
    assert (
        "sinit of row-sparse key 't': a replica could not take its copy (node 10: "
        in (body["error"])
    ), body
    assert "give the servers room for them (HETPS_TABLE_MAX_BYTES)" in body["error"]


def test_a_round_a_replica_has_no_room_for_is_answered_with_the_fix():
    """A growing table's round that would put a replica over its cap (its copies count):
    the round's pushes are answered with the replica's refusal and the fix."""
    wire, p, q = _pair()
    # bytes: the declaration (with its fixed cost) fits, three rows with their index do not
    q.tables.cap = TABLE_BYTES + len(repr("t")) + 100
    _sinit(p, rows=None)
    wire.deliver()
    _spush(p, W0, 0, [1, 2, 3], np.ones(6), 10)
    _spush(p, W1, 0, [1], [1.0, 1.0], 11)
    to, msg, _ = wire.held.pop()
    q.handle(msg)
    refusal = wire.replies[Q_ID][-1][1]["error"]
    p.replication._copied(p.replication._copies[0], Q_ID, RuntimeError(refusal))
    errors = _errors(wire, P_ID)
    assert len(errors) == 2 and sorted(_acked(wire, P_ID)) == [10, 11], errors
    assert "the round of row-sparse key 't': a replica could not take its copy" in errors[0]
