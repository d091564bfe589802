"""Every command but the data plane's requests, declared once (:func:`hetps.cluster.bodies.command`:
its body's type, the meaning of each field, who may send it to whom, its answer's type), and
the one place a body is checked against its type.
(docs/MODULES.md, "hetps.cluster.commands")"""

from __future__ import annotations

import sys
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType, field

from hetps.cluster import batch, bodies  # noqa: F401 - (batch declares its command)
from hetps.cluster import protocol as P
from hetps.cluster.bodies import (
    DECLARED,
    NODES,
    SCHED,
    Body,
    Count,
    Finite,
    Key,
    KeyDType,
    S,
    Shape,
    SInit,
    SLoad,
    W,
    command,
)

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
#: the live metrics' job id (printable ASCII)
JobId = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[ -~]*$")]
#: a slice: [key, part]
SliceName = tuple[Key, Count]
#: a request id
Req = int


class Empty(Body, kw_only=True):
    """No fields."""


command(P.HEARTBEAT, Empty, scheduler=NODES)
command(P.FINISH, Empty, scheduler=W)
command(P.ENTERED, Empty, scheduler=W)
command(P.ENTER, Empty, server=W)
command(P.EXIT, Empty, server=SCHED, worker=SCHED)
# a pickle: only from a registered worker
command(P.SET_OPTIMIZER, Empty, server=W, doc={"(array 0)": "the optimizer, pickled"})


class NodeTable(Body, kw_only=True):
    """The scheduler's answer to add_node: the node table (:mod:`hetps.cluster.enrol`).

    ``nodes``: [[id, role, rank, host, port], ...] (msgpack-encoded once for all); ``me``: a
        worker's own entry (its table lists the servers); ``id``: this node's id
    ``out``, ``in``: the routing ids of its connections to its peers, and of theirs to it
    ``n_workers``, ``group_runs``: the workers, their host groups in rank order (the first table)
    ``hosts``, ``host_runs``, ``ports``: a server's first table: the workers' addresses, and
        ``key``, the server's own key its routing ids with them are derived from
    ``groups``: the host groups (HETPS_HOST_GROUP); ``replicas``: HETPS_REPLICAS
    ``recovery``: 1: taken back into a running job, with ``down`` (dead servers), ``redirect``
        ([[dead, heir], ...]), ``left`` (workers let go) and ``elastic`` (HETPS_ELASTIC)
    ``cred``, ``gen``: the credential it proves who it is with, and its generation
    ``metrics_job``, ``metrics_s``: the live metrics' job id and seconds between reports"""

    nodes: bytes | list[NodeWire]
    node_id: NodeId = field(name="id")
    out: bytes | list[tuple[NodeId, RoutingId]]
    into: bytes | list[tuple[NodeId, RoutingId]] = field(name="in")
    me: NodeWire | None = None
    n_workers: Annotated[int, Meta(ge=0, le=1 << 20)] | None = None
    group_runs: bytes | list[tuple[int, int]] = b""
    hosts: Annotated[list[Host], Meta(max_length=1 << 20)] = []
    host_runs: bytes = b""
    ports: bytes = b""
    route_key: Annotated[bytes, Meta(min_length=32, max_length=32)] | None = field(
        default=None, name="key"
    )
    groups: bytes | list[tuple[int, int]] = b""
    replicas: Annotated[int, Meta(ge=1)] = 1
    recovery: int = 0
    down: list[NodeId] = []
    redirect: list[tuple[NodeId, NodeId]] = []
    left: list[NodeId] = []
    elastic: Count = 0
    credential: bytes | None = field(default=None, name="cred")
    generation: Count | None = field(default=None, name="gen")
    metrics_job: JobId | None = None
    metrics_s: Annotated[float, Meta(ge=0.05, le=3600)] | None = None


# -- node -> scheduler ------------------------------------------------------------------------
@command(P.ADD_NODE, reply=NodeTable, answer=P.NODES, scheduler=frozenset({P.NEWCOMER}))
class AddNode(Body, kw_only=True):
    """A node registers: where the scheduler connects back to it, and the rank it wants.

    ``role``: server or worker
    ``host``: the host the scheduler connects back to (a name or an address)
    ``port``: the port there (1-65535)
    ``back``: the routing id the scheduler connects back with (1-255 bytes)
    ``want_rank``: the rank its launcher gave it (-1: any)
    ``host_group``: a worker's host, as its launcher numbered it (HETPS_HOST_GROUP; -1: not known, a
        host of its own)"""

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


