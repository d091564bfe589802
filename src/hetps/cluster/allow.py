"""Who may send what: the per-command allow-list every receiver checks before handling.
(docs/MODULES.md, "hetps.cluster.allow")"""

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
