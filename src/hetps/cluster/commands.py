"""The declared body of every command a scheduler, a server, a worker or a state server
takes, and the one place a body is checked against it.

Each command's body travels as a msgpack map under short wire keys (their meanings are in
:data:`hetps.cluster.protocol.BODY_FIELDS`); here each is a :class:`msgspec.Struct` with
readable attribute names mapped onto those keys (``field(name=...)``), so the wire is
unchanged and old and new nodes understand each other. The chunk requests' types (init,
push, pull) are in :mod:`hetps.cluster.bodies`; :data:`TYPES` names every command's.

:func:`decode` is the decode point: each receiver's dispatch (the scheduler's, a node's, a
server's for the items of a batch, the standalone state server's) calls it for every request
before a handler runs. It converts the body into the command's type (msgspec checks every
type and bound in C, and refuses a field the command does not know), keeps it on the message
(``msg.typed``), and returns why a body is refused: a text naming the command and the field.
Replies are not decoded here (each is read by the request that waits for it); a command with
no type here is one no receiver handles, which the dispatch refuses as today. What needs the
receiver's state (does the key exist, is the node known) is checked by the handlers.
"""

from __future__ import annotations

import sys
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct, field

from hetps.cluster import bodies
from hetps.cluster import protocol as P
from hetps.cluster.bodies import Count, Key, KeyDType, Shape

#: a node id (the scheduler 1, servers 8 + 2r, workers 9 + 2r)
NodeId = Annotated[int, Meta(ge=0, lt=1 << 31)]
#: a ZeroMQ routing id: 1 to 255 bytes (the van refuses one starting with a zero byte)
RoutingId = Annotated[bytes, Meta(min_length=1, max_length=255)]
#: a node as the node table has it (NodeInfo.to_wire): id, role, rank, host, port
NodeWire = tuple[
    NodeId,
    Annotated[str, Meta(max_length=16)],
    Annotated[int, Meta(ge=-1)],
    Annotated[str, Meta(max_length=255)],
    Annotated[int, Meta(ge=0, le=65535)],
]
#: a text a peer reports (a reason, how a node died)
Text = Annotated[str, Meta(max_length=8192)]
#: a host name or address, as a node gives it
Host = Annotated[str, Meta(min_length=1, max_length=255)]
Port = Annotated[int, Meta(gt=0, lt=65536)]
#: seconds or another finite non-negative number
Seconds = Annotated[float, Meta(ge=0, le=sys.float_info.max)]
Finite = Annotated[float, Meta(ge=-sys.float_info.max, le=sys.float_info.max)]
#: a slice: [key, part]
SliceName = tuple[Key, Count]
#: a request id
Req = int


class Body(Struct, kw_only=True, forbid_unknown_fields=True):
    """A command's body (each subclass says ``kw_only`` again: msgspec does not inherit it)."""


class Empty(Body, kw_only=True):
    """No fields (heartbeat, finish, join, entered, enter, exit, set_optimizer)."""


# -- node -> scheduler ------------------------------------------------------------------------
class AddNode(Body, kw_only=True):
    """A node registers: where the scheduler connects back to it, and the rank it wants."""

    role: Literal["server", "worker"]
    host: Host
    port: Port
    back: RoutingId
    want_rank: Annotated[int, Meta(ge=-1)] = -1
    host_group: Annotated[int, Meta(ge=-1, lt=1 << 31)] = -1


class View(Body, kw_only=True):
    """What a node knows of the running job (readmit)."""

    nodes: list[NodeWire]
    down: list[NodeId] = []
    redirect: list[tuple[NodeId, NodeId]] = []
    done: list[NodeId] = []
    barriers: dict[str, Count] = {}
    replicas: Annotated[int, Meta(ge=1)] = 1


class Readmit(Body, kw_only=True):
    """A node of a running job asks a scheduler started again to take it back."""

    node_id: NodeId = field(name="id")
    role: Literal["server", "worker"]
    rank: Count
    host: Host
    port: Port
    back: RoutingId
    view: View
    #: the credential it was admitted with (cluster/credentials.py), with a cluster secret
    credential: bytes | None = field(default=None, name="cred")
    generation: Count | None = field(default=None, name="gen")


class Leave(Body, kw_only=True):
    reason: Annotated[str, Meta(max_length=2000)] = "left"


class Barrier(Body, kw_only=True):
    group: Literal["worker", "server", "all"]
    #: the barrier's number for this node (absent: one more than its last)
    n: Annotated[int, Meta(ge=1)] | None = None


class Admit(Body, kw_only=True):
    """A live worker at its round boundary (the first also gives what a joiner starts from)."""

    rounds: list[tuple[Key, Count]] = []
    tables: list[tuple[Key, dict[str, Any]]] = []


class EsyncReport(Body, kw_only=True):
    """A worker's local step, for the ESync state server."""

    #: believed by a standalone state server for a connection's first report only; the
    #: scheduler's service takes the connection's rank
    rank: int | None = None
    round: Count
    step_s: Seconds
    elapsed_s: Seconds
    endpoint: Annotated[str, Meta(max_length=300)] | None = field(default=None, name="ep")
    back: RoutingId | None = None


