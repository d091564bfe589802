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

A key's segment is made at its first push through the host (a key only broadcast, init and
pull, has none), by whichever local rank comes first: made whole under a name of its own
(``O_EXCL``, mode 0600) and linked under a name derived from the cluster secret, the host
group and the key; the others open what is linked there. Its name is unlinked as soon as
every local rank mapped it (and at ``close``), so a crash leaves nothing behind but what the
next job's sweep removes. An init again of the same form keeps the segment; a one-shot key
(an unnamed collective's) is released after its round (:meth:`HostAggregation.release`). A
wait for a local rank checks the store's node (a dead or hung worker is declared dead by the
scheduler), that the other local ranks' processes exist, and the request timeout; none hangs.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import mmap
import os
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
from hetps.kvstore.hostagg_tables import HostTables
from hetps.kvstore.hostshm import (
    FLAGS,
    MAGIC,
    PID_SLOT,
    SHM_DIR,
    alive,
    make,
    sweep_stale,
    unlink,
)
from hetps.kvstore.hostshm import pid_ns as _pid_ns
from hetps.kvstore.keys import KeyMeta, land_into
from hetps.kvstore.placement import chunk_elems, chunks
from hetps.kvstore.ports import StorePort
from hetps.transport.codec import Message, dtype_str

log = logging.getLogger("hetps.worker")
__all__ = ["SHM_DIR", "HostAggregation", "plan", "sweep_stale", "unlink"]


def plan(kv: StorePort) -> tuple[HostAggregation | None, tuple[int, int, int] | None]:
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
    if not (known and kv.sync):
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
    elif getattr(kv.joins, "rejoining", False):
        why = "this worker was started again and joins a host that went on without it"
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
    named: bool = True  # its name is still in /dev/shm (unlinked once every rank mapped it)
    form: tuple = ()  # the key's size, dtype and parts (an init of another form: a new one)
    owner: list[int] = field(default_factory=list)  # part -> the local rank that sends it
    rnd: dict[int, int] = field(default_factory=dict)  # round -> the key's server round

    def drop(self) -> None:
        """Let go of the mapping (unmapped once nothing refers to it any more)."""
        self.head = self.result = None  # type: ignore[assignment]
        self.slots, self.futs, self.sums, self.residual = [], {}, {}, {}
        try:
            self.mm.close()
        except BufferError:  # (a view still held somewhere: unmapped when it goes)
            pass


def _form(meta: KeyMeta) -> tuple:
    # (not the parts' servers: a plan of HETPS_BALANCE moves them, the segment stays)
    return (meta.size, meta.dtype.str, tuple((p.start, p.stop) for p in meta.parts))


