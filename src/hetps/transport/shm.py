"""Shared-memory rings: big array frames between two processes on one machine.
(docs/MODULES.md, "hetps.transport.shm")"""

from __future__ import annotations

import logging
import mmap
import os
import re
import secrets
import stat
import time
from collections.abc import Callable
from typing import Annotated, Any

import msgspec
import numpy as np

log = logging.getLogger("hetps.shm")

SHM_DIR = "/dev/shm"
HEADER_BYTES = 4096
ALIGN = 64
MAGIC = 0x474E495253505448  # b"HTPSRING" little-endian
_OPENED, _MAGIC, _SIZE, _TAIL = 0, 1, 2, 8  # uint64 slots of the header (tail on its own line)
# map every page up front: faulting tmpfs pages in on the first lap costs more than the copy
_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
STALE_AGE_S = 60.0  # a ring name older than this, of a creator that is gone, is swept
NAME_RE = re.compile(r"^hetps-shm-(\d+)-[0-9a-f]{32}$")
# names of older versions (64 random bits) are still swept
_SWEPT_RE = re.compile(r"^hetps-shm-(\d+)-(?:[0-9a-f]{16}|[0-9a-f]{32})$")


#: a message whose arrays together reach the bound above sends each of them of at least this
#: size through the ring too: a list call of 100 keys of 40 KB is 100 frames on the
#: connection otherwise, each paying ZeroMQ's per-frame cost (and encryption when secured)
RING_FLOOR_BYTES = 4 << 10
#: ... and so does a message whose arrays of at least the floor reach this together, where
#: that is below the bound (plain connections): 50 arrays of 40 KB took 5.5 ms per push+pull
#: round through the ring and 7.0 ms as frames; 10 of them measured alike either way
RING_MANY_BYTES = 1 << 20


def ring_floor(arrays: list, bound: int) -> int | None:
    """The smallest of ``arrays`` that goes into a ring (or a bulk channel, transport/bulk.py):
    ``bound`` itself, or the floor when the arrays reach the bound (or RING_MANY_BYTES)
    together; None when none goes."""
    total = 0
    for a in arrays:
        n = a.nbytes
        if n >= bound:
            return bound if len(arrays) == 1 else RING_FLOOR_BYTES
        if n >= RING_FLOOR_BYTES:
            total += n
    return RING_FLOOR_BYTES if total >= min(bound, RING_MANY_BYTES) else None


