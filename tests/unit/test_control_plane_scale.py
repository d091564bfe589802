"""The control plane at scale (benchmarks/scale_sim.py: 4,096 workers): what each fix keeps
true, checked small. A barrier's arrival reads no membership (O(1); a walk of the node table
per arrival was O(N^2) a barrier), the node table's routing ids come from one bulk call (an
HMAC per pair took seconds) and equal the per-pair derivation the fault parts use, and the
table every node gets is encoded once."""

from __future__ import annotations

import msgpack
import msgspec
import pytest

from hetps.cluster import protocol as P
from hetps.cluster.commands import NodeTable
from hetps.cluster.enrol import unpack_groups, unpack_routes, workers_of
from hetps.cluster.protocol import NodeInfo
from hetps.cluster.registration import Pending
from hetps.roles import new_scheduler
from hetps.transport.codec import Message
from roles import loopback_config

W = 64


@pytest.fixture
def sched():
    s = new_scheduler(loopback_config("scheduler", num_worker=W, num_server=4))
    s.nodes = {
        P.server_id(r): NodeInfo(P.server_id(r), "server", r, "127.0.0.1", 1) for r in range(4)
    }
    s.nodes.update(
        {P.worker_id(r): NodeInfo(P.worker_id(r), "worker", r, "127.0.0.1", 2) for r in range(W)}
    )
    s.sent = []
    s.send_to = lambda nid, msg: s.sent.append((nid, msg))
    yield s
    s.van.close()


def test_a_barrier_reads_its_members_once_not_per_arrival(sched, monkeypatch):
    walks = []
    members = sched.barriers.members
    monkeypatch.setattr(sched.barriers, "members", lambda g: walks.append(g) or members(g))
    for rnd in (1, 2):
        for i, nid in enumerate(sched.nodes):
            msg = Message(P.BARRIER, sender=nid, req=100 * rnd + i, body={"group": "all"})
            sched._dispatch(msg)
            released = [m for _, m in sched.sent if m.cmd == P.BARRIER_DONE]
            # nobody is released before the last arrival, everybody at it
            assert len(released) == (rnd - (i < len(sched.nodes) - 1)) * len(sched.nodes)
    assert walks == ["all"]  # once: the membership did not change
    # a worker finishes: the view is read again, and the next barrier does not wait for it
    sched._finish(Message(P.FINISH, sender=P.worker_id(0), req=1))
    sched.sent.clear()
    for nid in list(sched.nodes)[:-1]:
        if nid != P.worker_id(0):
            sched._dispatch(Message(P.BARRIER, sender=nid, req=7, body={"group": "all"}))
    assert not [m for _, m in sched.sent if m.cmd == P.BARRIER_DONE]
    sched._dispatch(Message(P.BARRIER, sender=list(sched.nodes)[-1], req=7, body={"group": "all"}))
    done = [nid for nid, m in sched.sent if m.cmd == P.BARRIER_DONE]
    assert sorted(done) == sorted(set(sched.nodes) - {P.worker_id(0)})
    assert walks == ["all", "worker", "all"]  # (a finish releases both groups)


def test_routing_ids_come_in_bulk_and_match_the_per_pair_derivation(sched):
    reg = sched.registration
    src = [P.worker_id(r) for r in range(W) for _ in range(4)]
    dst = [P.server_id(s) for _ in range(W) for s in range(4)]
    ids = reg.pair_ids(src, dst)
    assert len(set(ids)) == len(ids) == 4 * W  # one per pair and direction
    assert all(len(t) == 16 and t[:1] == b"h" for t in ids)
    assert ids[5] == reg.pair_id(src[5], dst[5])  # what takeover and elastic derive alone
    assert reg.pair_id(9, 8) != reg.pair_id(8, 9)
    sched.rejoined[8] = 1  # a server admitted again: every pair with it changes
    assert reg.pair_id(9, 8) != ids[0] and reg.pair_ids(src[5:6], dst[5:6]) == ids[5:6]


