"""Every command's body is a declared type (hetps.cluster.commands), decoded once by the
dispatch that takes the request, before any handler runs.

For every command: the body its sender makes decodes into its type (readable attribute names
over the unchanged wire keys); a field of the wrong type, a field the command does not know
and a value out of its bounds are each refused with a text naming the command and the field;
random bodies never make the decoder raise. The scheduler's dispatch refuses a malformed body
with an error answer and no handler runs.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetps.cluster import allow, bodies, commands
from hetps.cluster import protocol as P
from hetps.cluster.protocol import NodeInfo
from hetps.roles import new_scheduler
from hetps.transport.codec import Message, decode, encode
from roles import loopback_config

_BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "typed_messages.py"
_spec = importlib.util.spec_from_file_location("typed_messages", _BENCH)
typed_messages = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(typed_messages)
#: a body of every command as its sender makes it (the benchmark times the same ones)
SAMPLES = {cmd: body for cmd, (body, _arrays) in typed_messages.SAMPLES.items()}

NODE = [9, "worker", 0, "127.0.0.1", 40001]
#: each command's field out of its bounds: (wire key, value)
OUT_OF_BOUND = {
    P.ADD_NODE: ("port", 0),
    P.READMIT: ("port", 70000),
    P.BARRIER: ("n", 0),
    P.LEAVE: ("reason", "x" * 2001),
    P.ADMIT: ("rounds", [["w0", -1]]),
    P.ESYNC_REPORT: ("step_s", -1.0),
    P.BALANCE_REPORT: ("samples", [[9, 8, 4096.0]]),
    P.METRICS_REPORT: ("seq", 0),
    P.INIT: ("off", -1),
    P.PUSH: ("ce", 0),
    P.PULL: ("n", -1),
    P.BATCH: ("items", [[P.PULL, 0, {}, 0]]),
    P.GET_STATES: ("slices", [["w0", -1]]),
    P.PROBE: ("reply_bytes", 1 << 27),
    P.DROP: ("slices", [["w0"]]),
    P.REPLICATE: ("rnd", -1),
    P.SINIT: ("cols", 0),
    P.SPUSH: ("part", -1),
    P.SPULL: ("k", "x" * 1025),
    P.SDUMP: ("n", -1),
    P.SLOAD: ("state", ["x" * 65]),
    P.WORKER_DONE: ("node", [9, "worker", 0, "127.0.0.1", 70000]),
    P.NODE_DEAD: ("error", "x" * 8193),
    P.FAILOVER: ("to", -1),
    P.REJOIN: ("out", b""),
    P.WORKER_LEFT: ("workers", [-1]),
    P.WORKER_JOINING: ("node", [-9, "worker", 0, "127.0.0.1", 1]),
    P.WORKER_BACK: ("workers", [-1]),
}
#: commands whose fields have no bound (or that carry none)
NO_BOUNDS = {
    P.HEARTBEAT, P.FINISH, P.JOIN, P.ENTERED, P.SET_OPTIMIZER, P.ENTER, P.EXIT, P.SET_STATES,
    P.FORECAST, P.RECEIPT,
}  # fmt: skip


def _decode(cmd: str, body: dict) -> Message:
    msg = Message(cmd, req=1, body=body)
    msg.why = commands.decode(msg)
    return msg


def test_every_command_has_a_type_a_sample_and_a_bound_case():
    assert set(SAMPLES) == set(commands.TYPES)
    assert set(OUT_OF_BOUND) | NO_BOUNDS == set(commands.TYPES)
    assert not set(OUT_OF_BOUND) & NO_BOUNDS


@pytest.mark.parametrize("cmd", sorted(commands.TYPES))
def test_the_senders_body_decodes_unchanged_through_the_codec(cmd):
    body = SAMPLES[cmd]
    got = decode(encode(Message(cmd, req=3, body=body)), 1 << 20)
    assert commands.decode(got) is None, commands.decode(Message(cmd, req=3, body=body))
    kind = type(got.typed)
    assert kind is commands.TYPES[cmd] or kind in commands.TYPES[cmd].__args__
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(got.typed))  # by wire names
    assert {k: wire[k] for k in body} == got.body, (wire, got.body)


def test_every_declared_field_is_documented_in_the_protocol():
    for cmd, kind in commands.TYPES.items():
        wire = set(bodies._wire(kind, None))
        assert wire <= set(bodies.meanings(cmd)), (cmd, wire - set(bodies.meanings(cmd)))


def test_readable_names_read_the_wire_keys():
    msg = _decode(P.REJOIN, SAMPLES[P.REJOIN])
    assert (msg.typed.outbound, msg.typed.inbound) == (b"\x02" * 8, b"\x03" * 8)
    msg = _decode(P.SDUMP, SAMPLES[P.SDUMP])
    assert (msg.typed.key, msg.typed.part, msg.typed.offset, msg.typed.count) == ("emb", 0, 0, 512)
    msg = _decode(P.READMIT, SAMPLES[P.READMIT])
    assert (msg.typed.node_id, msg.typed.credential, msg.typed.view.barriers["worker"]) == (
        9, b"c" * 32, 3)  # fmt: skip
    msg = _decode(P.REPLICATE, SAMPLES[P.REPLICATE])
    assert isinstance(msg.typed, commands.ReplicaRound) and msg.typed.round == 3


@pytest.mark.parametrize("cmd", sorted(commands.TYPES))
def test_a_field_the_command_does_not_know_is_refused(cmd):
    msg = _decode(cmd, {**SAMPLES[cmd], "zz": 1})
    assert msg.why is not None and msg.why.startswith(cmd), msg.why
    assert "unknown field 'zz'" in msg.why and msg.typed is None


@pytest.mark.parametrize(
    "cmd,name",
    sorted((cmd, name) for cmd, body in SAMPLES.items() for name in body if name != "op"),
)
def test_a_field_of_the_wrong_type_is_refused_naming_it(cmd, name):
    msg = _decode(cmd, {**SAMPLES[cmd], name: {"x": {"y": b"z"}}})
    assert msg.why is not None and msg.why.startswith(cmd), msg.why
    assert f"field {name!r}" in msg.why and msg.typed is None, msg.why


@pytest.mark.parametrize("cmd", sorted(OUT_OF_BOUND))
def test_a_value_out_of_its_bounds_is_refused_naming_the_field(cmd):
    name, value = OUT_OF_BOUND[cmd]
    msg = _decode(cmd, {**SAMPLES[cmd], name: value})
    assert msg.why is not None and msg.why.startswith(cmd), msg.why
    assert f"field {name!r}" in msg.why and msg.typed is None, msg.why


def test_a_replicate_is_told_apart_by_its_op():
    assert "field 'op' (which copy" in _decode(P.REPLICATE, {"op": "x"}).why
    assert "field 'op'" in _decode(P.REPLICATE, {"k": "w0"}).why
    drop = _decode(P.REPLICATE, {"op": "drop", "slices": [["w0", 0]], "k": "w0"})
    assert "unknown field 'k' (a replicate body has op, slices)" in drop.why


def test_a_nested_field_is_named_with_its_path():
    view = dict(SAMPLES[P.READMIT]["view"], nodes=[[1, 2]])
    why = _decode(P.READMIT, {**SAMPLES[P.READMIT], "view": view}).why
    assert why.startswith("readmit: field 'view'") and "at view.nodes[0]" in why


def test_the_text_is_printable_whatever_the_peer_sent():
    why = _decode(P.BARRIER, {"group": "x\nhetps scheduler stop\x1b[2J"}).why
    assert why.startswith("barrier: field 'group'") and why.isprintable()


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**64), 2**64),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.binary(max_size=8),
)
values = st.recursive(
    scalars,
    lambda kids: st.one_of(
        st.lists(kids, max_size=4),
        st.dictionaries(st.one_of(st.text(max_size=4), st.integers()), kids, max_size=3),
    ),
    max_leaves=10,
)


@st.composite
def requests(draw):
    cmd = draw(st.sampled_from(sorted(commands.TYPES) + ["nodes", "?"]))
    known = sorted(bodies._wire(commands.TYPES[cmd], None)) if cmd in commands.TYPES else []
    names = st.one_of(st.sampled_from(known), st.text(max_size=4)) if known else st.text()
    body = draw(st.dictionaries(names, values, max_size=6))
    if cmd in SAMPLES and draw(st.booleans()):  # a sender's body with some fields changed
        body = {**SAMPLES[cmd], **body}
    return cmd, body


@settings(max_examples=400, deadline=None, database=None)
@given(requests())
def test_random_bodies_never_crash_the_decoder(request):
    cmd, body = request
    msg = Message(cmd, req=1, body=body)
    why = commands.decode(msg)
    if why is None:
        assert cmd not in commands.TYPES or msg.typed is not None
    else:
        assert isinstance(why, str) and why.startswith(cmd) and why.isprintable()
        assert msg.typed is None


@pytest.fixture
def sched():
    s = new_scheduler(loopback_config("scheduler", num_worker=1))
    s.nodes = {9: NodeInfo(9, "worker", 0, "127.0.0.1", 2)}
    s.sent = []
    s.send_to = lambda nid, msg: s.sent.append((nid, msg))
    yield s
    s.van.close()


def test_the_scheduler_refuses_a_malformed_body_before_any_handler(sched):
    sched._dispatch(Message(P.BARRIER, sender=9, req=5, body={"group": "worker", "n": "1"}))
    (nid, answer), = sched.sent  # fmt: skip
    assert nid == 9 and answer.reply and answer.req == 5
    assert answer.error.startswith("barrier: field 'n'")
    assert not sched.barriers.groups["worker"].arrived  # the handler never ran
    sched._dispatch(Message(P.BARRIER, sender=9, req=6, body={"group": "worker", "n": 1}))
    assert [m.cmd for _, m in sched.sent[1:]] == [P.BARRIER_DONE]  # the node goes on


def test_a_metrics_report_refused_at_the_dispatch_counts_as_refused(sched):
    """The live metrics count every refused report (the dashboard shows it): one the
    dispatch refused reaches the service's ``on_refused`` hook, not its handler."""
    from hetps.metrics.live import LiveMetrics

    live = LiveMetrics(sched)
    handled = []
    sched.register(P.METRICS_REPORT, lambda s, m: handled.append(m), on_refused=live.refused_body)
    sched._dispatch(Message(P.METRICS_REPORT, sender=9, req=4, body={"seq": 0, "t": 1.0}))
    while not sched._service_q.empty():  # (the service thread's work, run here)
        sched._service_q.get_nowait()()
    assert live.refused == 1 and not handled
    (_, answer), = sched.sent  # fmt: skip
    assert answer.error.startswith("metrics_report: field 'seq'")


