"""The Prometheus alert rules and the Grafana dashboard shipped in hetps/metrics/monitoring:
promtool checks the rules and runs their unit tests (each alert fires on the series that
should fire it, and not before); every query of the dashboard is valid PromQL (promtool checks
it as a recording rule) and every hetps metric the rules and the dashboard name is one the
scheduler's endpoint exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from importlib import resources
from types import SimpleNamespace

import pytest

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="needs promtool (Debian's prometheus package: apt-get install prometheus)",
)
HERE = resources.files("hetps.metrics") / "monitoring"


def _exported_names() -> set[str]:
    """Every metric family the endpoint serves for a job with a plan and ESync."""
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from hetps.metrics.live import LiveMetrics
    from hetps.metrics.prom import Collector

    node = SimpleNamespace(role="worker", rank=0, describe=lambda: "worker 0")
    nodes = {1: SimpleNamespace(role="server", rank=0, describe=lambda: "server 0"), 2: node}
    started = time.monotonic()
    sched = SimpleNamespace(
        cfg=SimpleNamespace(num_server=2, num_worker=1, root_uri="127.0.0.1"),
        node_info=nodes.get, reply=lambda *a: None,
        membership=lambda: {
            "nodes": nodes, "dead": {}, "finished": {}, "last_seen": {}, "recoveries": {2: 1},
            "failovers": [], "left": {}, "rejoined": {}, "late_after": 0.0,
            "uptime": time.monotonic() - started, "expected": {"server": 2, "worker": 1},
        },
    )  # fmt: skip
    planner = SimpleNamespace(plan_shares=lambda: {"epoch": 1, "shares": [0.75, 0.25]})
    esync = SimpleNamespace(progress=lambda: {"round": 1, "steps": [2], "total": [2]})
    live = LiveMetrics(sched, planner, esync)
    body = {"seq": 1, "t": 1.0, "rounds": 1, "links": [[0, 1, 1]],
            "h": {n: [[1] + [0] * 17, 0.1] for n in ("push", "pull", "round")}}  # fmt: skip
    live.handle(sched, SimpleNamespace(sender=2, req=0, body=body))
    server = {"seq": 1, "t": 1.0, "links": [[0, 1, 1]],
              "server": {"rounds": 1, "opt_s": 0.1, "replicas": 1}}  # fmt: skip
    live.handle(sched, SimpleNamespace(sender=1, req=0, body=server))
    assert live.refused == 0
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector(live))
    text = generate_latest(registry).decode()
    return {x.name for f in text_string_to_metric_families(text) for x in f.samples}


def _named(text: str) -> set[str]:
    return set(re.findall(r"\bhetps_[a-z_]+", text))


def _queries() -> list[str]:
    dash = json.loads((HERE / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    # the job picker: label_values(METRIC, exported_job)
    definition = dash["templating"]["list"][1]["definition"]
    exprs.append(re.fullmatch(r"label_values\((\w+), exported_job\)", definition).group(1))
    return exprs


def test_the_rules_and_the_dashboard_name_only_metrics_the_endpoint_exports():
    exported = _exported_names()
    rules = (HERE / "alerts.yml").read_text()
    queries = _queries()
    assert len(queries) >= 12
    for name in _named(rules) | _named("\n".join(queries)):
        assert name in exported, f"{name}: not a metric the scheduler serves"


@needs_promtool
def test_promtool_checks_the_rules_and_runs_their_tests(tmp_path):
    for f in ("alerts.yml", "alerts_test.yml"):
        (tmp_path / f).write_text((HERE / f).read_text())
    res = subprocess.run(
        [PROMTOOL, "check", "rules", "alerts.yml"], cwd=tmp_path, capture_output=True, text=True
    )
    assert res.returncode == 0 and "6 rules found" in res.stdout, res.stdout + res.stderr
    res = subprocess.run(
        [PROMTOOL, "test", "rules", "alerts_test.yml"], cwd=tmp_path, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stdout + res.stderr


@needs_promtool
def test_every_dashboard_query_is_valid_promql(tmp_path):
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"hetps:panel{i}", "expr": q.replace("$job_id", ".*")}
                    for i, q in enumerate(_queries())
                ],
            }
        ]
    }
    path = tmp_path / "panels.yml"
    path.write_text(json.dumps(rules))  # JSON is YAML
    res = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