def test_a_node_admitted_again_gets_every_peers_ids_in_two_calls(sched, monkeypatch):
    # (takeover and elastic: a server taken back at 4,096 workers needs 2 x 4,099 ids)
    reg, nid = sched.registration, P.server_id(1)
    others = [i for i in sched.nodes if i != nid]
    want_out = [[i, reg.pair_id(nid, i)] for i in others]
    want_in = [[i, reg.pair_id(i, nid)] for i in others]
    calls = []
    bulk = reg.pair_block
    monkeypatch.setattr(reg, "pair_block", lambda s, d: calls.append(len(s)) or bulk(s, d))
    assert reg.pairs_with(nid, others) == (want_out, want_in)
    assert calls == [len(others), len(others)]
    assert reg.pairs_with(nid, []) == ([], [])


def test_assign_encodes_the_table_once_and_derives_ids_in_one_call(sched, monkeypatch):
    nodes = dict(sched.nodes)
    sched.nodes = {}
    reg = sched.registration
    for nid, n in nodes.items():
        group = n.rank // 3 if n.role == "worker" else -1  # (hosts of 3 workers)
        reg.pending.append(Pending(bytes([nid]), n.role, n.host, n.port, 1, n.rank, group))
    sched.van.rename = sched.van.admit = lambda *a: None
    calls = []
    bulk = reg.pair_block
    monkeypatch.setattr(reg, "pair_block", lambda s, d: calls.append(len(s)) or bulk(s, d))
    monkeypatch.setattr(reg, "pair_id", lambda *a: pytest.fail("a routing id derived alone"))
    reg.assign()
    tables = [m for _, m in sched.sent if m.cmd == P.NODES]
    # (the workers' ids with every server; a server derives its own from its key)
    assert len(tables) == W + 4 and calls == [4 * W, 4 * W]
    by_role = {
        role: [m for m in tables if P.role_of(m.body["id"]) == role]
        for role in ("server", "worker")
    }
    for got in by_role.values():
        assert len({id(m.body["nodes"]) for m in got}) == 1  # the same bytes in every answer
        assert len({id(m.body.get("group_runs")) for m in got}) == 1
    server = msgspec.convert(by_role["server"][0].body, NodeTable)
    rows = msgpack.unpackb(server.nodes) + [n.to_wire() for n in workers_of(server)]
    assert sorted(r[0] for r in rows) == sorted(nodes)
    # a worker's table: the servers' entries, and the workers' made from their count and
    # host groups, as a worker makes them (no worker's address: none connects to another)
    rows = msgpack.unpackb(by_role["worker"][0].body["nodes"])
    assert sorted(r[0] for r in rows) == [P.server_id(s) for s in range(4)]
    made = workers_of(msgspec.convert(by_role["worker"][0].body, NodeTable))
    assert [(n.id, n.rank, n.group) for n in made] == [
        (i, n.rank, n.rank // 3) for i, n in nodes.items() if n.role == "worker"
    ]
    assert len(unpack_groups(by_role["worker"][0].body["group_runs"])) == -(-W // 3)
    for m in tables:  # a worker's routing ids: to every server and back
        if P.role_of(m.body["id"]) == "worker":
            out, into = unpack_routes(m.body["out"]), unpack_routes(m.body["in"])
            assert list(out) == list(into) == [P.server_id(s) for s in range(4)]
            assert out[P.server_id(1)] == reg.pair_ids([m.body["id"]], [P.server_id(1)])[0]
            assert into[P.server_id(1)] == reg.pair_ids([P.server_id(1)], [m.body["id"]])[0]


def test_registration_checks_each_node_without_walking_the_others(sched, monkeypatch):
    """The checks a registration passes (a second one on a connection, too many of a role, a
    rank claimed twice) read indexes kept as nodes register, also after the pending list
    was replaced from outside (a failed start)."""
    from hetps.cluster import commands

    sched.nodes = {}
    reg = sched.registration
    refused = []
    monkeypatch.setattr(reg, "refuse", lambda origin, h, p, b, req, text: refused.append(text))
    monkeypatch.setattr(sched.van, "connect", lambda *a, **k: None)
    monkeypatch.setattr(reg, "assign", lambda: None)

    def add(origin: bytes, role: str, want: int) -> None:
        body = {
            "role": role,
            "host": "127.0.0.1",
            "port": 1,
            "back": b"b" + origin,
            "want_rank": want,
        }
        msg = Message(P.ADD_NODE, req=1, body=body)
        msg.origin = origin
        assert commands.decode(msg) is None
        reg.add_node(msg)

    add(b"a", "worker", 0)
    add(b"a", "worker", 1)  # the same connection again: dropped (logged), not counted
    add(b"b", "worker", 0)
    assert len(reg.pending) == 1 and "already claimed" in refused[-1]
    reg.pending = list(reg.pending)  # replaced from outside: the indexes are read again
    for r in range(1, W):
        add(bytes([r]) + b"w", "worker", r)
    add(b"extra", "worker", -1)
    assert len(reg.pending) == W and "too many workers" in refused[-1]


def test_the_host_groups_travel_packed_and_every_node_reads_them(sched):
    """The workers' host groups go out as one bytes value (int32 pairs), so a node's decode
    of the table builds no Python list per worker (it was 2.3 ms a message at 4,096 workers),
    and a node reads each worker's group from them; a table whose groups are not whole pairs
    is refused as malformed, naming it."""
    from types import SimpleNamespace

    from hetps.cluster.enrol import Enrolment
    from hetps.transport.codec import decode, encode

    nodes = dict(sched.nodes)
    sched.nodes = {}
    reg = sched.registration
    for nid, n in nodes.items():
        group = n.rank // 8 if n.role == "worker" else -1
        reg.pending.append(Pending(bytes([nid]), n.role, n.host, n.port, 1, n.rank, group))
    sched.van.rename = sched.van.admit = lambda *a: None
    reg.assign()
    tables = [m for _, m in sched.sent if m.cmd == P.NODES]
    assert len(tables) == W + 4
    # packed once for all: every server's table the (id, group) pairs, every worker's the
    # runs of groups in rank order
    field = {"server": "group_runs", "worker": "group_runs"}
    for role, key in field.items():
        assert len({id(m.body[key]) for m in tables if P.role_of(m.body["id"]) == role}) == 1
    for m in tables:
        got = decode(encode(m), 1 << 30)  # as the node's van hands it over
        assert isinstance(got.body[field[P.role_of(got.body["id"])]], bytes)
        van = SimpleNamespace(
            admit=lambda *a: None, connect=lambda *a, **k: None, mark_dead=lambda *a: None
        )
        node = SimpleNamespace(role=P.role_of(got.body["id"]), van=van)
        Enrolment(node, van).take_table(msgspec.convert(got.body, NodeTable))
        assert node.info.id == got.body["id"]
        assert {i: n.group for i, n in node.nodes.items()} == {
            i: (n.rank // 8 if n.role == "worker" else -1) for i, n in nodes.items()
        }
    bad = dict(tables[0].body, group_runs=tables[0].body["group_runs"][:-4])  # half a pair
    van = SimpleNamespace(admit=lambda *a: None, connect=lambda *a, **k: None)
    enrol = Enrolment(SimpleNamespace(role="worker", van=van), van)
    enrol.answer(Message(P.NODES, req=1, reply=True, body=bad))
    assert "malformed node table" in enrol._reg_error and "(id, group) pairs" in enrol._reg_error
    worker_table = next(m for m in tables if P.role_of(m.body["id"]) == "worker")
    bad = dict(worker_table.body, n_workers=worker_table.body["n_workers"] + 1)
    enrol = Enrolment(SimpleNamespace(role="worker", van=van), van)
    enrol.answer(Message(P.NODES, req=1, reply=True, body=bad))
    assert "malformed node table" in enrol._reg_error and "do not add up" in enrol._reg_error
    bad = dict(worker_table.body, out=worker_table.body["out"][:-1])  # a record a byte short
    enrol = Enrolment(SimpleNamespace(role="worker", van=van), van)
    enrol.answer(Message(P.NODES, req=1, reply=True, body=bad))
    assert "malformed node table" in enrol._reg_error and "whole records" in enrol._reg_error


def test_the_scheduler_queues_thousands_of_connections_at_once(sched):
    """Thousands of nodes reach the scheduler at once: its listener queues them (ZeroMQ's
    default of 100 drops the rest, whose connections come a TCP retry of 1, 3, 7 s later;
    scale_sim's registration at 264 nodes took 1.2 s for it, 0.3 s with the queue)."""
    import zmq

    assert sched.van._router.getsockopt(zmq.BACKLOG) >= 4096


def test_a_servers_table_at_4096_workers_is_compact_and_gives_every_routing_id():
    """A server's node table at 4,096 workers in 512 hosts (128 servers) holds the servers'
    entries, the workers' count, host groups and host names as runs, a port per worker and
    the server's own key, not an entry and two routing ids per worker (310 KB): it stays under
    a bound, and the server makes from it every worker's entry and routing ids equal to the
    per-pair derivation the scheduler's other parts use (the ids a full table carried)."""
    from types import SimpleNamespace

    from hetps.cluster.enrol import Enrolment
    from hetps.transport.codec import decode, encode

    workers, servers, per_host = 4096, 128, 8
    sch = new_scheduler(loopback_config("scheduler", num_worker=workers, num_server=servers))
    try:
        sch.sent = []
        sch.send_to = lambda nid, msg: sch.sent.append((nid, msg))
        sch.van.rename = sch.van.admit = lambda *a: None
        reg = sch.registration
        for r in range(servers):
            origin = b"s" + r.to_bytes(2, "big")
            reg.pending.append(Pending(origin, "server", f"10.1.0.{r % 250}", 9000 + r, 1, r))
        for r in range(workers):
            host, group = f"10.0.{r // per_host // 250}.{r // per_host % 250}", r // per_host
            origin = b"w" + r.to_bytes(2, "big")
            reg.pending.append(Pending(origin, "worker", host, 20000 + r, 1, r, group))
        want = {i: n for i, n in enumerate(reg.pending)}
        reg.assign()
        tables = {nid: m for nid, m in sch.sent if m.cmd == P.NODES}
        for s in (P.server_id(0), P.server_id(servers - 1)):
            wire = encode(tables[s])
            assert sum(len(f) for f in wire) < 32 * 1024  # a full table: about 310 KB
            got = decode(wire, 1 << 30)
            admitted, connected = {}, {}
            van = SimpleNamespace(
                admit=lambda rid, nid, got=admitted: got.__setitem__(nid, rid),
                connect=lambda nid, addr, routing_id, bulk, got=connected: got.__setitem__(
                    nid, (addr, routing_id)
                ),
                mark_dead=lambda *a: pytest.fail("no node is down"),
            )
            node = SimpleNamespace(role="server", van=van)
            Enrolment(node, van).take_table(msgspec.convert(got.body, NodeTable))
            assert node.info.id == s and len(node.nodes) == workers + servers
            ws = [P.worker_id(r) for r in range(workers)]
            assert [(node.nodes[w].host, node.nodes[w].port, node.nodes[w].group) for w in ws] == [
                (want[servers + r].host, want[servers + r].port, r // per_host)
                for r in range(workers)
            ]
            # every id: the server's to each worker, and each worker's to it
            assert [connected[w] for w in ws] == [
                (f"{node.nodes[w].host}:{node.nodes[w].port}", t)
                for w, t in zip(ws, reg.pair_ids([s] * workers, ws), strict=True)
            ]
            assert [admitted[w] for w in ws] == reg.pair_ids(ws, [s] * workers)
            # and the worker's table says the same ids
            w = P.worker_id(workers - 1)
            assert unpack_routes(tables[w].body["out"])[s] == admitted[w]
            assert unpack_routes(tables[w].body["in"])[s] == connected[w][1]
        # a server's table whose addresses do not add up is refused, naming it
        body = tables[P.server_id(0)].body
        van = SimpleNamespace(admit=lambda *a: None, connect=lambda *a, **k: None)
        for bad, why in [
            ({"ports": body["ports"][:-2]}, "worker addresses that do not add up to 4096"),
            ({"hosts": body["hosts"][:-1]}, "host index beyond the 511 hosts"),
            ({"ports": b""}, "worker addresses that do not add up to 4096"),  # none at all
            ({"ports": b"\0\0" + body["ports"][2:]}, "port 0 (ports are 1-65535)"),  # a port 0
        ]:
            enrol = Enrolment(SimpleNamespace(role="server", van=van), van)
            enrol.answer(Message(P.NODES, req=1, reply=True, body={**body, **bad}))
            assert "malformed node table" in enrol._reg_error and why in enrol._reg_error
    finally:
        sch.van.close()


def test_a_server_taken_back_and_a_worker_that_joins_get_compact_tables():
    """At 4,096 workers in 512 hosts (128 servers, HETPS_REPLICAS, HETPS_ELASTIC) a worker let
    go that joins again, then a server taken over that registers again, each get a node table
    as compact as a first one (an explicit one: an entry and two ids per node, about 310 KB
    for the server): each makes from it every node's entry and its routing ids with each peer,
    equal to the per-pair derivation, and each peer is told the same ids (its REJOIN); the
    joined worker's ids, which the server's key alone does not give, are listed."""
    from types import SimpleNamespace

    from hetps.cluster.enrol import Enrolment
    from hetps.transport.codec import decode, encode

    workers, servers, per_host = 4096, 128, 8
    cfg = loopback_config(
        "scheduler", num_worker=workers, num_server=servers, replicas=2, elastic=1
    )
    sch = new_scheduler(cfg)
    try:
        sch.sent = []
        sch.send_to = lambda nid, msg: sch.sent.append((nid, msg))
        stub = lambda *a, **k: None  # noqa: E731 - the scheduler's links: not tested here
        sch.van.rename = sch.van.admit = sch.van.connect = sch.van.disconnect = stub
        reg = sch.registration
        for r in range(servers):
            reg.pending.append(Pending(b"s%d" % r, "server", "10.1.0.1", 9000 + r, 1, r))
        for r in range(workers):
            host, group = f"10.0.{r // per_host // 250}.{r // per_host % 250}", r // per_host
            reg.pending.append(Pending(b"w%d" % r, "worker", host, 20000 + r, 1, r, group))
        reg.assign()
        ws = [P.worker_id(r) for r in range(workers)]
        ss = [P.server_id(r) for r in range(servers)]
        joiner, back = ws[5], ss[3]

        def taken(nid: int, port: int, again) -> tuple[dict, dict, SimpleNamespace, dict]:
            sch.sent.clear()
            msg = Message(P.ADD_NODE, req=7)
            msg.origin = b"again"
            again(msg, nid, "10.9.9.9", port, b"h" + bytes(15))
            (table,) = [m for to, m in sch.sent if m.cmd == P.NODES and to == nid]
            wire = encode(table)
            assert sum(len(f) for f in wire) < 32 * 1024
            admitted, connected = {}, {}
            van = SimpleNamespace(
                admit=lambda rid, i: admitted.__setitem__(i, rid),
                connect=lambda i, addr, routing_id, bulk: connected.__setitem__(i, routing_id),
                mark_dead=lambda *a: None,
            )
            node = SimpleNamespace(role=P.role_of(nid), van=van)
            Enrolment(node, van).take_table(msgspec.convert(decode(wire, 1 << 30).body, NodeTable))
            told = {to: m.body for to, m in sch.sent if m.cmd == P.REJOIN}
            return admitted, connected, node, told

        # the worker let go joins again: its ids with every server, and theirs to it
        sch.dead[joiner] = sch.left[joiner] = "a test let it go"
        admitted, connected, node, told = taken(joiner, 30000, sch.workers_part.admit_worker)
        assert node.info.id == joiner and len(node.nodes) == workers + servers
        assert [node.nodes[w].group for w in ws] == [r // per_host for r in range(workers)]
        assert [connected[s] for s in ss] == reg.pair_ids([joiner] * servers, ss)
        assert [admitted[s] for s in ss] == reg.pair_ids(ss, [joiner] * servers)
        assert [(told[s]["out"], told[s]["in"]) for s in ss] == [
            (admitted[s], connected[s]) for s in ss
        ]
        # a server taken over registers again: every worker's entry and ids made from its
        # table (the joined worker's listed), every peer told the same ids
        sch.dead[back] = "a test stopped it"
        sch.failovers.append((back, ss[4]))
        admitted, connected, node, told = taken(back, 9100, sch.takeover.readmit)
        assert node.info.id == back and len(node.nodes) == workers + servers
        assert [(node.nodes[w].host, node.nodes[w].port, node.nodes[w].group) for w in ws] == [
            ("10.9.9.9" if w == joiner else f"10.0.{r // 8 // 250}.{r // 8 % 250}",
             30000 if w == joiner else 20000 + r, r // per_host)
            for r, w in enumerate(ws)
        ]  # fmt: skip
        peers = [i for i in ss if i != back] + ws
        assert [connected[i] for i in peers] == reg.pair_ids([back] * len(peers), peers)
        assert [admitted[i] for i in peers] == reg.pair_ids(peers, [back] * len(peers))
        assert [(told[i]["out"], told[i]["in"]) for i in peers] == [
            (admitted[i], connected[i]) for i in peers
        ]
        listed = unpack_routes(next(m for _, m in sch.sent if m.cmd == P.NODES).body["out"])
        assert joiner in listed and ws[6] not in listed
    finally:
        sch.van.close()
