"""Who may send what: the per-command allow-list every receiver checks before handling.

A message's sender is the connection it came on (the van maps ZeroMQ routing ids to node ids;
no header field names a sender), so each command's declared senders
(:func:`hetps.cluster.bodies.command`) are checked against the real sender's role:

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

from hetps.cluster.bodies import DECLARED, NODES
from hetps.cluster.commands import TYPES  # noqa: F401 - (every command declared)
from hetps.cluster.protocol import NEWCOMER, SCHEDULER, SERVER, WORKER

#: receiving role -> command -> the roles that may send it (as a request or a notice), as
#: each command's declaration says (:func:`hetps.cluster.bodies.command`)
ALLOWED: dict[str, dict[str, frozenset[str]]] = {
    role: {cmd: d.to[role] for cmd, d in DECLARED.items() if role in d.to}
    for role in (SCHEDULER, SERVER, WORKER)
}

#: answers only the scheduler gives while a node registers
REGISTRATION_ANSWERS = frozenset({"nodes", "refused", "add_node"})

#: senders of a scheduler service (a plug-in command) that no declaration names
SERVICE_DEFAULT = NODES


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
