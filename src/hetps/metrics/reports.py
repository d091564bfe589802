"""Live metrics' reports: what workers measure while a job runs, and the scheduler's checks
of them (docs/MODULES.md, "hetps.metrics.reports")."""

from __future__ import annotations

import logging
import math
import os
import re
import threading
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from msgspec import Meta

from hetps.metrics.bounds import (
    MAX_COUNT,
    MAX_SECONDS,
    Count,
    Link,
    Report,
    ReportError,
    Seconds,
    Time,
    decode,
    links,
    names,
    printable,
)
from hetps.metrics.records import RunWriter
from hetps.metrics.sysinfo import LogTail, Sampler, extras

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
#: the timeline: rounds a report carries at most (the newest), spans per round, rounds the
#: scheduler keeps per worker, the longest span
TL_ROUNDS, TL_SPANS, TL_KEEP, TL_MAX_DUR = 8, 32, 20, 3600.0
#: a script's own values (``log_metrics``): names per worker, entries a report carries, values
#: the scheduler keeps per name
M_NAMES, M_ENTRIES, M_KEEP = 16, 32, 200
_M_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]{0,31}")

_current: list = [None]  # this process' WorkerMeter (log_metrics reaches it)


def current_meter() -> WorkerMeter | None:
    """The live metrics meter of this process' store (None: no endpoint, or no store)."""
    return _current[0]


def check_values(values: dict) -> dict[str, float]:
    """A script's metric values as ``{name: float}``; raises ValueError naming a bad one."""
    out = {}
    for name, value in values.items():
        if not isinstance(name, str) or not _M_NAME.fullmatch(name):
            raise ValueError(
                f"metric name {name!r}: use a letter or _, then up to 31 letters, digits, _ or ."
            )
        if hasattr(value, "item"):  # a 0-d tensor or array
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"metric {name!r} must be a number, not {type(value).__name__}")
        if not math.isfinite(value):
            raise ValueError(f"metric {name!r} is {value}: only finite values are shown")
        out[name] = float(value)
    return out


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


class Reporter:
    """A thread that sends ``report()`` through ``send`` every ``interval`` seconds, with the
    process' CPU, memory, GPUs and (``own_output``) last lines (:mod:`hetps.metrics.sysinfo`)."""

    _what = "report"  # for the log line of a report not sent

    def _start_reports(
        self, interval: float, send: Callable[[dict], Any], own_output: bool, thread: str
    ) -> None:
        self.interval, self._send = interval, send
        self.sampler, self.tail = Sampler(), LogTail()
        if own_output:
            self.tail.install()
        self._seq, self._t0 = 0, time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=thread, daemon=True)
        self._thread.start()

    def _head(self) -> dict[str, Any]:
        self._seq += 1
        return {"seq": self._seq, "t": time.monotonic() - self._t0}

    def _machine(self, body: dict[str, Any]) -> dict[str, Any]:
        body["sys"] = self.sampler.sample()
        lines = self.tail.take()
        if lines:
            body["log"] = lines
        return body

    def flush(self) -> None:
        """Send one report now."""
        try:
            self._send(self.report())
        except Exception as exc:  # noqa: BLE001 - reporting never breaks the worker or server
            log.debug("metrics: %s not sent: %s", self._what, exc)

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
        self._last()
        self.flush()
        self.tail.uninstall()

    def _last(self) -> None:
        """What to do before the last report (nothing here)."""


