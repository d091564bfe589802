"""Host-local aggregation's shared-memory segments (:mod:`hetps.kvstore.hostagg`): their
layout's constants, how one is made whole and linked under its name, and the sweep of those a
crash left behind."""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import stat

import numpy as np

from hetps.transport.shm import alive, sweep

SHM_DIR = "/dev/shm"
MAGIC = 0x47474154534F4848  # b"HHOSTAGG" little-endian
NAME_RE = re.compile(r"^hetps-host-[0-9a-f]{32}-\d+-[0-9a-f]{24}(\.new\d+)?$")
FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
# header slots: 0 magic, 1 local ranks, 2 elements; then per local rank its pid, the round
# its slot holds, its PID namespace and its node id; then per part the round summed (its
# slots are free again), the round whose result is in (-round: the owner's push failed) and
# the workers that result holds when fewer than the job's (0: all)
PID_SLOT = 8


def make(path: str, total: int, header: bytes, what: str) -> int:
    """A new segment of ``total`` bytes for ``path``, ``header`` written, made whole under a
    name of its own and then linked (or the one another local rank linked there first): an
    open descriptor of it. A full shared memory is an error naming the fix, not a SIGBUS."""
    tmp = f"{path}.new{os.getpid()}"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    where = os.path.dirname(path)
    try:
        os.ftruncate(fd, total)
        try:  # reserve the pages now: a full /dev/shm is an error here, not a SIGBUS later
            os.posix_fallocate(fd, 0, total)
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"host aggregation needs {total} bytes of shared memory in {where} for "
                f"{what} and cannot have them ({exc.strerror}): make {where} larger "
                "(docker: --shm-size) or set HETPS_HOST_AGGREGATION=0",
            ) from None
        os.pwrite(fd, header, 0)
        try:
            os.link(tmp, path)
            return fd
        except FileExistsError:
            pass
    except BaseException:
        os.close(fd)
        raise
    finally:
        os.unlink(tmp)
    os.close(fd)
    return os.open(path, os.O_RDWR | os.O_NOFOLLOW)


def pid_ns() -> int:
    """This process's PID namespace (its inode), 0 where it cannot be read."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def unlink(name: str) -> None:
    """Remove a segment's name (already gone: nothing to do)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(SHM_DIR, name))


def sweep_stale(directory: str = SHM_DIR) -> int:
    """Unlink segments older than a minute whose local ranks (their maker, their users)
    are all gone."""
    return sweep(directory, NAME_RE, _gone)


def _gone(path: str, _: re.Match) -> bool:
    """Whether every local rank that uses the segment at ``path`` is gone (only a regular
    file of our own counts: never a link or a FIFO planted there)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return False
        head = np.frombuffer(os.read(fd, 4096), np.int64)
    finally:
        os.close(fd)
    ranks = max(1, min(int(head[1]), len(head) - PID_SLOT))  # (a torn header: its maker)
    return not any(alive(int(p)) for p in head[PID_SLOT : PID_SLOT + ranks] if p > 0)
