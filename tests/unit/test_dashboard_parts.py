"""The dashboard's parts without a job: the worker's timeline (phase spans and bytes per round,
bounded), the scheduler's checks of it (a hostile report is refused and changes nothing), the
node states and events the page shows, the HTTP endpoint's routes and headers, and the report
file built from a run directory (self-contained, escaped, bounded)."""

from __future__ import annotations

import json
import math
import re
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest

from hetps.metrics import dashboard
from hetps.metrics.live import LiveMetrics
from hetps.metrics.records import RunWriter, run_meta
from hetps.metrics.report import build_report, cmd_report, report_data
from hetps.metrics.reports import (
    NBUCKETS,
    TL_KEEP,
    TL_ROUNDS,
    TL_SPANS,
    ReportError,
    WorkerMeter,
    WorkerTotals,
    parse_report,
)
from hetps.metrics.spans import Spans


def _meter(links):
    return WorkerMeter(3600, lambda body: None, lambda: dict(links))


def test_a_round_s_spans_reach_the_meter_in_unix_time_with_the_bytes_it_carried():
    links = {0: (1000, 500), 1: (10, 10)}
    meter = _meter(links)
    try:
        spans = Spans(run_start=time.time() - 5)
        got = []
        spans.sink = got.append
        now = time.perf_counter()
        spans.add("push", now - 0.001, now)
        spans.add("compute", now - 0.003, now - 0.001)
        spans.take()
        (round_spans,) = got
        assert [s[0] for s in round_spans] == ["compute", "push"]
        assert all(abs(s[1] - time.time()) < 5 for s in round_spans)  # unix time, not run time
        meter.pushed("w")
        meter.add_round(round_spans)
        links[0] = (1600, 900)
        meter.pushed("w")
        meter.add_round([("pull", time.time(), 0.002)])
        body = meter.report()
        assert body["tl"][0][0] == 1 and body["tl"][1][0] == 2
        assert body["tl"][0][2] == [[0, 1000, 500], [1, 10, 10]]
        assert body["tl"][1][2] == [[0, 600, 400], [1, 0, 0]]  # what the round carried
        assert "tl" not in meter.report()  # shipped once
        for _ in range(TL_ROUNDS + 5):
            meter.add_round([("compute", time.time(), 0.001)] * (TL_SPANS + 3))
        body = meter.report()
        assert len(body["tl"]) == TL_ROUNDS  # the newest only
        assert all(len(r[1]) == TL_SPANS for r in body["tl"])
        rep = parse_report(body, num_servers=2)  # what a worker sends passes the checks
        assert len(rep["tl"]) == TL_ROUNDS
    finally:
        meter.close()


def _body(tl, seq=1):
    return {"seq": seq, "t": float(seq), "rounds": 5, "links": [], "tl": tl}


def _round(n, spans=None, links=None):
    return [n, spans if spans is not None else [["push", 1.7e9, 0.001]], links or [[0, 1, 2]]]


@pytest.mark.parametrize(
    "tl, says",
    [
        ("x", "'tl' must be a list"),
        ([_round(i + 1) for i in range(TL_ROUNDS + 1)], "at most"),
        ([[1, [], []], [1, [], []]], "must increase"),
        ([[0, [], []]], "round number"),
        ([[1, "spans", []]], "at most"),
        ([_round(1, [["push", 1.0, 0.1]] * (TL_SPANS + 1))], "at most"),
        ([_round(1, [["<script>", 1.0, 0.1]])], "phase"),
        ([_round(1, [["x" * 17, 1.0, 0.1]])], "phase"),
        ([_round(1, [[7, 1.0, 0.1]])], "phase"),
        ([_round(1, [["push", float("nan"), 0.1]])], "start"),
        ([_round(1, [["push", 1.0, 1e9]])], "length"),
        ([_round(1, [["push", 1.0]])], "[phase, start, seconds]"),
        ([_round(1, links=[[5, 1, 1]])], "server rank"),
        ([_round(1, links=[[0, -1, 1]])], "bytes sent"),
        ([_round(1, links=[[0, 1, 2]] * 3)], "at most 2 rows"),
        ([[1, [], [], 4]], "[round, spans, links]"),
    ],
)
def test_a_hostile_timeline_is_refused_with_its_reason(tl, says):
    with pytest.raises(ReportError, match=None) as err:
        parse_report(_body(tl), num_servers=2)
    assert says in str(err.value)


