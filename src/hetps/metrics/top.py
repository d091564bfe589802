"""``hetps top``: a live terminal view of a running cluster, read from the scheduler's metrics.

It scrapes the Prometheus endpoint a scheduler serves with ``--metrics-port`` every
``--interval`` seconds and draws it with rich (docs/LIVE.md). Needs ``prometheus_client`` and
``rich``: ``pip install 'hetps[metrics]'``."""

from __future__ import annotations

import argparse
import math
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import namedtuple
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse


class TopError(RuntimeError):
    """The endpoint cannot be read; the message says why and what to check."""


@dataclass
class Scrape:
    """One scrape: every sample by metric name, as ``{labels (sorted tuple): value}``."""

    at: float  # this machine's monotonic clock at the scrape
    samples: dict[str, dict[tuple, float]] = field(default_factory=dict)
    job: str = ""  # the job's id (every sample's ``job`` label, left out of the keys)

    def value(self, name: str, default: float | None = None, **labels: str) -> float | None:
        """The value of ``name`` with exactly ``labels`` (None/default when absent)."""
        return self.samples.get(name, {}).get(tuple(sorted(labels.items())), default)

    def series(self, name: str) -> list[tuple[dict[str, str], float]]:
        """Every sample of ``name``: (labels, value)."""
        return [(dict(k), v) for k, v in self.samples.get(name, {}).items()]


def parse(text: str, at: float | None = None) -> Scrape:
    """A scrape from Prometheus' text format."""
    from prometheus_client.parser import text_string_to_metric_families

    scrape = Scrape(time.monotonic() if at is None else at)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = dict(s.labels)
            scrape.job = labels.pop("job", scrape.job)
            scrape.samples.setdefault(s.name, {})[tuple(sorted(labels.items()))] = s.value
    return scrape


def fetch(url: str, timeout: float = 5.0) -> Scrape:
    """Scrape ``url``; raises :class:`TopError` with the reason when it cannot."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - a user's URL
            text = resp.read(16 << 20).decode("utf-8", "replace")
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise TopError(
            f"cannot read {url}: {reason}. Is the job running with --metrics-port (or "
            "HETPS_METRICS_PORT) and is this the address the scheduler printed "
            "('hetps metrics http://...')?"
        ) from None
    try:
        scrape = parse(text)
    except ValueError as exc:
        raise TopError(f"{url} does not serve Prometheus metrics: {exc}") from None
    if "hetps_start_time_seconds" not in scrape.samples:
        raise TopError(f"{url} serves metrics, but not a hetps scheduler's")
    return scrape


# -- what a frame shows -----------------------------------------------------------------------
#: a worker's row: push_ms and pull_ms are mean request latencies in milliseconds
WorkerRow = namedtuple("WorkerRow", "rank rounds round_s push_ms pull_ms rounds_per_s")
#: a link's row: rate in bytes/s over the workers' last report interval, total bytes so far
LinkRow = namedtuple("LinkRow", "src dst rate total")
#: what one frame of ``hetps top`` shows (computed from two scrapes, or one)
View = namedtuple(
    "View",
    "url uptime registered expected rounds rounds_per_s workers links slowest plan plan_epoch "
    "dead late finished esync_steps",
)


def _mean_ms(s: Scrape, kind: str, w: str) -> float | None:
    """Worker ``w``'s mean ``kind`` (push or pull) latency in milliseconds."""
    name = f"hetps_{kind}_latency_seconds"
    count, total = s.value(f"{name}_count", worker=w), s.value(f"{name}_sum", worker=w)
    return 1000.0 * total / count if count and total is not None else None


