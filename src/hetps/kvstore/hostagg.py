"""Host-local aggregation, a part of :class:`~hetps.kvstore.client.DistKVStore`: the workers
of one host sum their gradients through shared memory and push and pull the host's sum once
(BytePS's local reduce-scatter and broadcast; docs/HOSTS.md).

On in ``dist_sync`` when a host runs more than one worker (``LOCAL_WORLD_SIZE`` > 1, the
host group and local rank known: the host contract every launcher sets) and
``HETPS_HOST_AGGREGATION`` is on. Each dense key has a segment under ``/dev/shm``: one slot
per local rank for its gradient, one for the result, and a header of round counters. The
key's parts (one per server that holds some of it) are dealt over the local ranks by bytes,
so each local rank sums and sends the parts of its servers only (no local root carries every
byte):

* a push copies the worker's gradient into its slot and publishes the round;
* the owner of a part waits until every local rank published it, sums the slots in
  local-rank order (``s = x0; s += x1; ...``, in the key's dtype), and sends that sum as one
  push standing for the host's workers (``hg``: the servers count it for them, and sum a
  round's hosts in host-group order: :mod:`hetps.kvstore.hostrounds`), a fused push-pull
  whose answer lands in the segment's result;
* a pull waits until every part's result of its round is published and copies it out.

The segment is created by local rank 0 (``O_EXCL``, mode 0600) under a name derived from
the cluster secret, the host group and the key, opened by the others after the init's
barrier, and unlinked as soon as every local rank mapped it (and at ``close``), so a crash
leaves nothing behind but what the next job's sweep removes. A wait for a local rank checks
the store's node (a dead or hung worker is declared dead by the scheduler), that the other
local ranks' processes exist, and the request timeout; none hangs.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import mmap
import os
import re
import stat
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hetps.cluster import bodies
from hetps.cluster import protocol as P
from hetps.cluster.errors import ClusterError
from hetps.cluster.requests import Future
from hetps.config import ConfigError
from hetps.kvstore.keys import KeyMeta, land_into
from hetps.kvstore.placement import chunk_elems, chunks
from hetps.transport.codec import Message, dtype_str

log = logging.getLogger("hetps.worker")

SHM_DIR = "/dev/shm"
MAGIC = 0x47474154534F4848  # b"HHOSTAGG" little-endian
NAME_RE = re.compile(r"^hetps-host-[0-9a-f]{32}-\d+-[0-9a-f]{24}$")
STALE_AGE_S = 60.0
_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


def plan(kv: Any) -> tuple[HostAggregation | None, tuple[int, int, int] | None]:
    """What the store ``kv`` does with its host: its aggregation (None: each worker pushes
    its own), and the host tag its own pushes carry (None: no host order)."""
    cfg = kv.cfg
    # a worker whose host is known tags its pushes, so that the servers sum every round per
    # host, also on hosts of one worker (a round of tagged and untagged pushes is refused)
    known = cfg.host_group >= 0 and cfg.local_rank >= 0 and cfg.local_world_size >= 1
    # ... but only where some host has several workers: on hosts of one worker each (a
    # Kubernetes pod, a Slurm or Ray job of a task a node) a host's sum is its worker's push,
    # and a server keeps merging pushes as they come instead of keeping each one for the order
    workers = Counter(n.group for n in kv.node.nodes.values() if n.role == "worker")
    known = known and max(workers.values(), default=0) > 1 and -1 not in workers
    if not (known and kv.sync) or kv.node.elastic > 0 or kv.balance:
        if known and kv.sync and cfg.host_aggregation and cfg.local_world_size > 1:
            log.warning(
                "host aggregation is off under %s: each worker pushes its own gradients "
                "(docs/HOSTS.md)",
                "HETPS_BALANCE" if kv.balance else "HETPS_ELASTIC",
            )
        return None, None
    if cfg.local_rank >= cfg.local_world_size:
        raise ConfigError(
            f"LOCAL_RANK={cfg.local_rank} but LOCAL_WORLD_SIZE={cfg.local_world_size}: a "
            "local rank is below the host's worker count"
        )
    tag = (cfg.host_group, cfg.local_rank, 1)
    if not cfg.host_aggregation or cfg.local_world_size == 1:
        return None, tag
    why = None
    if cfg.secret is None:
        why = "the job has no cluster secret (hetps launch makes one)"
    elif kv.node.replicas > 1:
        why = "HETPS_REPLICAS resends pushes to a server that takes over"
    if why is not None:
        log.warning("host aggregation is off: %s; each worker pushes its own", why)
        return None, tag
    return HostAggregation(kv), tag


@dataclass
class HostKey:
    """One key's segment and what this worker knows of its rounds."""

    name: str
    mm: mmap.mmap
    head: np.ndarray  # int64 counters (see HostAggregation._layout)
    slots: list[np.ndarray]  # one gradient slot per local rank (flat)
    result: np.ndarray  # the host's result (flat)
    mine: list[int]  # indices of the parts this local rank sums and sends
    key: Any = None
    parts: int = 1
    pushed: int = 0  # rounds this worker pushed
    pulled: int = 0  # the last round this worker read the result of
    sent: dict[int, int] = field(default_factory=dict)  # part -> round sent
    futs: dict[int, list[Future]] = field(default_factory=dict)  # part -> its requests
    sums: dict[int, np.ndarray] = field(default_factory=dict)  # part -> the sent sum
    # 2-bit compression: part -> the host's residual of it (kept by the part's owner)
    residual: dict[int, np.ndarray] = field(default_factory=dict)
    fallback: bool = False  # a device tensor's key: each worker pushes its own
    named: bool = True  # its name is still in /dev/shm (unlinked once every rank mapped it)


