"""What the scheduler tells the launcher that started it, as a part of
:class:`hetps.cluster.scheduler.Scheduler`. (docs/MODULES.md, "hetps.cluster.launcher_link")"""

from __future__ import annotations

import logging

from hetps.cluster.ports import JobPort
from hetps.cluster.protocol import NodeInfo

log = logging.getLogger("hetps.scheduler")

#: the launcher's token before each line: ``hetps-launcher TOKEN <line>``
#: (``HETPS_LAUNCHER_TOKEN``, set by the launcher in the scheduler's environment alone)
TAG = "hetps-launcher "
PREFIX = "hetps scheduler "
ALIVE = PREFIX + "alive"
STOP = PREFIX + "stop "
CAUSE = PREFIX + "cause "


def tag(token: str) -> str:
    """What goes before each line to the launcher: nothing without a token."""
    return f"{TAG}{token} " if token else ""


def untag(text: str, token: str) -> str | None:
    """The line a scheduler said with ``token``, or None for any other line (a node's
    text the scheduler logged, or a line of no launcher)."""
    head = tag(token)
    if not token or not text.startswith(head):
        return None
    return text[len(head) :]


def line(kind: str, info: NodeInfo, reason: str) -> str:
    """One ``stop``/``cause`` line: ``kind`` is :data:`STOP` or :data:`CAUSE`; the reason is
    made one printable line."""
    text = "".join(c if c.isprintable() else "?" for c in reason[:2000])
    return f"{kind}{info.role} {info.rank} {text}"


def parse(text: str) -> tuple[str, str, int, str] | None:
    """("stop" or "cause", role, rank, reason) of a scheduler's line, or None."""
    for kind, head in (("stop", STOP), ("cause", CAUSE)):
        if text.startswith(head):
            parts = text[len(head) :].split(" ", 2)
            if len(parts) >= 2 and parts[0] in ("server", "worker") and parts[1].isdigit():
                return kind, parts[0], int(parts[1]), parts[2] if len(parts) > 2 else ""
    return None


class LauncherLink:
    """The scheduler's lines to its launcher (mixed into Scheduler)."""

    def __init__(self, sched: JobPort) -> None:
        self.sched = sched

    def say_alive(self) -> None:
        if self.sched.to_launcher is not None:
            self.sched.to_launcher(ALIVE)

    def declare_silent(self, nid: int, reason: str) -> None:
        """``nid`` fell silent: declare it dead, and have the launcher stop its process (it
        may be stopped or hung, not gone)."""
        self.sched.declare_dead(nid, reason)
        if nid in self.sched.dead and self.sched.to_launcher is not None:
            self.sched.to_launcher(line(STOP, self.sched.nodes[nid], reason))

    def name_cause(self, nid: int, text: str) -> None:
        """``nid``'s death ends the job (the first such death only counts)."""
        if self.sched.to_launcher is not None:
            self.sched.to_launcher(line(CAUSE, self.sched.nodes[nid], text))
