"""The worker's send queue: requests leave in priority order, one slice's requests in order.
(docs/MODULES.md, "hetps.kvstore.sender")"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from hetps.cluster import protocol as P
from hetps.cluster.batch import MAX_BATCH_BYTES, array_bytes

log = logging.getLogger("hetps.worker")

#: seconds a parked op waits for a caller's drain before the sender thread sends it
PARK_S = 0.002
#: seconds without a park after which the sender thread stops looking every PARK_S
IDLE_S = PARK_S  # (a round of push then pull: two wake-ups, not one per PARK_S)
#: parks less than this apart (short rounds): the sender thread looks every PARK_S, unwoken,
#: until parks stop coming for this long (one wake-up per PARK_S: fewer than two per round)
BUSY_S = 2 * PARK_S


@dataclass(order=True)
class _Op:
    prio: int
    seq: int
    keys: tuple = field(compare=False)  # the slices it belongs to (usually one)
    send: Any = field(compare=False)
    cost: int = field(default=0, compare=False)  # bytes of push credit it needs
    merge: Any = field(default=None, compare=False)  # (server, [(future, message), ...])
    parked: bool = field(default=False, compare=False)  # waits for a drain, PARK_S at most


class Sender:
    """Sends requests in priority order without reordering requests of one key; with a
    ``window`` (bytes) at most that many push bytes are on their way, and pulls still go
    (docs/MODULES.md, "hetps.kvstore.sender")."""

    def __init__(self, window: int = 0, send_batch: Any = None) -> None:
        self._heap: list[_Op] = []
        self._seq = itertools.count()
        self._last_prio: dict[Any, tuple[int, int]] = {}  # key -> (prio, seq) of its last queued op
        self._first: dict[Any, list[_Op]] = {}  # key -> its queued ops, oldest first
        # ops that need no credit and are the oldest of their key: they may pass a push that
        # waits for credit (a heap in the same order; entries already sent are skipped)
        self._free: list[_Op] = []
        self._sent: set[int] = set()  # seqs popped from one heap, still in the other
        self._cv = threading.Condition()
        self._busy = False
        self._closed = False
        self.window = int(window)
        # send_batch(server, futures, messages): requests to one server as one message
        self.send_batch = send_batch
        self.merged = 0  # ops that went along with another (a statistic, for tests)
        self._inflight = 0
        self._credit: dict[int, tuple[int, Any]] = {}  # req -> (bytes, future)
        self._parked = 0  # parked ops queued
        self._park_due = 0.0  # when the oldest of them is sent by the sender thread
        self._last_park = -IDLE_S  # when the last op was parked (monotonic)
        self._gap = IDLE_S + BUSY_S  # the time between the last two parks
        self._untimed = False  # the sender thread sleeps until woken
        self._thread = threading.Thread(target=self._loop, name="hetps-sender", daemon=True)
        self._thread.start()

    def _has_credit(self, cost: int) -> bool:
        if cost == 0:
            return True
        return self._inflight == 0 or self._inflight + cost <= self.window

    def submit(
        self,
        key: Any,
        priority: int,
        send: Any,
        cost: int = 0,
        keys: list | None = None,
        merge: Any = None,
        inline: bool = True,
        detach: Any = None,
        later: bool = False,
        park: bool = False,
    ) -> None:
        """Send ``send()`` for ``key`` (or for each of ``keys``) at ``priority`` (higher
        first): at once from the calling thread when nothing waits or is being sent (no
        thread hand-off), else queued. ``cost`` > 0 (push bytes, with a window) makes it wait
        for credit too. ``merge`` (server, [(future, message), ...]): the requests it sends,
        which may go in one message with other waiting requests to that server. With
        ``inline=False`` the sender thread sends it even when nothing waits, so the caller
        returns at once and what it queues next to that server may join it. With ``later``
        (and no window) an op that cannot go at once is queued without waking the sender
        thread: the caller sends it, with what waits before it, by :meth:`drain`. ``detach()`` is
        called before the op is queued (not when it is sent at once): a request that reads
        the caller's memory takes its own copy then, as it will be sent after the call.
        ``park`` (no window; implies ``later``): nobody may drain it soon, so the sender
        thread sends it after :data:`PARK_S` if no caller drained it by then."""
        cost = cost if self.window > 0 else 0
        park = park and self.window == 0
        ks = tuple(dict.fromkeys(keys)) if keys is not None else (key,)
        if self.window > 0 or self.send_batch is None:
            merge = None
        with self._cv:
            if (
                inline
                and not self._heap
                and not self._busy
                and not self._closed
                and self._has_credit(cost)
            ):
                self._busy = True
                self._inflight += cost  # (a push goes now: its credit is taken)
                inline = True
            else:
                inline = False
                if detach is not None:
                    detach()
                prio = -priority
                for k in ks:
                    last = self._last_prio.get(k)
                    if last is not None:
                        prio = max(prio, last[0])  # never go before an earlier op of a key
                op = _Op(prio, next(self._seq), ks, send, cost, merge)
                first = True
                for k in ks:
                    self._last_prio[k] = (prio, op.seq)
                    queue = self._first.setdefault(k, [])
                    queue.append(op)
                    first = first and len(queue) == 1
                # (the credit-free heap is kept only with a window: without one every op
                # has credit and goes from the main heap)
                if self.window > 0 and cost == 0 and first:
                    heapq.heappush(self._free, op)
                heapq.heappush(self._heap, op)
                if park:
                    now = time.monotonic()
                    op.parked = True
                    if not self._parked:
                        self._park_due = now + PARK_S
                    self._parked += 1
                    self._gap, self._last_park = now - self._last_park, now
                    if self._untimed:  # (it looks every PARK_S while parks come)
                        self._cv.notify()
                elif not (later and self.window == 0):
                    self._cv.notify()
        if inline:
            try:
                send()
            finally:
                with self._cv:
                    self._busy = False
                    # the sender thread waits for queued ops (and for close): with none,
                    # waking it would cost a thread switch per request for nothing
                    if self._heap or self._closed:
                        self._cv.notify()

    def hold(self, req: int, cost: int, fut: Any) -> None:
        """Record that request ``req`` (a push of ``cost`` bytes) holds credit until
        :meth:`release`d (its receipt or its answer) or its future ends otherwise."""
        if self.window > 0 and cost > 0:
            with self._cv:
                self._credit[req] = (cost, fut)

    def release(self, req: int) -> None:
        """Give back the credit of request ``req`` (idempotent)."""
        if self.window <= 0:
            return
        with self._cv:
            item = self._credit.pop(req, None)
            if item is not None:
                self._inflight -= item[0]
                self._cv.notify_all()

    def _pop_live(self, heap: list[_Op]) -> _Op | None:
        """Drop entries of ``heap`` that were sent from the other heap; the top live one."""
        while heap and heap[0].seq in self._sent:
            self._sent.discard(heapq.heappop(heap).seq)
        return heap[0] if heap else None

    def _take(self) -> tuple[_Op, list[_Op]] | None:
        """The next op that may go and the ops merged into it (lock held); busy till sent."""
        top = self._pop_live(self._heap)
        if top is None:
            return None
        if self._has_credit(top.cost):
            op = heapq.heappop(self._heap)
        else:
            op = self._pop_live(self._free)
            if op is None:
                return None
            heapq.heappop(self._free)
        # a credit-free op sits in both heaps (with a window): the other one must skip it
        if self.window > 0 and (op is not top or op.cost == 0):
            self._sent.add(op.seq)
        self._dequeue(op)
        self._inflight += op.cost
        self._busy = True
        return op, self._companions(op) if op.merge is not None and self._heap else []

    def _dequeue(self, op: _Op) -> None:
        """``op`` leaves its keys' queues (lock held); their next ops move up."""
        if op.parked:
            self._parked -= 1
        for k in op.keys:
            queue = self._first[k]
            queue.remove(op)
            if queue:
                nxt = queue[0]
                if self.window > 0 and nxt.cost == 0 and len(nxt.keys) == 1:
                    heapq.heappush(self._free, nxt)
            else:
                del self._first[k]
            if self._last_prio.get(k, (0, -1))[1] == op.seq:
                del self._last_prio[k]

    def _companions(self, op: _Op) -> list[_Op]:
        """Waiting ops that may go in one message with ``op`` (lock held): requests to its
        server that are first in line for each of their slices, in priority order."""
        server = op.merge[0]
        taken: list[_Op] = []
        count = len(op.merge[1])
        nbytes = sum(array_bytes(m) for _, m in op.merge[1])
        for other in sorted(self._heap):
            if count >= P.MAX_BATCH_ITEMS or nbytes >= MAX_BATCH_BYTES:
                break
            if other.merge is None or other.merge[0] != server:
                continue
            size = sum(array_bytes(m) for _, m in other.merge[1])
            if (
                count + len(other.merge[1]) <= P.MAX_BATCH_ITEMS
                and nbytes + size <= MAX_BATCH_BYTES
                and all(self._first[k][0] is other for k in other.keys)
            ):
                taken.append(other)
                count += len(other.merge[1])
                nbytes += size
                self._dequeue(other)
        if taken:
            gone = {o.seq for o in taken}
            self._heap = [o for o in self._heap if o.seq not in gone]
            heapq.heapify(self._heap)
            self.merged += len(taken)
        return taken

    def drain(self) -> None:
        """The calling thread sends the queued ops while the sender thread is idle and there
        is no window (no hand-off: a pull sends the push queued before it, merged)."""
        while True:
            with self._cv:
                item = None
                if not self._busy and not self._closed and self.window == 0:
                    item = self._take()
                if item is None:
                    if self._heap:
                        self._cv.notify()
                    return
            self._send_op(*item)

    def _send_op(self, op: _Op, more: list[_Op]) -> None:
        try:
            if more:
                pairs = [pair for o in (op, *more) for pair in o.merge[1]]
                self.send_batch(op.merge[0], [f for f, _ in pairs], [m for _, m in pairs])
            else:
                op.send()
        except Exception:  # reported through the op's future
            log.exception("worker: send failed")
        finally:
            with self._cv:  # (the thread loops on; a drain wakes it when it leaves ops)
                self._busy = False

    def _loop(self) -> None:
        while True:
            with self._cv:
                item = None
                while not self._closed or self._heap:
                    if self._heap and not self._busy:
                        if self._parked == len(self._heap) and not self._closed:
                            left = self._park_due - time.monotonic()  # a drain may take them
                            if left > 0:
                                self._cv.wait(left)
                                continue
                        item = self._take()
                        if item is not None:
                            break
                        # waiting for credit: requests that ended without a receipt (errors,
                        # a peer gone) give theirs back
                        for req, (_cost, fut) in list(self._credit.items()):
                            if fut is not None and fut.done():
                                self._inflight -= self._credit.pop(req)[0]
                        top = self._pop_live(self._heap)
                        if top is None or self._has_credit(top.cost):
                            continue
                        self._cv.wait(0.2)
                    elif self._busy and self._closed:  # closing while an inline send runs
                        self._cv.wait(0.05)
                    elif not self._heap and self._closed:
                        break
                    elif time.monotonic() - self._last_park < self._looking():
                        self._cv.wait(PARK_S)  # (parks come: a park does not wake it)
                    else:
                        self._untimed = True
                        self._cv.wait()
                        self._untimed = False
                if item is None:
                    return
            self._send_op(*item)

    def _looking(self) -> float:
        """How long after a park the sender thread looks every PARK_S (lock held)."""
        return max(IDLE_S, BUSY_S) if self._gap < BUSY_S else IDLE_S

    def close(self) -> None:
        """Send what is queued, then stop."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout=10)
