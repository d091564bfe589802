"""Live metrics of the servers: what each server reports of itself, and the scheduler's checks.

A server whose scheduler serves live metrics (the node table's ``metrics_s``) starts a
:class:`ServerMeter`: a thread that sends one ``metrics_report`` every ``metrics_s`` seconds
with the rounds it merged (every key slice's rounds, summed), the seconds its optimizer took,
its copies of every key (``HETPS_REPLICAS``) and the bytes on its links to the workers (totals,
from its transport counters). Nothing is added to the server's hot path but one
``perf_counter`` pair around each optimizer update. The scheduler checks each report
(:func:`parse_server_report`: types, bounds, one row per worker, numbers and totals that only
go forward) before it keeps it (:class:`ServerTotals`); a bad one is refused like a worker's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from hetps.metrics.bounds import MAX_T, ReportError, checked_int, checked_seconds

log = logging.getLogger("hetps.metrics.server_meter")

__all__ = ["ServerMeter", "ServerTotals", "parse_server_report"]


class ServerMeter:
    """One server's reports: ``stats()`` returns ``(rounds merged, optimizer seconds,
    replicas, {worker rank: (bytes sent, bytes received)})``; ``send(body)`` ships a report."""

    def __init__(self, interval: float, send: Callable[[dict], Any], stats: Callable[[], tuple]):
        from hetps.metrics.sysinfo import LogTail, Sampler

        self.sampler = Sampler()  # its CPU, memory, the machine's GPUs
        self.tail = LogTail().install()  # the last lines it wrote
        self.interval = interval
        self._send = send
        self._stats = stats
        self._seq = 0
        self._t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hetps-server-metrics", daemon=True)
        self._thread.start()

    def report(self) -> dict:
        rounds, opt_s, replicas, links = self._stats()
        self._seq += 1
        body = {
            "seq": self._seq,
            "t": time.monotonic() - self._t0,
            "server": {"rounds": int(rounds), "opt_s": float(opt_s), "replicas": int(replicas)},
            "links": [[r, int(s), int(v)] for r, (s, v) in sorted(links.items())],
            "sys": self.sampler.sample(),
        }
        lines = self.tail.take()
        if lines:
            body["log"] = lines
        return body

    def flush(self) -> None:
        try:
            self._send(self.report())
        except Exception as exc:  # noqa: BLE001 - reporting never breaks the server
            log.debug("metrics: server report not sent: %s", exc)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.flush()

    def close(self) -> None:
        """A last report, then stop."""
        if not self._stop.is_set():
            self._stop.set()
            self.flush()
            self.tail.uninstall()


def parse_server_report(body: Any, num_workers: int) -> dict:
    """A server's report, checked; raises :class:`ReportError` naming the first problem."""
    if not isinstance(body, dict) or not isinstance(body.get("server"), dict):
        raise ReportError("a server's report is a map with a 'server' map")
    srv = body["server"]
    out = {
        "seq": checked_int(body.get("seq"), "'seq'", 1),
        "t": checked_seconds(body.get("t"), "'t'", MAX_T),
        "rounds": checked_int(srv.get("rounds"), "'server.rounds'"),
        "opt_s": checked_seconds(srv.get("opt_s"), "'server.opt_s'"),
        "replicas": checked_int(srv.get("replicas"), "'server.replicas'", 1, 1 << 16),
    }
    links = body.get("links", [])
    if not isinstance(links, list) or len(links) > num_workers:
        raise ReportError(f"'links' must be a list of at most {num_workers} rows (one per worker)")
    rows: dict[int, tuple[int, int]] = {}
    for row in links:
        if not isinstance(row, list) or len(row) != 3:
            raise ReportError("a 'links' row must be [worker rank, sent, received]")
        rank = checked_int(row[0], "a link's worker rank", 0, num_workers - 1)
        if rank in rows:
            raise ReportError(f"'links' lists worker {rank} twice")
        rows[rank] = (
            checked_int(row[1], "a link's bytes sent"),
            checked_int(row[2], "a link's bytes received"),
        )
    out["links"] = rows
    from hetps.metrics.sysinfo import parse_extras

    out.update(parse_extras(body))
    return out


class ServerTotals:
    """What the scheduler knows of one server, from its reports."""

    def __init__(self) -> None:
        self.seq = 0
        self.t = 0.0
        self.rounds = 0
        self.opt_s = 0.0
        self.replicas = 1
        self.links: dict[int, tuple[int, int]] = {}
        self.reports = 0
        self.sys: dict | None = None
        self.log: deque[str] = deque(maxlen=20)

    def apply(self, rep: dict) -> None:
        """Keep a checked report; ReportError (and nothing changed) when it goes back."""
        if rep["seq"] <= self.seq:
            raise ReportError(f"report {rep['seq']} is not newer than report {self.seq}")
        if rep["t"] < self.t:
            raise ReportError(f"its time {rep['t']:.3f} s is before the last report's")
        if rep["rounds"] < self.rounds or rep["opt_s"] < self.opt_s:
            raise ReportError("the rounds or the optimizer's seconds went back")
        for rank, (sent, recv) in rep["links"].items():
            old = self.links.get(rank, (0, 0))
            if sent < old[0] or recv < old[1]:
                raise ReportError(f"the byte totals of the link to worker {rank} went back")
        self.seq, self.t = rep["seq"], rep["t"]
        self.rounds, self.opt_s, self.replicas = rep["rounds"], rep["opt_s"], rep["replicas"]
        self.links.update(rep["links"])
        if rep["sys"] is not None:
            self.sys = rep["sys"]
        self.log.extend(rep["log"])
        self.reports += 1

    def view(self) -> dict:
        return {
            "rounds": self.rounds,
            "opt_s": self.opt_s,
            "replicas": self.replicas,
            "links": dict(self.links),
            "reports": self.reports,
            "sys": self.sys,
            "log": list(self.log),
        }