class HostAggregation:
    """The host's aggregation for the store ``kv`` (``kv.hostagg``)."""

    def __init__(self, kv: StorePort) -> None:
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
        self.gens: dict[Any, int] = {}  # key -> its segments so far (their names differ)
        # dense keys initialised (a segment at their first push), in init order: their form
        # and which local rank sends each part
        self.forms: dict[Any, tuple] = {}
        self.owners: dict[Any, list[int]] = {}
        self.load = [0] * self.size  # bytes of parts each local rank sums
        self.dead: set[int] = set()  # local ranks let go (HETPS_ELASTIC)
        self.elastic = kv.node.elastic > 0
        self.lock = threading.RLock()
        self.tables = HostTables(self)  # the row-sparse keys' rounds
        if self.local == 0:
            sweep_stale()

    # -- segments -----------------------------------------------------------------------------
    def _layout(self, meta: KeyMeta) -> tuple[int, int, int]:
        parts = len(meta.parts)
        slots = PID_SLOT + 4 * self.size + 3 * parts
        head = (slots * 8 + 4095) // 4096 * 4096
        span = (meta.size * meta.dtype.itemsize + 63) // 64 * 64
        return head, span, head + (self.size + 1) * span

    def _name(self, k: Any) -> str:
        digest = hashlib.sha256(f"{type(k).__name__}:{k}:{self.gens[k]}".encode()).hexdigest()
        return f"hetps-host-{self.job[:32]}-{self.group}-{digest[:24]}"

    def create(self, k: Any, meta: KeyMeta) -> None:
        """At ``init`` of a dense key: its segment is made at its first push through the
        host (a key only broadcast has none); an init again of the same shape keeps the
        segment it has, another shape gets a new one (every local rank inits alike)."""
        form = _form(meta)
        if self.forms.get(k) != form:  # (inits come in the same order on every rank)
            self.forms[k], self.owners[k] = form, [-1] * len(meta.parts)
            self._deal(k, [p.size for p in meta.parts])
        old = self.keys.get(k)
        if old is None or old.form != form:
            self.release(k)

    def release(self, k: Any) -> None:
        """Forget key ``k``'s segment (a one-shot collective's key, done on this worker):
        its memory goes once every local rank released it; a later push of ``k`` makes a
        new one. Every local rank calls it at the same point of its calls."""
        hk = self.keys.pop(k, None)
        if k in self.gens:
            self.gens[k] += 1
        if hk is not None:
            if hk.named:
                unlink(hk.name)
            hk.drop()

    def attach(self, k: Any, meta: KeyMeta) -> HostKey:
        """This worker's map of key ``k``'s segment: the one another local rank made, else
        a new one (made whole under no name, then linked: whoever links first wins)."""
        self.gens.setdefault(k, 0)
        name = self._name(k)
        path = os.path.join(SHM_DIR, name)
        head, span, total = self._layout(meta)
        where = f"host group {self.group}'s segment of key {k!r}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            header = np.array([MAGIC, self.size, meta.size], np.int64).tobytes()
            fd = make(path, total, header, f"key {k!r}")
        try:
            st = os.fstat(fd)
            if (
                not stat.S_ISREG(st.st_mode)
                or st.st_uid != os.geteuid()
                or st.st_mode & 0o077
                or st.st_size != total
            ):
                raise ClusterError(f"{where} is not a private file of {total} bytes: refused")
            mm = mmap.mmap(fd, total, flags=FLAGS)
        finally:
            os.close(fd)
        hk = self._view(k, name, mm, meta, head, span)
        if tuple(hk.head[:3]) != (MAGIC, self.size, meta.size):
            hk.drop()
            raise ClusterError(
                f"{where} was made for {int(hk.head[1])} local ranks and {int(hk.head[2])} "
                f"elements, this worker has LOCAL_WORLD_SIZE={self.size} and {meta.size}"
            )
        if hk.head[PID_SLOT + self.local] != 0:
            hk.drop()
            raise ClusterError(
                f"two workers of host group {self.group} say LOCAL_RANK={self.local} (pid "
                f"{int(hk.head[PID_SLOT + self.local])} and {os.getpid()}): give each its own"
            )
        hk.head[self.slot(hk, "ns", self.local)] = _pid_ns()
        hk.head[self.slot(hk, "node", self.local)] = self.kv.node.id
        hk.head[PID_SLOT + self.local] = os.getpid()
        self.keys[k] = hk
        return hk

    def unname(self, hk: HostKey) -> None:
        """Unlink ``hk``'s name once every local rank mapped the segment (every rank tries
        after it mapped it and at its pushes, so one of them sees the last pid)."""
        pids = hk.head[PID_SLOT : PID_SLOT + self.size]
        if hk.named and all(pids[r] for r in range(self.size) if r not in self.dead):
            unlink(hk.name)
            hk.named = False

    def _view(
        self, k: Any, name: str, mm: mmap.mmap, meta: KeyMeta, head: int, span: int
    ) -> HostKey:
        counters = np.frombuffer(mm, np.int64, head // 8)
        n = meta.size

        def at(i: int) -> np.ndarray:
            return np.frombuffer(mm, meta.dtype, n, head + i * span)

        slots = [at(r) for r in range(self.size)]
        hk = HostKey(name, mm, counters, slots, at(self.size), [], k, len(meta.parts))
        hk.form, hk.owner = _form(meta), self.owners[k]
        hk.mine = [i for i, r in enumerate(hk.owner) if r == self.local]
        return hk

    def _deal(self, k: Any, sizes: list[int]) -> None:
        """Deal key ``k``'s parts without a live owner over the live local ranks by bytes
        (the same on every rank: keys in init order, parts in order)."""
        live = [r for r in range(self.size) if r not in self.dead]
        owner = self.owners[k]
        for i, size in enumerate(sizes):
            if owner[i] < 0 or owner[i] in self.dead:
                owner[i] = min(live, key=lambda r: (self.load[r], r))
                self.load[owner[i]] += size

    def _left(self) -> None:
        """HETPS_ELASTIC: the local ranks the scheduler let go are out of the host from the
        round they did not give their gradient to; their parts are dealt to the others. A
        rank is known by the node id it wrote in a segment; in one it never mapped (a key
        first pushed after it was let go) it is out once every live worker of the host is in."""
        node, n = self.kv.node, self.size
        live = {w.id for w in node.live_workers() if w.group == self.group}
        rows = [hk.head[self.slot(hk, "node", 0) :][:n].tolist() for hk in self.keys.values()]
        live -= {ids[r] for ids in rows for r in self.dead}  # (one started again pushes its own)
        out = [(r, ids[r], set(ids)) for ids in rows for r in range(n) if r not in self.dead]
        gone = {r for r, i, ids in out if i in node.left or (i not in live and live <= ids)}
        gone.discard(self.local)
        if gone:
            msg = "host aggregation: local ranks %s of host group %d were let go; the others "
            log.warning(
                msg + "sum their parts from the round they did not give", sorted(gone), self.group
            )
            self.dead |= gone
            for each, form in self.forms.items():
                self._deal(each, [p[1] - p[0] for p in form[2]])
            for each in self.keys.values():
                each.mine = [i for i, r in enumerate(each.owner) if r == self.local]

    def members(self, hk: HostKey, t: int) -> list[int]:
        """The local ranks whose gradients round ``t`` sums: the live ones, and one let go
        that gave its gradient to the round before it was."""
        contrib = self.slot(hk, "contrib", 0)
        return [r for r in range(self.size) if r not in self.dead or hk.head[contrib + r] >= t]

    def slot(self, hk: HostKey, what: str, i: int) -> int:
        """Where in ``hk``'s header word ``what`` of member (or part) ``i`` is."""
        base = PID_SLOT + 4 * self.size
        first = {
            "contrib": PID_SLOT + self.size,
            "ns": PID_SLOT + 2 * self.size,
            "node": PID_SLOT + 3 * self.size,
            "summed": base,
            "result": base + hk.parts,
            "short": base + 2 * hk.parts,
        }
        return first[what] + i

    # -- rounds -----------------------------------------------------------------------------
    def takes(self, k: Any) -> bool:
        """Whether key ``k``'s rounds go through the host (a dense key; a device tensor's
        too: its push is the host array the call staged, its pull lands in the call's host
        buffer, which the call's finisher copies to the device)."""
        if k not in self.forms:
            return False
        if k not in self.keys:
            self.attach(k, self.kv.meta[k])
        return True

    def push(self, k: Any, meta: KeyMeta, arr: np.ndarray) -> None:
        """This worker's gradient of a new round of ``k`` into its slot."""
        hk = self.keys[k]
        self.unname(hk)
        t = hk.pushed + 1
        if hk.pushed > hk.pulled:  # pushed again before pulling: its parts go now
            self._drive(hk, meta, block=True)
        summed = self.slot(hk, "summed", 0)
        parts = len(meta.parts)
        self.wait(k, lambda: bool((hk.head[summed : summed + parts] >= t - 1).all()), "push")
        np.copyto(hk.slots[self.local], np.ascontiguousarray(arr).reshape(-1))
        hk.head[self.slot(hk, "contrib", self.local)] = t
        hk.pushed = t
        meta.rounds += 1  # (the server's round of the key: a part sent again names it)
        hk.rnd[t] = meta.rounds - 1
        hk.rnd.pop(t - 8, None)
        with self.lock:
            self._pump()

    def settle(self, only: Any = None) -> None:
        """Wait until every round this worker pushed through the host (of key ``only``, or
        of every key) was applied by the servers, as a flat push's answer says: what
        ``wait_outstanding``, ``barrier`` and ``push(block=True)`` wait for."""
        if only is None:
            self.tables.settle()
        for k, hk in list(self.keys.items()):
            meta = self.kv.meta.get(k)
            if (only is not None and k != only) or meta is None:
                continue
            if hk.pushed <= hk.pulled:  # (its pull saw the round applied)
                continue
            self._drive(hk, meta, block=True)
            res, t = self.slot(hk, "result", 0), hk.pushed
            self.wait(
                k, lambda hk=hk, k=k, res=res, t=t: self._results(hk, k, res, hk.parts, t), "push"
            )

    def pending(self, k: Any) -> bool:
        """Whether a pull of ``k`` reads a round this worker pushed through the host."""
        hk = self.keys.get(k)
        return hk is not None and hk.pushed > hk.pulled

    def pull(self, k: Any, meta: KeyMeta, targets: list[np.ndarray]) -> Callable[[], None]:
        """What completes a pull of ``k``'s last pushed round into ``targets`` (blocks)."""
        hk = self.keys[k]
        t = hk.pushed

        def finish() -> None:
            self._drive(hk, meta, block=True)
            res = self.slot(hk, "result", 0)
            parts = len(meta.parts)
            self.wait(k, lambda: self._results(hk, k, res, parts, t), "pull")
            value = hk.result.reshape(meta.shape)
            for target in targets:
                target[...] = value
            short = self.kv.short_marks
            for i, p in enumerate(meta.parts):  # (as the part's owner heard it)
                w = int(hk.head[self.slot(hk, "short", i)])
                for a, b in chunks(p.start, p.stop, self._step(meta)):
                    if w:
                        short.setdefault(k, {})[(a, b)] = w
                    elif k in short:
                        short[k].pop((a, b), None)
            hk.pulled = t

        return finish

    def _step(self, meta: KeyMeta) -> int:
        return chunk_elems(self.kv.cfg.chunk_bytes, meta.dtype.itemsize)

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
        contrib = self.slot(hk, "contrib", 0)
        for i in hk.mine:
            if hk.sent.get(i, 0) >= t:
                continue

            def ready() -> bool:
                got = hk.head[contrib : contrib + self.size]
                return all(got[r] >= t for r in range(self.size) if r not in self.dead)

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
        members = self.members(hk, t)
        np.copyto(total, hk.slots[members[0]][p.start : p.stop])
        for r in members[1:]:  # local-rank order, as the servers sum hosts' workers
            np.add(total, hk.slots[r][p.start : p.stop], out=total)
        hk.head[self.slot(hk, "summed", i)] = t  # the slots of this part are free again
        key = hk.key
        step = self._step(meta)
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
                host=(self.group, self.local, len(members)),
                # HETPS_ELASTIC: a part taken over from a rank let go may have been applied
                round=hk.rnd.get(t) if self.elastic else None,
                threshold=comp.threshold if comp is not None else None,
            )
            msg = Message(P.PUSH, body=body, arrays=[payload])
            land = land_into(key, dest, a, b, kv.short_marks)
            futs.append(kv.request(key, 0, p.server, msg, land, dest[a:b]))
        hk.futs[i], hk.sent[i] = futs, t

    def _pump(self) -> None:
        """Send what is ready (every local rank's gradient in) and publish what came back."""
        for k, hk in list(self.keys.items()):
            meta = self.kv.meta.get(k)
            if meta is None:
                continue
            if any(hk.sent.get(i, 0) < hk.pushed for i in hk.mine):
                self._drive(hk, meta, block=False)
            for i in hk.mine:
                futs = hk.futs.get(i)
                if not futs or not all(f.done() for f in futs):
                    continue
                slot = self.slot(hk, "result", i)
                t = hk.sent[i]
                if hk.head[slot] == t or hk.head[slot] == -t:
                    continue
                failed = [f for f in futs if f.error is not None]
                # the workers the result holds where fewer than the job's (HETPS_ELASTIC),
                # as its answers said: every local rank's short_rounds() (0: all)
                p = meta.parts[i]
                first = (p.start, min(p.stop, p.start + self._step(meta)))
                w = self.kv.short_marks.get(k, {}).get(first, 0)
                hk.head[self.slot(hk, "short", i)] = w
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
                self.tables.pump()
            if ready():
                return
            now = time.monotonic()
            if now - checked > 0.05:
                checked = now
                if self.elastic:  # a local rank let go: the others take its parts over
                    self._left()
                else:  # (a dead local rank is seen here before the scheduler says)
                    self._peers(what)
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
                pid = int(hk.head[PID_SLOT + r])
                if r == self.local or pid <= 0 or hk.head[self.slot(hk, "ns", r)] != _pid_ns():
                    continue  # (a pid of another PID namespace names nothing here)
                if not alive(pid):
                    raise ClusterError(
                        f"host aggregation: local rank {r} (pid {pid}) of host group "
                        f"{self.group} died during a {what}; the host's round cannot complete"
                    )
            return

    def compression(self) -> None:
        """2-bit compression was set: every host residual starts again from zero."""
        for hk in self.keys.values():
            hk.residual = {}

    def close(self) -> None:
        """Unlink what is still named (a local rank that never mapped it) and unmap."""
        self.tables.close()
        for hk in self.keys.values():
            unlink(hk.name)
            hk.drop()
        self.keys = {}
