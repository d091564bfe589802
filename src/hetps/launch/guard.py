"""A role's keeper on a remote host (``hetps launch --launcher ssh``): ends the command's
process group when the ssh connection goes (docs/LAUNCHERS.md, "The remote role's guard")."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

from hetps.launch.contract import after_dashes
from hetps.launch.processes import end_group, forward_signals, shell_code, signal_group

#: seconds a group that was asked to end may take before it gets SIGKILL
KILL_S = 5.0
_GONE = select.POLLERR | select.POLLHUP | select.POLLNVAL


def run(argv: list[str], watch_fd: int = 1) -> int:
    """Run ``argv`` until it ends, or until ``watch_fd``'s reader is gone (then end it);
    its exit status as a shell reports it."""
    child = subprocess.Popen(argv, start_new_session=True)

    forward_signals(child.pid, KILL_S)
    watch = select.poll()
    watch.register(watch_fd, 0)  # (POLLERR and POLLHUP are reported whatever is asked)
    try:
        pidfd = os.pidfd_open(child.pid)
    except (AttributeError, OSError):  # (Linux before 5.3: the child is looked at each 0.5 s)
        pidfd = None
    else:
        watch.register(pidfd, select.POLLIN)
    try:
        while child.poll() is None:
            events = watch.poll(None if pidfd is not None else 500)
            if any(fd == watch_fd and ev & _GONE for fd, ev in events):
                end_group(child.pid, signal.SIGTERM, grace=KILL_S)
                watch.unregister(watch_fd)
        code = child.wait()
    finally:
        if pidfd is not None:
            os.close(pidfd)
    signal_group(child, signal.SIGKILL)  # what the command left behind
    return shell_code(code)


def main(argv: list[str]) -> int:
    """The entry: ``[--] COMMAND...``."""
    argv = after_dashes(argv)
    if not argv:
        print("usage: python -m hetps.launch.guard -- COMMAND...", file=sys.stderr)
        return 2
    try:
        return run(argv)
    except FileNotFoundError as exc:
        print(f"hetps launch: cannot start {argv[0]}: {exc.strerror}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
