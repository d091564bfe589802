"""The live dashboard: the scheduler's HTTP endpoint serves a page beside ``/metrics``.

One HTTP server thread in the scheduler answers ``/`` (the page, ``web/dashboard.html``),
``/static/...`` (its files and the vendored chart library), ``/api/state`` (everything the
page draws, :func:`state`) and ``/metrics`` (:class:`hetps.metrics.prom.Collector`).
Everything served is read-only and holds no secret, no key name and no node address
(docs/LIVE.md, "Security")."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from functools import partial
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

from hetps.config import NodeConfig
from hetps.metrics.prom import Snapshots
from hetps.metrics.reports import BUCKETS, HISTOGRAMS, WorkerTotals
from hetps.metrics.sysinfo import LogTail, Sampler, scrub

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
SILENT_S = 2.0  # seconds without a report at least before a worker's rates are "no data"


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

    def end(self, most: float) -> float:
        """Mark the job ended; how long to wait for one more scrape (at most ``most``)."""
        with self._lock:
            self.ended = True
            return min(most, self.gap + 1.0) if self.times else 0.0


class SchedulerView(Protocol):
    """What live metrics use of the scheduler: its settings, its node table (a report's
    sender), its members as plain values, and its way of answering."""

    cfg: NodeConfig

    def node_info(self, nid: int) -> Any: ...
    def membership(self) -> dict[str, Any]: ...
    def reply(self, request: Any, body: dict | None = None, arrays: list | None = None) -> None: ...


class Live(Snapshots, Protocol):
    """What the dashboard uses of the job's :class:`~hetps.metrics.live.LiveMetrics`: its
    scheduler, job id, events, watchers, workers' totals, own samples and how it ended."""

    sched: SchedulerView
    job: str
    events: Events
    scrapes: Scrapes
    pages: Scrapes
    workers: dict[int, WorkerTotals]
    lock: threading.Lock
    sampler: Sampler
    tail: LogTail
    ended: dict | None


def static_file(name: str) -> bytes:
    """A file of the package's ``web`` folder (the page, its script, the chart library)."""
    return resources.files("hetps.metrics").joinpath("web", *name.split("/")).read_bytes()


# -- what the page shows --------------------------------------------------------------------
def node_states(snap: dict) -> list[dict]:
    """One row per registered node: ``{"node", "role", "rank", "state", "detail"}``, state one
    of alive, late, finished, dead, taken over, left, rejoined."""
    nodes, dead = snap["nodes"], snap["dead"]
    taken = dict(snap.get("failovers", []))
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
             "detail": scrub(detail)[:300]}
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
                    )  # (the detail has no address: node_states scrubbed it)
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


def _phase_ms(w: dict, phase: str) -> float | None:
    """The last round's time in ``phase`` (its spans summed), else the mean of the requests
    of the last report (None: neither)."""
    if w["timeline"]:
        _, spans, _ = w["timeline"][-1]
        took = [d for name, _, d in spans if name == phase]
        return round(1000.0 * sum(took), 4) if took else None
    hist = w["last_h"].get(phase)
    return _mean_ms(hist) if hist else None


def _silent(live: Live, snap: dict) -> set[int]:
    """Worker ranks not heard from: late, dead or finished nodes, or no report for three
    report intervals (:data:`SILENT_S` at least). Their rates are "no data", not their last
    values."""
    nodes = snap["nodes"]
    gone = set(snap["late"]) | set(snap["dead"]) | set(snap["finished"])
    ranks = {nodes[nid].rank for nid in gone if nid in nodes and nodes[nid].role == "worker"}
    interval = float(getattr(live.sched.cfg, "metrics_interval", 1.0) or 1.0)
    silent_s = max(3 * interval, SILENT_S)
    return ranks | {r for r, w in snap["workers"].items() if w["age"] > silent_s}


def _node_rows(live: Live, snap: dict) -> list[dict]:
    """The node table, with each node's CPU, memory, GPUs and last lines beside it."""
    rows = node_states(snap)
    own = {("worker", r): w for r, w in snap["workers"].items()}
    own.update({("server", r): v for r, v in snap.get("servers", {}).items()})
    for row in rows:
        got = own.get((row["role"], row["rank"]), {})
        row.update(sys=got.get("sys"), log=got.get("log", []))
    return rows


def state(live: Live) -> dict:
    """What ``/api/state`` answers: one snapshot of the job, JSON-able."""
    snap = live.snapshot()
    live.events.observe(snap)
    workers = snap["workers"]
    expected = snap["expected"]
    silent = _silent(live, snap)
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
                "heard_s": round(w["age"], 3),
                "push_ms": _phase_ms(w, "push"),
                "pull_ms": _phase_ms(w, "pull"),
                "round_ms": _mean_ms(w["hists"]["round"]),
                "requests": {n: sum(w["hists"][n][0]) for n in HISTOGRAMS},
                "links": [[s, up, down] for s, (up, down) in sorted(w["links"].items())],
                "rates": None if r in silent else [
                    [s, round(up, 1), round(down, 1)] for s, (up, down) in sorted(w["rates"].items())
                ],
                "timeline": [
                    {"round": rnd, "spans": [list(sp) for sp in spans],
                     "links": [list(row) for row in links]}
                    for rnd, spans, links in w["timeline"]
                ],
                "metrics": {n: [list(x) for x in v] for n, v in sorted(w["metrics"].items())},
            }
        )  # fmt: skip
    return {
        "job": getattr(live, "job", ""),
        "now": time.time(),
        "uptime": round(snap["uptime"], 4),
        "expected": expected,
        "mode": getattr(live.sched.cfg, "mode", None) or "",
        "nodes": _node_rows(live, snap),
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
        "scheduler": {"sys": live.sampler.sample(), "log": live.tail.last()},
        "ended": live.ended is not None,
        "outcome": live.ended,  # how it ended: {ok, code, text, at}
    }


