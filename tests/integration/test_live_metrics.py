"""Live metrics of a real job: `hetps launch --metrics-port 0` runs 2 servers and 2 workers;
the test scrapes the scheduler's endpoint over HTTP while the job runs, checks the values
against what the workers did, drives `hetps top` in a pseudo-terminal and stops a worker
(SIGSTOP) to watch it turn late and come back.

The workers run ROUNDS rounds (rebalance, push, pull of one key; one ESync report in each of
the first ESYNC rounds) and then wait for a file the test writes once it has looked: the
numbers hold still while they are checked. No sleeps: every wait polls a condition with a
deadline.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from hetps.metrics.reports import BUCKETS
from hetps.metrics.top import parse
from security.lines import Lines

pexpect = pytest.importorskip("pexpect")
pytest.importorskip("prometheus_client")
pytest.importorskip("rich")

ROUNDS = 12
ESYNC = 3
ELEMS = 1000  # float32: 4000 bytes a push, one request (under the slice and chunk sizes)

SCRIPT = f"""
import os, time
import numpy as np
import hetps.kv
from hetps.esync.service import StateClient

kv = hetps.kv.create("dist_sync")
here = os.environ["LIVE_DIR"]
with open(os.path.join(here, f"pid{{kv.rank}}"), "w") as f:
    f.write(str(os.getpid()))
kv.init("w", np.zeros({ELEMS}, np.float32))
out = np.empty({ELEMS}, np.float32)
state = StateClient(kv.node)
for r in range(1, {ROUNDS} + 1):
    kv.rebalance()
    kv.push("w", np.ones({ELEMS}, np.float32))
    kv.pull("w", out=out)
    assert out[0] == 2, (r, out[0])  # the round's sum of two workers' ones (no optimizer)
    if r <= {ESYNC}:
        answer = state.report(r, 0.001, 0.001)
        assert "error" not in answer, answer
go = os.path.join(here, "go")
deadline = time.monotonic() + 120
while not os.path.exists(go):  # the test looks at the numbers meanwhile
    assert time.monotonic() < deadline, "the test never said go"
    time.sleep(0.05)
