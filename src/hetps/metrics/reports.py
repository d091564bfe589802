"""Live metrics' reports: what workers (and servers: :mod:`hetps.metrics.server_meter`)
measure while a job runs, and the checks the scheduler runs on them; the scheduler's side is
:mod:`hetps.metrics.live`, and :mod:`hetps.metrics.prom` and :mod:`hetps.metrics.dashboard`
serve it.

* :class:`WorkerMeter`, in each worker (only when the scheduler's endpoint is on: the node
  table says so): one ``perf_counter`` per push or pull request and one list increment when
  its answer comes in (fixed buckets, :data:`BUCKETS`); a thread of its own reports every
  ``HETPS_METRICS_INTERVAL`` seconds what the histograms gained (deltas), the round count, the
  bytes on each link (totals) and the last rounds' phase spans (bounded), in a few hundred bytes.
* :func:`parse_report` checks every report (a bad or hostile one is refused with a log line
  and changes nothing); :class:`WorkerTotals` keeps a worker's totals.

This module imports nothing of hetps but ``config``; docs/LIVE.md lists every metric.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable
from typing import Any

log = logging.getLogger("hetps.metrics.live")  # (the service's name: one logger for both)

#: upper bounds (seconds) of the latency and round-time buckets; one more bucket counts
#: everything above the last
BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
NBUCKETS = len(BUCKETS) + 1
HISTOGRAMS = ("push", "pull", "round")

#: bounds a report must keep (a bigger number is a broken or hostile peer's)
MAX_COUNT = 1 << 53  # exact in a float, as Prometheus reads it
MAX_SECONDS, MAX_T = 1e12, 1e10
#: the timeline: rounds a report carries at most (the newest), spans per round, rounds the
#: scheduler keeps per worker, the longest span
TL_ROUNDS, TL_SPANS, TL_KEEP, TL_MAX_DUR = 8, 32, 20, 3600.0


class ReportError(ValueError):
    """A metrics report the scheduler refuses; the message says what is wrong with it."""


# -- the worker's side ----------------------------------------------------------------------
class Histogram:
    """Fixed-bucket counts and a sum, written by one thread, read by another. The reader
    ships differences of these totals, so a read that races a write only moves an
    observation to the next report."""

    __slots__ = ("counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * NBUCKETS
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        """Count one observation (bucket ``i`` holds values up to ``BUCKETS[i]``)."""
        self.counts[bisect_left(BUCKETS, seconds)] += 1
        self.sum += seconds


class WorkerMeter:
    """One worker's live counters, reported to the scheduler every ``interval`` seconds.

    ``send(body)`` ships one report (the store sends it to the scheduler); ``links()``
    returns ``{server rank: (bytes sent, bytes received)}`` totals. ``close()`` sends a last
    report and stops the thread."""

    def __init__(
        self,
        interval: float,
        send: Callable[[dict], Any],
        links: Callable[[], dict[int, tuple[int, int]]],
    ) -> None:
        self.interval = interval
        self._send = send
        self._links = links
        self.hists = {name: Histogram() for name in HISTOGRAMS}
        self._push_hist = self.hists["push"]
        self._pull_hist = self.hists["pull"]
        self._shipped = {name: ([0] * NBUCKETS, 0.0) for name in HISTOGRAMS}
        self._pushes: dict[Any, int] = {}
        self.rounds = 0
        self.round_s: float | None = None
        self._round_t0: float | None = None
        self._seq = 0
        self._t0 = time.monotonic()
        # the timeline: the newest rounds' phase spans, not yet reported (RoundLog and hetps
        # train hand them over through add_round), and the link totals at the last round's end
        self._tl: deque[list] = deque(maxlen=TL_ROUNDS)
        self._tl_links: dict[int, tuple[int, int]] = {}
        self._tl_round = 0
        #: the run directory the worker logs into (RoundLog, hetps train): the scheduler
        #: leaves the dashboard's last state there when the job ends
        self.run_dir: str | None = None
        self._lock = threading.Lock()  # one report at a time (the thread, close)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hetps-metrics", daemon=True)
        self._thread.start()

    # hot path -----------------------------------------------------------------------------
    def timed(self, push: bool, callback: Callable[[Any], None] | None):
        """A request's answer callback that also times the request (from now to its answer;
        a request that fails is not counted)."""
        hist = self._push_hist if push else self._pull_hist
        t0 = time.perf_counter()
        if callback is None:

            def done(reply: Any) -> None:
                hist.observe(time.perf_counter() - t0)

        else:

            def done(reply: Any) -> None:
                callback(reply)
                hist.observe(time.perf_counter() - t0)

        return done

    def timed_fused_pull(self, finish: Callable[[], None]) -> Callable[[], None]:
        """A pull answered by the push before it (dist_sync): timed from now (its call) to the
        moment ``finish`` (its wait's) copied its value out, once the push's answer is in."""
        hist, t0 = self._pull_hist, time.perf_counter()

        def done() -> None:
            finish()
            hist.observe(time.perf_counter() - t0)

        return done

    def pushed(self, key: Any) -> None:
        """A push of ``key`` (its round's); a round begins with the first key pushed more
        often than any before, so rounds = the most pushes of any one key, and a round's time
        runs from one such start to the next."""
        n = self._pushes.get(key, 0) + 1
        self._pushes[key] = n
        if n > self.rounds:
            now = time.perf_counter()
            if self._round_t0 is not None:
                self.round_s = now - self._round_t0
                self.hists["round"].observe(self.round_s)
            self._round_t0 = now
            self.rounds = n

    def add_round(self, spans: list[tuple[str, float, float]]) -> None:
        """One round's phase spans, ``(phase, start, seconds)`` with ``start`` a unix time
        (:meth:`hetps.metrics.spans.Spans.take` hands them over), and the bytes each link
        carried since the last round's end: the next report carries them (the newest
        :data:`TL_ROUNDS` rounds; older ones not yet reported are dropped)."""
        try:
            links = self._links()
        except Exception:  # noqa: BLE001 - the timeline never breaks the worker
            links = {}
        rows = []
        for rank, (sent, recv) in sorted(links.items()):
            old = self._tl_links.get(rank, (0, 0))
            rows.append([rank, max(0, int(sent - old[0])), max(0, int(recv - old[1]))])
        self._tl_links = dict(links)
        self._tl_round = max(self._tl_round + 1, self.rounds)
        kept = [
            [str(name), round(float(start), 6), round(max(0.0, float(dur)), 6)]
            for name, start, dur in spans[:TL_SPANS]
        ]
        with self._lock:
            self._tl.append([self._tl_round, kept, rows])

    # reporting ----------------------------------------------------------------------------
    def report(self) -> dict:
        """The next report's body (and it counts as shipped)."""
        with self._lock:
            self._seq += 1
            body: dict[str, Any] = {
                "seq": self._seq,
                "t": time.monotonic() - self._t0,
                "rounds": self.rounds,
                "links": [[r, int(s), int(v)] for r, (s, v) in sorted(self._links().items())],
            }
            if self.round_s is not None:
                body["round_s"] = self.round_s
            gained = {}
            for name, hist in self.hists.items():
                counts, total = list(hist.counts), hist.sum
                old_counts, old_total = self._shipped[name]
                delta = [c - o for c, o in zip(counts, old_counts, strict=True)]
                if any(delta):
                    gained[name] = [delta, max(0.0, total - old_total)]
                    self._shipped[name] = (counts, total)
            if gained:
                body["h"] = gained
            if self.run_dir is not None:
                body["run"] = self.run_dir
            if self._tl:
                body["tl"] = list(self._tl)
                self._tl.clear()
            return body

    def flush(self) -> None:
        """Send one report now."""
        try:
            self._send(self.report())
        except Exception as exc:  # noqa: BLE001 - reporting never breaks the worker
            log.debug("metrics: report not sent: %s", exc)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.flush()

    def close(self) -> None:
        """Stop reporting, after a last report (so the scheduler has the final totals)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self.flush()


# -- checking a report ----------------------------------------------------------------------
def _int(value: Any, what: str, low: int = 0, high: int = MAX_COUNT) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ReportError(f"{what} must be an integer from {low} to {high}, not {_show(value)}")
    return value


def _seconds(value: Any, what: str, high: float = MAX_SECONDS) -> float:
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or not math.isfinite(value)
        or not 0 <= value <= high
    ):
        raise ReportError(
            f"{what} must be a number of seconds from 0 to {high:g}, not {_show(value)}"
        )
    return float(value)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def parse_report(body: Any, num_servers: int) -> dict:
    """A report's checked contents; raises :class:`ReportError` naming the first problem.
    Nothing a report holds can be bigger than its bounds: at most one link row per server,
    :data:`NBUCKETS` counts per histogram, numbers within :data:`MAX_COUNT` and
    :data:`MAX_SECONDS`."""
    if not isinstance(body, dict):
        raise ReportError("the body is not a map")
    out: dict[str, Any] = {
        "seq": _int(body.get("seq"), "'seq'", 1),
        "t": _seconds(body.get("t"), "'t'", MAX_T),
        "rounds": _int(body.get("rounds"), "'rounds'"),
        "round_s": None,
    }
    if "round_s" in body:
        out["round_s"] = _seconds(body["round_s"], "'round_s'")
    links = body.get("links", [])
    if not isinstance(links, list) or len(links) > num_servers:
        raise ReportError(f"'links' must be a list of at most {num_servers} rows (one per server)")
    rows: dict[int, tuple[int, int]] = {}
    for row in links:
        if not isinstance(row, list) or len(row) != 3:
            raise ReportError(
                f"a 'links' row must be [server rank, sent, received], not {_show(row)}"
            )
        rank = _int(row[0], "a link's server rank", 0, num_servers - 1)
        if rank in rows:
            raise ReportError(f"'links' lists server {rank} twice")
        rows[rank] = (_int(row[1], "a link's bytes sent"), _int(row[2], "a link's bytes received"))
    out["links"] = rows
    hists = body.get("h", {})
    if not isinstance(hists, dict) or not set(hists) <= set(HISTOGRAMS):
        raise ReportError(f"'h' must be a map with keys among {', '.join(HISTOGRAMS)}")
    out["h"] = {}
    for name, value in hists.items():
        if not isinstance(value, list) or len(value) != 2 or not isinstance(value[0], list):
            raise ReportError(f"histogram {name!r} must be [counts, sum]")
        counts = value[0]
        if len(counts) != NBUCKETS:
            raise ReportError(f"histogram {name!r} must have {NBUCKETS} counts, not {len(counts)}")
        out["h"][name] = (
            [_int(c, f"a count of histogram {name!r}") for c in counts],
            _seconds(value[1], f"the sum of histogram {name!r}"),
        )
    out["tl"] = _parse_timeline(body.get("tl", []), num_servers)
    run = out["run"] = body.get("run")
    if run is not None and not (
        isinstance(run, str) and 0 < len(run) <= 4096 and run.isprintable()
    ):
        raise ReportError("'run' must be a printable path of 1 to 4096 characters")
    return out


_PHASE = re.compile(r"[a-z][a-z_]{0,15}")


def _parse_timeline(tl: Any, num_servers: int) -> list[tuple[int, list, list]]:
    """The rounds of a report's ``tl``: ``[round, [[phase, start, seconds], ...], [[server,
    sent, received], ...]]`` each, rounds increasing; at most :data:`TL_ROUNDS` rounds of
    :data:`TL_SPANS` spans."""
    if not isinstance(tl, list) or len(tl) > TL_ROUNDS:
        raise ReportError(f"'tl' must be a list of at most {TL_ROUNDS} rounds")
    out = []
    last = 0
    for item in tl:
        if not isinstance(item, list) or len(item) != 3:
            raise ReportError(f"a 'tl' round must be [round, spans, links], not {_show(item)}")
        rnd = _int(item[0], "a 'tl' round number", 1)
        if rnd <= last:
            raise ReportError(f"'tl' rounds must increase ({rnd} after {last})")
        last = rnd
        spans, links = item[1], item[2]
        if not isinstance(spans, list) or len(spans) > TL_SPANS:
            raise ReportError(f"a 'tl' round holds a list of at most {TL_SPANS} spans")
        kept = []
        for span in spans:
            if not isinstance(span, list) or len(span) != 3:
                raise ReportError(f"a span must be [phase, start, seconds], not {_show(span)}")
            if not isinstance(span[0], str) or not _PHASE.fullmatch(span[0]):
                raise ReportError(
                    f"a span's phase must be a lower-case name of up to 16 letters, "
                    f"not {_show(span[0])}"
                )
            kept.append(
                (
                    span[0],
                    _seconds(span[1], "a span's start", MAX_T),
                    _seconds(span[2], "a span's length", TL_MAX_DUR),
                )
            )
        if not isinstance(links, list) or len(links) > num_servers:
            raise ReportError(f"a 'tl' round's links: a list of at most {num_servers} rows")
        rows = []
        for row in links:
            if not isinstance(row, list) or len(row) != 3:
                raise ReportError(
                    f"a 'tl' link row must be [server, sent, received], not {_show(row)}"
                )
            rows.append(
                (
                    _int(row[0], "a 'tl' link's server rank", 0, num_servers - 1),
                    _int(row[1], "a 'tl' link's bytes sent"),
                    _int(row[2], "a 'tl' link's bytes received"),
                )
            )
        out.append((rnd, kept, rows))
    return out


# -- the scheduler's side -------------------------------------------------------------------
class WorkerTotals:
    """What the scheduler knows of one worker, from its reports."""

    def __init__(self) -> None:
        self.seq = 0
        self.t = 0.0
        self.rounds = 0
        self.round_s: float | None = None
        self.links: dict[int, tuple[int, int]] = {}
        self.rates: dict[int, tuple[float, float]] = {}  # bytes/s over the last report
        self.hists = {name: ([0] * NBUCKETS, 0.0) for name in HISTOGRAMS}
        self.reports = 0
        self.timeline: deque[tuple[int, list, list]] = deque(maxlen=TL_KEEP)
        self.run: str | None = None

    def apply(self, rep: dict) -> None:
        """Add a checked report; raises ReportError (and changes nothing) when it does not
        follow the last one: an old or repeated number, time or totals going back."""
        if rep["seq"] <= self.seq:
            raise ReportError(f"report {rep['seq']} is not newer than report {self.seq}")
        if rep["t"] < self.t:
            raise ReportError(f"its time {rep['t']:.3f} s is before the last report's")
        if rep["rounds"] < self.rounds:
            raise ReportError(f"'rounds' went back from {self.rounds} to {rep['rounds']}")
        for rank, (sent, recv) in rep["links"].items():
            old = self.links.get(rank, (0, 0))
            if sent < old[0] or recv < old[1]:
                raise ReportError(f"the byte totals of the link to server {rank} went back")
        for name, (counts, _total) in rep["h"].items():
            have = self.hists[name][0]
            if any(a + b > MAX_COUNT for a, b in zip(have, counts, strict=True)):
                raise ReportError(f"histogram {name!r} would count beyond {MAX_COUNT}")
        dt = rep["t"] - self.t
        for rank, (sent, recv) in rep["links"].items():
            old = self.links.get(rank, (0, 0))
            if dt > 0:
                self.rates[rank] = ((sent - old[0]) / dt, (recv - old[1]) / dt)
            self.links[rank] = (sent, recv)
        for name, (counts, total) in rep["h"].items():
            have, have_sum = self.hists[name]
            self.hists[name] = (
                [a + b for a, b in zip(have, counts, strict=True)],
                min(have_sum + total, MAX_SECONDS),
            )
        self.seq, self.t, self.rounds = rep["seq"], rep["t"], rep["rounds"]
        if rep["round_s"] is not None:
            self.round_s = rep["round_s"]
        last = self.timeline[-1][0] if self.timeline else 0
        self.timeline.extend(r for r in rep["tl"] if r[0] > last)
        if rep["run"] is not None:
            self.run = rep["run"]
        self.reports += 1
