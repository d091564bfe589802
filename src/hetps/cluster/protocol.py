"""The wire protocol: every command name, and the body fields of the data plane.

Node ids follow ps-lite: the scheduler is 1, server rank r is ``8 + 2r``, worker rank r is
``9 + 2r``. Group ids for barriers: ``worker``, ``server``, ``all``.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULER_ID = 1

# -- control plane: node -> scheduler ------------------------------------------------------
ADD_NODE = "add_node"  # role, host, port, token, want_rank
BARRIER = "barrier"  # group
HEARTBEAT = "heartbeat"
FINISH = "finish"
LEAVE = "leave"  # reason: a node is going away because it failed
# id, role, rank, host, port, back, view: a node of a running job asks a scheduler started
# again at the same address (hetps scheduler --recover) to take it back
READMIT = "readmit"
# -- control plane: scheduler -> node ------------------------------------------------------
NODES = "nodes"  # nodes (NodeInfo.to_wire each), id: the node table, once the cluster is up
BARRIER_DONE = "barrier_done"
HEARTBEAT_ACK = "heartbeat_ack"
NODE_DEAD = "node_dead"  # node, error
# node, error, to: a server died and its keys live on (HETPS_REPLICAS): requests that were
# going to it go to ``to`` (the next live server), which holds a copy of each of its keys
FAILOVER = "failover"
# node, out, in: a dead server that was taken over is back (is_recovery): connect to it with
# routing id ``out``, admit its connection ``in``; it is a replica again, primary of nothing
REJOIN = "rejoin"
EXIT = "exit"
WORKER_DONE = "worker_done"  # to servers: node, a worker finished its job
# node, error, workers: a worker died and the job goes on without it (HETPS_ELASTIC): servers
# drop what it pushed into rounds not yet complete and finish them with the others
WORKER_LEFT = "worker_left"
# node: a let-go worker was started again and waits to join (live workers then agree on a round
# boundary: admit); node, workers: it joined, and counts in every round from now on
WORKER_JOINING = "worker_joining"
WORKER_BACK = "worker_back"
REFUSED = "refused"  # error

GROUPS = ("worker", "server", "all")

# -- joining a running job (HETPS_ELASTIC) ---------------------------------------------------
JOIN = "join"  # a worker started again -> scheduler: let me in; answer: state, barriers
ADMIT = "admit"  # a live worker at a round boundary -> scheduler (the first: array 0, state)
ENTER = "enter"  # the joiner -> each server: count me in rounds from now on
ENTERED = "entered"  # the joiner -> scheduler: every server counts me

# -- scheduler services (plug-ins) ---------------------------------------------------------
ESYNC_REPORT = "esync_report"  # worker -> ESync state server: ready for the round?
BALANCE_REPORT = "balance_report"  # worker -> load planner: measurements; answer: the plan
METRICS_REPORT = "metrics_report"  # worker -> live metrics (HETPS_METRICS_PORT): its counters

# -- data plane: worker <-> server ---------------------------------------------------------
INIT = "init"
PUSH = "push"
PULL = "pull"
SET_OPTIMIZER = "set_optimizer"
GET_STATES = "get_states"
SET_STATES = "set_states"
FORECAST = "forecast"  # tag: announces the next data message (link measurement)
PROBE = "probe"  # a probe payload for links that carry no data
DROP = "drop"  # slices: forget slices that moved to another server
RECEIPT = "receipt"  # req: a server got a push (credit for the worker's push window)
BATCH = "batch"  # items: several small requests (or their answers) in one message
# row-sparse keys (embedding tables, tables/worker.py and tables/server.py)
SINIT = "sinit"  # declare a table's part on a server (and write rows of its first value)
SPUSH = "spush"  # a round's row-sparse gradient: distinct sorted row ids, their rows
SPULL = "spull"  # read rows by id
SDUMP = "sdump"  # a checkpoint reads a table's part: its used rows, their state (in chunks)
SLOAD = "sload"  # a restore writes a table's part back (in chunks)
SPARSE_COMMANDS = frozenset({SINIT, SPUSH, SPULL, SDUMP, SLOAD})
# -- data plane: server -> server (HETPS_REPLICAS) -----------------------------------------
# op ("init": a chunk of a key's first value; "round": a dist_sync round's merged pushes),
# then the fields of that op: a primary's copy to a replica
REPLICATE = "replicate"

#: the commands a batch may carry (requests from a worker; answers from a server)
BATCH_COMMANDS = frozenset({INIT, PUSH, PULL, SPUSH, SPULL})
#: at most this many items in one batch
MAX_BATCH_ITEMS = 1024

#: Every command's body fields (and a few answers'), with their meanings: the one place that
#: says what each means. Every command's body is a declared type
#: (:data:`hetps.cluster.commands.TYPES`), checked once by the dispatch that takes it.
BODY_FIELDS: dict[str, dict[str, str]] = {
    INIT: {
        "k": "the key (int or str)",
        "part": "the part (slice) index of the key on this server",
        "off": "offset of this chunk within the part, in elements",
        "n": "elements in this chunk",
        "size": "elements of the whole part",
        "shape": "the key's shape",
        "dtype": "the key's dtype name (float16, float32 or float64)",
        "rnd": "the rounds the part has had (a slice a plan moves comes with them; default 0)",
        "tag": "the request id its forecast carried (the init is timed)",
        "op": "init, in a primary's copy to a replica (a replicate message)",
    },
    PUSH: {
        "k": "the key",
        "part": "the part index",
        "off": "offset of this chunk within the part",
        "n": "elements in this chunk",
        "sync": "true in dist_sync (rounds), false in dist_async",
        "ce": "elements per chunk the worker cuts parts into",
        "shape": "the key's shape",
        "dtype": "the key's dtype name",
        "pp": "a fused push-pull: answer with the value once the push took effect",
        "comp": "2-bit compression threshold (the payload is packed 2-bit words)",
        "rcpt": "send a receipt on arrival (push-window credit)",
        "tag": "the request id its forecast carried (the push is timed)",
        "rnd": "with HETPS_REPLICAS > 1, the worker's count of its earlier pushes of this key: "
        "a server that applied that round already acknowledges a resent push without "
        "applying it again, and keeps one of a later round until its round comes",
        "hg": "dist_sync with host groups known: [host group, local rank, workers]: the push "
        "is that host's (workers > 1: the host's sum, counted for that many workers); the "
        "server sums a round per host in local-rank order, then the hosts in group order",
    },
    PULL: {
        "k": "the key",
        "part": "the part index",
        "off": "offset within the part",
        "n": "elements wanted",
        "shape": "the key's shape",
        "dtype": "the key's dtype name",
        "tag": "the pull's reply is timed by the worker (a forecast goes first)",
    },
    SINIT: {
        "k": "the key",
        "part": "this server's index among the table's parts (row r lives on part r % nparts)",
        "nparts": "parts of the table (the servers)",
        "rows": "rows of the whole table (None: a table that grows)",
        "cols": "columns",
        "dtype": "the table's dtype name",
        "scale": "rows start uniform in [-scale, scale) (0: zeros)",
        "seed": "seed of the initial values",
        "bound": "bytes this server may hold of the table (0: no bound)",
        "opt": "optional: the table's own optimizer, pickled (accepted from a worker only)",
        "(arrays)": "optional: row ids (int64) and their first values (rows x cols)",
    },
    SPUSH: {
        "k": "the key",
        "part": "the server's part of the table",
        "sync": "true in dist_sync (rounds: every worker pushes once per round, maybe no "
        "rows), false in dist_async",
        "(arrays)": "sorted distinct row ids (int64) and their gradient rows (ids x cols)",
        "rnd": "with HETPS_REPLICAS > 1, the worker's count of its earlier pushes of the table: "
        "a server that applied that round already acknowledges a resent push without applying "
        "it again, and keeps one of a later round until its round comes",
    },
    SPULL: {
        "k": "the key",
        "part": "the server's part of the table",
        "(arrays)": "row ids (int64); the answer: their rows, in that order",
    },
    SDUMP: {
        "k": "the key",
        "part": "the server's part of the table",
        "off": "the first row wanted of the part's used rows, sorted by id",
        "n": "rows wanted (0: only the answer's body)",
        "(answer)": "count (the part's used rows), state ([[name, dtype, columns], ...]: the "
        "optimizer state's per-row arrays), numbers (its other entries: Adam's t), has_state; "
        "arrays: the rows' ids, their values, each state array's rows",
    },
    SLOAD: {
        "k": "the key",
        "part": "the server's part of the table",
        "fresh": "the part's first chunk: start it again empty, with the state's numbers",
        "state": "names of the optimizer state's per-row arrays that follow the rows",
        "numbers": "the optimizer state's other entries (Adam's t)",
        "(arrays)": "sorted distinct row ids (int64), their values, each state array's rows",
    },
    PROBE: {
        "reply_bytes": "bytes of payload in the answer",
        "spread": "one flow of a spread probe (several flows at once)",
        "tag": "the request id its forecast carried",
    },
    BATCH: {
        "items": "[[cmd, req, body, arrays], ...]: one request (from a worker) or one answer "
        "(from a server) each, in order: its command (init, push, pull, spush or spull), its request id, its "
        "own body (the fields of that command, or of its answer), and how many of the batch's "
        "arrays are its own (they follow the previous items' arrays)",
    },
    REPLICATE: {
        "op": "which copy: init, round, sync, optimizer, states or drop; for a table's part "
        "(tables/server_replicas.py) sinit, sload, sround or ssync",
        "(op init)": "a chunk of a key's first value, with the fields of an init; array 0 is "
        "the data",
        "(op round)": "a dist_sync round: k, part, rnd, mode; array 0 is the merged pushes "
        "(grad) or the new value (value)",
        "(op sync)": "a whole slice a replica takes in place of what it had: k, part, shape, "
        "dtype, rnd; array 0 its value, array 1 (if any) its optimizer state, pickled",
        "(op optimizer)": "the primary's optimizer, pickled in array 0",
        "(op states)": "optimizer states of slices a plan moved here, pickled in array 0",
        "(op drop)": "slices: [[key, part], ...] a plan moved away",
        "k": "the key",
        "part": "the part index",
        "off": "op init: offset of this chunk within the part",
        "n": "op init: elements in this chunk",
        "size": "op init: elements of the whole part",
        "tag": "op init: as an init's",
        "rnd": "the rounds the copy has had with this one",
        "mode": "grad (the merged pushes, for the optimizer) or value (the new value)",
        "shape": "the key's shape",
        "dtype": "the key's dtype name",
        "slices": "[[key, part], ...] to forget",
        "(op sinit, sload)": "the worker's request as it came, with its fields",
        "(op sround)": "a table round: k, part, rnd; arrays: the round's distinct row ids and "
        "their per-row sums; dropped: the round failed on the primary, only counted",
        "(op ssync)": "a whole table part: first its sinit fields with fresh, rnd, state and "
        "numbers, then chunks of its used rows as an sload's",
        "dropped": "op sround: the round failed on the primary (it is only counted)",
        "nparts": "ops sinit, ssync: the table's parts (its servers)",
        "rows": "ops sinit, ssync: the table's rows (null: a growing table)",
        "cols": "ops sinit, ssync: the table's columns",
        "scale": "ops sinit, ssync: the initial rows' scale",
        "seed": "ops sinit, ssync: the initial rows' seed",
        "bound": "ops sinit, ssync: the part's byte bound per server",
        "opt": "ops sinit, ssync: the table's own optimizer, pickled",
        "fresh": "ops sload, ssync: the part is made again before its rows are written",
        "state": "ops sload, ssync: the optimizer state's names, one array each after the rows",
        "numbers": "ops sload, ssync: the optimizer state's numbers (e.g. Adam's t)",
    },
    ADD_NODE: {
        "role": "server or worker",
        "host": "the host the scheduler connects back to (a name or an address)",
        "port": "the port there (1-65535)",
        "back": "the routing id the scheduler connects back with (1-255 bytes)",
        "want_rank": "the rank its launcher gave it (-1: any)",
        "host_group": "a worker's host, as its launcher numbered it (HETPS_HOST_GROUP; -1: "
        "not known, a host of its own)",
    },
    HEARTBEAT: {},
    FINISH: {},
    LEAVE: {"reason": "why the node is going away (at most 2000 characters)"},
    BARRIER: {
        "group": "worker, server or all",
        "n": "the barrier's number for this node (absent: one more than its last)",
    },
    ESYNC_REPORT: {
        "rank": "the worker's rank (a standalone state server believes it for a connection's "
        "first report only; the scheduler takes the connection's)",
        "round": "the round of the step",
        "step_s": "seconds of the worker's last local step",
        "elapsed_s": "seconds since the round began, on the worker",
        "ep": "host:port the standalone state server answers to",
        "back": "the routing id the worker knows the standalone state server by",
    },
    SET_OPTIMIZER: {"(array 0)": "the optimizer, pickled (accepted from a worker only)"},
    SET_STATES: {
        "move": "the states of slices a plan moved here (their replicas get them too)",
        "(array 0)": "the states, pickled (accepted from a worker only)",
    },
    WORKER_DONE: {"node": "the worker that finished (NodeInfo)"},
    EXIT: {},
    NODE_DEAD: {"node": "the node that died (NodeInfo)", "error": "how it died"},
    FAILOVER: {
        "node": "the server that died (NodeInfo)",
        "error": "how it died",
        "to": "the id of the live server that now serves its keys",
    },
    WORKER_LEFT: {
        "node": "the worker that died (NodeInfo)",
        "error": "how it died",
        "workers": "the ids of the workers still in the job",
    },
    JOIN: {
        "(answer)": "barriers ({group: n}: the barriers it has passed from now on), rounds "
        "([[key, n], ...]: the rounds the first live worker pushed of each key), tables (the "
        "row-sparse keys' declarations, as admit gave them); array 0: "
        "the state it gave (admit)"
    },
    ADMIT: {
        "(array 0)": "from the first live worker: the state a joiner starts from (bytes)",
        "rounds": "from the first live worker: [[key, n], ...], the rounds it pushed",
        "tables": "from the first live worker: [[key, {rows, cols, dtype, scale, seed, "
        "server_bytes}], ...], the row-sparse keys' declarations",
        "(answer)": "once every worker waiting to join is in",
    },
    ENTER: {},
    ENTERED: {},
    WORKER_JOINING: {"node": "the worker that waits to join (NodeInfo)"},
    WORKER_BACK: {
        "node": "the worker that joined (NodeInfo)",
        "workers": "the ids of the workers in the job now",
    },
    READMIT: {
        "id": "the node's id in the running job",
        "role": "its role (server or worker)",
        "rank": "its rank",
        "host": "the host the scheduler connects back to, as in add_node",
        "port": "the port there",
        "back": "the routing id the scheduler connects back with",
        "view": "what the node knows of the job: nodes (the node table), down (dead servers), "
        "redirect ([[dead, heir], ...]), done (a server: the workers that finished), "
        "barriers ({group: the barriers it passed}), replicas",
        "cred": "with a cluster secret: the credential it was admitted with",
        "gen": "with a cluster secret: that credential's generation",
        "(answer)": "restarted: true from a scheduler that was started again (the node then "
        "sends its unanswered requests to it again); absent from the scheduler it knew",
    },
    REJOIN: {
        "node": "the server admitted again (NodeInfo: its old id and rank, a new address)",
        "out": "the routing id to connect to it with",
        "in": "the routing id its connection to this node uses",
    },
    GET_STATES: {"slices": "[[key, part], ...] to read (absent: every state)"},
    DROP: {"slices": "[[key, part], ...] or [[key, part, the server it moved to], ...] to forget"},
    FORECAST: {"tag": "the request id of the data message that follows"},
    RECEIPT: {"req": "the push request that arrived"},
    BALANCE_REPORT: {
        "round": "the worker's rebalance() count",
        "samples": "[[src, dst, bytes, t0, t1, kind], ...] link samples (kind 1: probe, "
        "2/3: a spread's flow)",
        "server_times": "{server rank: [bytes, seconds]} of the last round",
        "(array 0)": "the samples instead of the list: float64, one row [src, dst, bytes, t0, "
        "t1, kind] each (how the balance agent sends them)",
        "(array 1)": "the server times instead of the map: float64, one row [server rank, "
        "bytes, seconds] each",
        "sizes": "element counts of the keys in init order (first report, or new keys)",
        "assign": "the server of every slice, in layout order (with sizes)",
        "calibration": "these samples hold a whole new probe cycle",
        "spread_done": "[way, rank] of the spread probe this worker took part in",
    },
    METRICS_REPORT: {
        "seq": "the report's number, from 1, one more each report (an old or repeated one is "
        "refused)",
        "t": "seconds since the worker's meter started (its own clock, increasing)",
        "rounds": "rounds this worker began so far: the most pushes of any one key",
        "round_s": "seconds of its last whole round (absent before the second round)",
        "links": "[[server rank, bytes sent to it, bytes received from it], ...], totals "
        "since the worker started, at most one row per server (a server's report: [[worker "
        "rank, sent, received], ...], one row per worker)",
        "tl": "the worker's last rounds since its last report (at most 8): [[round, [[phase, "
        "unix start, seconds], ...] (at most 32), [[server rank, sent, received], ...] (the "
        "round's bytes)], ...] (hetps.metrics.reports)",
        "run": "the run directory the worker logs into, where the scheduler leaves the "
        "dashboard's last state (a printable path, at most 4096 characters)",
        "server": "a server's report: {rounds: rounds merged, opt_s: seconds in the "
        "optimizer, replicas: copies of every key} (hetps.metrics.server_meter)",
        "h": "{push|pull|round: [counts, sum]}: what the worker's fixed-bucket histograms "
        "gained since its last report (counts per bucket of hetps.metrics.reports.BUCKETS and "
        "one for above them; the sum of the observed seconds)",
        "m": "the script's own values since the last report (hetps.torch.log_metrics): "
        "[[step, {name: number}], ...], at most 32 entries and 16 names",
        "sys": "{cpu: percent of one core since the last report, rss: resident bytes, gpu: "
        "[[utilisation %, memory used, memory total], ...] (NVML), or nogpu: why none}",
        "log": "the last lines the node wrote since its last report (at most 20 of 300 "
        "characters, addresses replaced)",
    },
    # the planner's answer to a balance report (hetps.balance.wire)
    BALANCE_REPORT + " answer": {
        "plan": "msgpack bytes, the same for every worker and encoded once a round: epoch, "
        "assign (the server of every slice), shares, plan_s, kept, surprise, recalibrations, "
        "and recalibrate or spread when asked",
        "node_rates": "worker rank 0 only: the per-node caps and where they come from",
        "error": "instead of a plan: why there is none",
        "(array 0)": "worker rank 0 only: the link matrix, float64 N x N bytes/s, inf on the "
        "diagonal",
    },
}


def printable(value: object, limit: int = 2000) -> str:
    """A peer's text for a log line or an answer: printable characters only, bounded."""
    text = value if isinstance(value, str) else repr(value)
    return "".join(c if c.isprintable() else "?" for c in text[:limit])


