"""Live metrics' pure parts: the worker's histograms and reports, the scheduler's checks of a
report (a broken or hostile worker's report is refused and changes nothing), `hetps top`'s
frame from two scrapes, and the endpoint's address rule."""

from __future__ import annotations

import pytest

from hetps.config import ConfigError, node_config_from_env
from hetps.metrics.reports import (
    BUCKETS,
    NBUCKETS,
    Histogram,
    ReportError,
    WorkerMeter,
    WorkerTotals,
    parse_report,
)
from hetps.metrics.top import parse, view


def test_a_value_on_a_bucket_bound_counts_in_that_bucket():
    h = Histogram()
    for v in (BUCKETS[0], BUCKETS[0] * 1.01, BUCKETS[-1], BUCKETS[-1] * 2):
        h.observe(v)
    assert h.counts[0] == 1 and h.counts[1] == 1
    assert h.counts[NBUCKETS - 2] == 1 and h.counts[NBUCKETS - 1] == 1
    assert sum(h.counts) == 4


def test_reports_ship_what_was_gained_since_the_last_one():
    sent = []
    meter = WorkerMeter(3600, sent.append, lambda: {0: (100, 50)})
    try:
        for _ in range(3):
            meter.pushed("a")
            meter.pushed("b")  # a second key of the same round: no new round
            meter.timed(True, None)(None)
        first = meter.report()
        meter.timed(False, None)(None)
        second = meter.report()
        third = meter.report()
    finally:
        meter.close()
    assert first["rounds"] == 3 and sum(first["h"]["push"][0]) == 3
    assert sum(first["h"]["round"][0]) == 2  # between the 3 round starts
    assert "pull" not in first["h"]
    assert set(second["h"]) == {"pull"} and sum(second["h"]["pull"][0]) == 1
    assert "h" not in third  # nothing new
    assert [r["seq"] for r in (first, second, third)] == [1, 2, 3]
    assert first["links"] == [[0, 100, 50]]
    assert sent and sent[-1]["seq"] == 4  # close() sends a last report
    for body in (first, second, third, sent[-1]):
        parse_report(body, num_servers=1)  # what a worker sends passes the scheduler's checks


def _good(**change):
    body = {
        "seq": 1,
        "t": 1.0,
        "rounds": 2,
        "round_s": 0.5,
        "links": [[0, 10, 20], [1, 0, 0]],
        "h": {"push": [[1] + [0] * (NBUCKETS - 1), 0.001]},
    }
    body.update(change)
    return body


@pytest.mark.parametrize(
    "body, says",
    [
        ([], "not a map"),
        (_good(seq=0), "'seq'"),
        (_good(seq=True), "'seq'"),
        (_good(t=float("nan")), "'t'"),
        (_good(t=-1), "'t'"),
        (_good(rounds="3"), "'rounds'"),
        (_good(rounds=1 << 60), "'rounds'"),
        (_good(round_s=float("inf")), "'round_s'"),
        (_good(links={"0": 1}), "'links'"),
        (_good(links=[[0, 1, 2]] * 3), "at most 2 rows"),
        (_good(links=[[0, 1, 2], [0, 1, 2]]), "twice"),
        (_good(links=[[2, 1, 2]]), "server rank"),
        (_good(links=[[0, -1, 2]]), "bytes sent"),
        (_good(links=[[0, 1]]), "[server rank, sent, received]"),
        (_good(h={"push": [[1] * 3, 0.0]}), f"{NBUCKETS} counts"),
        (_good(h={"evil": [[0] * NBUCKETS, 0.0]}), "keys among"),
        (_good(h={"pull": [[-1] + [0] * (NBUCKETS - 1), 0.0]}), "a count"),
        (_good(h={"pull": [[0] * NBUCKETS, -0.5]}), "the sum"),
        (_good(h={"pull": "x"}), "[counts, sum]"),
    ],
)
def test_a_malformed_report_is_refused_with_its_reason(body, says):
    with pytest.raises(ReportError, match=None) as err:
        parse_report(body, num_servers=2)
    assert says in str(err.value)


def test_a_report_out_of_order_is_refused_and_changes_nothing():
    w = WorkerTotals()
    w.apply(parse_report(_good(), 2))
    before = (w.seq, w.rounds, dict(w.links), {k: (list(c), s) for k, (c, s) in w.hists.items()})
    for bad in (
        _good(),  # the same report again
        _good(seq=2, t=0.5),  # time went back
        _good(seq=2, t=2.0, rounds=1),  # rounds went back
        _good(seq=2, t=2.0, links=[[0, 5, 20]]),  # bytes went back
        _good(seq=2, t=2.0, h={"push": [[1 << 53] + [0] * (NBUCKETS - 1), 0.0]}),
    ):
        with pytest.raises(ReportError):
            w.apply(parse_report(bad, 2))
    after = (w.seq, w.rounds, dict(w.links), {k: (list(c), s) for k, (c, s) in w.hists.items()})
    assert after == before
    w.apply(parse_report(_good(seq=2, t=3.0, links=[[0, 30, 20]]), 2))
    assert w.rates[0] == (10.0, 0.0)  # 20 more bytes sent in 2 s
    assert w.hists["push"][0][0] == 2


