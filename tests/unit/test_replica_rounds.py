"""Server copies (HETPS_REPLICAS), message by message: two KVServers wired by hand, so the
orders a failover makes possible are played exactly (the processes and the kill are in
tests/integration/test_replicas.py)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from hetps import optim
from hetps.kvstore.server import KVServer
from hetps.roles import new_server
from hetps.transport.codec import Message

P_ID, Q_ID, W0, W1 = 8, 10, 9, 11


class _Wire:
    """The nodes of two servers; a copy to the other is held until :meth:`deliver`."""

    def __init__(self, ids: tuple[int, ...] = (P_ID, Q_ID)) -> None:
        self.ids = ids  # the servers, in rank order
        self.held: list[tuple] = []  # (to, message, callback) not delivered yet
        self.replies: dict[int, list[tuple[Message, dict | None, list]]] = {i: [] for i in ids}
        self.servers: dict[int, KVServer] = {}
        self.dead: set[int] = set()

    def node(self, me: int):
        wire = self
        roles = {**dict.fromkeys(self.ids, "server"), W0: "worker", W1: "worker"}

        class Node:
            id = me
            replicas = 2
            redirect: dict[int, int] = {}
            on_failover = None

            def role_of(self, nid):
                return roles.get(nid)

            def workers(self):
                return [W0, W1]

            def live_servers(self):
                return [SimpleNamespace(id=i) for i in wire.ids if i not in wire.dead]

            def describe(self, nid):
                return f"node {nid}"

            def reply(self, msg, body=None, arrays=None, track=False):
                wire.replies[me].append((msg, body, arrays or []))

            def send(self, peer, msg):
                return True

            def request(self, peer, msg, callback=None, what=None):
                msg.sender = me
                fut = SimpleNamespace(errback=None, done=lambda: False, error=None)
                wire.held.append((peer, msg, callback))
                return fut

        return Node()

    def deliver(self) -> None:
        """Hand every held copy to its server and its answer back."""
        held, self.held = self.held, []
        for to, msg, callback in held:
            before = len(self.replies[to])
            self.servers[to].handle(msg)
            ((reply, body, _),) = self.replies[to][before:]
            assert body is None or "error" not in body, body
            callback(reply)


def _pair():
    wire = _Wire()
    for nid in (P_ID, Q_ID):
        wire.servers[nid] = new_server(wire.node(nid))
    return wire, wire.servers[P_ID], wire.servers[Q_ID]


def _init(srv: KVServer, value: np.ndarray) -> None:
    body = {"k": "w", "part": 0, "off": 0, "n": value.size, "size": value.size,
            "shape": [value.size], "dtype": "float32"}  # fmt: skip
    srv.handle(Message("init", sender=W0, req=1, body=body, arrays=[value]))


def _push(srv: KVServer, worker: int, rnd: int, grad: np.ndarray, req: int, pp=False):
    body = {"k": "w", "part": 0, "off": 0, "n": grad.size, "sync": True, "ce": grad.size,
            "rnd": rnd}  # fmt: skip
    if pp:
        body["pp"] = True
    srv.handle(Message("push", sender=worker, req=req, body=body, arrays=[grad.copy()]))


def _acked(wire: _Wire, nid: int) -> list[int]:
    return [m.req for m, body, _ in wire.replies[nid] if m.cmd == "push"]


def _set_sgd(wire: _Wire) -> None:
    blob = np.frombuffer(optim.dumps(optim.SGD(learning_rate=0.1, momentum=0.9)), np.uint8)
    for srv in wire.servers.values():  # a worker sends it to every server
        srv.handle(Message("set_optimizer", sender=W0, req=2, arrays=[blob]))


def test_a_round_is_acknowledged_only_once_its_copy_is_applied():
    wire, p, q = _pair()
    _set_sgd(wire)
    _init(p, np.arange(4, dtype=np.float32))
    assert _acked(wire, P_ID) == [] and wire.held  # the init waits for its copy
    wire.deliver()
    assert np.array_equal(q.slices[("w", 0)].value, np.arange(4, dtype=np.float32))
    _push(p, W0, 0, np.ones(4, np.float32), req=10)
    _push(p, W1, 0, np.full(4, 2.0, np.float32), req=11)
    assert _acked(wire, P_ID) == []  # applied on p, not yet on q
    _pull = Message("pull", sender=W0, req=12, body={"k": "w", "part": 0, "off": 0, "n": 4})
    p.handle(_pull)  # a pull of the slice waits for the copy too
    assert [m.req for m, _, _ in wire.replies[P_ID] if m.cmd == "pull"] == []
    wire.deliver()
    assert sorted(_acked(wire, P_ID)) == [10, 11]
    assert [m.req for m, _, _ in wire.replies[P_ID] if m.cmd == "pull"] == [12]
    sp, sq = p.slices[("w", 0)], q.slices[("w", 0)]
    assert sp.rounds == sq.rounds == 1
    assert np.array_equal(sp.value, sq.value)  # same optimizer, same merged pushes
    np.testing.assert_equal(sp.state, sq.state)  # momentum too
    assert sp.has_state and sq.has_state


def test_after_a_failover_a_resent_applied_round_is_only_acknowledged():
    """p applied round 0 and copied it, then died before its acknowledgements left: both
    workers push round 0 again to q, which acknowledges without applying it twice, and a
    fused push-pull gets the round's value."""
    wire, p, q = _pair()
    _set_sgd(wire)
    _init(p, np.zeros(4, np.float32))
    wire.deliver()
    _push(p, W0, 0, np.ones(4, np.float32), req=10)
    _push(p, W1, 0, np.ones(4, np.float32), req=11)
    wire.deliver()
    after_round = q.slices[("w", 0)].value.copy()
    wire.dead.add(P_ID)  # p is gone; what follows goes to q
    _push(q, W0, 0, np.ones(4, np.float32), req=20, pp=True)
    _push(q, W1, 0, np.ones(4, np.float32), req=21)
    assert sorted(_acked(wire, Q_ID)) == [20, 21]
    assert np.array_equal(q.slices[("w", 0)].value, after_round)
    assert q.slices[("w", 0)].rounds == 1
    ((_, _, arrays),) = [r for r in wire.replies[Q_ID] if r[0].req == 20]
    assert np.array_equal(arrays[0], after_round)
    # the next round is applied as usual
    _push(q, W0, 1, np.ones(4, np.float32), req=22)
    _push(q, W1, 1, np.ones(4, np.float32), req=23)
    assert q.slices[("w", 0)].rounds == 2 and not np.array_equal(
        q.slices[("w", 0)].value, after_round
    )


