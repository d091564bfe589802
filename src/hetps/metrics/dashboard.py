"""The live dashboard: the scheduler's HTTP endpoint serves a page beside ``/metrics``.

One HTTP server in the scheduler (a thread; no other process, nothing fetched from the
internet) answers:

* ``/`` — the dashboard page (``web/dashboard.html``, its script and style sheet);
* ``/static/...`` — those files and the vendored chart library (``web/vendor/uplot``);
* ``/api/state`` — everything the page draws, as JSON (:func:`state`): the nodes and their
  state, the rounds, each worker's totals and its last rounds' phase spans (the timeline), the
  link bytes, the load plan's shares, ESync's local steps, and the failures and node changes
  as they were seen (:class:`Events`);
* ``/metrics`` — Prometheus' text format (:class:`hetps.metrics.prom.Collector`).

The page polls ``/api/state`` once a second. Everything served is read-only and holds no
secret, no key name and no node address (docs/LIVE.md, "Security").
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any

from hetps.metrics.reports import BUCKETS, HISTOGRAMS

log = logging.getLogger("hetps.metrics.dashboard")

__all__ = ["Events", "finish_job", "node_states", "serve_http", "state", "static_file"]

#: what /static/ serves: name -> (file under hetps/metrics/web, content type)
STATIC = {
    "dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "timeline.js": ("timeline.js", "text/javascript; charset=utf-8"),
    "dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
    "uPlot.iife.min.js": ("vendor/uplot/uPlot.iife.min.js", "text/javascript; charset=utf-8"),
    "uPlot.min.css": ("vendor/uplot/uPlot.min.css", "text/css; charset=utf-8"),
    "uPlot.LICENSE": ("vendor/uplot/LICENSE", "text/plain; charset=utf-8"),
}
#: the page's own rules: scripts and styles from this server only, no connection elsewhere
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
MAX_EVENTS = 200
FINAL_FILE = "live-final.json"  # the dashboard's last state, in the run directory
MAX_LINGER = 60.0  # seconds the endpoint waits at most, after the job, for a last scrape


class Scrapes:
    """When ``/metrics`` was read: the endpoint stays up after the job until one more scrape
    came (or the gap between the last two scrapes has passed, and a second), so that
    Prometheus reads the final values."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.gap = 0.0  # between the last two scrapes
        self.after_end = threading.Event()
        self.ended = False
        self._lock = threading.Lock()

    def seen(self) -> None:
        now = time.monotonic()
        with self._lock:
            if self.times:
                self.gap = now - self.times[-1]
            self.times[:] = [now]
            if self.ended:
                self.after_end.set()


def static_file(name: str) -> bytes:
    """A file of the package's ``web`` folder (the page, its script, the chart library)."""
    return resources.files("hetps.metrics").joinpath("web", *name.split("/")).read_bytes()


# -- what the page shows --------------------------------------------------------------------
def node_states(snap: dict) -> list[dict]:
    """One row per registered node: ``{"node", "role", "rank", "state", "detail"}``, state one
    of alive, late, finished, dead, taken over, left, rejoined."""
    nodes, dead = snap["nodes"], snap["dead"]
    taken = {d: to for d, to in snap.get("failovers", [])}
    left = snap.get("left", {})
    rejoined = snap.get("rejoined", {})
    rows = []
    for nid, n in sorted(nodes.items(), key=lambda kv: (kv[1].role != "server", kv[1].rank)):
        detail = ""
        if nid in dead and nid in taken and taken[nid] in nodes:
            to = nodes[taken[nid]]
            state, detail = "taken over", f"by {to.role}{to.rank}: {dead[nid]}"
        elif nid in dead and nid in left:
            state, detail = "left", str(left[nid])
        elif nid in dead:
            state, detail = "dead", str(dead[nid])
        elif nid in snap["finished"]:
            state = "finished"
        elif nid in snap["late"]:
            state = "late"
        elif rejoined.get(nid, 0) > 0:
            state, detail = "rejoined", f"admitted again {rejoined[nid]} time(s)"
        else:
            state = "alive"
        rows.append(
            {"node": f"{n.role}{n.rank}", "role": n.role, "rank": n.rank, "state": state,
             "detail": detail[:300]}
        )  # fmt: skip
    return rows