SCRAPE = """
hetps_start_time_seconds{{job="j1"}} 1.7e9
hetps_rounds_total{{job="j1"}} {rounds}
hetps_worker_rounds_total{{job="j1",worker="0"}} {rounds}
hetps_worker_rounds_total{{job="j1",worker="1"}} {behind}
hetps_round_duration_seconds_count{{job="j1",worker="0"}} {rounds}
hetps_round_duration_seconds_sum{{job="j1",worker="0"}} {sum0}
hetps_round_duration_seconds_count{{job="j1",worker="1"}} {behind}
hetps_round_duration_seconds_sum{{job="j1",worker="1"}} {sum1}
hetps_push_latency_seconds_count{{job="j1",worker="0"}} 4
hetps_push_latency_seconds_sum{{job="j1",worker="0"}} 0.008
hetps_link_bytes_total{{job="j1",src="worker0",dst="server0"}} {bytes}
hetps_node_dead{{job="j1",node="server0",role="server",rank="0"}} 0
hetps_node_dead{{job="j1",node="server1",role="server",rank="1"}} 1
{esync}
"""


def _scrape(at, rounds, behind, sum0, sum1, nbytes, esync=""):
    text = SCRAPE.format(
        rounds=rounds, behind=behind, sum0=sum0, sum1=sum1, bytes=nbytes, esync=esync
    )
    return parse(text, at=at)


def test_top_takes_rates_from_counters_and_names_the_slowest_worker():
    prev = _scrape(0.0, 20, 19, 2.0, 5.7, 5000)
    cur = _scrape(2.0, 30, 29, 3.0, 8.7, 7000)  # 2 s between the scrapes
    assert cur.job == "j1"  # the job's id labels every series; top shows one job
    v = view("http://x/metrics", cur, prev)
    assert v.rounds == 30 and v.rounds_per_s == pytest.approx(5.0)
    assert v.workers[0].rounds_per_s == pytest.approx(5.0)
    assert v.workers[0].push_ms == pytest.approx(2.0)
    assert v.workers[0].round_s == pytest.approx(0.1)  # the mean of the last 10 rounds
    assert v.workers[1].round_s == pytest.approx(0.3)
    assert v.slowest is not None and v.slowest.rank == 1  # rounds behind the others
    # bytes/s: rate() of the counter, nothing else
    assert [(r.src, r.dst, r.rate, r.total) for r in v.links] == [
        ("worker0", "server0", 1000.0, 7000.0)
    ]
    assert v.dead == ["server1"]
    assert view("http://x/metrics", cur).rounds_per_s is None  # one scrape: no rate


def test_top_names_esyncs_slow_worker_by_its_local_steps():
    """Under ESync (-m esync --slowdown 1,2) both workers take part in every round and the
    fast one's rounds last as long or longer (it does more local steps in them): the slow
    worker is the one with fewer steps."""
    steps = (
        'hetps_esync_local_steps_total{{job="j1",worker="0"}} {a}\n'
        'hetps_esync_local_steps_total{{job="j1",worker="1"}} {b}'
    )
    prev = _scrape(0.0, 20, 20, 2.2, 2.0, 0, steps.format(a=40, b=20))
    cur = _scrape(1.0, 30, 30, 3.3, 3.0, 0, steps.format(a=60, b=30))
    v = view("http://x/metrics", cur, prev)
    assert v.workers[0].round_s > v.workers[1].round_s  # the fast worker's longer rounds
    assert v.slowest is not None and v.slowest.rank == 1
    assert v.esync_steps == {0: 60, 1: 30}


def _env(**extra):
    env = {
        "DMLC_ROLE": "scheduler",
        "DMLC_PS_ROOT_URI": "127.0.0.1",
        "DMLC_PS_ROOT_PORT": "0",
        "DMLC_NUM_SERVER": "1",
        "DMLC_NUM_WORKER": "1",
    }
    env.update(extra)
    return env


def test_the_endpoint_binds_loopback_or_the_schedulers_own_address_only():
    cfg = node_config_from_env(_env(HETPS_METRICS_PORT="0"))
    assert cfg.metrics_port == 0 and cfg.metrics_host == "127.0.0.1"
    with pytest.raises(ConfigError, match="HETPS_METRICS_HOST='0.0.0.0'.*never binds every"):
        node_config_from_env(_env(HETPS_METRICS_PORT="0", HETPS_METRICS_HOST="0.0.0.0"))
    with pytest.raises(ConfigError, match="HETPS_METRICS_PORT=70000 is above 65535"):
        node_config_from_env(_env(HETPS_METRICS_PORT="70000"))


def test_train_hands_metrics_port_to_the_scheduler_not_to_its_workers(monkeypatch):
    import sys

    import hetps.launch.local as local
    from hetps.app import train
    from hetps.cli import build_parser

    argv = ["train", "--workers", "2", "--servers", "1", "--metrics-port", "0", "-m", "sync"]
    seen = {}

    def fake_run_cluster(spec, **kw):
        seen["spec"], seen["kw"] = spec, kw
        return 0

    monkeypatch.setattr(local, "run_cluster", fake_run_cluster)
    monkeypatch.setattr(sys, "argv", ["hetps", *argv])
    args = build_parser().parse_args(argv)
    assert train.launch_cluster(args) == 0
    assert seen["kw"]["metrics_port"] == 0
    assert "--metrics-port" not in seen["spec"].command


def test_launch_refuses_a_metrics_port_that_is_no_port():
    from hetps.launch.contract import LaunchSpec
    from hetps.launch.local import run_cluster

    with pytest.raises(SystemExit, match="--metrics-port 70000: give a TCP port"):
        run_cluster(LaunchSpec(1, 1, ["true"]), metrics_port=70000)
