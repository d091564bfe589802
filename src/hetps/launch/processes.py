"""How a launcher starts and stops its processes: each in a session of its own (it and all it
starts are one process group, signalled together), its output on one pipe, dying with the
launcher; exit statuses as a shell reports them."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any

#: how long a launcher waits, after the scheduler or a server exited 1, for the failure of
#: the node that ended the job (its own exit follows that of the nodes it took down)
CAUSE_WAIT_S = 5.0
#: util-linux's setpriv, which sets the parent-death signal and then runs the command
SETPRIV = shutil.which("setpriv") if sys.platform.startswith("linux") else None


@dataclass
class Child:
    """One started process and its role."""

    role: str
    rank: int
    proc: subprocess.Popen
    label: str
    reader: threading.Thread | None = None
    heard: float | None = None  # (hetps's scheduler) when it last said it is alive
    hung: str | None = None  # why the launcher stopped it with SIGKILL (it hung)


class Output:
    """A launcher's output (``out``): its own lines and each process's, under the name of
    who said them, whole lines from any thread (``_print_lock``)."""

    out: Any
    _print_lock: threading.Lock

    def _log(self, text: str) -> None:
        """A line of the launcher's own."""
        self._say("launcher", [text])

    def _print(self, child: Any, lines: list[str]) -> None:
        """Lines ``child`` (anything with a ``label``: a :class:`Child`, a Ray role) said."""
        self._say(child.label, lines)

    def _say(self, who: str, lines: list[str]) -> None:
        if not lines:
            return
        with self._print_lock:
            self.out.write("".join(f"[{who}] {line}\n" for line in lines))
            self.out.flush()


def role_argv(role: str) -> list[str]:
    """The command that runs hetps' own ``role`` (scheduler, server) with this Python."""
    return [sys.executable, "-m", "hetps.cli", role]


def shell_code(code: int) -> int:
    """A child's exit status as a shell reports it: 128 + N for a child killed by signal N
    (``Popen.returncode`` is -N), else the code itself."""
    return 128 - code if code < 0 else code


def ended_within(proc: subprocess.Popen, timeout: float) -> bool:
    """Whether ``proc`` ends within ``timeout`` seconds (waited for that long at most)."""
    try:
        proc.wait(timeout=max(0.0, timeout))
    except subprocess.TimeoutExpired:
        return False
    return True


def dies_with_launcher(argv: list[str], signal_name: str = "KILL") -> list[str]:
    """``argv`` run so that it gets ``SIG<signal_name>`` when the launcher's thread that
    starts it dies (``PR_SET_PDEATHSIG``), however the launcher ends; unchanged where setpriv
    is missing. (srun takes TERM: it forwards it to every task and ends the step, where KILL
    would leave the step to Slurm's own time-outs.)"""
    if SETPRIV is None:
        return argv
    return [SETPRIV, "--pdeathsig", signal_name, "--", *argv]


def start_piped(
    argv: list[str],
    env: dict[str, str],
    *,
    cwd: str | None = None,
    stdin: int = subprocess.DEVNULL,
    signal_name: str = "KILL",
) -> subprocess.Popen:
    """Start ``argv`` in a session of its own with ``env``, its stdout and stderr on one pipe,
    dying with the launcher (:func:`dies_with_launcher` with ``signal_name``)."""
    return subprocess.Popen(
        dies_with_launcher(argv, signal_name),
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=stdin,
        start_new_session=True,
    )


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` to the process group ``proc`` leads (it and whatever it started); a group
    that is gone is no error."""
    _killpg(proc.pid, sig)


def raise_interrupt(signum, frame) -> None:  # type: ignore[no-untyped-def]
    """A SIGINT/SIGTERM handler: stop what the launcher waits for, as Ctrl-C does."""
    raise KeyboardInterrupt


def stopped_in_group(pgid: int) -> list[int]:
    """The processes of process group ``pgid`` that are stopped (SIGSTOP, SIGTSTP, a
    debugger's stop: state ``T`` or ``t`` in ``/proc/PID/stat``). A signal other than
    SIGKILL (and SIGCONT) waits, undelivered, until such a process is continued."""
    out = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                text = f.read().decode("ascii", "replace")
        except OSError:
            continue
        fields = text.rsplit(")", 1)[-1].split()  # state, ppid, pgrp, ... (after "(comm)")
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] in ("T", "t"):
            out.append(int(name))
    return out


def end_group(pgid: int, sig: int = signal.SIGTERM, grace: float | None = None) -> bool:
    """Ask process group ``pgid`` to end with ``sig``; a group with a stopped process gets
    SIGKILL at once (``sig`` would wait for a SIGCONT that never comes), and with ``grace``
    a group still there that many seconds later gets SIGKILL too (from a timer thread).
    Whether it got SIGKILL at once."""
    if not _killpg(pgid, sig):
        return False
    if stopped_in_group(pgid):
        _killpg(pgid, signal.SIGKILL)
        return True
    if grace is not None:
        timer = threading.Timer(grace, _killpg, (pgid, signal.SIGKILL))
        timer.daemon = True
        timer.start()
    return False


def _killpg(pgid: int, sig: int) -> bool:
    """Send ``sig`` to group ``pgid``; False when the group is gone or not ours."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def forward_signals(pgid: int, grace: float) -> None:
    """On SIGTERM, SIGINT or SIGHUP, end group ``pgid`` with that signal
    (:func:`end_group`, SIGKILL ``grace`` seconds later)."""

    def forward(signum, frame):  # type: ignore[no-untyped-def]
        end_group(pgid, signum, grace=grace)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