class BalanceReport(Body, kw_only=True):
    """A worker's measurements for the load planner."""

    round: int
    #: [src, dst, bytes, t0, t1(, kind)] each
    samples: Annotated[
        list[Annotated[list[Finite], Meta(min_length=5, max_length=6)]], Meta(max_length=1 << 17)
    ] = []
    #: {server rank: [bytes, seconds]} of the last round
    server_times: dict[
        Annotated[str, Meta(pattern="^[0-9]{1,6}$")],
        Annotated[list[Finite], Meta(min_length=2, max_length=2)],
    ] = {}
    sizes: list[Count] | None = None
    assign: list[int] | None = None
    calibration: bool = False
    spread_done: tuple[str, int] | None = None


class MetricsReport(Body, kw_only=True):
    """A worker's or a server's counters for live metrics (the rest of their checks, bounds
    and shapes, are :func:`hetps.metrics.reports.parse_report`'s)."""

    seq: Annotated[int, Meta(ge=1)]
    t: Seconds
    rounds: Count | None = None
    round_s: Seconds | None = None
    links: list[list[int]] = []
    timeline: list[Any] | None = field(default=None, name="tl")
    run: str | None = None
    server: dict[str, int | float] | None = None
    histograms: dict[str, list[Any]] | None = field(default=None, name="h")
    values: list[Any] | None = field(default=None, name="m")
    sys: dict[str, Any] | None = None
    log: list[str] | None = None


# -- worker -> server -------------------------------------------------------------------------
class Batch(Body, kw_only=True):
    #: [command, request id, body, arrays] each (each item's body is then decoded as its own)
    items: Annotated[
        list[
            tuple[
                Literal["init", "push", "pull", "spush", "spull"],
                Annotated[int, Meta(ge=1)],
                dict[str, Any],
                Count,
            ]
        ],
        Meta(max_length=P.MAX_BATCH_ITEMS),
    ]


class GetStates(Body, kw_only=True):
    slices: list[SliceName] | None = None


class SetStates(Body, kw_only=True):
    #: a plan moved these slices here: their replicas get the states too
    move: bool = False


class Forecast(Body, kw_only=True):
    tag: int


class Probe(Body, kw_only=True):
    reply_bytes: Annotated[int, Meta(ge=0, le=1 << 26)] = 0
    spread: bool = False
    tag: int | None = None


class Drop(Body, kw_only=True):
    #: [key, part] or [key, part, the server it moved to] each
    slices: list[Annotated[list[Key], Meta(min_length=2, max_length=3)]] = []


class Receipt(Body, kw_only=True):
    req: Req


# -- row-sparse keys (tables) -----------------------------------------------------------------
class TablePart(Body, kw_only=True):
    key: Key = field(name="k")
    part: Count


class SInit(TablePart, kw_only=True):
    parts: Annotated[int, Meta(ge=1)] = field(name="nparts")
    rows: Count | None
    cols: Annotated[int, Meta(ge=1, le=1 << 20)]
    dtype: KeyDType
    scale: Finite = 0.0
    seed: Count = 0
    bound: Count = 0
    #: the table's own optimizer, pickled (from a worker only)
    optimizer: bytes | None = field(default=None, name="opt")


class SPush(TablePart, kw_only=True):
    sync: bool = True
    #: HETPS_REPLICAS > 1: the worker's count of its earlier pushes of the table
    round: Count | None = field(default=None, name="rnd")


class SPull(TablePart, kw_only=True):
    pass


class SDump(TablePart, kw_only=True):
    offset: Count = field(default=0, name="off")
    count: Count = field(default=0, name="n")


class SLoad(TablePart, kw_only=True):
    fresh: bool = False
    state: list[Annotated[str, Meta(max_length=64)]] = []
    numbers: dict[str, int | float] = {}


# -- server -> server (HETPS_REPLICAS): op names which copy ---------------------------------
class ReplicaRound(Body, tag_field="op", tag="round", kw_only=True):
    key: Key = field(name="k")
    part: Count
    round: Count = field(name="rnd")
    mode: Literal["grad", "value"]


class ReplicaSync(Body, tag_field="op", tag="sync", kw_only=True):
    key: Key = field(name="k")
    part: Count
    shape: Shape
    dtype: KeyDType
    round: Count = field(name="rnd")


class ReplicaOptimizer(Body, tag_field="op", tag="optimizer", kw_only=True):
    pass


class ReplicaStates(Body, tag_field="op", tag="states", kw_only=True):
    pass


class ReplicaDrop(Body, tag_field="op", tag="drop", kw_only=True):
    slices: list[SliceName]


# a table's part (tables/server_replicas.py): the worker's sinit and sload as they came, a
# round's distinct rows and sums, and a whole part (a header, then chunks of its used rows)
class ReplicaSInit(SInit, tag_field="op", tag="sinit", kw_only=True):
    pass


class ReplicaSLoad(SLoad, tag_field="op", tag="sload", kw_only=True):
    pass


class ReplicaSRound(Body, tag_field="op", tag="sround", kw_only=True):
    key: Key = field(name="k")
    part: Count
    round: Count = field(name="rnd")
    #: the round failed on the primary: only counted
    dropped: bool = False