class ReadmitAnswer(Body, kw_only=True):
    """``restarted``: true from a scheduler that was started again (the node then sends its
    unanswered requests to it again); absent from the scheduler it knew"""

    restarted: bool = False


@command(P.READMIT, reply=ReadmitAnswer, scheduler=frozenset({P.NEWCOMER, P.SERVER, P.WORKER}))
class Readmit(Body, kw_only=True):
    """A node of a running job asks a scheduler started again to take it back (the senders: a
    restarted scheduler's newcomers).

    ``id``: the node's id in the running job
    ``role``: its role (server or worker)
    ``rank``: its rank
    ``host``: the host the scheduler connects back to, as in add_node
    ``port``: the port there
    ``back``: the routing id the scheduler connects back with
    ``view``: what the node knows of the job: nodes (the node table), down (dead servers), redirect
        ([[dead, heir], ...]), done (a server: the workers that finished), barriers ({group: the
        barriers it passed}), replicas
    ``cred``: with a cluster secret: the credential it was admitted with
    ``gen``: with a cluster secret: that credential's generation"""

    node_id: NodeId = field(name="id")
    role: Literal["server", "worker"]
    rank: Count
    host: Host
    port: Port
    back: RoutingId
    view: View
    credential: bytes | None = field(default=None, name="cred")
    generation: Count | None = field(default=None, name="gen")


@command(P.LEAVE, scheduler=NODES)  # self only: the connection names the node that leaves
class Leave(Body, kw_only=True):
    """``reason``: why the node is going away (at most 2000 characters)"""

    reason: Annotated[str, Meta(max_length=2000)] = "left"


class BarrierAnswer(Body, kw_only=True):
    """``members``: HETPS_ELASTIC: the ids of the group's live members"""

    members: list[NodeId] | None = None


@command(P.BARRIER, reply=BarrierAnswer, answer=P.BARRIER_DONE, scheduler=NODES)
class Barrier(Body, kw_only=True):
    """``group``: worker, server or all
    ``n``: the barrier's number for this node (absent: one more than its last)
    ``host``: a host's leader: the workers of its host it arrives for (itself among them or
    not), all at ``n``; one answer releases them (cluster/hostlead.py)"""

    group: Literal["worker", "server", "all"]
    n: Annotated[int, Meta(ge=1)] | None = None
    host: Annotated[list[NodeId], Meta(max_length=4096)] | None = None


class JoinAnswer(Body, kw_only=True):
    """``barriers``: {group: n}: the barriers it has passed from now on
    ``rounds``: [[key, n], ...]: the rounds the first live worker pushed of each key
    ``tables``: the row-sparse keys' declarations, as admit gave them
    ``(array 0)``: the state it gave (admit)"""

    barriers: dict[str, Count] = {}
    rounds: list[tuple[Key, Count]] = []
    tables: list[tuple[Key, dict[str, Any]]] = []


# (HETPS_ELASTIC) a worker started again asks to join; self only
command(P.JOIN, Empty, reply=JoinAnswer, scheduler=W)


@command(P.ADMIT, scheduler=W)
class Admit(Body, kw_only=True):
    """A live worker at its round boundary (the first also gives what a joiner starts from; the
    answer comes once every worker waiting to join is in).

    ``(array 0)``: from the first live worker: the state a joiner starts from (bytes)
    ``rounds``: from the first live worker: [[key, n], ...], the rounds it pushed
    ``tables``: from the first live worker: [[key, {rows, cols, dtype, scale, seed, server_bytes}],
        ...], the row-sparse keys' declarations"""

    rounds: list[tuple[Key, Count]] = []
    tables: list[tuple[Key, dict[str, Any]]] = []