def test_a_push_of_a_later_round_waits_for_its_round():
    """Resent and new pushes may meet out of order at the server taking over: a push of
    round 1 that comes before the same worker's push of round 0 is kept until round 0 is
    applied, not merged into round 0."""
    wire, p, q = _pair()
    wire.dead.add(Q_ID)  # no copies to make: p alone
    _init(p, np.zeros(2, np.float32))
    _push(p, W0, 1, np.full(2, 10.0, np.float32), req=11)  # early
    _push(p, W1, 0, np.full(2, 2.0, np.float32), req=12)
    sl = p.slices[("w", 0)]
    assert sl.rounds == 0
    _push(p, W0, 0, np.full(2, 1.0, np.float32), req=10)  # round 0 complete: sum 3
    assert sl.rounds == 1 and np.array_equal(sl.value, [3.0, 3.0])
    _push(p, W1, 1, np.full(2, 20.0, np.float32), req=13)
    assert sl.rounds == 2 and np.array_equal(sl.value, [30.0, 30.0])
    assert sorted(_acked(wire, P_ID)) == [10, 11, 12, 13]


def test_a_late_copy_from_a_dead_primary_is_not_mixed_into_the_round_being_rebuilt():
    """p applied round 0 and died with its copy to q still on the wire. A worker's resent
    round-0 push reaches q (now serving the key) first, then the late copy, then the other
    worker's resend: the round is made once, from the resent pushes, and round 1 after it."""
    wire, p, q = _pair()
    _init(p, np.zeros(4, np.float32))
    wire.deliver()
    _push(p, W0, 0, np.full(4, 1.0, np.float32), req=10)
    _push(p, W1, 0, np.full(4, 2.0, np.float32), req=11)  # p applies round 0: the sum, 3
    late, wire.held = wire.held, []  # its copy to q is still on the wire
    wire.dead.add(P_ID)
    _push(q, W0, 0, np.full(4, 1.0, np.float32), req=20)
    wire.held = late
    wire.deliver()  # the late copy
    _push(q, W1, 0, np.full(4, 2.0, np.float32), req=21)
    sl = q.slices[("w", 0)]
    assert sl.rounds == 1 and np.array_equal(sl.value, [3.0] * 4)
    _push(q, W1, 1, np.full(4, 20.0, np.float32), req=23)
    _push(q, W0, 1, np.full(4, 10.0, np.float32), req=22)
    assert sorted(_acked(wire, Q_ID)) == [20, 21, 22, 23]
    assert sl.rounds == 2 and np.array_equal(sl.value, [30.0] * 4)