def view(url: str, cur: Scrape, prev: Scrape | None = None) -> View:
    """The frame for ``cur`` (``prev``, an earlier scrape, gives the rates)."""
    dt = cur.at - prev.at if prev is not None and cur.at > prev.at else None

    def mean_round(w: str) -> float | None:
        """The mean round over the last interval (since the start without one)."""
        name = "hetps_round_duration_seconds"
        n1, s1 = cur.value(f"{name}_count", worker=w), cur.value(f"{name}_sum", worker=w)
        n0 = prev.value(f"{name}_count", worker=w) if prev is not None else None
        s0 = prev.value(f"{name}_sum", worker=w) if prev is not None else None
        if n1 is None or s1 is None:
            return None
        if n0 is not None and s0 is not None and n1 > n0:
            return (s1 - s0) / (n1 - n0)
        return s1 / n1 if n1 else None

    def rate(name: str, **labels: str) -> float | None:
        if dt is None or prev is None:
            return None
        a, b = prev.value(name, **labels), cur.value(name, **labels)
        if a is None or b is None:
            return None
        return max(0.0, (b - a) / dt)

    name = "hetps_worker_rounds_total"
    workers = [
        WorkerRow(int(w), int(n), mean_round(w), _mean_ms(cur, "push", w), _mean_ms(cur, "pull", w),
                  rate(name, worker=w))
        for w, n in sorted(((lb["worker"], n) for lb, n in cur.series(name)), key=lambda x: int(x[0]))
    ]  # fmt: skip
    links = [
        LinkRow(lb["src"], lb["dst"], rate("hetps_link_bytes_total", **lb) or 0.0, v)
        for lb, v in cur.series("hetps_link_bytes_total")
    ]
    links.sort(key=lambda r: (r.src, r.dst))
    # ESync's local steps, when the job runs ESync (any worker reported a step)
    steps = {
        int(lb["worker"]): int(v)
        for lb, v in cur.series("hetps_esync_local_steps_total")
        if any(x for _, x in cur.series("hetps_esync_local_steps_total"))
    }
    # the slowest: under ESync every worker takes part in every round and a slow one does
    # fewer local steps in it, so the fewest steps; else a worker rounds behind the others,
    # then the longest round
    slowest = None
    if workers and steps:
        slowest = min(workers, key=lambda w: (steps.get(w.rank, 0), w.rounds))
    elif workers:
        slowest = max(workers, key=lambda w: (-w.rounds, w.round_s or 0.0))
    shares = sorted(cur.series("hetps_plan_share_ratio"), key=lambda lv: int(lv[0]["server"]))
    dead = sorted(lb["node"] for lb, v in cur.series("hetps_node_dead") if v)
    epoch = cur.value("hetps_plan_epoch")
    return View(
        url=url,
        uptime=max(0.0, time.time() - (cur.value("hetps_start_time_seconds", 0.0) or 0.0)),
        registered={lb["role"]: int(v) for lb, v in cur.series("hetps_nodes_registered")},
        expected={lb["role"]: int(v) for lb, v in cur.series("hetps_nodes_expected")},
        rounds=int(cur.value("hetps_rounds_total", 0.0) or 0),
        rounds_per_s=rate("hetps_rounds_total"),
        workers=workers,
        links=links,
        slowest=slowest,
        plan=[v for _, v in shares] or None,
        plan_epoch=int(epoch) if epoch is not None else None,
        dead=dead,
        late=int(cur.value("hetps_nodes_late", 0.0) or 0),
        finished=int(cur.value("hetps_workers_finished", 0.0) or 0),
        esync_steps=steps,
    )