def test_who_may_send_a_command_is_read_from_its_one_declaration():
    for receiver, row in allow.ALLOWED.items():
        assert row == {c: d.to[receiver] for c, d in bodies.DECLARED.items() if receiver in d.to}
    assert all(d.to for d in bodies.DECLARED.values())  # each is taken by some role
    assert allow.permits("server", "worker", P.PUSH) and not allow.permits(
        "server", "server", P.PUSH
    )
    assert allow.permits("worker", "server", P.FORECAST) and not allow.permits(
        "worker", "worker", P.FORECAST
    )
    assert allow.permits("scheduler", None, P.ADD_NODE) and not allow.permits(
        "scheduler", None, P.BARRIER
    )
    assert allow.senders("scheduler", P.READMIT) == "a server or a worker or an unregistered node"
    assert not allow.permits("server", "worker", "pace")  # (no declaration: nobody sends it)


def test_declared_answers_decode_into_their_types_and_others_stay_as_they_are():
    body = {"barriers": {"worker": 3}, "rounds": [["w", 2]], "tables": [["t", {"rows": 4}]]}
    join = Message(P.JOIN, req=1, reply=True, body=body)
    assert commands.decode(join) is None
    assert (join.typed.barriers, join.typed.rounds, join.typed.tables) == (
        {"worker": 3}, [("w", 2)], [("t", {"rows": 4})])  # fmt: skip
    why = commands.decode(Message(P.JOIN, req=1, reply=True, body={"rounds": [["w", -1]]}))
    assert why.startswith("join: field 'rounds' ([[key, n], ...]: the rounds the first live")
    old = Message(P.READMIT, req=1, reply=True, body={})  # (the scheduler it knew)
    assert commands.decode(old) is None and old.typed.restarted is False
    error = Message(P.READMIT, req=1, reply=True, body={"error": "no"})  # read as an error
    assert commands.decode(error) is None and error.typed is None
    pull = Message(P.PULL, req=1, reply=True, body={"w": 2})  # no declared answer
    assert commands.decode(pull) is None and pull.typed is None