class WorkerMeter(Reporter):
    """One worker's live counters, reported to the scheduler every ``interval`` seconds
    (``send(body)``, the store's); ``links()`` returns ``{server rank: (bytes sent, bytes
    received)}`` totals. ``close()`` sends a last report and stops the thread."""

    def __init__(
        self,
        interval: float,
        send: Callable[[dict], Any],
        links: Callable[[], dict[int, tuple[int, int]]],
        own_output: bool = False,
    ) -> None:
        self._links = links
        self.hists = {name: Histogram() for name in HISTOGRAMS}
        self._shipped = {name: ([0] * NBUCKETS, 0.0) for name in HISTOGRAMS}
        self._pushes: dict[Any, int] = {}
        self.rounds = 0
        self.round_s: float | None = None
        self._round_t0: float | None = None
        # the timeline: the newest rounds' phase spans, not yet reported (RoundLog and hetps
        # train hand them over through add_round), and the link totals at the last round's end
        self._tl: deque[list] = deque(maxlen=TL_ROUNDS)
        self._tl_links: dict[int, tuple[int, int]] = {}
        self._tl_round = 0
        #: the run directory the worker logs into (RoundLog, hetps train): the scheduler
        #: leaves the dashboard's last state there when the job ends
        self.run_dir: str | None = None
        self.job = ""  # the scheduler's job id (the node table's), for bind_run
        # the rounds' phases when no RoundLog hands them over (any script): each round's first
        # push call to its last push answer, first pull call to last pull answer, and the
        # compute before them; [round, push0, push1, pull0, pull1, compute0]
        self.auto = True
        self._cur: list | None = None
        self._answered = 0.0
        self._unix = time.time() - time.perf_counter()
        self._metrics: deque[list] = deque(maxlen=M_ENTRIES)  # log_metrics, not yet reported
        self._names: set[str] = set()
        self._lock = threading.Lock()  # one report at a time (the thread, close)
        self._start_reports(interval, send, own_output, "hetps-metrics")
        _current[0] = self

    # hot path -----------------------------------------------------------------------------
    def timed(self, push: bool, callback: Callable[[Any], None] | None):
        """A request's answer callback that also times the request (from now to its answer;
        a request that fails is not counted)."""
        return self._start_timing(
            1 if push else 3, self.hists["push" if push else "pull"], callback
        )

    def timed_fused_pull(self, finish: Callable[[], None]) -> Callable[[], None]:
        """A pull answered by the push before it (dist_sync): timed from now (its call) to the
        moment ``finish`` (its wait's) copied its value out, once the push's answer is in."""
        return self._start_timing(3, self.hists["pull"], finish)

    def _start_timing(self, at: int, hist: Histogram, first: Callable | None) -> Callable:
        """Time a request from now (its round's phase ``at``); call the result at its answer
        (it calls ``first`` with its arguments, then stops the clock)."""
        t0, rec = time.perf_counter(), self._cur
        if rec is not None and t0 < rec[at]:
            rec[at] = t0

        def end(*answer: Any) -> None:
            if first is not None:
                first(*answer)
            t1 = time.perf_counter()
            hist.observe(t1 - t0)
            self._answered = t1
            if rec is not None and t1 > rec[at + 1]:
                rec[at + 1] = t1

        return end

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
            self._next_round(n, now)

    def _next_round(self, n: int, now: float) -> None:
        """Round ``n`` begins: the round before goes to the timeline (when no RoundLog does)."""
        done, self._cur = self._cur, None
        if not self.auto:
            return
        if done is not None:
            self._round_spans(done)
        self._cur = [n, now, 0.0, math.inf, 0.0, self._answered]

    def _round_spans(self, rec: list) -> None:
        _, push0, push1, pull0, pull1, compute0 = rec
        u = self._unix
        spans = []
        if 0 < compute0 < push0:
            spans.append(("compute", compute0 + u, push0 - compute0))
        if push1 > push0:
            spans.append(("push", push0 + u, push1 - push0))
        if math.isfinite(pull0) and pull1 > pull0:
            spans.append(("pull", pull0 + u, pull1 - pull0))
        if spans:
            self._add_round(spans, rec[0])

    def log_metrics(self, values: dict, step: int | None = None) -> None:
        """The script's own values (loss, accuracy, ...) at ``step`` (default: the round): the
        next report carries them. Raises ValueError for a bad name or value."""
        checked = check_values(values)
        if len(self._names | set(checked)) > M_NAMES:
            raise ValueError(f"at most {M_NAMES} metric names per worker")
        if step is None:
            step = self.rounds
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_COUNT:
            raise ValueError(f"step must be an integer from 0 to {MAX_COUNT}, not {step!r}")
        self._names |= set(checked)
        with self._lock:
            self._metrics.append([step, checked])

    def add_round(self, spans: list[tuple[str, float, float]]) -> None:
        """One round's phase spans, ``(phase, start, seconds)`` with ``start`` a unix time
        (:meth:`hetps.metrics.spans.Spans.take` hands them over), and the bytes each link
        carried since the last round's end: the next report carries them (the newest
        :data:`TL_ROUNDS` rounds; older ones not yet reported are dropped). The rounds'
        phases are then the caller's, not timed from the requests."""
        self.auto, self._cur = False, None
        self._add_round(spans)

    def _add_round(self, spans: list[tuple[str, float, float]], rnd: int | None = None) -> None:
        try:
            links = self._links()
        except Exception:  # noqa: BLE001 - the timeline never breaks the worker
            links = {}
        rows = []
        for rank, (sent, recv) in sorted(links.items()):
            old = self._tl_links.get(rank, (0, 0))
            rows.append([rank, max(0, int(sent - old[0])), max(0, int(recv - old[1]))])
        self._tl_links = dict(links)
        self._tl_round = max(self._tl_round + 1, self.rounds if rnd is None else rnd)
        kept = [
            [str(name), round(float(start), 6), round(max(0.0, float(dur)), 6)]
            for name, start, dur in spans[:TL_SPANS]
        ]
        with self._lock:
            self._tl.append([self._tl_round, kept, rows])

    def bind_run(self, run_dir: str | os.PathLike[str], lead: bool) -> None:
        """The run directory this worker logs into (RoundLog, hetps train). The scheduler
        leaves the dashboard's last state there only when its ``run.json`` names this job:
        the ``lead`` worker (rank 0, which wrote it) adds the job's id as ``live_job``."""
        self.run_dir = str(Path(run_dir).resolve())
        if lead and self.job and (Path(run_dir) / "run.json").is_file():
            try:
                RunWriter.reopen(run_dir).update(live_job=self.job)
            except Exception as exc:  # noqa: BLE001 - the dashboard never breaks the run
                log.info("metrics: run.json does not name the job: %s", exc)

    # reporting ----------------------------------------------------------------------------
    def report(self) -> dict:
        """The next report's body (and it counts as shipped)."""
        with self._lock:
            body = self._head()
            body["rounds"] = self.rounds
            body["links"] = [[r, int(s), int(v)] for r, (s, v) in sorted(self._links().items())]
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
            if self._metrics:
                body["m"] = list(self._metrics)
                self._metrics.clear()
        return self._machine(body)

    def _last(self) -> None:
        """Before the last report: the last round's phases; this meter is no longer current."""
        if self.auto and self._cur is not None:
            done, self._cur = self._cur, None
            self._round_spans(done)
        if _current[0] is self:
            _current[0] = None