# header slots: 0 magic, 1 local ranks, 2 elements; then per local rank its pid, the round
# its slot holds and its PID namespace; then per part the round summed (its slots are free again) and the
# round whose result is in (-round: the owner's push of it failed)
_PID = 8


class HostAggregation:
    """The host's aggregation for the store ``kv`` (``kv.hostagg``)."""

    def __init__(self, kv: Any) -> None:
        cfg = kv.cfg
        self.kv = kv
        self.group, self.local, self.size = cfg.host_group, cfg.local_rank, cfg.local_world_size
        assert cfg.secret is not None
        # the job: its secret, its scheduler's address and its restart (a user's own secret
        # may serve two jobs on one host, and a job started again may meet its last names)
        where = f"{cfg.root_uri}:{cfg.root_port}:{cfg.restart}".encode()
        self.job = hmac.new(
            cfg.secret, b"hetps host aggregation " + where, hashlib.sha256
        ).hexdigest()
        self.keys: dict[Any, HostKey] = {}
        self.gens: dict[Any, int] = {}
        self.load = [0] * self.size  # bytes of parts each local rank sums
        self.lock = threading.RLock()
        self.noticed = False
        if self.local == 0:
            sweep_stale()

    # -- segments -----------------------------------------------------------------------------
    def _layout(self, meta: KeyMeta) -> tuple[int, int, int]:
        parts = len(meta.parts)
        slots = _PID + 3 * self.size + 2 * parts
        head = (slots * 8 + 4095) // 4096 * 4096
        span = (meta.size * meta.dtype.itemsize + 63) // 64 * 64
        return head, span, head + (self.size + 1) * span

    def _name(self, k: Any, again: bool = False) -> str:
        gen = self.gens[k] if again else self.gens.get(k, -1) + 1
        self.gens[k] = gen
        digest = hashlib.sha256(f"{type(k).__name__}:{k}:{gen}".encode()).hexdigest()[:24]
        return f"hetps-host-{self.job[:32]}-{self.group}-{digest}"

    def create(self, k: Any, meta: KeyMeta) -> None:
        """At ``init`` of a dense key, before its barrier: local rank 0 makes the segment."""
        name = self._name(k)
        old = self.keys.pop(k, None)
        if old is not None:
            unlink(old.name)
        if self.local != 0:
            return  # opened after the barrier (opened)
        head, span, total = self._layout(meta)
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, total)
            try:  # reserve the pages now: a full /dev/shm is an error here, not a SIGBUS later
                os.posix_fallocate(fd, 0, total)
            except OSError as exc:
                raise OSError(
                    exc.errno,
                    f"host aggregation needs {total} bytes of shared memory in {SHM_DIR} for "
                    f"key {k!r} and cannot have them ({exc.strerror}): make {SHM_DIR} larger "
                    "(docker: --shm-size) or set HETPS_HOST_AGGREGATION=0",
                ) from None
            mm = mmap.mmap(fd, total, flags=_FLAGS)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        self.keys[k] = hk = self._view(k, name, mm, meta, head, span)
        hk.head[:3] = (MAGIC, self.size, meta.size)
        hk.head[_PID] = os.getpid()
        hk.head[self._slot(hk, "ns", 0)] = _pid_ns()

    def opened(self, todo: list[tuple[Any, KeyMeta]]) -> None:
        """After ``init``'s barrier: the other local ranks open the segments local rank 0
        made; whoever maps one last unlinks its name."""
        for k, meta in todo:
            hk = self.keys.get(k)
            if hk is None:
                hk = self._open(k, meta)
                self.keys[k] = hk
            self._unname(hk)

    def _unname(self, hk: HostKey) -> None:
        """Unlink ``hk``'s name once every local rank mapped the segment (every rank tries
        after its open and at its pushes, so one of them sees the last pid)."""
        if hk.named and all(hk.head[_PID : _PID + self.size]):
            unlink(hk.name)
            hk.named = False

    def _open(self, k: Any, meta: KeyMeta) -> HostKey:
        name = self._name(k, again=True)
        head, span, total = self._layout(meta)
        where = f"host group {self.group}'s segment of key {k!r}"
        try:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise ClusterError(
                f"{where} is missing: local rank 0 of this host did not make it; every worker "
                "of a host must have the same HETPS_HOST_GROUP and LOCAL_WORLD_SIZE, and one "
                "of them LOCAL_RANK=0"
            ) from None
        try:
            st = os.fstat(fd)
            if (
                not stat.S_ISREG(st.st_mode)
                or st.st_uid != os.geteuid()
                or st.st_mode & 0o077
                or st.st_size != total
            ):
                raise ClusterError(f"{where} is not a private file of {total} bytes: refused")
            mm = mmap.mmap(fd, total, flags=_FLAGS)
        finally:
            os.close(fd)
        hk = self._view(k, name, mm, meta, head, span)
        if tuple(hk.head[:3]) != (MAGIC, self.size, meta.size):
            raise ClusterError(
                f"{where} was made for {int(hk.head[1])} local ranks and {int(hk.head[2])} "
                f"elements, this worker has LOCAL_WORLD_SIZE={self.size} and {meta.size}"
            )
        if hk.head[_PID + self.local] != 0:
            raise ClusterError(
                f"two workers of host group {self.group} say LOCAL_RANK={self.local} (pid "
                f"{int(hk.head[_PID + self.local])} and {os.getpid()}): give each its own"
            )
        hk.head[self._slot(hk, "ns", self.local)] = _pid_ns()
        hk.head[_PID + self.local] = os.getpid()
        return hk

    def _view(
        self, k: Any, name: str, mm: mmap.mmap, meta: KeyMeta, head: int, span: int
    ) -> HostKey:
        counters = np.frombuffer(mm, np.int64, head // 8)
        n = meta.size

        def at(i: int) -> np.ndarray:
            return np.frombuffer(mm, meta.dtype, n, head + i * span)

        mine = []
        for i, p in enumerate(meta.parts):  # deal the parts by bytes (the same on every rank)
            owner = min(range(self.size), key=lambda r: (self.load[r], r))
            self.load[owner] += p.size
            if owner == self.local:
                mine.append(i)
        slots = [at(r) for r in range(self.size)]
        return HostKey(name, mm, counters, slots, at(self.size), mine, k, len(meta.parts))

    def _slot(self, hk: HostKey, what: str, i: int) -> int:
        base = _PID + 3 * self.size
        first = {
            "contrib": _PID + self.size,
            "ns": _PID + 2 * self.size,
            "summed": base,
            "result": base + hk.parts,
        }
        return first[what] + i

    # -- rounds -----------------------------------------------------------------------------
    def takes(self, k: Any, device: bool) -> bool:
        """Whether key ``k``'s rounds go through the host (a dense key; a device tensor's
        key falls back to each worker's own push, said once)."""
        hk = self.keys.get(k)
        if hk is None:
            return False
        if device and not hk.fallback:
            hk.fallback = True
            if not self.noticed:
                self.noticed = True
                log.warning(
                    "host aggregation: key %r holds device tensors, which each worker pushes "
                    "itself (host aggregation of device tensors is not built)",
                    k,
                )
        return not hk.fallback

    def push(self, k: Any, meta: KeyMeta, arr: np.ndarray) -> None:
        """This worker's gradient of a new round of ``k`` into its slot."""
        hk = self.keys[k]
        self._unname(hk)
        t = hk.pushed + 1
        if hk.pushed > hk.pulled:  # pushed again before pulling: its parts go now
            self._drive(hk, meta, block=True)
        summed = self._slot(hk, "summed", 0)
        parts = len(meta.parts)
        self.wait(k, lambda: bool((hk.head[summed : summed + parts] >= t - 1).all()), "push")
        np.copyto(hk.slots[self.local], np.ascontiguousarray(arr).reshape(-1))
        hk.head[self._slot(hk, "contrib", self.local)] = t
        hk.pushed = t
        with self.lock:
            self._pump()

    def settle(self, only: Any = None) -> None:
        """Wait until every round this worker pushed through the host (of key ``only``, or
        of every key) was applied by the servers, as a flat push's answer says: what
        ``wait_outstanding``, ``barrier`` and ``push(block=True)`` wait for."""
        for k, hk in list(self.keys.items()):
            meta = self.kv.meta.get(k)
            if (only is not None and k != only) or hk.fallback or meta is None:
                continue
            if hk.pushed <= hk.pulled:  # (its pull saw the round applied)
                continue
            self._drive(hk, meta, block=True)
            res, t = self._slot(hk, "result", 0), hk.pushed
            self.wait(
                k, lambda hk=hk, k=k, res=res, t=t: self._results(hk, k, res, hk.parts, t), "push"
            )

    def pending(self, k: Any) -> bool:
        """Whether a pull of ``k`` reads a round this worker pushed through the host."""
        hk = self.keys.get(k)
        return hk is not None and not hk.fallback and hk.pushed > hk.pulled

    def pull(self, k: Any, meta: KeyMeta, targets: list[np.ndarray]) -> Callable[[], None]:
        """What completes a pull of ``k``'s last pushed round into ``targets`` (blocks)."""
        hk = self.keys[k]
        t = hk.pushed

        def finish() -> None:
            self._drive(hk, meta, block=True)
            res = self._slot(hk, "result", 0)
            parts = len(meta.parts)
            self.wait(k, lambda: self._results(hk, k, res, parts, t), "pull")
            value = hk.result.reshape(meta.shape)
            for target in targets:
                target[...] = value
            hk.pulled = t

        return finish

    def _results(self, hk: HostKey, k: Any, res: int, parts: int, t: int) -> bool:
        got = hk.head[res : res + parts]
        if (got < 0).any():
            i = int(np.argmax(got < 0))
            if i in hk.mine:  # this worker's own push: its error
                for f in hk.futs[i]:
                    if f.error is not None:
                        f.reported = True
                        raise f.error
            raise ClusterError(
                f"the host's push of key {k!r} (part {i}) failed on another local rank of "
                f"host group {self.group}: its log says why"
            )
        return bool((got >= t).all())

    def _drive(self, hk: HostKey, meta: KeyMeta, block: bool) -> None:
        """Sum and send this rank's parts of the key's last pushed round: waiting for the
        other local ranks' gradients (``block``), or only if they are all in."""
        t = hk.pushed
        contrib = self._slot(hk, "contrib", 0)
        for i in hk.mine:
            if hk.sent.get(i, 0) >= t:
                continue

            def ready() -> bool:
                return bool((hk.head[contrib : contrib + self.size] >= t).all())

            if not ready():
                if not block:
                    return
                self.wait(None, ready, "push", hk=hk, t=t)
            with self.lock:
                if hk.sent.get(i, 0) < t:
                    self._send(hk, meta, i, t)

    def _send(self, hk: HostKey, meta: KeyMeta, i: int, t: int) -> None:
        kv = self.kv
        p = meta.parts[i]
        total = hk.sums.get(i)
        if total is None or not all(f.done() for f in hk.futs.get(i, [])):
            total = hk.sums[i] = np.empty(p.size, meta.dtype)
        np.copyto(total, hk.slots[0][p.start : p.stop])
        for r in range(1, self.size):  # local-rank order, as the servers sum hosts' workers
            np.add(total, hk.slots[r][p.start : p.stop], out=total)
        hk.head[self._slot(hk, "summed", i)] = t  # the slots of this part are free again
        key = hk.key
        step = chunk_elems(kv.cfg.chunk_bytes, meta.dtype.itemsize)
        dest = hk.result
        futs = []
        comp = kv.compressor  # (the host's sum is compressed, with the host's residual)
        if comp is not None and i not in hk.residual:
            hk.residual[i] = np.zeros(p.size, np.float32)
        for a, b in chunks(p.start, p.stop, step):
            payload = total[a - p.start : b - p.start]
            if comp is not None:
                payload = comp.compress(payload, hk.residual[i][a - p.start : b - p.start])
            body = bodies.chunk(
                key,
                p.index,
                a - p.start,
                b - a,
                meta.shape,
                dtype_str(meta.dtype),
                sync=True,
                chunk=step,
                fused=True,
                host=(self.group, self.local, self.size),
                threshold=comp.threshold if comp is not None else None,
            )
            msg = Message(P.PUSH, body=body, arrays=[payload])
            land = land_into(key, dest, a, b, kv.short_marks)
            futs.append(kv.request(key, 0, p.server, msg, land, dest[a:b]))
        hk.futs[i], hk.sent[i] = futs, t

    def _pump(self) -> None:
        """Send what is ready (every local rank's gradient in) and publish what came back."""
        for k, hk in list(self.keys.items()):
            if hk.fallback:
                continue
            meta = self.kv.meta.get(k)
            if meta is None:
                continue
            if any(hk.sent.get(i, 0) < hk.pushed for i in hk.mine):
                self._drive(hk, meta, block=False)
            for i in hk.mine:
                futs = hk.futs.get(i)
                if not futs or not all(f.done() for f in futs):
                    continue
                slot = self._slot(hk, "result", i)
                t = hk.sent[i]
                if hk.head[slot] == t or hk.head[slot] == -t:
                    continue
                failed = [f for f in futs if f.error is not None]
                hk.head[slot] = -t if failed else t
                if failed:
                    log.error("host aggregation: the push of key %r failed", k)

    def wait(
        self,
        k: Any,
        ready: Callable[[], bool],
        what: str,
        hk: HostKey | None = None,
        t: int = 0,
    ) -> None:
        """Poll ``ready`` (sending and publishing meanwhile) until it holds; raise, naming
        them, when a local rank's process is gone, the node failed, or the request timeout
        passed."""
        kv = self.kv
        start = time.monotonic()
        delay, checked = 2e-5, start
        while True:
            with self.lock:
                self._pump()
            if ready():
                return
            now = time.monotonic()
            if now - checked > 0.05:
                checked = now
                self._peers(what)  # (a dead local rank is seen here before the scheduler says)
                kv.node.check()
            if now - start > kv.timeout:
                raise ClusterError(
                    f"host aggregation: a {what} waited {kv.timeout:.0f} s for the other "
                    f"local ranks of host group {self.group} (LOCAL_WORLD_SIZE={self.size}); "
                    "every worker of a host must run the same rounds"
                )
            time.sleep(delay)  # between looks at the counters other processes write
            delay = min(delay * 2, 1e-3)

    def _peers(self, what: str) -> None:
        for hk in list(self.keys.values()):
            for r in range(self.size):
                pid = int(hk.head[_PID + r])
                if r == self.local or pid <= 0 or hk.head[self._slot(hk, "ns", r)] != _pid_ns():
                    continue  # (a pid of another PID namespace names nothing here)
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    raise ClusterError(
                        f"host aggregation: local rank {r} (pid {pid}) of host group "
                        f"{self.group} died during a {what}; the host's round cannot complete"
                    ) from None
                except PermissionError:
                    pass
            return

    def compression(self) -> None:
        """2-bit compression was set: every host residual starts again from zero."""
        for hk in self.keys.values():
            hk.residual = {}

    def close(self) -> None:
        """Unlink what is still named (a local rank that never opened it) and unmap."""
        for hk in self.keys.values():
            unlink(hk.name)
        self.keys = {}


def _pid_ns() -> int:
    """This process's PID namespace (its inode), 0 where it cannot be read."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def unlink(name: str) -> None:
    """Remove a segment's name (already gone: nothing to do)."""
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


def sweep_stale(directory: str = SHM_DIR) -> int:
    """Unlink segments older than a minute whose local rank 0 (their maker) is gone."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        if not NAME_RE.match(name):
            continue
        path = os.path.join(directory, name)
        try:
            # only a regular file of our own (never a link or a FIFO planted there)
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                    continue
                if time.time() - st.st_mtime < STALE_AGE_S:
                    continue
                head = os.read(fd, 8 * (_PID + 1))
            finally:
                os.close(fd)
            pid = int(np.frombuffer(head, np.int64)[_PID])
            if pid <= 0:
                raise ProcessLookupError
            os.kill(pid, 0)
            continue
        except ProcessLookupError:
            pass
        except (OSError, ValueError, IndexError):
            continue
        try:
            os.unlink(path)
            removed += 1
        except OSError:
            pass
    return removed