def test_the_scheduler_keeps_the_newest_rounds_and_ignores_repeats():
    w = WorkerTotals()
    w.apply(parse_report(_body([_round(i) for i in range(1, 8)]), 2))
    w.apply(parse_report(_body([_round(3), _round(8)], seq=2), 2))  # 3 again: not kept twice
    assert [r[0] for r in w.timeline] == list(range(1, 9))
    seq = 3
    for start in range(9, 9 + 3 * TL_KEEP, TL_ROUNDS):
        w.apply(parse_report(_body([_round(start + i) for i in range(TL_ROUNDS)], seq=seq), 2))
        seq += 1
    assert len(w.timeline) == TL_KEEP  # bounded
    assert [r[0] for r in w.timeline] == sorted(r[0] for r in w.timeline)


def _node(role, rank):
    return SimpleNamespace(role=role, rank=rank, describe=lambda: f"{role} {rank}")


def _snap(**kw):
    snap = {
        "nodes": {1: _node("server", 0), 2: _node("server", 1), 3: _node("worker", 0),
                  4: _node("worker", 1), 5: _node("worker", 2)},
        "dead": {}, "finished": {}, "late": [], "recoveries": {}, "failovers": [], "left": {},
        "rejoined": {}, "uptime": 1.0,
    }  # fmt: skip
    snap.update(kw)
    return snap


def test_node_states_and_events_name_every_change_once():
    ev = dashboard.Events()
    ev.observe(_snap())
    assert ev.list() == []  # every node alive from the start: nothing to say
    states = {r["node"]: r["state"] for r in dashboard.node_states(_snap())}
    assert set(states.values()) == {"alive"}
    bad = _snap(
        dead={1: "server 0 stopped answering", 4: "worker 1 killed", 5: "worker 2 exited"},
        failovers=[(1, 2)],
        left={5: "exited 1"},
        late=[3],
        recoveries={2: 1},
        uptime=2.5,
    )
    rows = {r["node"]: r for r in dashboard.node_states(bad)}
    assert rows["server0"]["state"] == "taken over" and "by server1" in rows["server0"]["detail"]
    assert rows["worker1"]["state"] == "dead"
    assert rows["worker2"]["state"] == "left"
    assert rows["worker0"]["state"] == "late"
    ev.observe(bad)
    ev.observe(bad)  # seen again: no new events
    texts = [e["text"] for e in ev.list()]
    assert len(texts) == 5, texts
    assert any(t.startswith("server0 taken over") for t in texts)
    assert {e["kind"] for e in ev.list() if "worker1 dead" in e["text"]} == {"failure"}
    assert any("server1 heard from again" in t for t in texts)
    back = _snap(rejoined={1: 1}, finished={3: 9}, uptime=3.0)
    ev.observe(back)
    new = [e["text"] for e in ev.list()][5:]
    assert "server0 rejoined: admitted again 1 time(s)" in new and "worker0 finished" in new


class _Sched:
    def __init__(self):
        self.cfg = SimpleNamespace(num_server=1, num_worker=2, root_uri="127.0.0.1")
        self.nodes = {1: _node("server", 0), 2: _node("worker", 0), 3: _node("worker", 1)}
        self.dead, self.finished, self.last_seen = {}, {}, {}
        self.started = time.monotonic()

    def reply(self, msg, body):
        pass

    def node_info(self, nid):
        return self.nodes.get(nid)

    def membership(self):  # the scheduler's, for a job with nobody late, left or back
        return {
            "nodes": dict(self.nodes), "dead": dict(self.dead), "finished": dict(self.finished),
            "last_seen": dict(self.last_seen), "recoveries": {}, "failovers": [], "left": {},
            "rejoined": {}, "late_after": 0.0, "uptime": time.monotonic() - self.started,
            "expected": {"server": self.cfg.num_server, "worker": self.cfg.num_worker},
        }  # fmt: skip


def _get(url):
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.status, dict(resp.headers), resp.read()