@command(P.ESYNC_REPORT, scheduler=W)  # the rank is the connection's, not the body's
class EsyncReport(Body, kw_only=True):
    """A worker's local step, for the ESync state server.

    ``rank``: the worker's rank (a standalone state server believes it for a connection's first
        report only; the scheduler takes the connection's)
    ``round``: the round of the step
    ``step_s``: seconds of the worker's last local step
    ``elapsed_s``: seconds since the round began, on the worker
    ``ep``: host:port the standalone state server answers to
    ``back``: the routing id the worker knows the standalone state server by"""

    rank: int | None = None
    round: Count
    step_s: Seconds
    elapsed_s: Seconds
    endpoint: Annotated[str, Meta(max_length=300)] | None = field(default=None, name="ep")
    back: RoutingId | None = None


class BalanceAnswer(Body, kw_only=True):
    """The load planner's answer (:mod:`hetps.balance.wire`).

    ``plan``: the plan every worker gets, msgpack-packed once (:class:`hetps.balance.wire.Plan`)
    ``node_rates``: worker rank 0's: the per-node caps and where they come from
    ``(array 0)``: worker rank 0's: the estimated link matrix (float64, N x N)"""

    plan: bytes | UnsetType = UNSET
    node_rates: dict[str, list[Any]] | UnsetType = UNSET


@command(P.BALANCE_REPORT, reply=BalanceAnswer, scheduler=W)
class BalanceReport(Body, kw_only=True):
    """A worker's measurements for the load planner (its answer: :mod:`hetps.balance.wire`).

    ``round``: the worker's rebalance() count
    ``samples``: [[src, dst, bytes, t0, t1, kind], ...] link samples (kind 1: probe, 2/3: a spread's
        flow)
    ``server_times``: {server rank: [bytes, seconds]} of the last round
    ``(array 0)``: the samples instead of the list: float64, one row [src, dst, bytes, t0, t1, kind]
        each (how the balance agent sends them)
    ``(array 1)``: the server times instead of the map: float64, rows [server rank, bytes, seconds]
    ``sizes``: element counts of the keys in init order (first report, or new keys)
    ``assign``: the server of every slice, in layout order (with sizes)
    ``calibration``: these samples hold a whole new probe cycle
    ``spread_done``: [way, rank] of the spread probe this worker took part in
    ``one_push``: this worker's host pushes once for its workers (host-local aggregation)
    ``host``: a host's leader: the workers of its host it reports for, whose arrays follow each
        other in the two arrays (cluster/hostlead.py)
    ``host_rows``: with ``host``: [[samples, server times], ...] rows of each of them (samples
        merged per (host, server) pair by the leader: all the first's)"""

    round: int
    samples: Annotated[
        list[Annotated[list[Finite], Meta(min_length=5, max_length=6)]], Meta(max_length=1 << 17)
    ] = []
    server_times: dict[
        Annotated[str, Meta(pattern="^[0-9]{1,6}$")],
        Annotated[list[Finite], Meta(min_length=2, max_length=2)],
    ] = {}
    sizes: list[Count] | None = None
    assign: list[int] | None = None
    calibration: bool = False
    one_push: bool = False
    spread_done: tuple[str, int] | None = None
    host: Annotated[list[NodeId], Meta(max_length=4096)] | None = None
    host_rows: Annotated[list[tuple[Count, Count]], Meta(max_length=4096)] | None = None


@command(P.METRICS_REPORT, scheduler=NODES)  # counted as the connection's node, not the body's
class MetricsReport(Body, kw_only=True):
    """A worker's or a server's counters for live metrics (the rest of their checks, bounds and
    shapes, are :func:`hetps.metrics.reports.parse_report`'s).

    ``seq``: the report's number, from 1, one more each report (an old or repeated one is refused)
    ``t``: seconds since the worker's meter started (its own clock, increasing)
    ``rounds``: rounds this worker began so far: the most pushes of any one key
    ``round_s``: seconds of its last whole round (absent before the second round)
    ``links``: [[server rank, bytes sent to it, bytes received from it], ...], totals since the
        worker started, at most one row per server (a server's report: [[worker rank, sent,
        received], ...], one row per worker)
    ``tl``: the worker's last rounds since its last report (at most 8): [[round, [[phase, unix
        start, seconds], ...] (at most 32), [[server rank, sent, received], ...] (the round's
        bytes)], ...] (hetps.metrics.reports)
    ``run``: the run directory the worker logs into, where the scheduler leaves the dashboard's last
        state (a printable path, at most 4096 characters)
    ``server``: a server's report: {rounds: rounds merged, opt_s: seconds in the optimizer,
        replicas: copies of every key} (hetps.metrics.server_meter)
    ``h``: {push|pull|round: [counts, sum]}: what the worker's fixed-bucket histograms gained since
        its last report (counts per bucket of hetps.metrics.reports.BUCKETS and one for above them;
        the sum of the observed seconds)
    ``m``: the script's own values since the last report (hetps.torch.log_metrics): [[step, {name:
        number}], ...], at most 32 entries and 16 names
    ``sys``: {cpu: percent of one core since the last report, rss: resident bytes, gpu:
        [[utilisation %, memory used, memory total], ...] (NVML), or nogpu: why none}
    ``log``: the last lines the node wrote since its last report (at most 20 of 300 characters,
        addresses replaced)"""

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
@command(P.GET_STATES, server=W)
class GetStates(Body, kw_only=True):
    """``slices``: [[key, part], ...] to read (absent: every state)"""

    slices: list[SliceName] | None = None


