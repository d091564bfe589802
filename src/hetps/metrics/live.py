"""Live metrics, the scheduler's side: :class:`LiveMetrics` checks every report, keeps the
totals and gives a snapshot on each scrape or poll (docs/MODULES.md, "hetps.metrics.live")."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from typing import Any

from hetps.config import ConfigError, is_loopback
from hetps.config.table import unspecified
from hetps.metrics.dashboard import Events, SchedulerView, Scrapes, serve_http
from hetps.metrics.reports import ReportError, WorkerTotals, parse_report
from hetps.metrics.server_meter import ServerTotals, parse_server_report
from hetps.metrics.sysinfo import LogTail, Sampler

log = logging.getLogger("hetps.metrics.live")


class LiveMetrics:
    """The scheduler's live metrics: the ``metrics_report`` service and the Prometheus
    collector. ``sched`` is the :class:`~hetps.cluster.scheduler.Scheduler` (its node tables
    are read on each scrape); ``planner`` and ``esync``, when given, the load planner and
    ESync's state service it hosts."""

    def __init__(self, sched: SchedulerView, planner: Any = None, esync: Any = None) -> None:
        self.sched = sched
        self.planner = planner
        self.esync = esync
        self.num_servers = sched.cfg.num_server
        self.workers: dict[int, WorkerTotals] = {}
        self.servers: dict[int, Any] = {}  # hetps.metrics.server_meter.ServerTotals
        self.refused = 0
        self.lock = threading.Lock()
        self._httpd: Any = None  # hetps.metrics.httpserve.HttpServer
        self.host = ""
        self.hosts: list[str] = []  # every address served (the host, and loopback beside it)
        self.port = 0
        self.events = Events()  # failures and node changes, stamped when first seen
        self.scrapes = Scrapes()  # when /metrics was read (a last scrape after the job)
        self.pages = Scrapes()  # when /api/state was read (a page sees the job's end)
        self.ended: dict | None = None  # how the job ended, once it has (finish_job)
        self.sampler = Sampler()  # the scheduler's own CPU and memory
        self.tail = LogTail()  # its last lines (installed by the composition root)
        #: this job's id on the dashboard: the scheduler's start time and 4 random hex digits
        self.job = time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)

    # the service ----------------------------------------------------------------------------
    def handle(self, sched: SchedulerView, msg: Any) -> None:
        """One worker's report (the scheduler's service for ``metrics_report``)."""
        node = sched.node_info(msg.sender)
        if node is None or node.role not in ("worker", "server"):  # the allow-list says so
            self._refuse(sched, msg, "node", "metrics reports come from workers and servers")
            return
        try:
            if node.role == "server":  # hetps.metrics.server_meter
                rep = parse_server_report(msg.body, sched.cfg.num_worker)
                with self.lock:
                    self.servers.setdefault(node.rank, ServerTotals()).apply(rep)
            else:
                rep = parse_report(msg.body, self.num_servers)
                with self.lock:
                    self.workers.setdefault(node.rank, WorkerTotals()).apply(rep)
        except ReportError as exc:
            self._refuse(sched, msg, node.describe(), str(exc))
            return
        if msg.req:
            sched.reply(msg, {})
        self.events.observe(self.snapshot(timeline=False))

    def refused_body(self, sched: SchedulerView, msg: Any, why: str) -> None:
        """A report the scheduler's dispatch refused (a body not of its declared type: logged
        and answered there): counted with the others refused."""
        with self.lock:
            self.refused += 1

    def _refuse(self, sched: SchedulerView, msg: Any, who: str, text: str) -> None:
        with self.lock:
            self.refused += 1
        log.warning("scheduler: refused a metrics report from %s: %s", who, text)
        if msg.req:
            sched.reply(msg, {"error": f"metrics report refused: {text}"})

    # the endpoint ---------------------------------------------------------------------------
    def serve(self, port: int, host: str) -> LiveMetrics:
        """Serve ``/metrics`` over HTTP on ``host:port`` (0: a free port; :attr:`port` says
        which). ``host`` must be loopback or the scheduler's own address, never every
        interface; a non-loopback address is served on loopback too (the same port), where
        ``kubectl port-forward`` connects inside a pod."""
        if unspecified(host) or not (is_loopback(host) or host == self.sched.cfg.root_uri):
            raise ConfigError(
                f"HETPS_METRICS_HOST={host!r}: the metrics endpoint binds a loopback address or "
                f"the scheduler's address ({self.sched.cfg.root_uri}), never another and never "
                "every interface: name the scheduler's own address (its IP or host name)"
            )
        try:
            import prometheus_client  # noqa: F401
        except ImportError:
            raise ConfigError(
                "HETPS_METRICS_PORT (--metrics-port) needs prometheus_client: "
                "pip install 'hetps[metrics]'"
            ) from None
        from hetps.metrics.httpserve import loopback_twin

        hosts = [host] if is_loopback(host) else [host, loopback_twin(host)]
        try:
            self._httpd = serve_http(self, hosts, port)
        except OSError as exc:
            raise ConfigError(
                f"HETPS_METRICS_PORT={port}: cannot serve metrics on {' and '.join(hosts)} "
                f"port {port} ({exc.strerror or exc}); pick a free port, or 0 for any"
            ) from None
        self.host, self.port, self.hosts = host, self._httpd.port, hosts
        return self

    @property
    def base_url(self) -> str:
        """Where the dashboard is (``http://host:port/``)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    @property
    def url(self) -> str:
        """Where the metrics are (``http://host:port/metrics``)."""
        return self.base_url + "metrics"

    def close(self) -> None:
        """Stop serving (idempotent)."""
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.close()
        self.tail.uninstall()

    # what a scrape reads ----------------------------------------------------------------------
    def snapshot(self, timeline: bool = True) -> dict:
        """Everything one scrape shows, copied at one moment (with each worker's last rounds'
        phase spans when ``timeline``)."""
        sched = self.sched
        with self.lock:
            workers = {
                r: {k: getattr(w, k) for k in ("rounds", "round_s", "reports", "sys")}
                | {k: dict(getattr(w, k)) for k in ("links", "rates", "last_h")}
                | {
                    "hists": {n: (list(c), s) for n, (c, s) in w.hists.items()},
                    "timeline": list(w.timeline) if timeline else [],
                    "age": time.monotonic() - w.heard,  # seconds since its last report
                    "log": list(w.log),
                    "metrics": {n: list(v) for n, v in w.metrics.items()},
                }
                for r, w in self.workers.items()
            }
            refused = self.refused
            servers = {r: t.view() for r, t in self.servers.items()}
        m = sched.membership()  # plain values, taken by the scheduler
        now = time.monotonic()
        late_after, dead, finished = m["late_after"], m["dead"], m["finished"]
        late = [
            nid
            for nid, seen in m["last_seen"].items()
            if late_after and now - seen > late_after and nid not in dead and nid not in finished
        ]
        kept = ("nodes", "dead", "finished", "recoveries", "failovers", "left", "rejoined")
        return {
            **{k: m[k] for k in (*kept, "expected", "uptime")},
            "workers": workers,
            "servers": servers,
            "refused": refused,
            "late": late,
            "start_time": time.time() - m["uptime"],
            "plan": self.planner.plan_shares() if self.planner is not None else None,
            "esync": self.esync.progress() if self.esync is not None else None,
            "ended": self.ended,
        }
