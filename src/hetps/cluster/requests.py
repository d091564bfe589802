"""Request tracking (ps-lite's Customer): request id -> future, with failure fan-out.

A node sends a request with a fresh id and keeps a :class:`Future`; the receive thread
resolves it when the reply arrives. When the scheduler says a peer died, every pending future
fails with that error, so nobody waits forever.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from hetps.cluster.errors import ClusterError, RequestError, RequestTimeout

log = logging.getLogger("hetps.requests")


#: taken for an instant when a future ends or a group starts waiting on it (never blocks long)
_ENDING = threading.Lock()


def _block(gate: Any, timeout: float | None) -> bool:
    """Wait until ``gate`` (a lock a future releases when it ends) is released, ``timeout``
    seconds at most (None: for ever); leaves it released for the next waiter."""
    if not gate.acquire(
        True, -1 if timeout is None else min(max(timeout, 0.0), threading.TIMEOUT_MAX)
    ):
        return False
    gate.release()
    return True


class _Group:
    """One wake-up for the waiter of many futures (:func:`wait_all`): its gate opens when the
    last of them ends, or the first fails."""

    __slots__ = ("left", "gate")

    def __init__(self) -> None:
        self.left = 0
        self.gate = threading.Lock()
        self.gate.acquire()

    def ended(self, failed: bool) -> None:
        """One of its futures ended (``_ENDING`` held)."""
        self.left -= 1
        if (self.left == 0 or failed) and self.gate.locked():
            self.gate.release()


class Future:
    """The pending answer to one request. Its waiters block on a lock it releases when it
    ends (one C call each way, no :class:`threading.Event` per request); :func:`wait_all`
    waits for a whole call's futures with one wake-up."""

    __slots__ = (
        "req",
        "peer",
        "_what",
        "landing",
        "_done",
        "_ending",
        "_gate",
        "_groups",
        "_result",
        "_error",
        "_callback",
        "_tracker",
        "reported",
        "sent",
        "errback",
    )

    def __init__(
        self,
        req: int,
        peer: int,
        what: str | Callable[[], str],
        callback: Callable[[Any], None] | None,
        tracker: RequestTracker | None = None,
    ):
        self.req = req
        self.peer = peer
        # what the request is, for its errors: a text, or what makes it (made only if needed)
        self._what = what
        # where the reply's first array may be written straight from a shared-memory ring
        # (flat, contiguous, writable; its callback then finds it in place)
        self.landing: Any = None
        self._done = False
        self._ending = False  # an answer or an error is being recorded (one wins)
        self._gate = threading.Lock()  # released when it ends
        self._gate.acquire()
        self._groups: list[_Group] | None = None  # wait_all calls waiting for it
        self._result: Any = None
        self._error: BaseException | None = None
        self._callback = callback
        self._tracker = tracker  # (None: a future no tracker keeps)
        # its error was raised to a caller already (a later wait_outstanding skips it)
        self.reported = False
        # the request as sent, kept while unanswered when its server has copies
        # (HETPS_REPLICAS): it goes again to the server that takes over if that one dies
        self.sent: Any = None
        # called with the error when it fails (in the failing thread), as callback is with
        # the answer
        self.errback: Callable[[BaseException], None] | None = None

    @property
    def what(self) -> str:
        """What the request is (``"spush of key 't' on server 0"``), as its errors say it."""
        what = self._what
        if not isinstance(what, str):
            what = self._what = what()
        return what

    def join(self, group: _Group) -> bool:
        """Wake ``group`` too when this ends (False: it has ended; under ``_ENDING``)."""
        if self._done:
            return False
        if self._groups is None:
            self._groups = [group]
        else:
            self._groups.append(group)
        return True

    def done(self) -> bool:
        """Whether the answer (or an error) is in."""
        return self._done

    @property
    def error(self) -> BaseException | None:
        """The error it ended with (None while running, or when it succeeded)."""
        return self._error if self._done else None

    def unreported_error(self) -> bool:
        """Whether it failed and no caller has seen the error yet."""
        return self._done and self._error is not None and not self.reported

    def _claim(self) -> bool:
        """Whether this thread records its end (the first answer or error to come)."""
        with _ENDING:
            if self._ending:
                return False
            self._ending = True
            return True

    def _end(self) -> None:
        """It ended (result or error recorded): wake its waiters and their groups."""
        with _ENDING:
            self._done = True
            groups, self._groups = self._groups, None
            failed = self._error is not None
            for g in groups or ():
                g.ended(failed)
        self._gate.release()

    def set_result(self, value: Any) -> None:
        """Resolve with ``value`` (runs the callback first, in the caller's thread)."""
        if self._ending or not self._claim():
            return
        try:
            if self._callback is not None:
                self._callback(value)
            self._result = value
        except BaseException as exc:  # noqa: BLE001 - reported to the waiter
            self._error = exc
        self._end()

    def give_up(self, timeout: float | None) -> None:
        """Fail with :class:`RequestTimeout`: no answer came within ``timeout`` seconds."""
        if self._tracker is not None:  # a late reply must not land after we gave up
            self._tracker.discard(self.req)
        err = RequestTimeout(
            f"{self.what}: no answer from node {self.peer} within {timeout or 0:.1f} s "
            "(raise HETPS_REQUEST_TIMEOUT if the job is just slow)"
        )
        # the request is over for everyone: it counts as failed (so whatever it held, e.g. a
        # push's send credit, is given back) and other waiters see the same error; if the
        # answer came in just now, its callback is let finish
        self.set_error(err)
        _block(self._gate, None)

    def set_error(self, error: BaseException) -> None:
        """Fail with ``error``."""
        if self._ending or not self._claim():
            return
        self._error = error
        self._end()
        if self.errback is not None:
            try:
                self.errback(error)
            except Exception:  # noqa: BLE001 - the failure is already recorded
                log.exception("an error hook of %s failed", self.what)

    def settle(self, timeout: float | None = None) -> None:
        """Block until answered or failed, without raising its error (a later wait reports
        it); RequestTimeout after ``timeout``, as :meth:`wait`."""
        if not self._done and not _block(self._gate, timeout):
            self.give_up(timeout)
            if isinstance(self._error, RequestTimeout):  # (not if it came in just now)
                self.landed()
                self.reported = True
                raise self._error

    def wait(self, timeout: float | None = None) -> Any:
        """Block until answered; raise the error if it failed, RequestTimeout after ``timeout``."""
        if not self._done and not _block(self._gate, timeout):
            self.give_up(timeout)
        if self._error is not None:
            self.landed()
            self.reported = True
            raise self._error
        return self._result

    def landed(self) -> None:
        """A failed request with a place for its answer: wait until the receive thread is
        not writing into that place (it looked the place up before the request failed)."""
        if self.landing is not None and self._tracker is not None:
            with self._tracker.landing_guard:
                pass