@command(P.SET_STATES, server=W)  # a pickle: only from a registered worker
class SetStates(Body, kw_only=True):
    """``move``: the states of slices a plan moved here (their replicas get them too)
    ``(array 0)``: the states, pickled (accepted from a worker only)"""

    move: bool = False


@command(P.FORECAST, server=W, worker=S)
class Forecast(Body, kw_only=True):
    """``tag``: the request id of the data message that follows"""

    tag: int


@command(P.PROBE, server=W)
class Probe(Body, kw_only=True):
    """``reply_bytes``: bytes of payload in the answer
    ``spread``: one flow of a spread probe (several flows at once)
    ``tag``: the request id its forecast carried"""

    reply_bytes: Annotated[int, Meta(ge=0, le=1 << 26)] = 0
    spread: bool = False
    tag: int | None = None


@command(P.DROP, server=W)
class Drop(Body, kw_only=True):
    """``slices``: [[key, part], ...] or [[key, part, the server it moved to], ...] to forget"""

    slices: list[Annotated[list[Key], Meta(min_length=2, max_length=3)]] = []


@command(P.RECEIPT, worker=S)
class Receipt(Body, kw_only=True):
    """``req``: the push request that arrived"""

    req: Req


# -- server -> server (HETPS_REPLICAS): op names which copy ---------------------------------
class ReplicaRound(Body, tag_field="op", tag="round", kw_only=True):
    """``k``: the key
    ``part``: the part index
    ``rnd``: the rounds the copy has had with this one
    ``mode``: grad (the merged pushes, for the optimizer) or value (the new value)
    ``(array 0)``: the merged pushes (grad) or the new value (value)"""

    key: Key = field(name="k")
    part: Count
    round: Count = field(name="rnd")
    mode: Literal["grad", "value"]


class ReplicaSync(Body, tag_field="op", tag="sync", kw_only=True):
    """``k``: the key
    ``part``: the part index
    ``shape``: the key's shape
    ``dtype``: the key's dtype name
    ``rnd``: the rounds the copy has had with this one
    ``(arrays)``: a whole slice a replica takes in place of what it had: array 0 its value, array 1
        (if any) its optimizer state, pickled"""

    key: Key = field(name="k")
    part: Count
    shape: Shape
    dtype: KeyDType
    round: Count = field(name="rnd")


class ReplicaOptimizer(Body, tag_field="op", tag="optimizer", kw_only=True):
    """``(array 0)``: the primary's optimizer, pickled"""


class ReplicaStates(Body, tag_field="op", tag="states", kw_only=True):
    """``(array 0)``: optimizer states of slices a plan moved here, pickled"""


class ReplicaDrop(Body, tag_field="op", tag="drop", kw_only=True):
    """``slices``: [[key, part], ...] a plan moved away, to forget"""

    slices: list[SliceName]


# a table's part (tables/server_replicas.py): the worker's sinit and sload as they came, a
# round's distinct rows and sums, and a whole part (a header, then chunks of its used rows)
class ReplicaSInit(SInit, tag_field="op", tag="sinit", kw_only=True):
    pass


class ReplicaSLoad(SLoad, tag_field="op", tag="sload", kw_only=True):
    pass