# -- the server -----------------------------------------------------------------------------
def answer(live: Live, registry: Any, method: str, path: str) -> tuple[int, bytes, str, dict]:
    """The endpoint's answer to ``method path``: (status, body, content type, headers)."""
    path = path.split("?", 1)[0]
    if path == "/metrics":
        from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

        body = generate_latest(registry)
        live.scrapes.seen()  # before answering: the scraper has it counted
        return 200, body, CONTENT_TYPE_LATEST, {}
    if path in ("/", "/index.html"):
        return (
            200,
            static_file("dashboard.html"),
            "text/html; charset=utf-8",
            {"Content-Security-Policy": CSP, "X-Frame-Options": "DENY"},
        )
    if path == "/api/state":
        body = json.dumps(state(live), separators=(",", ":")).encode()
        live.pages.seen()  # a page has this state (the job's end waits for one, bounded)
        return 200, body, "application/json", {}
    if path.startswith("/static/") and path[8:] in STATIC:
        name, ctype = STATIC[path[8:]]
        return 200, static_file(name), ctype, {}
    return 404, b"not found: try / or /metrics\n", "text/plain; charset=utf-8", {}


def serve_http(live: Live, hosts: list[str], port: int) -> Any:
    """Start the endpoint's server on ``port`` of each of ``hosts`` (a thread of its own:
    :class:`hetps.metrics.httpserve.HttpServer`)."""
    from prometheus_client import CollectorRegistry

    from hetps.metrics.httpserve import HttpServer
    from hetps.metrics.prom import Collector

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector(live))
    return HttpServer(hosts, port, partial(answer, live, registry))


def _write_final(live: Live, body: dict) -> str | None:
    """Write the last state into this job's run directory: the one rank 0 names, only when
    its ``run.json`` names this job (``live_job``: the lead worker writes the job id the
    scheduler gave it) and the scheduler's own user owns it. A worker's report names a
    folder; it never makes the scheduler write into one that is not this job's run. The
    path, or None."""
    with live.lock:
        runs = [w.run for _, w in sorted(live.workers.items()) if w.run]
    if not runs:
        return None
    d = Path(runs[0])
    try:
        dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        log.info("metrics: %s is no run directory here: no %s written", d, FINAL_FILE)
        return None
    try:
        why = _not_this_job(live, dfd)
        if why:
            log.warning("metrics: no %s written into %s: %s", FINAL_FILE, d, why)
            return None
        tmp = f".{FINAL_FILE}.{os.getpid()}.tmp"
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
            fd = os.open(tmp, flags, 0o644, dir_fd=dfd)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(body, f, separators=(",", ":"))
            os.replace(tmp, FINAL_FILE, src_dir_fd=dfd, dst_dir_fd=dfd)
        except OSError as exc:
            log.warning("metrics: cannot write %s into %s: %s", FINAL_FILE, d, exc)
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
            return None
        return str(d / FINAL_FILE)
    finally:
        os.close(dfd)


def _not_this_job(live: Live, dfd: int) -> str:
    """Why the open directory ``dfd`` is not this job's run directory ('' when it is)."""
    if os.fstat(dfd).st_uid != os.getuid():
        return "it belongs to another user"
    try:
        fd = os.open("run.json", os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dfd)
    except OSError:
        return "it holds no run.json"
    with os.fdopen(fd, "rb") as f:
        raw = f.read(1 << 20)
    try:
        meta = json.loads(raw)
    except ValueError:
        return "its run.json is no JSON"
    if not isinstance(meta, dict) or meta.get("live_job") != live.job:
        return f"its run.json does not name this job ({live.job}) as live_job"
    return ""


def ending(live: Live, code: int) -> dict:
    """How the job ended: ``{"ok", "code", "text", "at"}``, the text naming what failed."""
    if code == 0:
        return {"ok": True, "code": 0, "text": "success: every worker finished", "at": time.time()}
    failed = [e["text"] for e in live.events.list() if e["kind"] == "failure"]
    why = failed[-1] if failed else "see the scheduler's last lines"
    return {"ok": False, "code": int(code), "text": f"failure (exit code {code}): {why}"[:400],
            "at": time.time()}  # fmt: skip


def finish_job(live: Live, max_linger: float = MAX_LINGER, code: int = 0) -> str | None:
    """The job ended with exit code ``code``: ``/api/state`` says how from now on
    (``ended``), its last state goes into the run directory (``live-final.json``), then the
    endpoint stays up until a page watching it (polling ``/api/state``) and a scraper of
    ``/metrics`` have each read it once more, waiting at most the gap between their last two
    reads plus a second (never more than ``max_linger``), and not at all for one that never
    came. Returns the file written, if any."""
    try:
        live.events.observe(live.snapshot(timeline=False))  # the failure, before saying so
        live.ended = ending(live, code)
        body = state(live)
        path = _write_final(live, body)
    except Exception as exc:  # noqa: BLE001 - the job is over: never fail its end for this
        log.warning("metrics: the last state was not saved: %s", exc)
        path = None
    deadline = time.monotonic() + max_linger
    for watchers in (live.scrapes, live.pages):  # (a wait of 0 or less returns at once)
        watchers.after_end.wait(min(watchers.end(max_linger), deadline - time.monotonic()))
    return path
