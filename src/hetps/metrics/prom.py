"""The Prometheus view of a job's live metrics (:class:`hetps.metrics.live.LiveMetrics`): one
collector, built anew on each scrape from :meth:`LiveMetrics.snapshot`. docs/LIVE.md lists
every metric."""

from __future__ import annotations

import itertools
from typing import Any, Protocol

from hetps.metrics.reports import BUCKETS


class Snapshots(Protocol):
    """What the collector uses of the job's :class:`~hetps.metrics.live.LiveMetrics`."""

    def snapshot(self, timeline: bool = True) -> dict: ...


class Collector:
    """prometheus_client's view of a :class:`LiveMetrics` (built anew on each scrape)."""

    def __init__(self, live: Snapshots) -> None:
        self.live = live

    def collect(self):
        """Every family, each sample labelled with the job's id (``job``)."""
        from prometheus_client.samples import Sample

        job = str(getattr(self.live, "job", "") or "")
        snap = self.live.snapshot()
        for family in self._families(snap):
            samples = list(family.samples)
            if family.type in ("counter", "histogram"):
                # every counter and histogram counts from the scheduler's start: _created
                end = "_total" if family.type == "counter" else "_count"
                samples += [
                    Sample(family.name + "_created", x.labels, snap["start_time"])
                    for x in family.samples
                    if x.name.endswith(end)
                ]
            family.samples = [x._replace(labels={"job": job, **x.labels}) for x in samples]
            yield family

    def _families(self, s: dict):
        from prometheus_client.core import CounterMetricFamily as C
        from prometheus_client.core import GaugeMetricFamily as G
        from prometheus_client.core import HistogramMetricFamily

        def fam(kind: type, name: str, doc: str, samples: Any, *labels: str) -> Any:
            family = kind(name, doc, labels=list(labels))
            for values, x in samples:
                family.add_metric(list(values), x)
            return family

        # fmt: off
        nodes, workers, ended = s["nodes"], s["workers"], s.get("ended")
        yield fam(G, "hetps_start_time_seconds",
                  "when the scheduler started, in seconds since the epoch",
                  [((), s["start_time"])])
        yield fam(G, "hetps_nodes_expected", "servers and workers the job waits for",
                  [((r,), n) for r, n in s["expected"].items()], "role")
        yield fam(G, "hetps_nodes_registered", "servers and workers registered",
                  [((r,), sum(n.role == r for n in nodes.values())) for r in ("server", "worker")],
                  "role")
        yield fam(G, "hetps_node_dead",
                  "1 for a node declared dead, 0 for a registered node that is not",
                  [((_name(n.role, n.rank), n.role, str(n.rank)), int(nid in s["dead"]))
                   for nid, n in sorted(nodes.items())], "node", "role", "rank")
        yield fam(G, "hetps_nodes_late",
                  "nodes silent for more than 3 heartbeat intervals now (not yet dead)",
                  [((), len(s["late"]))])
        yield fam(C, "hetps_node_recoveries",
                  "times a node was heard again after more than 3 heartbeat intervals of silence",
                  [((_name(nodes[nid].role, nodes[nid].rank),), times)
                   for nid, times in sorted(s["recoveries"].items()) if nid in nodes], "node")
        yield fam(G, "hetps_workers_finished", "workers that finished their job",
                  [((), len(s["finished"]))])
        yield fam(G, "hetps_job_failed",
                  "1 once the job ended with a failing exit code, else 0 (running or succeeded)",
                  [((), int(ended is not None and not ended["ok"]))])
        yield fam(G, "hetps_job_ended", "1 once the job ended (either way), else 0",
                  [((), int(ended is not None))])
        least = min((w["rounds"] for w in workers.values()), default=0)
        yield fam(C, "hetps_rounds",
                  "rounds every worker has begun (the least of the workers' counts)",
                  [((), least if len(workers) == s["expected"]["worker"] else 0)])
        yield fam(C, "hetps_worker_rounds", "rounds a worker has begun",
                  [((str(r),), w["rounds"]) for r, w in sorted(workers.items())], "worker")
        for name, metric, doc in (
            ("round", "hetps_round_duration_seconds", "time of a worker's rounds"),
            ("push", "hetps_push_latency_seconds", "a push request, from the call to its answer"),
            ("pull", "hetps_pull_latency_seconds", "a pull request, from the call to its answer"),
        ):
            h = HistogramMetricFamily(metric, doc, labels=["worker"])
            for r, w in sorted(workers.items()):
                counts, total = w["hists"][name]
                acc = list(itertools.accumulate(counts))
                buckets = [(repr(float(b)), n) for b, n in zip(BUCKETS, acc, strict=False)]
                h.add_metric([str(r)], [*buckets, ("+Inf", acc[-1])], total)
            yield h
        yield fam(C, "hetps_link_bytes", "bytes on a worker-server link, by direction",
                  [pair for r, w in sorted(workers.items())
                   for srv, (sent, recv) in sorted(w["links"].items())
                   for pair in (((_name("worker", r), _name("server", srv)), sent),
                                ((_name("server", srv), _name("worker", r)), recv))],
                  "src", "dst")
        servers = sorted(s.get("servers", {}).items())
        yield fam(C, "hetps_server_rounds", "rounds a server merged (every key slice's)",
                  [((str(r),), v["rounds"]) for r, v in servers], "server")
        yield fam(C, "hetps_server_optimizer_seconds", "seconds a server's optimizer took",
                  [((str(r),), v["opt_s"]) for r, v in servers], "server")
        yield fam(C, "hetps_server_bytes",
                  "bytes on a server's links to the workers, by direction (from the server's "
                  "counters)",
                  [((str(r), way), sum(x[i] for x in v["links"].values()))
                   for r, v in servers for i, way in enumerate(("out", "in"))],
                  "server", "direction")
        yield fam(G, "hetps_server_replicas", "copies of every key the job keeps (HETPS_REPLICAS)",
                  [((str(r),), v["replicas"]) for r, v in servers], "server")
        yield fam(C, "hetps_metrics_reports", "metrics reports taken, by worker",
                  [((str(r),), w["reports"]) for r, w in sorted(workers.items())], "worker")
        yield fam(C, "hetps_metrics_reports_refused",
                  "metrics reports refused (malformed or out of order)", [((), s["refused"])])
        plan, es = s["plan"], s["esync"]
        if plan is not None:
            yield fam(G, "hetps_plan_share_ratio",
                      "the load plan's share of the elements per server (0 to 1)",
                      [((str(srv),), x) for srv, x in enumerate(plan["shares"])], "server")
            yield fam(G, "hetps_plan_epoch", "plans adopted so far", [((), plan["epoch"])])
        if es is not None:
            yield fam(G, "hetps_esync_round", "ESync's current round (0: none yet)",
                      [((), es["round"])])
            yield fam(G, "hetps_esync_round_local_steps",
                      "local steps a worker reported in ESync's current round",
                      [((str(w),), n) for w, n in enumerate(es["steps"])], "worker")
            yield fam(C, "hetps_esync_local_steps",
                      "local steps a worker reported to ESync, all rounds",
                      [((str(w),), n) for w, n in enumerate(es["total"])], "worker")
        # fmt: on


def _name(role: str, rank: int) -> str:
    return f"{role}{rank}"