def server_id(rank: int) -> int:
    """ps-lite id of server ``rank``."""
    return 8 + 2 * rank


def worker_id(rank: int) -> int:
    """ps-lite id of worker ``rank``."""
    return 9 + 2 * rank


def role_of(node_id: int) -> str:
    """Role of a ps-lite node id."""
    if node_id == SCHEDULER_ID:
        return "scheduler"
    return "server" if node_id % 2 == 0 else "worker"


def rank_of(node_id: int) -> int:
    """Rank of a server or worker id."""
    return (node_id - 8) // 2


@dataclass(frozen=True)
class NodeInfo:
    """A registered node as every member of the cluster knows it."""

    id: int
    role: str
    rank: int
    host: str
    port: int
    group: int = -1  # a worker's host group (HETPS_HOST_GROUP); -1: not known

    def describe(self) -> str:
        """Human description: ``worker rank 1 (node 11, 127.0.0.1:4242)``."""
        if self.role == "scheduler":
            return f"scheduler (node 1, {self.host}:{self.port})"
        where = f", {self.host}:{self.port}" if self.host else ""  # (a worker's view of another)
        return f"{self.role} rank {self.rank} (node {self.id}{where})"

    def to_wire(self) -> list:
        """Compact msgpack-able form (the host group travels beside it: the node table's
        ``groups``)."""
        return [self.id, self.role, self.rank, self.host, self.port]

    @classmethod
    def from_wire(cls, item: list, groups: dict[int, int] | None = None) -> NodeInfo:
        """Inverse of :meth:`to_wire`; ``groups`` (node id -> host group) gives its group."""
        i, role, rank, host, port = item
        i = int(i)
        group = groups.get(i, -1) if groups else -1
        return cls(i, str(role), int(rank), str(host), int(port), group)