class RequestTracker:
    """Issues request ids and keeps their futures until answered or failed."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._fatal: BaseException | None = None
        # held by the receive thread while it decodes a message, the time in which it may
        # copy answers into their requests' arrays (see landing_of): a waiter whose request
        # failed takes it once, so nothing writes into its array after it has its error
        self.landing_guard = threading.Lock()

    def new(
        self,
        peer: int,
        what: str | Callable[[], str],
        callback: Callable[[Any], None] | None = None,
    ) -> Future:
        """A new future for a request to ``peer``; fails at once if the cluster is broken."""
        fut = Future(next(self._ids), peer, what, callback, self)
        with self._lock:
            if self._fatal is not None:
                fut.set_error(self._fatal)
                return fut
            self._pending[fut.req] = fut
        return fut

    def landing_of(self, req: int, sender: int | None = None) -> Any:
        """Where the reply to ``req`` may land, while someone still waits for it (from
        ``sender`` only, when given: the peer the request went to)."""
        with self._lock:
            fut = self._pending.get(req)
        if fut is None or (sender is not None and fut.peer != sender):
            return None
        return fut.landing

    def discard(self, req: int) -> None:
        """Forget request ``req`` (its caller stopped waiting)."""
        with self._lock:
            self._pending.pop(req, None)

    def resolve(
        self, req: int, value: Any, error: str | None = None, sender: int | None = None
    ) -> bool:
        """Deliver the reply to request ``req``; False if nobody waits for it. With ``sender``
        (the node the reply came from) it must be the peer the request went to: a reply from
        anybody else is refused (logged) and the request keeps waiting for its own."""
        with self._lock:
            fut = self._pending.get(req)
            if fut is not None and sender is not None and fut.peer != sender:
                log.warning(
                    "refused a reply to request %d from node %d: the request went to node %d",
                    req,
                    sender,
                    fut.peer,
                )
                return False
            if fut is not None:
                del self._pending[req]
        if fut is None:
            return False
        if error is not None:
            fut.set_error(RequestError(error))
        else:
            fut.set_result(value)
        return True

    def fail_all(self, error: BaseException) -> None:
        """Fail every pending and every future request with ``error`` (the cluster is broken)."""
        with self._lock:
            if self._fatal is None:
                self._fatal = error
            pending = list(self._pending.values())
            self._pending.clear()
        for fut in pending:
            fut.set_error(error)

    def retarget(self, peer: int, to: int) -> list[Future]:
        """Point the pending requests to ``peer`` at ``to`` (a server that took over from a
        dead one): their answers are taken from ``to`` from now on. Returns them in the order
        they were made."""
        with self._lock:
            hit = sorted((f for f in self._pending.values() if f.peer == peer), key=lambda f: f.req)
            for f in hit:
                f.peer = to
        return hit

    def pending(self) -> int:
        """Number of unanswered requests."""
        with self._lock:
            return len(self._pending)


def wait_all(futures: list[Future], timeout: float, what: str = "request") -> list[Any]:
    """Wait for every future within one overall ``timeout``; the first error is raised (and
    counts as reported for every future of the call that failed by then). The waiting thread
    wakes once: when the last future ends, or one fails."""
    deadline = time.monotonic() + timeout
    group = _Group()
    if len(futures) > 1:
        with _ENDING:
            group.left = sum(fut.join(group) for fut in futures if not fut.done())
        if group.left:  # (its one waiter: the gate is taken, never given back)
            group.gate.acquire(True, min(max(timeout, 0.0), threading.TIMEOUT_MAX))
    out = []
    try:  # (woken by a failure, perhaps a later future's: it ends the call at once)
        if group.left and (bad := next((f for f in futures if f.error is not None), None)):
            bad.wait(0)
        for fut in futures:
            remaining = deadline - time.monotonic()
            if remaining <= 0 and not fut.done():
                raise RequestTimeout(f"{what}: timed out after {timeout:.1f} s")
            out.append(fut.wait(max(remaining, 0.0)))
    except BaseException as exc:
        if isinstance(exc, RequestTimeout):  # the call is over: so are its requests
            for fut in futures:
                if not fut.done():
                    fut.give_up(timeout)
                fut.landed()
        for fut in futures:
            if fut.done():
                fut.reported = True
        raise
    return out


__all__ = ["ClusterError", "Future", "RequestTracker", "wait_all"]
