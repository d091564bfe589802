"""The Prometheus view of a job's live metrics (:class:`hetps.metrics.live.LiveMetrics`): one
collector, built anew on each scrape from :meth:`LiveMetrics.snapshot`. docs/LIVE.md lists
every metric."""

from __future__ import annotations

from typing import Any

from hetps.metrics.reports import BUCKETS


class Collector:
    """prometheus_client's view of a :class:`LiveMetrics` (built anew on each scrape)."""

    def __init__(self, live: Any) -> None:
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

    def _families(self, s: dict):  # noqa: C901 - one metric after another
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        nodes = s["nodes"]
        started = s["start_time"]

        g = GaugeMetricFamily(
            "hetps_start_time_seconds", "when the scheduler started, in seconds since the epoch"
        )
        g.add_metric([], started)
        yield g
        g = GaugeMetricFamily(
            "hetps_nodes_expected", "servers and workers the job waits for", labels=["role"]
        )
        for role, n in s["expected"].items():
            g.add_metric([role], n)
        yield g
        g = GaugeMetricFamily(
            "hetps_nodes_registered", "servers and workers registered", labels=["role"]
        )
        for role in ("server", "worker"):
            g.add_metric([role], sum(1 for n in nodes.values() if n.role == role))
        yield g
        g = GaugeMetricFamily(
            "hetps_node_dead",
            "1 for a node declared dead, 0 for a registered node that is not",
            labels=["node", "role", "rank"],
        )
        for nid, n in sorted(nodes.items()):
            g.add_metric([_name(n.role, n.rank), n.role, str(n.rank)], int(nid in s["dead"]))
        yield g
        g = GaugeMetricFamily(
            "hetps_nodes_late",
            "nodes silent for more than 3 heartbeat intervals now (not yet dead)",
        )
        g.add_metric([], len(s["late"]))
        yield g
        c = CounterMetricFamily(
            "hetps_node_recoveries",
            "times a node was heard again after more than 3 heartbeat intervals of silence",
            labels=["node"],
        )
        for nid, times in sorted(s["recoveries"].items()):
            n = nodes.get(nid)
            if n is not None:
                c.add_metric([_name(n.role, n.rank)], times)
        yield c
        g = GaugeMetricFamily("hetps_workers_finished", "workers that finished their job")
        g.add_metric([], len(s["finished"]))
        yield g
        ended = s.get("ended")
        g = GaugeMetricFamily(
            "hetps_job_failed",
            "1 once the job ended with a failing exit code, else 0 (running or succeeded)",
        )
        g.add_metric([], int(ended is not None and not ended["ok"]))
        yield g
        g = GaugeMetricFamily("hetps_job_ended", "1 once the job ended (either way), else 0")
        g.add_metric([], int(ended is not None))
        yield g

        workers = s["workers"]
        c = CounterMetricFamily(
            "hetps_rounds", "rounds every worker has begun (the least of the workers' counts)"
        )
        c.add_metric(
            [],
            min((w["rounds"] for w in workers.values()), default=0)
            if len(workers) == s["expected"]["worker"]
            else 0,
        )
        yield c
        c = CounterMetricFamily(
            "hetps_worker_rounds", "rounds a worker has begun", labels=["worker"]
        )
        for r, w in sorted(workers.items()):
            c.add_metric([str(r)], w["rounds"])
        yield c
        for name, metric, doc in (
            ("round", "hetps_round_duration_seconds", "time of a worker's rounds"),
            ("push", "hetps_push_latency_seconds", "a push request, from the call to its answer"),
            ("pull", "hetps_pull_latency_seconds", "a pull request, from the call to its answer"),
        ):
            h = HistogramMetricFamily(metric, doc, labels=["worker"])
            for r, w in sorted(workers.items()):
                counts, total = w["hists"][name]
                buckets, acc = [], 0
                for bound, n in zip(BUCKETS, counts, strict=False):
                    acc += n
                    buckets.append((_le(bound), acc))
                buckets.append(("+Inf", acc + counts[-1]))
                h.add_metric([str(r)], buckets, total)
            yield h
        c = CounterMetricFamily(
            "hetps_link_bytes", "bytes on a worker-server link, by direction", labels=["src", "dst"]
        )
        for r, w in sorted(workers.items()):
            for srv, (sent, recv) in sorted(w["links"].items()):
                c.add_metric([_name("worker", r), _name("server", srv)], sent)
                c.add_metric([_name("server", srv), _name("worker", r)], recv)
        yield c
        servers = s.get("servers", {})
        c = CounterMetricFamily(
            "hetps_server_rounds", "rounds a server merged (every key slice's)", labels=["server"]
        )
        o = CounterMetricFamily(
            "hetps_server_optimizer_seconds",
            "seconds a server's optimizer took",
            labels=["server"],
        )
        b = CounterMetricFamily(
            "hetps_server_bytes",
            "bytes on a server's links to the workers, by direction (from the server's counters)",
            labels=["server", "direction"],
        )
        g = GaugeMetricFamily(
            "hetps_server_replicas", "copies of every key the job keeps (HETPS_REPLICAS)",
            labels=["server"],
        )  # fmt: skip
        for r, v in sorted(servers.items()):
            c.add_metric([str(r)], v["rounds"])
            o.add_metric([str(r)], v["opt_s"])
            b.add_metric([str(r), "out"], sum(x[0] for x in v["links"].values()))
            b.add_metric([str(r), "in"], sum(x[1] for x in v["links"].values()))
            g.add_metric([str(r)], v["replicas"])
        yield from (c, o, b, g)
        c = CounterMetricFamily(
            "hetps_metrics_reports", "metrics reports taken, by worker", labels=["worker"]
        )
        for r, w in sorted(workers.items()):
            c.add_metric([str(r)], w["reports"])
        yield c
        c = CounterMetricFamily(
            "hetps_metrics_reports_refused", "metrics reports refused (malformed or out of order)"
        )
        c.add_metric([], s["refused"])
        yield c
        plan = s["plan"]
        if plan is not None:
            g = GaugeMetricFamily(
                "hetps_plan_share_ratio",
                "the load plan's share of the elements per server (0 to 1)",
                labels=["server"],
            )
            for srv, share in enumerate(plan["shares"]):
                g.add_metric([str(srv)], share)
            yield g
            g = GaugeMetricFamily("hetps_plan_epoch", "plans adopted so far")
            g.add_metric([], plan["epoch"])
            yield g
        es = s["esync"]
        if es is not None:
            g = GaugeMetricFamily("hetps_esync_round", "ESync's current round (0: none yet)")
            g.add_metric([], es["round"])
            yield g
            g = GaugeMetricFamily(
                "hetps_esync_round_local_steps",
                "local steps a worker reported in ESync's current round",
                labels=["worker"],
            )
            for w, n in enumerate(es["steps"]):
                g.add_metric([str(w)], n)
            yield g
            c = CounterMetricFamily(
                "hetps_esync_local_steps",
                "local steps a worker reported to ESync, all rounds",
                labels=["worker"],
            )
            for w, n in enumerate(es["total"]):
                c.add_metric([str(w)], n)
            yield c


def _name(role: str, rank: int) -> str:
    return f"{role}{rank}"


def _le(bound: float) -> str:
    return repr(float(bound))