class Events:
    """Failures and node changes, each stamped when the scheduler first saw it (on a report or
    a poll of the page): a node dead, taken over, let go or admitted again, late, heard
    again, finished. Keeps the last :data:`MAX_EVENTS`."""

    def __init__(self) -> None:
        self.items: list[dict] = []
        self._seen: dict[str, Any] = {}
        self._lock = threading.Lock()

    def observe(self, snap: dict) -> None:
        """Compare ``snap`` (:meth:`LiveMetrics.snapshot`) with what was seen before."""
        rows = {r["node"]: r for r in node_states(snap)}
        recov = {
            f"{snap['nodes'][nid].role}{snap['nodes'][nid].rank}": times
            for nid, times in snap.get("recoveries", {}).items()
            if nid in snap["nodes"]
        }
        now = time.time()
        with self._lock:
            for name, row in rows.items():
                before = self._seen.get(("state", name))
                if row["state"] != before and not (before is None and row["state"] == "alive"):
                    kind = "failure" if row["state"] in ("dead", "taken over", "left") else "info"
                    text = f"{name} {row['state']}" + (
                        f": {row['detail']}" if row["detail"] else ""
                    )
                    self._add(now, snap["uptime"], kind, text)
                self._seen[("state", name)] = row["state"]
            for name, times in recov.items():
                if times > self._seen.get(("recov", name), 0):
                    self._add(now, snap["uptime"], "info", f"{name} heard from again")
                self._seen[("recov", name)] = times

    def _add(self, now: float, uptime: float, kind: str, text: str) -> None:
        self.items.append({"t": round(now, 3), "uptime": round(uptime, 3), "kind": kind,
                           "text": text})  # fmt: skip
        del self.items[:-MAX_EVENTS]

    def list(self) -> list[dict]:
        with self._lock:
            return list(self.items)


def _mean_ms(hist: tuple[list[int], float]) -> float | None:
    counts, total = hist
    n = sum(counts)
    return round(1000.0 * total / n, 4) if n else None


def state(live: Any) -> dict:
    """What ``/api/state`` answers: one snapshot of the job, JSON-able."""
    snap = live.snapshot()
    live.events.observe(snap)
    workers = snap["workers"]
    expected = snap["expected"]
    rounds = (
        min((w["rounds"] for w in workers.values()), default=0)
        if len(workers) == expected["worker"]
        else 0
    )
    rows = []
    for r, w in sorted(workers.items()):
        rows.append(
            {
                "rank": r,
                "rounds": w["rounds"],
                "round_s": w["round_s"],
                "reports": w["reports"],
                "push_ms": _mean_ms(w["hists"]["push"]),
                "pull_ms": _mean_ms(w["hists"]["pull"]),
                "round_ms": _mean_ms(w["hists"]["round"]),
                "requests": {n: sum(w["hists"][n][0]) for n in HISTOGRAMS},
                "links": [[s, up, down] for s, (up, down) in sorted(w["links"].items())],
                "rates": [
                    [s, round(up, 1), round(down, 1)] for s, (up, down) in sorted(w["rates"].items())
                ],
                "timeline": [
                    {"round": rnd, "spans": [list(sp) for sp in spans],
                     "links": [list(row) for row in links]}
                    for rnd, spans, links in w["timeline"]
                ],
            }
        )  # fmt: skip
    sched = live.sched
    return {
        "job": getattr(live, "job", ""),
        "now": time.time(),
        "uptime": round(snap["uptime"], 4),
        "expected": expected,
        "mode": getattr(sched.cfg, "mode", None) or "",
        "nodes": node_states(snap),
        "finished": len(snap["finished"]),
        "rounds": rounds,
        "workers": rows,
        "servers": [
            {
                "rank": r,
                "rounds": v["rounds"],
                "opt_s": round(v["opt_s"], 6),
                "replicas": v["replicas"],
                "reports": v["reports"],
                "bytes_out": sum(x[0] for x in v["links"].values()),
                "bytes_in": sum(x[1] for x in v["links"].values()),
            }
            for r, v in sorted(snap.get("servers", {}).items())
        ],  # fmt: skip
        "plan": snap["plan"],
        "esync": snap["esync"],
        "events": live.events.list(),
        "refused": snap["refused"],
        "buckets": list(BUCKETS),
    }


# -- the server -----------------------------------------------------------------------------
#: connections served at once (a thread each); one more is closed at once
MAX_CONNECTIONS = 32
#: seconds a connection has to send its request (and to take the answer)
REQUEST_TIMEOUT_S = 10.0