kv.close()
"""


def scrape(url: str):
    with urllib.request.urlopen(url, timeout=5) as resp:
        return parse(resp.read().decode())


def poll(url: str, ready, what: str, timeout: float = 60.0):
    """Scrape until ``ready(scrape)`` holds; the last scrape."""
    deadline = time.monotonic() + timeout
    while True:
        s = scrape(url)
        if ready(s):
            return s
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{what}: not seen within {timeout:g} s; last scrape:\n{s.samples}"
            )
        time.sleep(0.1)  # between scrapes (the condition is what is waited for)


class Job:
    def __init__(self, tmp: Path) -> None:
        self.dir = tmp
        script = tmp / "worker.py"
        script.write_text(SCRIPT)
        env = dict(os.environ)
        env.update(
            LIVE_DIR=str(tmp),
            HETPS_METRICS_INTERVAL="0.1",
            PS_HEARTBEAT_INTERVAL="0.2",
            PS_HEARTBEAT_TIMEOUT="60",
            HETPS_CONNECT_TIMEOUT="30",
            HETPS_SLICE_ELEMS=str(ELEMS),  # one slice: one request per push and per pull
            OMP_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hetps.cli", "launch", "-n", "2", "-s", "2",
             "--balance", "average", "--metrics-port", "0", "--", sys.executable, str(script)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip
        self.out = Lines(self.proc.stdout)
        self.url = self.out.wait(r"hetps metrics (http://\S+)", timeout=60).group(1)

    def pid(self, rank: int) -> int:
        return int((self.dir / f"pid{rank}").read_text())

    def finish(self) -> int:
        (self.dir / "go").touch()
        return self.proc.wait(timeout=60)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    j = Job(tmp_path_factory.mktemp("live"))
    try:
        # every test sees the job after its rounds (whichever runs first, or alone)
        poll(
            j.url,
            lambda s: (
                s.value("hetps_rounds_total") == ROUNDS
                and all(
                    s.value("hetps_pull_latency_seconds_count", worker=str(w)) == ROUNDS
                    for w in (0, 1)
                )
            ),
            "every worker's rounds and pulls",
        )
        yield j
        code = j.finish()
        assert code == 0, "".join(j.out.lines)
    finally:
        j.kill()


def test_the_endpoint_counts_what_the_workers_did(job):
    s = poll(
        job.url,
        lambda s: (
            s.value("hetps_rounds_total") == ROUNDS
            and all(
                s.value("hetps_pull_latency_seconds_count", worker=str(w)) == ROUNDS for w in (0, 1)
            )
        ),
        "every worker's rounds and pulls",
    )
    assert s.value("hetps_nodes_registered", role="server") == 2
    assert s.value("hetps_nodes_registered", role="worker") == 2
    assert not any(v for _, v in s.series("hetps_node_dead"))
    assert s.value("hetps_metrics_reports_refused_total") == 0
    shares = {
        int(lb["server"]): v for lb, v in s.series("hetps_plan_share_ratio")
    }  # one slice: all on one server
    assert sorted(shares.values()) == [0.0, 1.0], shares
    holder = next(srv for srv, v in shares.items() if v == 1.0)
    for w in ("0", "1"):
        assert s.value("hetps_worker_rounds_total", worker=w) == ROUNDS
        for op in ("push", "pull"):
            name = f"hetps_{op}_latency_seconds"
            assert s.value(f"{name}_count", worker=w) == ROUNDS, op
            buckets = [s.value(f"{name}_bucket", worker=w, le=repr(b)) for b in BUCKETS]
            assert buckets == sorted(buckets) and buckets[-1] <= ROUNDS  # cumulative
            assert s.value(f"{name}_bucket", worker=w, le="+Inf") == ROUNDS
            assert 0 < s.value(f"{name}_sum", worker=w) < 60
        # a round's time from one round's first push to the next one's
        assert s.value("hetps_round_duration_seconds_count", worker=w) == ROUNDS - 1
        assert s.value("hetps_round_duration_seconds_sum", worker=w) > 0
        assert s.value("hetps_esync_local_steps_total", worker=w) == ESYNC
        # the pushed and pulled values crossed the link to the server holding the key; a
        # message's header and the rebalance's probes add a little, never as much again
        up = s.value("hetps_link_bytes_total", src=f"worker{w}", dst=f"server{holder}")
        down = s.value("hetps_link_bytes_total", src=f"server{holder}", dst=f"worker{w}")
        payload = ROUNDS * ELEMS * 4
        assert payload <= up <= 2 * payload + (256 << 10), up
        assert payload <= down <= 2 * payload + (256 << 10), down
    assert s.value("hetps_esync_round") == ESYNC


def _free_port() -> int:
    import socket

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return sk.getsockname()[1]


def test_a_real_prometheus_scrapes_the_job(job, tmp_path):
    """A real Prometheus server (Debian's `prometheus`, started here with its own config and
    storage) scrapes the scheduler's endpoint; its query API then gives the job's numbers."""
    import json
    import shutil
    import urllib.parse

    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus is not installed (scripts/setup.sh --tests installs it as root)")
    target = urllib.parse.urlparse(job.url)
    (tmp_path / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 250ms\n  scrape_timeout: 200ms\n"
        "scrape_configs:\n  - job_name: hetps\n"
        f"    metrics_path: {target.path}\n"
        f"    static_configs:\n      - targets: ['{target.netloc}']\n"
    )
    port = _free_port()
    prom = subprocess.Popen(
        [binary, f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip

    def query(expr: str) -> list:
        url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                body = json.loads(resp.read())
        except OSError:
            return []  # not up yet
        assert body["status"] == "success", body
        return body["data"]["result"]

    try:
        deadline = time.monotonic() + 60
        while not query("hetps_rounds_total"):
            assert prom.poll() is None, prom.stderr.read()
            assert time.monotonic() < deadline, "Prometheus never stored hetps_rounds_total"
            time.sleep(0.1)  # polls Prometheus' API until its first scrape is stored
        (rounds,) = query("hetps_rounds_total")
        assert float(rounds["value"][1]) == ROUNDS
        # the job's id labels every series; Prometheus keeps its own `job` (the scrape job's
        # name) and files the endpoint's as `exported_job`
        assert rounds["metric"]["job"] == "hetps"
        assert rounds["metric"]["exported_job"] == scrape(job.url).job != ""
        per_worker = {r["metric"]["worker"]: float(r["value"][1]) for r in query(
            "hetps_worker_rounds_total")}  # fmt: skip
        assert per_worker == {"0": ROUNDS, "1": ROUNDS}, per_worker
        (up,) = query('up{job="hetps"}')
        assert float(up["value"][1]) == 1.0
        links = query("sum(hetps_link_bytes_total)")
        assert links and float(links[0]["value"][1]) >= 4 * ROUNDS * ELEMS * 4 * 0.99, links
    finally:
        os.killpg(prom.pid, signal.SIGKILL)
        prom.wait()


def test_top_once_prints_one_frame(job):
    port = int(re.search(r":(\d+)/", job.url).group(1))
    out = subprocess.run(
        [sys.executable, "-m", "hetps.cli", "top", "--port", str(port), "--once",
         "--interval", "0.2"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert f"rounds: {ROUNDS}" in out.stdout, out.stdout
    assert re.search(r"rounds/s: \d+\.\d\d", out.stdout), out.stdout
    assert "worker0" in out.stdout and "worker1" in out.stdout
    assert "plan (epoch" in out.stdout and "100.0 %" in out.stdout


def test_top_in_a_terminal_shows_workers_rates_and_links(job):
    top = pexpect.spawn(
        sys.executable,
        ["-m", "hetps.cli", "top", job.url, "--interval", "0.3"],
        dimensions=(50, 110),
        encoding="utf-8",
        timeout=30,
        env={**os.environ, "TERM": "xterm-256color"},
    )
    try:
        # the first frame has no rate yet ("-"); the second one does
        top.expect(r"rounds/s: \d+\.\d\d")
        top.expect(r"worker1 +│ +12 ")  # the workers table: worker1 with its 12 rounds
        top.expect(r"worker\d -> server\d")  # a link row
        top.expect(r"server\d -> worker\d")
        top.sendintr()
        top.expect(pexpect.EOF)
        top.close()
        assert top.exitstatus == 0, (top.exitstatus, top.signalstatus)
    finally:
        if top.isalive():
            top.terminate(force=True)


def test_a_stopped_worker_turns_late_then_counts_one_recovery(job):
    pid = job.pid(1)
    os.kill(pid, signal.SIGSTOP)
    try:
        poll(job.url, lambda s: s.value("hetps_nodes_late") == 1, "worker 1 late", timeout=30)
    finally:
        os.kill(pid, signal.SIGCONT)
    s = poll(
        job.url,
        lambda s: (
            s.value("hetps_node_recoveries_total", node="worker1") == 1
            and s.value("hetps_nodes_late") == 0
        ),
        "worker 1 back",
        timeout=30,
    )
    assert s.value("hetps_node_recoveries_total", node="worker0") is None
    assert not any(v for _, v in s.series("hetps_node_dead"))