def test_the_endpoint_serves_the_page_its_files_the_state_and_the_metrics():
    pytest.importorskip("prometheus_client")
    sched = _Sched()
    live = LiveMetrics(sched).serve(0, "127.0.0.1")
    try:
        msg = SimpleNamespace(sender=2, req=0, body=_body([_round(1), _round(2)]))
        live.handle(sched, msg)
        bad = SimpleNamespace(sender=3, req=0, body=_body([_round(2), _round(1)]))
        live.handle(sched, bad)  # refused: changes nothing
        base = live.base_url
        code, headers, page = _get(base)
        assert code == 200 and b'<canvas id="timeline"' in page
        assert "script-src 'self'" in headers["Content-Security-Policy"]  # nothing from elsewhere
        assert b"https://" not in page and b"http://" not in page
        for name in ("uPlot.iife.min.js", "timeline.js", "dashboard.js", "dashboard.css"):
            code, headers, body = _get(base + "static/" + name)
            assert code == 200 and len(body) > 500, name
        _, _, lic = _get(base + "static/uPlot.LICENSE")
        assert b"MIT" in lic or b"Permission is hereby granted" in lic
        _, headers, body = _get(base + "api/state")
        assert headers["Content-Type"] == "application/json"
        s = json.loads(body)
        assert s["refused"] == 1
        (w,) = s["workers"]
        assert w["rank"] == 0 and [r["round"] for r in w["timeline"]] == [1, 2]
        assert w["timeline"][0]["spans"] == [["push", 1.7e9, 0.001]]
        assert [n["state"] for n in s["nodes"]] == ["alive"] * 3
        _, _, prom = _get(base + "metrics")
        from prometheus_client.parser import text_string_to_metric_families

        samples = [x for f in text_string_to_metric_families(prom.decode()) for x in f.samples]
        assert samples and {x.labels.get("job") for x in samples} == {live.job}  # every series
        names = {x.name for x in samples}
        assert {"hetps_worker_rounds_total", "hetps_start_time_seconds"} <= names
        # counters and histograms say since when they count (the scheduler's start)
        created = {x.name: x.value for x in samples if x.name.endswith("_created")}
        assert {"hetps_worker_rounds_created", "hetps_push_latency_seconds_created"} <= set(created)
        start = next(x.value for x in samples if x.name == "hetps_start_time_seconds")
        assert set(created.values()) == {start} and abs(start - time.time()) < 60
        dead = {x.labels["node"]: x.value for x in samples if x.name == "hetps_node_dead"}
        assert dead == {"server0": 0, "worker0": 0, "worker1": 0}  # a series per node
        gone = {"hetps_uptime_seconds", "hetps_link_bytes_per_second", "hetps_round_seconds",
                "hetps_nodes_dead", "hetps_plan_share"}  # fmt: skip
        assert not names & gone
        for path in ("static/../live.py", "static/x.js", "nope", "static/"):
            with pytest.raises(urllib.error.HTTPError) as err:
                _get(base + path)
            assert err.value.code == 404, path
    finally:
        live.close()


def _run_dir(tmp_path, network="mlp", loss=0.5):
    run = tmp_path / "run"
    RunWriter(run, run_meta("sync", network, 2, 1, 8, started_at=1.7e9))
    for rank in (0, 1):
        with (run / f"worker-{rank}.jsonl").open("w") as f:
            for i in range(1, 31):
                rec = {
                    "iter": i, "rank": rank, "local_steps": 1, "t": 0.01 * i, "epoch": 0,
                    "samples": 8, "loss": loss,
                    "compute_s": 0.004, "push_s": 0.001, "wait_s": 0.003, "pull_s": 0.002,
                    "bytes_sent": 100, "bytes_recv": 90,
                    "spans": [["compute", 0.01 * i, 0.004], ["push", 0.01 * i + 0.004, 0.001]],
                }  # fmt: skip
                f.write(json.dumps(rec) + "\n")
    return run


def test_the_report_is_one_file_with_the_run_s_data_and_the_chart_library(tmp_path):
    run = _run_dir(tmp_path, network="</script><script>alert(1)</script>", loss=math.nan)
    (run / "live-final.json").write_text(
        json.dumps({"events": [{"kind": "failure", "uptime": 3.5, "text": "worker1 dead: killed"}]})
    )
    text = build_report(run)
    assert "<script>alert(1)" not in text  # a run's own text cannot end the data script
    assert text.count("<script") == 4  # the data, uPlot, the timeline, the report's code
    assert "uPlot" in text and "Permission is hereby granted" in text  # inlined, licence too
    data = report_data(__import__("hetps.metrics.runs", fromlist=["load_run"]).load_run(run))
    assert [w["rounds"] for w in data["workers"]] == [30, 30]
    assert data["workers"][0]["phase_ms"]["compute"] == pytest.approx(4.0)
    assert data["workers"][0]["series"][0][3] is None  # NaN loss: JSON holds no NaN
    assert any("worker1 dead" in f for f in data["failures"])
    assert any("run end" in f for f in data["failures"])  # run.json says no end


