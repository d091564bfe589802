"""What the launcher does when a child dies, as a part of
:class:`hetps.launch.local.Launcher`: tell the scheduler at once, and with restarts left
start the job again (``--max-restarts``), go on without a dead worker (``--elastic``), start a
dead scheduler again at its port (``--recover``), or start a dead server again to rejoin
(``--replicas``).
docs/FAULTS.md says what a user sees.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hetps.launch.processes import Child


class Supervision:
    """Restart decisions (mixed into Launcher, which holds what is used here)."""

    spec: Any
    restarts: int
    respawns: int
    children: list
    _failed: Any
    _worker_start: dict
    _server_start: dict
    _respawned: list
    _scheduler: Any
    _up: Any
    _port_value: int
    _sched_start: tuple[list[str], dict[str, str]]

    def _again(self) -> bool:
        """After a failure: whether to start the job again (restarts left)."""
        if self._used() >= self.spec.max_restarts:
            return False
        self.restarts += 1
        self._log(
            f"restart {self._used()} of {self.spec.max_restarts}: starting the "
            f"job again (HETPS_RESTART={self.restarts})"
        )
        return True

    def _used(self) -> int:
        """Restarts used up: whole-job restarts and processes started again."""
        return self.restarts + self.respawns

    def _let_go(self, child: Child, remaining: list[Child], how: str, code: int) -> bool:
        """A dead worker of a running job with --elastic MIN: the job goes on without it
        while at least MIN workers remain (the scheduler tells every node: its rounds finish
        with the others)."""
        if (
            child.role != "worker"
            or not self.spec.elastic_min
            or self._scheduler is None
            or not self._up.is_set()  # before the start completed: a failed start
        ):
            return False
        left = sum(1 for c in remaining if c.role == "worker" and c.proc.poll() is None)
        if left < self.spec.elastic_min:
            self._log(
                f"{child.label} {how} (code {code}) and {left} workers would be left, fewer "
                f"than --elastic {self.spec.elastic_min}: the job fails"
            )
            return False
        self._notify(child, f"{how} (code {code})")
        self._log(
            f"elastic: {child.label} {how} (code {code}); the job goes on without it, "
            f"with {left} workers"
        )
        if self.spec.rejoin_workers:
            self._respawn(child, remaining, "it joins the running job at a round boundary")
        return True

    def _respawn(self, child: Child, remaining: list[Child], how: str) -> None:
        """With restarts left, start dead ``child`` (a worker or a server) again alone: it
        rejoins the running job (``how``)."""
        if self._used() >= self.spec.max_restarts:
            return
        self.respawns += 1
        self._log(
            f"restart {self._used()} of {self.spec.max_restarts}: starting {child.label} "
            f"again ({how}, is_recovery=1)"
        )
        starts = self._worker_start if child.role == "worker" else self._server_start
        again = self._start(child.role, child.rank, *starts[child.rank])
        self._respawned.append(again)
        remaining.append(again)

    def _scheduler_again(self, child: Child, remaining: list[Child], how: str, code: int) -> bool:
        """A dead scheduler of a running job (hetps's own, restarts left): start it again at
        the same address with --recover; the nodes come back to it and the job goes on."""
        if (
            child is not self._scheduler
            # (it ended the job itself: a failure)
            or not (how.startswith("was killed") or child.hung)
            or not self._up.is_set()
            or self._used() >= self.spec.max_restarts
            or not any(c.role == "worker" for c in remaining)
            # the balance planner's rounds of measurements are not carried over
            or self._sched_start[1].get("HETPS_BALANCE", "none").lower() not in ("", "none")
        ):
            return False
        self.respawns += 1
        self._log(
            f"the scheduler {how} (code {code}); restart {self._used()} of "
            f"{self.spec.max_restarts}: starting it again at port {self._port_value} "
            "(--recover): the running nodes come back to it"
        )
        argv, env = self._sched_start
        env = {**env, "DMLC_PS_ROOT_PORT": str(self._port_value)}
        sched = self._start("scheduler", 0, [*argv, "--recover"], env, keep_stdin=True)
        self._scheduler = sched
        remaining.append(sched)
        return True

    def _taken_over(self, child: Child, remaining: list[Child]) -> bool:
        """Whether the job goes on without ``child``: a server, with copies of its keys on
        another that is still running (fewer than --replicas servers died)."""
        if (
            child.role != "server"
            or self.spec.replicas <= 1
            or self._scheduler is None
            or not self._up.is_set()  # before the start completed there is nothing to take over
        ):
            return False
        ranks = {c.rank for c in self.children if c.role == "server"}
        up = {c.rank for c in remaining if c.role == "server"}
        return len(ranks - up) < self.spec.replicas and any(
            c.role == "scheduler" for c in remaining
        )

    def _notify(self, child: Child, how: str) -> None:
        """Tell the scheduler at once that ``child`` ended, so it declares the node dead (and
        every survivor hears the cause) now, not after the heartbeat timeout."""
        sched = self._scheduler
        if sched is None or child is sched or sched.proc.stdin is None:
            return
        with contextlib.suppress(BrokenPipeError, ValueError, OSError):  # (the scheduler is gone)
            sched.proc.stdin.write(f"dead {child.role} {child.rank} {how}\n".encode())
            sched.proc.stdin.flush()
