"""Live metrics of the servers: what each server reports of itself, and the scheduler's checks.
(docs/MODULES.md, "hetps.metrics.server_meter")"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from hetps.metrics.bounds import Count, Report, ReportError, Seconds, decode, links, names
from hetps.metrics.reports import Reporter, Totals
from hetps.metrics.sysinfo import extras

log = logging.getLogger("hetps.metrics.server_meter")

__all__ = ["ServerMeter", "ServerTotals", "parse_server_report"]


class ServerMeter(Reporter):
    """One server's reports: ``stats()`` returns ``(rounds merged, optimizer seconds,
    replicas, {worker rank: (bytes sent, bytes received)})``; ``send(body)`` ships a report."""

    _what = "server report"

    def __init__(self, interval: float, send: Callable[[dict], Any], stats: Callable[[], tuple]):
        self._stats = stats
        self._start_reports(interval, send, True, "hetps-server-metrics")

    def report(self) -> dict:
        """The next report's body."""
        rounds, opt_s, replicas, links = self._stats()
        body = self._head()
        body["server"] = {"rounds": int(rounds), "opt_s": float(opt_s), "replicas": int(replicas)}
        body["links"] = [[r, int(s), int(v)] for r, (s, v) in sorted(links.items())]
        return self._machine(body)


class ServerPart(msgspec.Struct):
    """What a server's report says of the server itself."""

    rounds: Count
    opt_s: Seconds
    replicas: Annotated[int, Meta(ge=1, le=1 << 16)]


class ServerReport(Report, kw_only=True):
    """A server's report (cluster.commands.MetricsReport lists its fields)."""

    server: ServerPart


_NAMES = {"$.server": "a server's report has a 'server' map"} | {
    f"$.server.{k}": f"'server.{k}'" for k in ("rounds", "opt_s", "replicas")
}


def parse_server_report(body: Any, num_workers: int) -> dict:
    """A server's report, checked; raises :class:`ReportError` naming the first problem."""
    rep = decode(body, ServerReport, names("worker", num_workers) | _NAMES)
    srv = rep.server
    return {
        "seq": rep.seq,
        "t": rep.t,
        "rounds": srv.rounds,
        "opt_s": srv.opt_s,
        "replicas": srv.replicas,
        "links": links(rep.links, num_workers, "worker"),
        **extras(rep),
    }


class ServerTotals(Totals):
    """What the scheduler knows of one server, from its reports."""

    peer = "worker"

    def __init__(self) -> None:
        super().__init__()
        self.opt_s, self.replicas = 0.0, 1

    def apply(self, rep: dict) -> None:
        """Keep a checked report; ReportError (and nothing changed) when it goes back."""
        self._check_newer(rep)
        if rep["rounds"] < self.rounds or rep["opt_s"] < self.opt_s:
            raise ReportError("the rounds or the optimizer's seconds went back")
        self.opt_s, self.replicas = rep["opt_s"], rep["replicas"]
        self.links.update(rep["links"])
        self._keep(rep)

    def view(self) -> dict:
        """What a scrape shows of the server (copies)."""
        kept = ("rounds", "opt_s", "replicas", "reports", "sys")
        return {k: getattr(self, k) for k in kept} | {
            "links": dict(self.links),
            "log": list(self.log),
        }