# -- checking a report ----------------------------------------------------------------------
_Phase = Annotated[str, Meta(pattern="^[a-z][a-z_]{0,15}$")]
#: a round of the timeline: [round, [[phase, unix start, seconds], ...], [[server, sent,
#: received], ...]]
_Round = tuple[
    Annotated[int, Meta(ge=1, le=MAX_COUNT)],
    Annotated[
        list[tuple[_Phase, Time, Annotated[float, Meta(ge=0, le=TL_MAX_DUR)]]],
        Meta(max_length=TL_SPANS),
    ],
    list[Link],
]


class WorkerReport(Report, kw_only=True):
    """A worker's report (cluster.commands.MetricsReport lists its fields)."""

    rounds: Count
    round_s: Seconds | None = None
    h: dict[
        Literal["push", "pull", "round"],
        tuple[Annotated[list[Count], Meta(min_length=NBUCKETS, max_length=NBUCKETS)], Seconds],
    ] = {}
    tl: Annotated[list[_Round], Meta(max_length=TL_ROUNDS)] = []
    run: Annotated[str, Meta(min_length=1, max_length=4096)] | None = None
    m: Annotated[
        list[tuple[Count, Annotated[dict[str, float], Meta(max_length=M_NAMES)]]],
        Meta(max_length=M_ENTRIES),
    ] = []


_NAMES = {
    "$.h": f"'h' must be a map with keys among {', '.join(HISTOGRAMS)}",
    "$.h[]": "a histogram [counts, sum]",
    "$.h[][0]": f"a histogram's counts (it must have {NBUCKETS} counts)",
    "$.h[][0][]": "a count of a histogram",
    "$.h[][1]": "the sum of a histogram",
    "$.tl": f"'tl' must be a list of at most {TL_ROUNDS} rounds",
    "$.tl[]": "a 'tl' round [round, spans, links]",
    "$.tl[][0]": "a 'tl' round number",
    "$.tl[][1]": f"a 'tl' round holds a list of at most {TL_SPANS} spans",
    "$.tl[][1][]": "a span [phase, start, seconds]",
    "$.tl[][1][][0]": "a span's phase (a lower-case name of up to 16 letters)",
    "$.tl[][1][][1]": "a span's start",
    "$.tl[][1][][2]": "a span's length",
    "$.tl[][2][]": "a 'tl' link row [server, sent, received]",
    "$.tl[][2][][0]": "a 'tl' link's server rank",
    "$.tl[][2][][1]": "a 'tl' link's bytes sent",
    "$.tl[][2][][2]": "a 'tl' link's bytes received",
    "$.run": "'run' must be a printable path of 1 to 4096 characters",
    "$.m": f"'m' must be a list of at most {M_ENTRIES} [step, values] entries",
    "$.m[]": "an 'm' entry [step, {name: value}]",
    "$.m[][0]": "an 'm' step",
    "$.m[][1]": f"an 'm' entry holds at most {M_NAMES} values",
}