def _span(n: int) -> int:
    return max(ALIGN, (n + ALIGN - 1) // ALIGN * ALIGN)


def sweep_stale(directory: str = SHM_DIR) -> int:
    """Unlink ring files whose creating process no longer exists; returns how many."""
    return sweep(directory, _SWEPT_RE, lambda path, m: not alive(int(m.group(1))))


def sweep(directory: str, pattern: re.Pattern, gone: Callable[[str, re.Match], bool]) -> int:
    """Unlink the files of ``directory`` named by ``pattern`` that are older than a minute
    and whose users are ``gone(path, match)`` (an OSError there: kept); how many went.

    A name lives only until its users opened it: an older one is left over, but a young one
    may belong to a process this one cannot see (another PID namespace sharing /dev/shm)."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        m = pattern.match(name)
        path = os.path.join(directory, name)
        try:
            if m is None or time.time() - os.lstat(path).st_mtime < STALE_AGE_S:
                continue
            if gone(path, m):
                os.unlink(path)
                removed += 1
        except (OSError, ValueError, IndexError):
            continue
    return removed


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one not ours to signal counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


class OutRing:
    """The sending end: ``put`` copies a frame in and returns its counter, or None."""

    def __init__(self, size: int, directory: str = SHM_DIR) -> None:
        if size < ALIGN:
            raise ValueError(f"ring size {size} is below {ALIGN} bytes")
        sweep_stale(directory)
        self.size = int(size)
        self.name = f"hetps-shm-{os.getpid()}-{secrets.token_hex(16)}"
        self._path: str | None = os.path.join(directory, self.name)
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # allocate every page now: a sparse file on a full /dev/shm (Docker gives
            # containers 64 MB) would kill the process with SIGBUS at the first write
            # past what fits, where a failed allocation is an OSError and frames use TCP
            os.posix_fallocate(fd, 0, HEADER_BYTES + self.size)
            self._mm = mmap.mmap(fd, HEADER_BYTES + self.size, flags=_FLAGS)
        except BaseException:
            os.close(fd)
            self._unlink()
            raise
        os.close(fd)
        self._hdr = np.frombuffer(self._mm, np.uint64, count=16)
        self._data = np.frombuffer(self._mm, np.uint8, offset=HEADER_BYTES)
        self._hdr[_SIZE] = self.size
        self._hdr[_MAGIC] = MAGIC
        self.head = 0
        self.closed = False

    def _unlink(self) -> None:
        if self._path is not None:
            try:
                os.unlink(self._path)
            except OSError:
                pass
            self._path = None

    @property
    def ready(self) -> bool:
        """Whether the receiver has opened the ring (then its name is unlinked)."""
        if self.closed or not self._hdr[_OPENED]:
            return False
        self._unlink()
        return True

    @property
    def free(self) -> int:
        """Bytes the receiver has consumed up to, minus what is written: the free space."""
        return self.size - (self.head - int(self._hdr[_TAIL]))

    def fits(self, sizes: list[int]) -> bool:
        """Whether frames of ``sizes`` bytes, put in this order now, would all fit."""
        hdr = self._hdr
        if hdr is None:  # closed
            return False
        pos, tail = self.head, int(hdr[_TAIL])
        for n in sizes:
            span = _span(n)
            off = pos % self.size
            if off + span > self.size:
                pos += self.size - off
            if pos + span - tail > self.size:
                return False
            pos += span
        return True

    def wait_room(self, sizes: list[int], timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for room for frames of ``sizes`` bytes (the receiver
        consumes at memory speed, so a full ring is usually free again within a millisecond;
        its tail is shared memory, with no wake-up to wait on: looked at every 0.1 ms).
        False when there was none by then, or when they could never fit together."""
        if sum(_span(n) for n in sizes) > self.size:
            return False
        deadline = time.monotonic() + timeout
        while True:
            if self.closed:
                return False
            if self.fits(sizes):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.0001)

    def put(self, frame: np.ndarray) -> int | None:
        """Copy ``frame`` (uint8, contiguous) in; its counter, or None when it does not fit."""
        got = self.slot(frame.nbytes)
        if got is None:
            return None
        got[1][:] = frame
        return got[0]

    def slot(self, n: int) -> tuple[int, np.ndarray] | None:
        """Room for a frame of ``n`` bytes, taken now: its counter and the ring's memory to
        write it into (``n`` uint8, 64-byte aligned) before the message naming the counter
        leaves; None when it does not fit."""
        span = _span(n)
        if span > self.size or self.closed:
            return None
        pos = self.head
        off = pos % self.size
        if off + span > self.size:  # never straddle the end: start the next lap
            pos += self.size - off
            off = 0
        if pos + span - int(self._hdr[_TAIL]) > self.size:
            return None
        self.head = pos + span
        return pos, self._data[off : off + n]

    def close(self) -> None:
        """Unlink the name (if still there) and unmap."""
        if self.closed:
            return
        self.closed = True
        self._unlink()
        self._hdr = self._data = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:  # a view is still alive somewhere: the mapping goes with it
            pass


