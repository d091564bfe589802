"""Process checks for tests that must leave nothing behind: is a pid alive (a zombie is not),
and wait until a set of pids is gone."""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, already dead but not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_gone(pids: Iterable[int], timeout: float = 10.0) -> list[int]:
    """Poll until every pid is gone; the ones still alive after ``timeout`` seconds."""
    pids = list(pids)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.1)  # between looks at /proc (the condition is what is waited for)
    return [p for p in pids if alive(p)]