def test_a_command_is_declared_once_and_taken_by_a_named_role():
    with pytest.raises(ValueError, match="'push' is declared twice"):
        bodies.command(P.PUSH, bodies.Push, server=bodies.W)
    with pytest.raises(ValueError, match=r"scheduler=, server= or worker= \(got \['servr'\]\)"):
        bodies.command("zz", bodies.Push, servr=bodies.W)
    assert "zz" not in bodies.DECLARED and bodies.DECLARED[P.PUSH].kind is bodies.Push


def test_the_node_table_is_a_declared_answer_whose_type_makes_its_checks():
    """The scheduler's node table (add_node's answer) decodes into NodeTable; a count, a
    replica number, a metrics period or a job id out of bounds is refused by its type, naming
    the field, and a node that gets one fails its registration with that text."""
    from types import SimpleNamespace

    from hetps.cluster.enrol import Enrolment

    table = {"nodes": [NODE], "id": 9, "out": b"", "in": b"", "replicas": 2, "metrics_s": 0.5}
    msg = Message(P.NODES, req=1, reply=True, body=table)
    assert commands.decode(msg) is None
    assert (msg.typed.node_id, msg.typed.replicas, msg.typed.metrics_s) == (9, 2, 0.5)
    for name, value in [
        ("replicas", 0),
        ("n_workers", -1),
        ("metrics_s", 0.001),
        ("metrics_job", "a\nb"),
        ("elastic", -1),
        ("gen", -1),
    ]:
        bad = Message(P.NODES, req=1, reply=True, body={**table, name: value})
        why = commands.decode(bad)
        assert why is not None and f"field {name!r}" in why and bad.typed is None, (name, why)
        links = SimpleNamespace()
        enrol = Enrolment(SimpleNamespace(role="worker"), links)
        enrol.answer(Message(P.NODES, req=1, reply=True, body={**table, name: value}))
        assert "malformed node table" in enrol._reg_error and f"field {name!r}" in enrol._reg_error