class ReplicaSRound(Body, tag_field="op", tag="sround", kw_only=True):
    """``k``: the key
    ``part``: the server's part of the table
    ``rnd``: the rounds the copy has had with this one
    ``dropped``: the round failed on the primary (it is only counted)
    ``(arrays)``: the round's distinct row ids and their per-row sums"""

    key: Key = field(name="k")
    part: Count
    round: Count = field(name="rnd")
    dropped: bool = False


class ReplicaSSync(SLoad, tag_field="op", tag="ssync", kw_only=True):
    """A whole table part: first its sinit fields (their meanings are a sinit's) with fresh,
    rnd, state and numbers (the header), then chunks of its used rows as an sload's.

    ``rnd``: the rounds the copy has had with this one"""

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
# a primary's copies (HETPS_REPLICAS; docs/SECURITY.md, pickles)
_op = "which copy: init, round, sync, optimizer, states or drop; for a table's part sinit, "
command(P.REPLICATE, Replicate, server=S, doc={"op": _op + "sload, sround or ssync"})


# -- scheduler -> nodes -----------------------------------------------------------------------
class NodeNotice(Body, kw_only=True):
    """``node``: the node it is about (NodeInfo)"""

    node: NodeWire


command(P.WORKER_DONE, NodeNotice, server=SCHED, doc={"node": "the worker that finished"})
command(P.WORKER_JOINING, NodeNotice, worker=SCHED, doc={"node": "the worker that waits to join"})


@command(P.NODE_DEAD, server=SCHED, worker=SCHED)
class NodeDead(NodeNotice, kw_only=True):
    """``node``: the node that died (NodeInfo)
    ``error``: how it died"""

    error: Text = ""


@command(P.FAILOVER, server=SCHED, worker=SCHED)
class Failover(NodeDead, kw_only=True):
    """``node``: the server that died (NodeInfo)
    ``to``: the id of the live server that now serves its keys"""

    to: NodeId


@command(P.REJOIN, server=SCHED, worker=SCHED)
class Rejoin(NodeNotice, kw_only=True):
    """``node``: the server admitted again (NodeInfo: its old id and rank, a new address)
    ``out``: the routing id to connect to it with
    ``in``: the routing id its connection to this node uses"""

    outbound: RoutingId = field(name="out")
    inbound: RoutingId = field(name="in")


@command(P.WORKER_LEFT, server=SCHED, worker=SCHED)
class WorkerLeft(NodeDead, kw_only=True):
    """``node``: the worker that died (NodeInfo)
    ``workers``: the ids of the workers still in the job"""

    workers: list[NodeId]


@command(P.WORKER_BACK, server=SCHED, worker=SCHED)
class WorkerBack(NodeNotice, kw_only=True):
    """``node``: the worker that joined (NodeInfo)
    ``workers``: the ids of the workers in the job now"""

    workers: list[NodeId] = []


#: every command's declared body (a request or a notice)
TYPES: dict[str, Any] = {cmd: d.kind for cmd, d in DECLARED.items()}
#: the declared answers (other answers are read by their request as they are)
REPLIES: dict[str, Any] = {d.answer or c: d.reply for c, d in DECLARED.items() if d.reply}


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
    """``msg``'s body as its command's (or its answer's) declared type, kept on
    ``msg.typed``; the text that refuses it (naming the command and the field), or None. A
    message decoded already, an error answer, an answer of no declared type and a command
    no receiver handles (its dispatch refuses it) are left as they are."""
    if msg.typed is not None:
        return None
    kind = REPLIES.get(msg.cmd) if msg.reply else TYPES.get(msg.cmd)
    if kind is None or msg.reply and msg.error is not None:
        return None
    tagged = _TAGGED.get(msg.cmd)
    if tagged is not None:  # (an unknown tag: the union says what is wrong)
        field_name, members = tagged
        tag = msg.body.get(field_name) if isinstance(msg.body, dict) else None
        kind = members.get(tag, kind) if isinstance(tag, str) else kind
    try:
        msg.typed = msgspec.convert(msg.body, kind, builtin_types=(bytes,))  # (not base64 text)
    except msgspec.ValidationError as exc:
        # (printable: the text is logged and answered, and may quote what the peer sent)
        return P.printable(bodies.explain(msg.cmd, msg.body, kind, str(exc)))
    except Exception as exc:  # noqa: BLE001 - whatever a peer sent, the node goes on
        return P.printable(f"{msg.cmd}: the body cannot be read as its type ({exc!r})")
    return None