def test_hetps_report_names_a_directory_that_is_no_run(tmp_path, capsys):
    args = SimpleNamespace(run=str(tmp_path), output=None)
    assert cmd_report(args) == 2
    assert "no run.json here" in capsys.readouterr().err
    run = _run_dir(tmp_path)
    assert cmd_report(SimpleNamespace(run=str(run), output=None)) == 0
    assert (run / "report.html").is_file()
    assert f"report: {run / 'report.html'}" in capsys.readouterr().out


def test_after_the_job_the_last_state_is_saved_and_a_last_scrape_reads_it(tmp_path):
    pytest.importorskip("prometheus_client")
    import threading

    run = _run_dir(tmp_path)
    sched = _Sched()
    live = LiveMetrics(sched).serve(0, "127.0.0.1")
    RunWriter.reopen(run).update(live_job=live.job)  # (rank 0's WorkerMeter.bind_run)
    try:
        body = dict(_body([_round(1)]), run=str(run))
        live.handle(sched, SimpleNamespace(sender=2, req=0, body=body))
        _get(live.url)
        _get(live.url)  # a scraper watches: the endpoint will wait for its next scrape
        sched.finished[2] = 1
        live.scrapes.gap = 1000.0  # a scraper every 1000 s: the endpoint waits (60 s at most)
        out = []
        t = threading.Thread(target=lambda: out.append(dashboard.finish_job(live)))
        t.start()
        deadline = time.monotonic() + 30
        while not (run / "live-final.json").exists():
            assert time.monotonic() < deadline, "no live-final.json"
            time.sleep(0.01)  # polls for the file finish_job writes first
        live.scrapes.gap = 1000.0  # a scraper every 1000 s: the endpoint waits (60 s at most)
        t.join(timeout=1.0)
        assert t.is_alive()  # still waiting for the last scrape
        _, _, prom = _get(live.url)  # the endpoint still answers, with the final values
        t.join(timeout=30)
        assert not t.is_alive() and out == [str(run / "live-final.json")]
        assert b"hetps_workers_finished" in prom
        final = json.loads((run / "live-final.json").read_text())
        assert final["ended"] is True and final["finished"] == 1
        assert [n["state"] for n in final["nodes"]] == ["alive", "finished", "alive"]
    finally:
        live.close()


def test_a_run_named_by_a_worker_must_be_a_run_directory_of_this_job(tmp_path):
    """A worker's report names a folder; the scheduler writes only into this job's run
    directory (its run.json names the job), never into another run's or a plain folder."""
    pytest.importorskip("prometheus_client")
    sched = _Sched()
    live = LiveMetrics(sched)
    (tmp_path / "victim").mkdir()
    other = _run_dir(tmp_path / "other")  # another job's run: its run.json names no live_job
    elsewhere = _run_dir(tmp_path / "elsewhere")
    RunWriter.reopen(elsewhere).update(live_job="20260101-000000-beef")  # another job's id
    (tmp_path / "link").symlink_to(other)
    victims = (tmp_path / "victim", tmp_path / "nowhere", other, elsewhere, tmp_path / "link")
    for run in victims:
        live.workers.clear()
        live.handle(sched, SimpleNamespace(sender=2, req=0, body=dict(_body([]), run=str(run))))
        assert dashboard.finish_job(live) is None  # nobody scraped: no wait either
    for run in victims:
        assert not (run / "live-final.json").exists(), run
    mine = _run_dir(tmp_path / "mine")
    RunWriter.reopen(mine).update(live_job=live.job)
    live.workers.clear()
    live.handle(sched, SimpleNamespace(sender=2, req=0, body=dict(_body([]), run=str(mine))))
    assert dashboard.finish_job(live) == str(mine / "live-final.json")
    assert json.loads((mine / "live-final.json").read_text())["outcome"]["ok"] is True
    for bad in ("", "x" * 5000, "a\x00b", 7):
        with pytest.raises(ReportError, match="'run'"):
            parse_report(dict(_body([]), run=bad), 1)