class ReplicaSSync(SLoad, tag_field="op", tag="ssync", kw_only=True):
    #: the header (fresh) carries the part's declaration and rounds; a chunk has none
    parts: Annotated[int, Meta(ge=1)] | None = field(default=None, name="nparts")
    rows: Count | None = None
    cols: Annotated[int, Meta(ge=1, le=1 << 20)] | None = None
    dtype: KeyDType | None = None
    scale: Finite = 0.0
    seed: Count = 0
    bound: Count = 0
    optimizer: bytes | None = field(default=None, name="opt")
    round: Count | None = field(default=None, name="rnd")


#: a replicate's body: an init's (op init), or one of the others
Replicate = (
    bodies.Init
    | ReplicaRound
    | ReplicaSync
    | ReplicaOptimizer
    | ReplicaStates
    | ReplicaDrop
    | ReplicaSInit
    | ReplicaSLoad
    | ReplicaSRound
    | ReplicaSSync
)


# -- scheduler -> nodes -----------------------------------------------------------------------
class NodeNotice(Body, kw_only=True):
    node: NodeWire


class NodeDead(NodeNotice, kw_only=True):
    error: Text = ""


class Failover(NodeNotice, kw_only=True):
    error: Text = ""
    #: the live server that serves the dead one's keys now
    to: NodeId


class Rejoin(NodeNotice, kw_only=True):
    #: the routing id to connect to it with, and the one its connection to this node uses
    outbound: RoutingId = field(name="out")
    inbound: RoutingId = field(name="in")


class WorkerLeft(NodeNotice, kw_only=True):
    error: Text = ""
    workers: list[NodeId]


class WorkerBack(NodeNotice, kw_only=True):
    workers: list[NodeId] = []


#: every command's declared body (a request or a notice; replies are read by their request)
TYPES: dict[str, Any] = {
    # to the scheduler
    P.ADD_NODE: AddNode,
    P.READMIT: Readmit,
    P.HEARTBEAT: Empty,
    P.BARRIER: Barrier,
    P.FINISH: Empty,
    P.LEAVE: Leave,
    P.JOIN: Empty,
    P.ADMIT: Admit,
    P.ENTERED: Empty,
    P.ESYNC_REPORT: EsyncReport,
    P.BALANCE_REPORT: BalanceReport,
    P.METRICS_REPORT: MetricsReport,
    # to a server
    **bodies.TYPES,
    P.BATCH: Batch,
    P.SET_OPTIMIZER: Empty,
    P.GET_STATES: GetStates,
    P.SET_STATES: SetStates,
    P.FORECAST: Forecast,
    P.PROBE: Probe,
    P.DROP: Drop,
    P.ENTER: Empty,
    P.REPLICATE: Replicate,
    P.SINIT: SInit,
    P.SPUSH: SPush,
    P.SPULL: SPull,
    P.SDUMP: SDump,
    P.SLOAD: SLoad,
    # to a worker
    P.RECEIPT: Receipt,
    # from the scheduler to nodes
    P.WORKER_DONE: NodeNotice,
    P.EXIT: Empty,
    P.NODE_DEAD: NodeDead,
    P.FAILOVER: Failover,
    P.REJOIN: Rejoin,
    P.WORKER_LEFT: WorkerLeft,
    P.WORKER_JOINING: NodeNotice,
    P.WORKER_BACK: WorkerBack,
}


#: a command whose body is one of several types told apart by a tag field: the tag field and
#: each tag's type (converting into the union itself costs msgspec 20x more: it is not cached)
_TAGGED: dict[str, tuple[str, dict[Any, Any]]] = {
    cmd: (
        kind.__args__[0].__struct_config__.tag_field,
        {m.__struct_config__.tag: m for m in kind.__args__},
    )
    for cmd, kind in TYPES.items()
    if hasattr(kind, "__args__")
}


def decode(msg: Any) -> str | None:
    """``msg``'s body as its command's declared type, kept on ``msg.typed``; the text that
    refuses it (naming the command and the field), or None. A reply, a message decoded
    already and a command no receiver handles (its dispatch refuses it) are left as they
    are."""
    if msg.reply or msg.typed is not None:
        return None
    kind = TYPES.get(msg.cmd)
    if kind is None:
        return None
    tagged = _TAGGED.get(msg.cmd)
    if tagged is not None:  # (an unknown tag: the union says what is wrong)
        field_name, members = tagged
        tag = msg.body.get(field_name) if isinstance(msg.body, dict) else None
        kind = members.get(tag, kind) if isinstance(tag, str) else kind
    try:
        msg.typed = msgspec.convert(msg.body, kind)
    except msgspec.ValidationError as exc:
        # (printable: the text is logged and answered, and may quote what the peer sent)
        return P.printable(bodies.explain(msg.cmd, msg.body, kind, str(exc)))
    except Exception as exc:  # noqa: BLE001 - whatever a peer sent, the node goes on
        return P.printable(f"{msg.cmd}: the body cannot be read as its type ({exc!r})")
    return None