class InRing:
    """The receiving end of a ring named in an offer."""

    lends = True  # (its arrays may be lent to a handler: see codec.decode's ``borrow``)

    def __init__(self, name: str, directory: str = SHM_DIR) -> None:
        if not isinstance(name, str) or NAME_RE.match(name) is None:
            raise ValueError(f"{name!r} is not a hetps ring name")
        self.name = name
        # the file stays open: its size is checked again before every read, since a page
        # past the end of a mapping truncated by its sender kills the reader with SIGBUS
        self._fd = fd = os.open(os.path.join(directory, name), os.O_RDWR | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
                raise ValueError(
                    f"ring {name} is not a private file of this user (mode "
                    f"{stat.S_IMODE(st.st_mode):o}, owner {st.st_uid}): refused"
                )
            total = st.st_size
            if total < HEADER_BYTES + ALIGN:
                raise ValueError(f"ring {name} holds {total} bytes, too few")
            self.total = total
            self._mm = mmap.mmap(fd, total, flags=_FLAGS)
            try:
                self._check_size()  # (truncated while it was being mapped)
            except ValueError:
                self._mm.close()
                raise
        except BaseException:
            os.close(fd)
            raise
        self._hdr = np.frombuffer(self._mm, np.uint64, count=16)
        self.size = total - HEADER_BYTES
        if int(self._hdr[_MAGIC]) != MAGIC or int(self._hdr[_SIZE]) != self.size:
            self._hdr = None  # type: ignore[assignment]
            self._mm.close()
            os.close(fd)
            raise ValueError(f"ring {name} has a bad header")
        self._data = np.frombuffer(self._mm, np.uint8, offset=HEADER_BYTES)
        self.tail = int(self._hdr[_TAIL])
        self._taken = self.tail
        self.owner: int | None = None  # the node id that offered it (set by the van)
        self.broken = False  # truncated under us: refused from then on
        self._hdr[_OPENED] = 1

    def _check_size(self) -> None:
        """ValueError (and the ring is broken) if the file is no longer the size mapped."""
        if getattr(self, "broken", False):
            raise ValueError(f"ring {self.name} was truncated by its sender: refused")
        try:
            now = os.fstat(self._fd).st_size
        except OSError as exc:
            now = f"unknown ({exc})"
        if now != self.total:
            self.broken = True
            raise ValueError(
                f"ring {self.name} was truncated by its sender ({now} of {self.total} bytes "
                "mapped): refused"
            )

    def take(
        self, pos: int, n: int, out: np.ndarray | None = None, view: bool = False
    ) -> np.ndarray:
        """A copy of the ``n`` bytes written at counter ``pos`` (into ``out``, ``n`` uint8,
        when given); ValueError unless that lies in the part of the ring the sender may have
        written and this end not yet consumed. With ``view``: no copy, a read-only view of
        the ring itself, valid only until the next :meth:`commit` (the caller holds it)."""
        if self._data is None:
            raise ValueError(f"ring {self.name} is closed")
        if not (isinstance(pos, int) and 0 <= pos < (1 << 62) and isinstance(n, int) and n >= 0):
            raise ValueError(f"bad ring position {pos!r}")
        span = _span(n)
        off = pos % self.size
        if pos < self.tail or pos + span > self.tail + self.size or off + n > self.size:
            raise ValueError(
                f"frame at {pos} of {n} bytes is outside the ring's unread part "
                f"[{self.tail}, {self.tail + self.size})"
            )
        self._check_size()
        self._taken = max(self._taken, pos + span)
        if view:
            out = self._data[off : off + n]
            out.flags.writeable = False
            return out
        if out is None:
            out = np.empty(n, np.uint8)
        out[:] = self._data[off : off + n]
        return out

    def holds(self, arr: np.ndarray) -> bool:
        """Whether ``arr`` may be (a view of) this ring's memory."""
        return self._data is not None and np.may_share_memory(arr, self._data)

    def commit(self) -> None:
        """Publish that everything taken so far may be overwritten."""
        if self._taken > self.tail and self._hdr is not None and not self.broken:
            try:
                self._check_size()
            except ValueError:
                return
            self._hdr[_TAIL] = self._taken
            self.tail = self._taken

    def close(self) -> None:
        self._hdr = self._data = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:
            pass
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class RingOffer(msgspec.Struct, forbid_unknown_fields=True):
    """The body of a ring offer: ``name``: the ring's file under /dev/shm."""

    name: Annotated[str, msgspec.Meta(max_length=255)]


def open_offered(rings: dict, msg: Any, name: str, verbose: int = 0) -> None:
    """Map the ring a known peer offered in ``msg`` into ``rings``; it may carry only that
    connection's arrays (an offer naming a ring another connection offered is refused)."""
    try:  # (a RingOffer: a name of at most 255 characters; InRing checks it further)
        ring_name = msgspec.convert(msg.body, RingOffer).name
    except msgspec.ValidationError as exc:
        log.warning("%s refused a ring offer from node %s: %s", name, msg.sender, exc)
        return
    mine = rings.get(ring_name)
    if mine is not None and mine.owner != msg.origin:
        log.warning(
            "%s refused a ring offer from node %s: ring %s is another connection's",
            name,
            msg.sender,
            ring_name,
        )
        return
    try:
        ring = InRing(ring_name)
    except (OSError, ValueError) as exc:  # another machine, or a bad offer: stay on TCP
        if verbose >= 1:
            log.info("%s: ring %r from node %s not opened: %s", name, ring_name, msg.sender, exc)
        return
    ring.owner = msg.origin
    for other, old in list(rings.items()):  # the sender's previous ring, if any
        if isinstance(old, InRing) and old.owner == msg.origin:
            old.close()
            del rings[other]
    rings[ring.name] = ring


def drop_broken(rings: dict[str, InRing]) -> list[str]:
    """Close and remove the rings of ``rings`` found truncated; their names."""
    names = [name for name, ring in rings.items() if ring.broken]
    for name in names:
        rings.pop(name).close()
    return names