# -- drawing ----------------------------------------------------------------------------------
def _bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _num(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None or not math.isfinite(x) else fmt.format(x)


def render(v: View) -> Any:
    """The frame as a rich renderable."""
    from rich.console import Group
    from rich.text import Text

    nodes = ", ".join(
        f"{v.registered.get(r, 0)}/{v.expected.get(r, 0)} {r}s" for r in ("server", "worker")
    )
    head = Text()
    head.append(f"hetps top  {v.url}  up {v.uptime:.0f} s\n", style="bold")
    head.append(f"nodes: {nodes}; finished workers: {v.finished}\n")
    head.append(f"rounds: {v.rounds}   rounds/s: {_num(v.rounds_per_s)}\n", style="bold")
    if v.slowest is not None:
        head.append(
            f"slowest worker: worker{v.slowest.rank} ({v.slowest.rounds} rounds, round "
            f"{_num(v.slowest.round_s, '{:.4f}')} s"
            + (f", {v.esync_steps.get(v.slowest.rank, 0)} ESync steps" if v.esync_steps else "")
            + ")\n"
        )
    head.append(f"dead nodes: {', '.join(v.dead) or 'none'}\n", style="bold red" if v.dead else "")
    if v.late:
        head.append(f"late nodes (silent > 3 heartbeats): {v.late}\n", style="yellow")

    steps = ["esync steps"] if v.esync_steps else []
    workers = [
        [f"worker{w.rank}", str(w.rounds), _num(w.rounds_per_s), _num(w.round_s, "{:.4f}"),
         _num(w.push_ms, "{:.3f}"), _num(w.pull_ms, "{:.3f}")]
        + ([str(v.esync_steps.get(w.rank, 0))] if steps else [])
        for w in v.workers
    ]  # fmt: skip
    cols = ["worker", "rounds", "rounds/s", "round s", "push ms", "pull ms", *steps]
    links = [[f"{x.src} -> {x.dst}", _bytes(x.rate) + "/s", _bytes(x.total)] for x in v.links]
    plan = Text("plan: none (load balancing is off)")
    if v.plan is not None:
        shares = [[f"server{srv}", f"{100 * share:.1f} %"] for srv, share in enumerate(v.plan)]
        plan = _table(f"plan (epoch {v.plan_epoch})", ["server", "share"], shares)
    return Group(
        head,
        _table("workers", cols, workers, "right"),
        _table("links", ["link", "bytes/s", "total"], links),
        plan,
    )


def _table(title: str, cols: list[str], rows: list[list[str]], first: str = "left") -> Any:
    """A rich table: the first column justified ``first``, the others right."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for i, col in enumerate(cols):
        table.add_column(col, justify=first if i == 0 else "right")  # type: ignore[arg-type]
    for row in rows:
        table.add_row(*row)
    return table


# -- the command --------------------------------------------------------------------------------
def endpoint(args: argparse.Namespace) -> str:
    """The URL to scrape, from ``URL`` or ``--port``/``--host``."""
    if args.url and args.port is not None:
        raise SystemExit("hetps top: give a URL or --port, not both")
    if args.url:
        url = args.url if "://" in args.url else f"http://{args.url}"
        if not url.startswith(("http://", "https://")):
            raise SystemExit(f"hetps top: {args.url!r} is not an http:// URL")
        return url if urlparse(url).path.strip("/") else url.rstrip("/") + "/metrics"
    if args.port is None:
        raise SystemExit(
            "hetps top: give the scheduler's metrics URL (it prints 'hetps metrics "
            "http://...') or --port P"
        )
    if not 0 < args.port < 65536:
        raise SystemExit(f"hetps top: --port {args.port} is not a TCP port (1 to 65535)")
    return f"http://{args.host}:{args.port}/metrics"


def main(args: argparse.Namespace) -> int:
    """``hetps top``."""
    try:
        import rich  # noqa: F401
    except ImportError:
        print("hetps top: needs rich: pip install 'hetps[metrics]'", file=sys.stderr)
        return 2
    if not args.interval > 0:
        print(f"hetps top: --interval {args.interval} must be above 0", file=sys.stderr)
        return 2
    url = endpoint(args)
    from rich.console import Console

    console = Console()
    stop = threading.Event()
    try:
        prev = fetch(url)
        if args.once:
            stop.wait(args.interval)  # a second scrape, for the rates
            cur = fetch(url)
            console.print(render(view(url, cur, prev)))
            return 0
        # Ctrl-C ends the view between two frames (an exception raised wherever the signal
        # lands, say inside rich's refresh, could leave it hanging); the handler only sets a
        # flag: taking a lock there could deadlock with the code it interrupted
        interrupted: list[bool] = []
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, lambda *_: interrupted.append(True))
        return _live(console, url, prev, args.interval, interrupted)
    except TopError as exc:
        print(f"hetps top: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


def _pause(seconds: float, interrupted: list[bool]) -> bool:
    """Sleep ``seconds`` in short steps; True as soon as Ctrl-C was pressed."""
    end = time.monotonic() + seconds
    while not interrupted and time.monotonic() < end:
        time.sleep(min(0.05, max(0.0, end - time.monotonic())))
    return bool(interrupted)


def _live(console: Any, url: str, prev: Scrape, interval: float, interrupted: list[bool]) -> int:
    from rich.live import Live

    cur = prev
    with Live(render(view(url, cur)), console=console, refresh_per_second=4) as live:
        while not _pause(interval, interrupted):
            try:
                cur, prev = fetch(url), cur
            except TopError:
                live.stop()
                console.print(f"hetps top: {url} no longer answers: the job has ended")
                return 0
            live.update(render(view(url, cur, prev)))
    return 0