class _Bounded(ThreadingHTTPServer):
    """At most :data:`MAX_CONNECTIONS` connections at a time, each timed out: connections
    that send nothing cannot hold the scheduler's threads or descriptors."""

    daemon_threads = True
    request_queue_size = 64  # (the listen backlog: 5 by default)

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # full: this one is closed, the others go on
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class _Handler(BaseHTTPRequestHandler):
    server_version = "hetps"
    sys_version = ""
    timeout = REQUEST_TIMEOUT_S
    live: Any = None
    registry: Any = None

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass  # no line per request on the scheduler's output

    def _send(self, code: int, body: bytes, ctype: str, extra: dict | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Cache-Control", "no-store")
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_HEAD(self) -> None:  # noqa: N802 - http.server's name
        self.do_GET()

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        path = self.path.split("?", 1)[0]
        try:
            if path == "/metrics":
                from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

                body = generate_latest(self.registry)
                self.live.scrapes.seen()  # before answering: the scraper has it counted
                self._send(200, body, CONTENT_TYPE_LATEST)
            elif path in ("/", "/index.html"):
                self._send(
                    200,
                    static_file("dashboard.html"),
                    "text/html; charset=utf-8",
                    {"Content-Security-Policy": CSP, "X-Frame-Options": "DENY"},
                )
            elif path == "/api/state":
                body = json.dumps(state(self.live), separators=(",", ":")).encode()
                self._send(200, body, "application/json")
            elif path.startswith("/static/") and path[8:] in STATIC:
                name, ctype = STATIC[path[8:]]
                self._send(200, static_file(name), ctype)
            else:
                self._send(404, b"not found: try / or /metrics\n", "text/plain; charset=utf-8")
        except (BrokenPipeError, ConnectionResetError):
            pass


def serve_http(live: Any, host: str, port: int) -> tuple[ThreadingHTTPServer, threading.Thread]:
    """Start the endpoint's server on ``host:port`` in a daemon thread."""
    from prometheus_client import CollectorRegistry

    from hetps.metrics.prom import Collector

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector(live))
    handler = type("Handler", (_Handler,), {"live": live, "registry": registry})
    server_cls: type[ThreadingHTTPServer] = _Bounded
    if ":" in host:
        import socket

        server_cls = type("Server6", (_Bounded,), {"address_family": socket.AF_INET6})
    httpd = server_cls((host, port), handler)
    thread = threading.Thread(target=httpd.serve_forever, name="hetps-dashboard", daemon=True)
    thread.start()
    return httpd, thread


def _write_final(live: Any, body: dict) -> str | None:
    """Write the last state into the run directory a worker named (rank 0's first), when it
    is a run directory on this machine (it holds run.json); the path, or None."""
    from pathlib import Path

    with live.lock:
        runs = [w.run for _, w in sorted(live.workers.items()) if w.run]
    for run in runs[:1]:
        d = Path(run)
        if not (d.is_dir() and (d / "run.json").is_file()):
            log.info("metrics: %s is no run directory here: no %s written", run, FINAL_FILE)
            return None
        tmp = d / f".{FINAL_FILE}.{os.getpid()}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(body, f, separators=(",", ":"))
            os.replace(tmp, d / FINAL_FILE)
        except OSError as exc:
            log.warning("metrics: cannot write %s into %s: %s", FINAL_FILE, d, exc)
            tmp.unlink(missing_ok=True)
            return None
        return str(d / FINAL_FILE)
    return None


def finish_job(live: Any, max_linger: float = MAX_LINGER) -> str | None:
    """The job ended: leave its last state in the run directory (``live-final.json``), then
    keep the endpoint up until a last scrape of ``/metrics`` read the final values, waiting at
    most the gap between the last two scrapes (plus a second; never more than
    ``max_linger``), and not at all when nobody scraped. Returns the file written, if any."""
    try:
        body = state(live)
        body["ended"] = True
        path = _write_final(live, body)
    except Exception as exc:  # noqa: BLE001 - the job is over: never fail its end for this
        log.warning("metrics: the last state was not saved: %s", exc)
        path = None
    scrapes = live.scrapes
    with scrapes._lock:
        scrapes.ended = True
        wait = min(max_linger, scrapes.gap + 1.0) if scrapes.times else 0.0
    if wait > 0:
        scrapes.after_end.wait(wait)
    return path
