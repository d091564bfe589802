"""Removal of emulator namespaces; also runnable as a stand-alone guard process.
(docs/MODULES.md, "hetps.netem.reap")"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time

# Namespace names are ``<prefix><owner pid>-<token>-<role>``, role ``hub`` or ``n<i>``.
NAME_RE = re.compile(r"^(?P<prefix>[a-z]+?)(?P<pid>\d+)-(?P<token>[0-9a-f]+)-(?P<role>hub|n\d+)$")

HUB_BRIDGE = "br0"


def list_namespaces(ip: str) -> list[str]:
    """Names of all named network namespaces (``ip netns list``)."""
    out = quiet([ip, "netns", "list"])
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def namespace_pids(ip: str, name: str) -> list[int]:
    """Process ids running inside namespace ``name``."""
    out = quiet([ip, "netns", "pids", name])
    return [int(t) for t in out.stdout.split() if t.isdigit() and int(t) != os.getpid()]


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return False


def kill_pids(pids: list[int], deadline_s: float = 2.0) -> None:
    """SIGKILL ``pids`` and wait (bounded) until they are gone."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    end = time.monotonic() + deadline_s
    for pid in pids:
        while pid_alive(pid) and time.monotonic() < end:
            time.sleep(0.01)  # polling a foreign pid: there is nothing to wait on


def remove_run(ip: str, run_id: str, *, names: list[str] | None = None) -> list[str]:
    """Remove every namespace of run ``run_id`` (processes, veths, bridge, then namespaces).

    Idempotent and tolerant: missing namespaces or devices are not errors. Returns the names
    of the namespaces that were removed.
    """
    if names is None:
        names = [n for n in list_namespaces(ip) if n.startswith(run_id + "-")]
    nodes = [n for n in names if not n.endswith("-hub")]
    hubs = [n for n in names if n.endswith("-hub")]
    for name in names:
        kill_pids(namespace_pids(ip, name))
    for hub in hubs:
        # Delete the devices explicitly: destroying a namespace frees its devices from a
        # kernel work queue, i.e. later; an explicit delete is synchronous.
        cmds = [f"link del {n.rsplit('-', 1)[1].replace('n', 'v', 1)}" for n in nodes]
        cmds.append(f"link del {HUB_BRIDGE}")
        quiet([ip, "-force", "-n", hub, "-batch", "-"], input="\n".join(cmds) + "\n")
    return [name for name in nodes + hubs if quiet([ip, "netns", "del", name]).returncode == 0]


def quiet(argv: list[str], input: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` to its end, its output captured as text (a failure is the caller's)."""
    return subprocess.run(argv, input=input, capture_output=True, text=True, check=False)


def main(argv: list[str]) -> int:
    """Reaper entry point: wait for EOF on stdin, then remove the run unless told ``done``."""
    if len(argv) != 2:
        print("usage: reap.py IP RUN_ID", file=sys.stderr)
        return 2
    ip, run_id = argv
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the owner's business
    data = sys.stdin.buffer.read()  # blocks until the owner closes the pipe or dies
    if data.strip() == b"done":
        return 0
    remove_run(ip, run_id)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