def _server_body(seq=1, rounds=10, opt_s=0.5, links=None, **server):
    return {"seq": seq, "t": float(seq), "links": links if links is not None else [[0, 100, 200]],
            "server": {"rounds": rounds, "opt_s": opt_s, "replicas": 1, **server}}  # fmt: skip


@pytest.mark.parametrize(
    "body, says",
    [
        ({"seq": 1, "t": 1.0}, "'server' map"),
        (_server_body(rounds=-1), "'server.rounds'"),
        (_server_body(opt_s=float("inf")), "'server.opt_s'"),
        (_server_body(replicas=0), "'server.replicas'"),
        (_server_body(links=[[2, 1, 1]]), "worker rank"),
        (_server_body(links=[[0, 1, 1], [0, 1, 1]]), "worker 0 twice"),
        (_server_body(links=[[0, 1, 1], [1, 1, 1], [1, 2, 2]]), "at most 2"),
        (_server_body(links=[[0, 1]]), "[worker rank, sent, received]"),
    ],
)
def test_a_hostile_server_report_is_refused_with_its_reason(body, says):
    from hetps.metrics.server_meter import parse_server_report

    with pytest.raises(ReportError) as err:
        parse_server_report(body, num_workers=2)
    assert says in str(err.value)


def test_servers_report_themselves_and_the_endpoint_exports_them():
    pytest.importorskip("prometheus_client")
    from hetps.metrics.prom import Collector

    sched = _Sched()
    live = LiveMetrics(sched)
    srv = SimpleNamespace(sender=1, req=0, body=_server_body())
    live.handle(sched, srv)
    back = SimpleNamespace(sender=1, req=0, body=_server_body(seq=2, rounds=9))
    live.handle(sched, back)  # rounds going back: refused, nothing changed
    assert live.refused == 1 and live.servers[0].rounds == 10
    s = dashboard.state(live)
    assert s["servers"] == [{"rank": 0, "rounds": 10, "opt_s": 0.5, "replicas": 1, "reports": 1,
                             "bytes_out": 100, "bytes_in": 200}]  # fmt: skip
    text = "".join(f"{f.name} {x.labels} {x.value}\n" for f in Collector(live).collect()
                   for x in f.samples)  # fmt: skip
    fams = {f.name: f for f in Collector(live).collect()}
    assert fams["hetps_server_rounds"].samples[0].value == 10, text
    assert {x.labels["direction"]: x.value for x in fams["hetps_server_bytes"].samples
            if x.name.endswith("_total")} == {"out": 100, "in": 200}  # fmt: skip