def parse_report(body: Any, num_servers: int) -> dict:
    """A report's checked contents; raises :class:`ReportError` naming the first problem.
    Nothing a report holds can be bigger than its bounds (:class:`WorkerReport`): at most
    one link row per server, :data:`NBUCKETS` counts per histogram, numbers within
    :data:`MAX_COUNT` and :data:`MAX_SECONDS`."""
    rep = decode(body, WorkerReport, names("server", num_servers) | _NAMES)
    printable(rep.run, _NAMES["$.run"])
    last, tl = 0, []
    for rnd, spans, rows in rep.tl:
        if rnd <= last:
            raise ReportError(f"'tl' rounds must increase ({rnd} after {last})")
        last = rnd
        got = links(rows, num_servers, "server", "in a 'tl' round, ")
        tl.append((rnd, spans, [(r, s, v) for r, (s, v) in got.items()]))
    try:
        values = [(step, check_values(v)) for step, v in rep.m]
    except ValueError as exc:
        raise ReportError(str(exc)) from None
    return {
        "seq": rep.seq,
        "t": rep.t,
        "rounds": rep.rounds,
        "round_s": rep.round_s,
        "links": links(rep.links, num_servers, "server"),
        "h": rep.h,
        "tl": tl,
        "m": values,
        "run": rep.run,
        **extras(rep),
    }


# -- the scheduler's side -------------------------------------------------------------------
class Totals:
    """What the scheduler knows of one node from what every report has; ``peer`` is the role
    at the other end of the node's links."""

    peer = "server"

    def __init__(self) -> None:
        self.seq, self.t, self.rounds, self.reports = 0, 0.0, 0, 0
        self.links: dict[int, tuple[int, int]] = {}
        self.sys: dict | None = None
        self.log: deque[str] = deque(maxlen=20)

    def _check_newer(self, rep: dict) -> None:
        """Raise ReportError unless ``rep`` follows the last report: a newer number, no
        earlier time, no byte total going back."""
        if rep["seq"] <= self.seq:
            raise ReportError(f"report {rep['seq']} is not newer than report {self.seq}")
        if rep["t"] < self.t:
            raise ReportError(f"its time {rep['t']:.3f} s is before the last report's")
        for rank, (sent, recv) in rep["links"].items():
            old = self.links.get(rank, (0, 0))
            if sent < old[0] or recv < old[1]:
                raise ReportError(f"the byte totals of the link to {self.peer} {rank} went back")

    def _keep(self, rep: dict) -> None:
        """Keep what every report has (after the checks)."""
        self.seq, self.t, self.rounds = rep["seq"], rep["t"], rep["rounds"]
        if rep["sys"] is not None:
            self.sys = rep["sys"]
        self.log.extend(rep["log"])
        self.reports += 1


class WorkerTotals(Totals):
    """What the scheduler knows of one worker, from its reports."""

    def __init__(self) -> None:
        super().__init__()
        self.round_s: float | None = None
        self.rates: dict[int, tuple[float, float]] = {}  # bytes/s over the last report
        self.hists = {name: ([0] * NBUCKETS, 0.0) for name in HISTOGRAMS}
        self.timeline: deque[tuple[int, list, list]] = deque(maxlen=TL_KEEP)
        self.run: str | None = None
        self.heard = time.monotonic()  # the scheduler's clock: when the last report came
        self.last_h: dict[str, tuple[list[int], float]] = {}  # the last report's gains
        self.metrics: dict[str, deque[tuple[int, float]]] = {}  # name -> (step, value)

    def apply(self, rep: dict) -> None:
        """Add a checked report; raises ReportError (and changes nothing) when it does not
        follow the last one: an old or repeated number, time or totals going back."""
        self._check_newer(rep)
        if rep["rounds"] < self.rounds:
            raise ReportError(f"'rounds' went back from {self.rounds} to {rep['rounds']}")
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
        if rep["round_s"] is not None:
            self.round_s = rep["round_s"]
        last = self.timeline[-1][0] if self.timeline else 0
        self.timeline.extend(r for r in rep["tl"] if r[0] > last)
        if rep["run"] is not None:
            self.run = rep["run"]
        for step, values in rep["m"]:
            for name, value in values.items():
                if name in self.metrics or len(self.metrics) < M_NAMES:
                    self.metrics.setdefault(name, deque(maxlen=M_KEEP)).append((step, value))
        self.last_h = rep["h"]
        self.heard = time.monotonic()
        self._keep(rep)