def _same_state(x, y) -> bool:
    """Whether two optimizer states hold the same numbers (as the wire carries them)."""
    return x is not None and optim.dump_states({0: x}) == optim.dump_states({0: y})


def test_a_plan_that_moves_a_slice_moves_its_copies_state_and_rounds():
    """Three servers, two copies (A's replica is B, B's is C, C's is A), as a worker's
    migration (hetps.balance.agent) plays it: ``w`` moves A -> C and ``v`` moves A -> B after
    two momentum rounds. Then every copy is where the new plan puts it, with the primary's
    value, momentum and round count, and the next round is applied at once."""
    a_id, b_id, c_id = 8, 10, 12
    wire = _Wire((a_id, b_id, c_id))
    for nid in wire.ids:
        wire.servers[nid] = new_server(wire.node(nid))
    a, b, c = (wire.servers[i] for i in wire.ids)
    _set_sgd(wire)
    meta = {"shape": [4], "dtype": "float32"}
    for req, key in enumerate(("w", "v")):
        body = {"k": key, "part": 0, "off": 0, "n": 4, "size": 4, **meta}
        a.handle(Message("init", sender=W0, req=req, body=body, arrays=[np.zeros(4, np.float32)]))
    wire.deliver()
    for rnd in range(2):
        for key in ("w", "v"):
            for w, g in ((W0, 1.0), (W1, 2.0 + rnd)):
                body = {"k": key, "part": 0, "off": 0, "n": 4, "sync": True, "ce": 4, "rnd": rnd}
                grad = np.full(4, g, np.float32)
                a.handle(Message("push", sender=w, req=100 + rnd, body=body, arrays=[grad]))
        wire.deliver()
    want = {k: (a.slices[(k, 0)].value.copy(), a.slices[(k, 0)].state) for k in ("w", "v")}
    assert b.slices[("w", 0)].origin == a_id and not b.slices[("w", 0)].primary
    assert ("w", 0) not in c.slices

    # the migration: reads on A (done), inits with the rounds so far, states, then drops
    for to, key in ((c, "w"), (b, "v")):
        body = {"k": key, "part": 0, "off": 0, "n": 4, "size": 4, "rnd": 2, **meta}
        to.handle(Message("init", sender=W0, req=200, body=body, arrays=[want[key][0]]))
        wire.deliver()  # the new primary's replica gets the value first
        blob = np.frombuffer(optim.dump_states({(key, 0): want[key][1]}), np.uint8)
        to.handle(Message("set_states", sender=W0, req=201, body={"move": True}, arrays=[blob]))
        assert [m.cmd for m, _, _ in wire.replies[to.node.id][-1:]] != ["set_states"]
        wire.deliver()  # ... and its state before the set_states is answered
        assert wire.replies[to.node.id][-1][0].cmd == "set_states"
    a.handle(Message("drop", sender=W0, req=202, body={"slices": [["w", 0], ["v", 0]]}))
    wire.deliver()

    # w: C serves it, A keeps the copy (A is C's replica); B's copy of A's is gone
    # v: B serves it, C has the copy (with the momentum it never had), A has nothing
    assert c.slices[("w", 0)].primary and not a.slices[("w", 0)].primary
    assert a.slices[("w", 0)].origin == c_id and ("w", 0) not in b.slices
    assert b.slices[("v", 0)].primary and c.slices[("v", 0)].origin == b_id
    assert ("v", 0) not in a.slices
    for srv, key in ((c, "w"), (a, "w"), (b, "v"), (c, "v")):
        sl = srv.slices[(key, 0)]
        assert sl.rounds == 2 and np.array_equal(sl.value, want[key][0])
        assert _same_state(sl.state, want[key][1]), (srv.node.id, key)

    # round 3 goes to the new primaries and is applied (and copied) at once
    for to, key in ((c, "w"), (b, "v")):
        for w, g in ((W0, 1.0), (W1, 5.0)):
            body = {"k": key, "part": 0, "off": 0, "n": 4, "sync": True, "ce": 4, "rnd": 2}
            grad = np.full(4, g, np.float32)
            to.handle(Message("push", sender=w, req=300, body=body, arrays=[grad]))
        wire.deliver()
        assert _acked(wire, to.node.id)[-2:] == [300, 300]
    for primary, copy, key in ((c, a, "w"), (b, c, "v")):
        p_sl, c_sl = primary.slices[(key, 0)], copy.slices[(key, 0)]
        assert p_sl.rounds == c_sl.rounds == 3
        assert np.array_equal(p_sl.value, c_sl.value) and _same_state(p_sl.state, c_sl.state)


