"""The body of a role's Ray actor (:class:`RoleProcess`): it starts one role's process on its
node and hands the process's output and exit status to the driver
(the launcher's RayLauncher)."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading

from hetps.launch.contract import usable_cores, without_host_vars
from hetps.launch.processes import end_group, signal_group, start_piped


class RoleProcess:
    """The body of a role's Ray actor: starts one process on its node and hands its output
    to the driver. Its methods run in a few threads (``max_concurrency``), so ``stop`` works
    while ``poll`` waits."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self._lines: collections.deque[str] = collections.deque()
        self._cond = threading.Condition()
        self._eof = False
        # every process is started by this one thread, which lives as long as the actor: the
        # parent-death signal fires when the *thread* that started a process ends
        self._requests: queue.Queue = queue.Queue()
        threading.Thread(target=self._spawn_loop, daemon=True, name="hetps-spawn").start()

    def where(self) -> dict:
        """This actor's node: its IP, id and usable cores."""
        # an actor runs in Ray's worker process, which imported the Ray package before it
        ray_pkg = sys.modules["ray"]

        return {
            "ip": ray_pkg.util.get_node_ip_address(),
            "node_id": ray_pkg.get_runtime_context().get_node_id(),
            "cores": usable_cores(),
            "pid": os.getpid(),
        }

    def _spawn_loop(self) -> None:
        while True:
            argv, env, cwd, done = self._requests.get()
            try:
                done.set_result(self._spawn(argv, env, cwd))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                done.set_exception(exc)

    def _spawn(self, argv: list[str], env: dict[str, str], cwd: str) -> int:
        if not os.path.isdir(cwd):
            raise FileNotFoundError(
                f"the working directory {cwd} does not exist on this node: run hetps launch "
                "from a directory every node of the Ray cluster has"
            )
        if shutil.which(argv[0], path=env.get("PATH")) is None:
            raise FileNotFoundError(f"{argv[0]}: no such file or command on this node")
        self.proc = start_piped(argv, env, cwd=cwd)
        threading.Thread(target=self._pump, daemon=True, name="hetps-pump").start()
        return self.proc.pid

    def start(self, argv: list[str], overlay: dict[str, str], cwd: str) -> int:
        """Start ``argv`` in ``cwd`` with this process's environment plus ``overlay``;
        returns its pid. Raises FileNotFoundError (the message says what is missing)."""
        env = without_host_vars(dict(os.environ))  # a worker's come in its overlay
        env.update(overlay)
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._requests.put((argv, env, cwd, done))
        return done.result()

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for raw in iter(self.proc.stdout.readline, b""):
            with self._cond:
                self._lines.append(raw.decode("utf-8", "replace").rstrip("\n"))
                self._cond.notify_all()
        self.proc.stdout.close()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def poll(self, timeout: float = 0.5) -> tuple[list[str], int | None]:
        """(the output lines since the last call, the exit status or None while it runs),
        waiting up to ``timeout`` s for either. The status comes once every line is out."""
        proc = self.proc
        with self._cond:
            self._cond.wait_for(lambda: self._lines or self._eof, timeout=timeout)
            code = proc.poll() if proc is not None else None
            if code is not None and not self._eof:
                # the rest of its output; a process it started and left behind may hold the
                # pipe open for ever, so not longer than this (as the local launcher)
                self._cond.wait_for(lambda: self._eof, timeout=2.0)
            lines = list(self._lines)
            self._lines.clear()
        return lines, code

    def stop(self, grace: float = 5.0) -> int | None:
        """SIGTERM the process's group, SIGKILL it after ``grace`` s (at once when a process
        of it is stopped: SIGTERM would wait for a SIGCONT); returns its status."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None and not end_group(proc.pid, signal.SIGTERM):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=grace)
        signal_group(proc, signal.SIGKILL)  # the group may hold grandchildren
        try:
            return proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return None