def test_every_exported_family_carries_the_snapshot_s_values():
    """Each family's samples from a snapshot with a distinct number everywhere: link bytes
    by direction, cumulative histogram buckets, the least worker's rounds, servers, plan and
    ESync; every sample labelled with the job."""
    pytest.importorskip("prometheus_client")
    from hetps.metrics.prom import Collector

    node = SimpleNamespace
    counts = [3, 0, 2] + [0] * (NBUCKETS - 4) + [1]  # 3 fast, 2 in the third bucket, 1 beyond
    worker = {
        "rounds": 7,
        "reports": 4,
        "links": {0: (11, 22), 1: (33, 44)},
        "hists": {"round": (counts, 9.5), "push": (counts, 1.5), "pull": (counts, 2.5)},
    }
    snap = {
        "start_time": 1700.5, "expected": {"server": 2, "worker": 2}, "dead": {12},
        "nodes": {9: node(role="server", rank=0), 11: node(role="worker", rank=0),
                  12: node(role="worker", rank=1)},
        "late": [9], "recoveries": {11: 2, 99: 5}, "finished": [11], "ended": {"ok": False},
        "workers": {0: worker, 1: {**worker, "rounds": 5, "reports": 6, "links": {}}},
        "servers": {0: {"rounds": 8, "opt_s": 0.25, "replicas": 2, "links": {0: (5, 6), 1: (7, 8)}}},
        "refused": 3, "plan": {"shares": [0.25, 0.75], "epoch": 4},
        "esync": {"round": 6, "steps": [1, 2], "total": [10, 20]},
    }  # fmt: skip
    live = SimpleNamespace(job="j1", snapshot=lambda: snap)
    got = {}
    for family in Collector(live).collect():
        for x in family.samples:
            assert x.labels.pop("job") == "j1", x
            got[(x.name, tuple(sorted(x.labels.items())))] = x.value
    buckets = {"0.0001": 3, "0.00025": 3, "0.0005": 5, "+Inf": 6}
    want = {
        ("hetps_start_time_seconds", ()): 1700.5,
        ("hetps_nodes_expected", (("role", "worker"),)): 2,
        ("hetps_nodes_registered", (("role", "server"),)): 1,
        ("hetps_nodes_registered", (("role", "worker"),)): 2,
        ("hetps_node_dead", (("node", "worker1"), ("rank", "1"), ("role", "worker"))): 1,
        ("hetps_node_dead", (("node", "worker0"), ("rank", "0"), ("role", "worker"))): 0,
        ("hetps_nodes_late", ()): 1,
        ("hetps_node_recoveries_total", (("node", "worker0"),)): 2,
        ("hetps_workers_finished", ()): 1,
        ("hetps_job_failed", ()): 1,
        ("hetps_job_ended", ()): 1,
        ("hetps_rounds_total", ()): 5,
        ("hetps_worker_rounds_total", (("worker", "1"),)): 5,
        ("hetps_link_bytes_total", (("dst", "server1"), ("src", "worker0"))): 33,
        ("hetps_link_bytes_total", (("dst", "worker0"), ("src", "server1"))): 44,
        ("hetps_server_rounds_total", (("server", "0"),)): 8,
        ("hetps_server_optimizer_seconds_total", (("server", "0"),)): 0.25,
        ("hetps_server_bytes_total", (("direction", "out"), ("server", "0"))): 12,
        ("hetps_server_bytes_total", (("direction", "in"), ("server", "0"))): 14,
        ("hetps_server_replicas", (("server", "0"),)): 2,
        ("hetps_metrics_reports_total", (("worker", "1"),)): 6,
        ("hetps_metrics_reports_refused_total", ()): 3,
        ("hetps_plan_share_ratio", (("server", "1"),)): 0.75,
        ("hetps_plan_epoch", ()): 4,
        ("hetps_esync_round", ()): 6,
        ("hetps_esync_round_local_steps", (("worker", "1"),)): 2,
        ("hetps_esync_local_steps_total", (("worker", "1"),)): 20,
        ("hetps_pull_latency_seconds_count", (("worker", "0"),)): 6,
        ("hetps_pull_latency_seconds_sum", (("worker", "0"),)): 2.5,
        **{("hetps_round_duration_seconds_bucket", (("le", le), ("worker", "1"))): n
           for le, n in buckets.items()},
    }  # fmt: skip
    assert {k: got.get(k) for k in want} == want
    assert ("hetps_node_recoveries_total", (("node", "worker99"),)) not in got  # not a node