def test_a_drop_spares_what_a_server_serves_for_the_slices_new_server():
    """A plan moved ``w`` from B to A (A serves it, B keeps the copy), then A died and B took
    its keys over. The drop "at B" (sent after the move, or sent to A and resent to B) names
    A as the new server: B serves for A now, so it keeps ``w`` and tells no replica to drop
    it. A named ``get_states`` (a plan's read) answers a copy's state too."""
    wire, a, b = _pair()
    _set_sgd(wire)
    _init(a, np.arange(4, dtype=np.float32))
    wire.deliver()
    _push(a, W0, 0, np.ones(4, np.float32), req=10)
    _push(a, W1, 0, np.ones(4, np.float32), req=11)
    wire.deliver()
    states = Message("get_states", sender=W0, req=12, body={"slices": [["w", 0]]})
    b.handle(states)  # a copy here: its state is the primary's
    blob = wire.replies[Q_ID][-1][2][0]
    assert _same_state(optim.load_states(blob.tobytes())[("w", 0)], a.slices[("w", 0)].state)
    wire.dead.add(P_ID)
    b.node.redirect = {P_ID: Q_ID}
    b.replication.on_failover(P_ID, Q_ID)
    assert b.slices[("w", 0)].primary
    b.handle(Message("drop", sender=W0, req=13, body={"slices": [["w", 0, P_ID]]}))
    assert ("w", 0) in b.slices and wire.replies[Q_ID][-1][0].req == 13
    b.handle(Message("drop", sender=W0, req=14, body={"slices": [["w", 0, 99]]}))
    assert ("w", 0) not in b.slices  # (moved elsewhere: it goes)
    b.handle(Message("drop", sender=W0, req=15, body={"slices": [["w", 0, True]]}))
    assert "error" in wire.replies[Q_ID][-1][1]
