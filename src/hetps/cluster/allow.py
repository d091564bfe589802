"""Who may send what: the per-command allow-list every receiver checks before handling.

A message's sender is the connection it came on (the van maps ZeroMQ routing ids to node ids;
no header field names a sender), so each row below is checked against the real sender's role:

* ``scheduler``: node 1, whose connection a node learns when it registers (the routing id it
  asked the scheduler to use);
* ``server``, ``worker``: registered nodes, each over the connection the scheduler paired it
  with (a routing id per ordered pair of nodes, known only to the two of them and the
  scheduler);
* ``newcomer``: a connection that belongs to no node yet; it may only register.

Commands that act on the sender alone carry no node field (``leave``, ``finish``,
``heartbeat``, ``barrier``): the connection names the node, so a node can speak only for itself.
Replies are not listed: a reply is accepted only from the peer its request went to
(:meth:`hetps.cluster.requests.RequestTracker.resolve`). Registration answers (``nodes``,
``refused``, an ``add_node`` progress reply) are accepted only from the scheduler. A command
the scheduler sends that is not listed here goes to the node's handler, which refuses what it
does not know. Everything else not listed is refused, with one log line per message.

Unpickling: ``set_optimizer`` and ``set_states`` carry pickles, which run code when loaded,
and so may ``sinit`` (a row-sparse table's own optimizer, field ``opt``). They are accepted
only from a registered worker's connection (with a cluster secret: an authenticated one); a
server's copies to its replicas (``replicate``, HETPS_REPLICAS) pass them on, from a server of
the job. A server unpickles nothing else from the network.
"""

from __future__ import annotations

SCHEDULER = "scheduler"
SERVER = "server"
WORKER = "worker"
NEWCOMER = "newcomer"  # a connection that belongs to no registered node

_NODES = frozenset({SERVER, WORKER})
_W = frozenset({WORKER})
_S = frozenset({SERVER})
_SCHED = frozenset({SCHEDULER})

#: receiving role -> command -> the roles that may send it (as a request or a notice)
ALLOWED: dict[str, dict[str, frozenset[str]]] = {
    SCHEDULER: {
        "add_node": frozenset({NEWCOMER}),
        "readmit": frozenset({NEWCOMER, SERVER, WORKER}),  # (a restarted scheduler's newcomers)
        "heartbeat": _NODES,
        "barrier": _NODES,
        "finish": _W,
        "leave": _NODES,  # self only: the connection names the node that leaves
        "esync_report": _W,  # the rank is the connection's, not the body's
        "balance_report": _W,
        "metrics_report": _NODES,  # counted as the connection's node, not the body's
        "join": _W,  # (HETPS_ELASTIC) a worker started again; self only
        "admit": _W,
        "entered": _W,
    },
    SERVER: {
        "init": _W,
        "push": _W,
        "pull": _W,
        "batch": _W,  # init/push/pull items, each checked as if it came alone
        "sinit": _W,  # row-sparse tables (tables/server.py)
        "spush": _W,
        "spull": _W,
        "sdump": _W,  # a checkpoint reads a table (tables/server_dump.py)
        "sload": _W,  # a restore writes it back
        "set_optimizer": _W,  # a pickle: only from a registered worker
        "get_states": _W,
        "set_states": _W,  # a pickle: only from a registered worker
        "forecast": _W,
        "probe": _W,
        "drop": _W,
        "pace": _W,
        "worker_done": _SCHED,
        "exit": _SCHED,
        "node_dead": _SCHED,
        "failover": _SCHED,
        "rejoin": _SCHED,
        "worker_left": _SCHED,
        "worker_back": _SCHED,
        "enter": _W,  # (HETPS_ELASTIC) a worker that joined: count it in rounds; self only
        "replicate": _S,  # a primary's copies (HETPS_REPLICAS; docs/SECURITY.md, pickles)
    },
    WORKER: {
        "forecast": _S,
        "receipt": _S,
        "exit": _SCHED,
        "node_dead": _SCHED,
        "failover": _SCHED,
        "rejoin": _SCHED,
        "worker_left": _SCHED,
        "worker_joining": _SCHED,
        "worker_back": _SCHED,
    },
}

#: answers only the scheduler gives while a node registers
REGISTRATION_ANSWERS = frozenset({"nodes", "refused", "add_node"})

#: senders of a scheduler service (a plug-in command) that the table does not list
SERVICE_DEFAULT = _NODES


def permits(receiver: str, sender: str | None, cmd: str, service: bool = False) -> bool:
    """Whether a node of role ``receiver`` accepts ``cmd`` (not a reply) from a sender of role
    ``sender`` (None or :data:`NEWCOMER`: a connection of no registered node). ``service``:
    the scheduler has a plug-in for ``cmd`` that the table does not list."""
    row = ALLOWED.get(receiver, {})
    allowed = row.get(cmd)
    if allowed is None:
        if receiver == SCHEDULER and service:
            allowed = SERVICE_DEFAULT
        elif receiver != SCHEDULER and sender == SCHEDULER:
            return True  # the scheduler's own commands go to the node's handler
        else:
            return False
    return (sender or NEWCOMER) in allowed


def senders(receiver: str, cmd: str) -> str:
    """Who may send ``cmd`` to ``receiver``, for error messages."""
    allowed = ALLOWED.get(receiver, {}).get(cmd)
    if not allowed:
        return f"nobody (a {receiver} takes no {cmd!r})"
    return " or ".join(
        sorted("an unregistered node" if r == NEWCOMER else f"a {r}" for r in allowed)
    )