def test_a_thousand_idle_connections_never_keep_a_page_out(monkeypatch):
    """1,000 connections that send nothing (held open by this test) cost the scheduler no
    thread: the oldest beyond MAX_CONNECTIONS are closed to make room, every page request
    in between and after is answered, and a connection that stays silent is closed after
    its request timeout."""
    import socket
    import threading as th

    pytest.importorskip("prometheus_client")
    from hetps.metrics import httpserve

    monkeypatch.setattr(httpserve, "REQUEST_TIMEOUT_S", 3.0)
    sched = _Sched()
    live = LiveMetrics(sched).serve(0, "127.0.0.1")
    before = th.active_count()
    idle: list[socket.socket] = []
    try:
        answered = 0
        for i in range(1000):
            idle.append(socket.create_connection(("127.0.0.1", live.port)))
            if i % 100 == 99:  # a page's poll between them
                code, _, body = _get(live.base_url + "api/state")
                answered += code == 200 and b'"workers"' in body
        for _ in range(15):  # with all of them held
            code, _, page = _get(live.base_url)
            answered += code == 200 and b"<canvas" in page
        assert answered == 25
        # no thread per connection; the oldest were closed by the server, not by us
        assert th.active_count() <= before + httpserve.ANSWER_THREADS
        idle[0].settimeout(5)
        assert idle[0].recv(1) == b""
        assert live._httpd.evicted >= 1000 - httpserve.MAX_CONNECTIONS
        # the newest, still silent, is closed once its request timeout has passed
        idle[-1].settimeout(10)
        t0 = time.monotonic()
        assert idle[-1].recv(1) == b""
        assert time.monotonic() - t0 > 1.0
        # a head too big is refused with its status; another method too
        with socket.create_connection(("127.0.0.1", live.port)) as sk:
            sk.sendall(b"GET /" + b"x" * 9000 + b" HTTP/1.1\r\n\r\n")
            assert sk.recv(100).startswith(b"HTTP/1.1 431")
        with socket.create_connection(("127.0.0.1", live.port)) as sk:
            sk.sendall(b"POST /api/state HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
            assert sk.recv(100).startswith(b"HTTP/1.1 405")
    finally:
        for sk in idle:
            sk.close()
        live.close()


def test_after_a_failure_the_endpoint_waits_for_the_page_to_read_how_the_job_ended():
    """A page polling /api/state is answered once more after the end (at most the gap
    between its last two polls and a second): it reads ``ended`` and the failure, with no
    node address in any text."""
    import threading

    pytest.importorskip("prometheus_client")
    sched = _Sched()
    live = LiveMetrics(sched).serve(0, "127.0.0.1")
    try:
        _get(live.base_url + "api/state")
        _, _, first = _get(live.base_url + "api/state")  # a page polls
        assert json.loads(first)["ended"] is False and json.loads(first)["outcome"] is None
        sched.dead[3] = "worker rank 1 (node 3, 10.1.2.3:4242) was killed by signal 9"
        live.pages.gap = 1000.0  # a page polling every 1000 s: the endpoint waits (60 s at most)
        out = []
        t = threading.Thread(target=lambda: out.append(dashboard.finish_job(live, code=1)))
        t.start()
        t.join(timeout=1.0)
        assert t.is_alive()  # waiting for the page
        _, _, body = _get(live.base_url + "api/state")
        t.join(timeout=30)
        assert not t.is_alive() and out == [None]  # (no run directory named)
        s = json.loads(body)
        assert s["ended"] is True and s["outcome"]["ok"] is False and s["outcome"]["code"] == 1
        assert s["outcome"]["text"] == (
            "failure (exit code 1): worker1 dead: worker rank 1 (node 3, <address>) was "
            "killed by signal 9"
        )
        assert "10.1.2.3" not in body.decode()
        assert [e["text"] for e in s["events"]][-1].startswith("worker1 dead: worker rank 1")
        _, _, prom = _get(live.url)
        assert b"hetps_job_failed{" in prom and b"hetps_job_ended{" in prom
        samples = {
            line.split("{")[0]: line.rsplit(" ", 1)[1]
            for line in prom.decode().splitlines()
            if line.startswith(("hetps_job_failed", "hetps_job_ended"))
        }
        assert samples == {"hetps_job_failed": "1.0", "hetps_job_ended": "1.0"}
    finally:
        live.close()


def test_a_worker_not_heard_from_has_no_rates_and_every_address_is_scrubbed():
    from hetps.metrics.sysinfo import scrub

    sched = _Sched()
    sched.cfg.metrics_interval = 0.2
    live = LiveMetrics(sched)
    for sender, links in ((2, [[0, 100, 50]]), (3, [[0, 10, 5]])):
        live.handle(sched, SimpleNamespace(sender=sender, req=0, body=dict(_body([]), links=links)))
        body = dict(_body([], seq=2), links=[[0, 300, 150]], t=3.0)
        live.handle(sched, SimpleNamespace(sender=sender, req=0, body=body))
    rates = {w["rank"]: w["rates"] for w in dashboard.state(live)["workers"]}
    assert rates[0] == [[0, 100.0, 50.0]] and rates[1] == [[0, 145.0, 72.5]]
    live.workers[1].heard -= dashboard.SILENT_S + 0.1  # no report for that long
    sched.finished[2] = 1  # and worker 0 finished
    rates = {w["rank"]: w["rates"] for w in dashboard.state(live)["workers"]}
    assert rates == {0: None, 1: None}
    for text, want in (
        ("at 127.0.0.1:5000 and [::1]:80, tcp://10.0.0.1:9 or node-3.svc:9100; 10.2.3.4",
         "at <address> and <address>, <address> or <address>; <address>"),
        ("round 12: loss 0.5 at 12:30", "round 12: loss 0.5 at 12:30"),
    ):  # fmt: skip
        assert scrub(text) == want


def test_a_report_s_machine_lines_and_values_are_checked_and_kept():
    from hetps.metrics.reports import M_NAMES

    ok = dict(
        _body([]),
        sys={"cpu": 12.5, "rss": 10_000_000, "nogpu": "no NVIDIA driver here"},
        log=["worker 0 step 1 at 127.0.0.1:5000"],
        m=[[1, {"loss": 0.5, "accuracy": 0.25}], [2, {"loss": 0.4}]],
    )
    rep = parse_report(ok, 1)
    assert rep["sys"] == {"cpu": 12.5, "rss": 10_000_000, "nogpu": "no NVIDIA driver here"}
    assert rep["log"] == ["worker 0 step 1 at <address>"]  # a node's own scrub is not trusted
    totals = WorkerTotals()
    totals.apply(rep)
    assert {n: list(v) for n, v in totals.metrics.items()} == {
        "loss": [(1, 0.5), (2, 0.4)], "accuracy": [(1, 0.25)],
    }  # fmt: skip
    for bad, says in (
        ({"sys": {"cpu": -1}}, "'sys.cpu'"),
        ({"sys": {"gpu": [[101, 1, 2]]}}, "utilisation"),
        ({"sys": {"disk": 1}}, "'sys' must be a map"),
        ({"log": ["x" * 301]}, "'log' line"),
        ({"log": ["a\x1b[2Jb"]}, "'log' line"),
        ({"log": ["x"] * 21}, "at most 20 lines"),
        ({"m": [[1, {"loss": float("nan")}]]}, "only finite"),
        ({"m": [[1, {"1oss": 1.0}]]}, "metric name '1oss'"),
        ({"m": [[1, {f"v{i}": 1.0 for i in range(M_NAMES + 1)}]]}, "at most 16"),
        ({"m": [[-1, {"loss": 1.0}]]}, "'m' step"),
    ):
        with pytest.raises(ReportError, match=re.escape(says)):
            parse_report(dict(_body([]), **bad), 1)


def test_log_metrics_reaches_the_meter_and_bad_values_are_refused():
    from hetps.metrics import reports
    from hetps.torch import log_metrics

    sent = []
    meter = WorkerMeter(3600, sent.append, lambda: {})
    try:
        assert log_metrics(loss=0.25, accuracy=1) is True
        assert log_metrics(step=7, val_loss=0.5) is True
        for bad, says in (
            ({"loss": "x"}, "must be a number"),
            ({"loss": float("inf")}, "only finite"),
            ({"2x": 1.0}, "metric name '2x'"),
        ):
            with pytest.raises(ValueError, match=re.escape(says)):
                log_metrics(**bad)
        body = meter.report()
        assert body["m"] == [[0, {"loss": 0.25, "accuracy": 1.0}], [7, {"val_loss": 0.5}]]
        assert "rss" in body["sys"] and ("gpu" in body["sys"] or "nogpu" in body["sys"])
    finally:
        meter.close()
    assert reports.current_meter() is None
    assert log_metrics(loss=1.0) is False  # no meter: nothing to show it on
    with pytest.raises(ValueError, match="must be a number"):
        log_metrics(loss=None)  # bad input is an error with or without the endpoint


def test_without_roundlog_each_round_s_push_and_pull_phases_reach_the_timeline():
    meter = WorkerMeter(3600, lambda body: None, lambda: {0: (10, 20)})
    try:
        for _ in range(3):  # a round: push 2 keys (requests answered), then pull them
            done = []
            for key in ("a", "b"):  # (the store counts the push, then sends its request)
                meter.pushed(key)
                done.append(meter.timed(True, None))
            for d in done:
                d(None)
            pulls = [meter.timed(False, None) for _ in range(2)]
            for d in pulls:
                d(None)
        meter.pushed("a")  # round 4 begins: round 3 is complete
        tl = meter.report()["tl"]
    finally:
        meter.close()
    assert [r[0] for r in tl] == [1, 2, 3]
    for _, spans, _links in tl:
        names = [s[0] for s in spans]
        assert names[-2:] == ["push", "pull"] and all(s[2] >= 0 for s in spans)
        push, pull = spans[-2], spans[-1]
        assert push[1] <= pull[1] and abs(push[1] - time.time()) < 60
    assert [s[0] for s in tl[1][1]] == ["compute", "push", "pull"]  # between rounds: compute
    # a RoundLog's own spans take over: the requests no longer make rounds
    meter = WorkerMeter(3600, lambda body: None, lambda: {})
    try:
        meter.add_round([("compute", 1.7e9, 0.01)])
        meter.pushed("a")
        meter.pushed("a")
        assert [r[1] for r in meter.report()["tl"]] == [[["compute", 1.7e9, 0.01]]]
    finally:
        meter.close()
