"""What the launcher does about processes that hang rather than die, and whom it names when
a job fails, as a part of :class:`hetps.launch.local.Launcher` (docs/LAUNCHERS.md,
"Processes that hang, and whom a failure names")."""

from __future__ import annotations

import contextlib
import queue
import signal
import subprocess
import time
from typing import Any

from hetps.cluster import launcher_link
from hetps.config import ConfigError, env_value
from hetps.launch.processes import Child, ended_within, signal_group

#: a longer gap between two checks means the launcher itself was away (it checks 5 times a s)
AWAY_S = 1.0


def hang_limit(env: dict[str, str], restarts_left: bool) -> float:
    """Seconds of the scheduler's silence after which the launcher takes it for hung (0: no
    check, heartbeats are off). With restarts left, a third of the heartbeat timeout, at
    least three intervals (the scheduler says it is alive twice an interval) but at most half
    the timeout, so that a scheduler started again takes the nodes back before they give up
    on it (at ``PS_HEARTBEAT_TIMEOUT``); without, the timeout itself."""
    try:
        interval = float(env_value("PS_HEARTBEAT_INTERVAL", env))
        timeout = float(env_value("PS_HEARTBEAT_TIMEOUT", env))
    except (ConfigError, TypeError, ValueError):  # the scheduler itself says what is wrong
        return 0.0
    if interval <= 0:
        return 0.0
    if not restarts_left:
        return timeout
    return min(max(3 * interval, timeout / 3), timeout / 2)


class Liveness:
    """Hung processes and the first failure (mixed into Launcher)."""

    spec: Any
    _scheduler: Any
    _sched_start: tuple[list[str], dict[str, str]]
    _declared: queue.SimpleQueue
    _cause: tuple[str, int, str] | None
    _used: Any  # (Supervision's)
    _log: Any  # (Launcher's)
    _checked: float | None = None  # when _stop_hung last ran

    def _scheduler_says(self, child: Child, text: str) -> bool:
        """A line of hetps's scheduler for the launcher: act on it (True), or False for an
        ordinary output line."""
        if not text.startswith(launcher_link.PREFIX):
            return False
        if text == launcher_link.ALIVE:
            child.heard = time.monotonic()
            return True
        said = launcher_link.parse(text)
        if said is None:
            return False
        kind, role, rank, reason = said
        if kind == "stop":
            self._declared.put((role, rank, reason))
        elif self._cause is None:
            self._cause = (role, rank, reason)
        return True

    def _stop_hung(self, remaining: list[Child]) -> None:
        """SIGKILL each node the scheduler declared dead for its silence, and the scheduler
        itself when it has been silent too long. Each is then handled as a dead process
        (``Child.hung`` says why)."""
        while not self._declared.empty():
            role, rank, reason = self._declared.get()
            child = next((c for c in remaining if c.role == role and c.rank == rank), None)
            if child is not None and child.proc.poll() is None:
                self._kill(child, f"was declared dead by the scheduler ({reason})")
        now = time.monotonic()
        last, self._checked = self._checked, now
        sched = self._scheduler
        if sched is None or sched not in remaining or sched.heard is None:
            return
        if last is not None and now - last > AWAY_S:
            # the launcher itself did not run meanwhile (stopped with Ctrl-Z, starved): what
            # the scheduler said may still wait unread in the pipe; silence counts from now
            sched.heard = max(sched.heard, now)
            return
        limit = hang_limit(self._sched_start[1], self._used() < self.spec.max_restarts)
        silent = now - sched.heard
        if limit and silent > limit and sched.proc.poll() is None:
            self._kill(
                sched,
                f"hung: it said nothing to the launcher for {silent:.2f} s (more than "
                f"{limit:.2f} s, from PS_HEARTBEAT_INTERVAL/PS_HEARTBEAT_TIMEOUT)",
            )

    def _kill(self, child: Child, why: str) -> None:
        child.hung = why
        self._log(f"{child.label} {why}: stopping it (SIGKILL)")
        signal_group(child.proc, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):  # (in uninterruptible sleep)
            child.proc.wait(timeout=10)

    def _first_failure(self, child: Child, remaining: list[Child]) -> Child:
        """The process whose failure ended the job: ``child``, or the node the scheduler
        names (``hetps scheduler cause``) when that is another one. A node's death makes the
        scheduler end the job and the others fail after it; they may end before the node
        itself does. The scheduler is given a moment to end (and say why), and the node it
        names ``failure_grace`` to exit."""
        sched = self._scheduler
        if sched is not None and sched is not child and sched in remaining:
            if not ended_within(sched.proc, min(5.0, self.spec.failure_grace)):
                return child  # it goes on: it knows of no failure
            if sched.reader is not None:
                sched.reader.join(timeout=2)  # every line it said is read
        if self._cause is None:
            return child
        role, rank, _ = self._cause
        cause = next(
            (c for c in remaining if c.role == role and c.rank == rank and c is not child), None
        )
        if cause is None:
            return child
        if not ended_within(cause.proc, self.spec.failure_grace):
            return child
        remaining.remove(cause)
        if cause.reader is not None:
            cause.reader.join(timeout=2)
        return cause


def ended(child: Child) -> tuple[str, int]:
    """How an ended child ended, in words, and its exit code as a shell reports it (128 + N
    for signal N)."""
    rc = child.proc.returncode
    how = child.hung or (f"was killed by signal {-rc}" if rc < 0 else "exited")
    return how, 128 - rc if rc < 0 else rc
