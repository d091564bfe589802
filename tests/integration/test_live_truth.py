"""The dashboard never lies, and the alerts fire: one real job (`hetps launch -n 2 -s 1
--metrics-port 0`) of a plain DistributedOptimizer script (no RoundLog) that logs its loss and
accuracy with `hetps.torch.log_metrics` and prints a line a round, watched by Debian's
headless Chromium (tests/chrome.py) and scraped by a real Prometheus (0.5 s scrapes and rule
evaluations) that loads the shipped alerts.yml.

In order: the page shows each worker's values, every node's CPU and memory (and GPUs, or why
none), each node's last lines and a timeline filled without RoundLog; it keeps polling while
1,000 idle connections are held; a stopped worker's link rates turn to "no data"; a kill -9
of a worker ends the job, the page says it failed and why (with no node address in any
text), and Prometheus' ALERTS holds HetpsNodeDead and HetpsJobFailed, firing, after the
job's series went stale. No sleeps: every wait polls a condition with a deadline.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from contextlib import nullcontext
from importlib import resources
from pathlib import Path

import pytest

from chrome import Chrome, missing
from security.lines import Lines

pytest.importorskip("prometheus_client")
pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(missing() is not None, reason=missing() or "")
PROMETHEUS = shutil.which("prometheus")

SCRIPT = """
import os, time
import torch
import hetps.kv
import hetps.torch as hps

torch.set_num_threads(1)
kv = hetps.kv.create("dist_sync")
here = os.environ["TRUTH_DIR"]
with open(os.path.join(here, f"pid{kv.rank}"), "w") as f:
    f.write(str(os.getpid()))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))
opt = hps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                               model.named_parameters(), kvstore=kv)
g = torch.Generator().manual_seed(kv.rank)
x = torch.randn(64, 16, generator=g)
y = (x[:, 0] > 0).long()
deadline = time.monotonic() + 120
step = 0
while not os.path.exists(os.path.join(here, "go")):
    assert time.monotonic() < deadline, "the test never said go"
    opt.zero_grad()
    out = model(x)
    loss = torch.nn.functional.cross_entropy(out, y)
    loss.backward()
    opt.step()
    step += 1
    acc = (out.argmax(1) == y).float().mean()
    hps.log_metrics(loss=loss.detach(), accuracy=acc)
    print(f"worker {kv.rank} step {step} loss {loss.item():.4f}", flush=True)
kv.close()
"""

COLORS = {"compute": (0x4C, 0x72, 0xB0), "push": (0xDD, 0x84, 0x52)}
PIXELS = """
const c = document.getElementById('timeline');
const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
const want = arguments[0], out = {};
for (const k in want) out[k] = 0;
for (let i = 0; i < d.length; i += 4)
  for (const k in want)
    if (d[i] === want[k][0] && d[i + 1] === want[k][1] && d[i + 2] === want[k][2]) out[k]++;
return out;
"""
ADDRESS = re.compile(r"\b\d{1,3}(?:\.\d{1,3}){3}:\d+")


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


def _free_port() -> int:
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return sk.getsockname()[1]


class Prometheus:
    """A real Prometheus scraping ``target`` every 0.5 s with the shipped alert rules."""

    def __init__(self, tmp: Path, target: str) -> None:
        rules = resources.files("hetps.metrics") / "monitoring" / "alerts.yml"
        (tmp / "alerts.yml").write_text(rules.read_text())
        (tmp / "prometheus.yml").write_text(
            "global:\n  scrape_interval: 500ms\n  evaluation_interval: 500ms\n"
            "rule_files: [alerts.yml]\n"
            "scrape_configs:\n  - job_name: hetps\n    scrape_timeout: 400ms\n"
            f"    static_configs:\n      - targets: ['{target}']\n"
        )
        self.port = _free_port()
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip

    def query(self, expr: str) -> list:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode(
            {"query": expr}
        )
        try:
            return get_json(url)["data"]["result"]
        except OSError:
            return []  # (not up yet)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


class Job:
    def __init__(self, tmp: Path) -> None:
        self.dir = tmp
        (tmp / "worker.py").write_text(SCRIPT)
        env = dict(os.environ)
        env.update(
            TRUTH_DIR=str(tmp),
            HETPS_METRICS_INTERVAL="0.2",
            PS_HEARTBEAT_INTERVAL="0.2",  # late after 0.6 s of silence
            PS_HEARTBEAT_TIMEOUT="60",
            HETPS_CONNECT_TIMEOUT="30",
            OMP_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hetps.cli", "launch", "-n", "2", "-s", "1", "--metrics-port",
             "0", "--", sys.executable, str(tmp / "worker.py")],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip
        self.out = Lines(self.proc.stdout)
        self.base = self.out.wait(r"hetps dashboard (http://\S+/)", timeout=60).group(1)
        self.hostport = self.base.split("/")[2]
        self.prom: Prometheus | None = None

    def pid(self, rank: int) -> int:
        return int((self.dir / f"pid{rank}").read_text())

    def state(self) -> dict:
        return get_json(self.base + "api/state")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        if self.prom is not None:
            self.prom.stop()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    with Chrome(tmp_path_factory.mktemp("chrome")) as b:
        yield b


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("truth")
    j = Job(tmp)
    try:
        if PROMETHEUS is not None:
            j.prom = Prometheus(tmp, j.hostport)
        deadline = time.monotonic() + 60
        while True:  # both workers report rounds, values and lines
            s = j.state()
            ws = s["workers"]
            if len(ws) == 2 and all(w["rounds"] >= 3 for w in ws):
                break
            assert time.monotonic() < deadline, f"no rounds within 60 s: {s}"
            time.sleep(0.1)  # between polls of the endpoint
        yield j
    finally:
        j.kill()


def test_the_page_shows_values_machines_lines_and_a_timeline_without_roundlog(job, browser):
    with nullcontext(browser) as b:
        b.get(job.base + "?interval=0.25")
        b.wait("return +document.body.dataset.values >= 4", "2 workers' loss and accuracy")
        b.wait(
            "return [...document.querySelectorAll('#logs details')].map(d => d.dataset.node)"
            ".includes('worker1')",
            "worker1's last lines",
        )
        page = b.js(
            "const v = [...document.querySelectorAll('#workers tbody tr')].map(tr => "
            "[+tr.dataset.rank, tr.querySelector('td.values').textContent]);"
            "const m = [...document.querySelectorAll('#machines tbody tr')].map(tr => "
            "[tr.dataset.node, tr.dataset.cpu, +tr.dataset.rss, tr.querySelector('td.gpu')"
            ".textContent]);"
            "const l = {}; document.querySelectorAll('#logs details').forEach(d => "
            "l[d.dataset.node] = d.querySelector('pre').textContent);"
            "return {values: v, machines: m, logs: l};"
        )
        s = job.state()
        # each worker's own values, the last it logged (loss of cross entropy on 2 classes)
        for rank, text in page["values"]:
            found = re.fullmatch(r"accuracy ([\d.]+), loss ([\d.]+)", text)
            assert found, text
            assert 0 <= float(found.group(1)) <= 1 and 0 < float(found.group(2)) < 5
            w = next(w for w in s["workers"] if w["rank"] == rank)
            assert len(w["metrics"]["loss"]) >= 3  # a history: the chart's
        assert b.js("return document.querySelectorAll('#values-chart .u-wrap').length") == 1
        # every node's CPU and memory; GPUs or why none
        rows = {name: (cpu, rss, gpu) for name, cpu, rss, gpu in page["machines"]}
        assert sorted(rows) == ["scheduler", "server0", "worker0", "worker1"]
        for name, (cpu, rss, gpu) in rows.items():
            assert 10e6 < rss < 64e9, (name, rss)  # a Python process' resident bytes
            assert cpu != "" and 0 <= float(cpu) < 1600, (name, cpu)
            assert gpu.startswith("none: ") or gpu.startswith("gpu0 "), gpu
        assert float(rows["worker1"][0]) > 0  # a training worker uses its CPU
        # each worker's last lines are its own
        for rank in (0, 1):
            lines = page["logs"][f"worker{rank}"].splitlines()
            assert lines and all(ln.startswith(f"worker {rank} step ") for ln in lines), lines
        assert "hetps metrics" in page["logs"].get("scheduler", "")  # the scheduler's own
        # the timeline of a plain DistributedOptimizer script: compute, then push (pushpull)
        b.wait("return +document.body.dataset.timelineRounds > 0", "a timeline")
        pixels = b.js(PIXELS, {k: list(v) for k, v in COLORS.items()})
        assert all(n > 20 for n in pixels.values()), pixels
        # push and pull are the last round's (a pushpull: no pull of its own)
        for w in s["workers"]:
            last = w["timeline"][-1]["spans"]
            push = 1000 * sum(d for name, _, d in last if name == "push")
            assert w["push_ms"] == pytest.approx(push, abs=1e-3) and w["push_ms"] > 0
            assert w["pull_ms"] is None
        assert b.severe_logs() == []


@pytest.mark.slow  # (the endpoint's own test holds 1,000 in the default run: test_dashboard_parts)
def test_the_page_keeps_polling_while_a_thousand_idle_connections_are_held(job, browser):
    host, port = job.hostport.rsplit(":", 1)
    with nullcontext(browser) as b:
        b.get(job.base + "?interval=0.25")
        b.wait("return +document.body.dataset.polls >= 2", "two polls")
        idle = []
        try:
            errors = b.js("return document.body.dataset.errors || '0'")
            for _ in range(1000):
                idle.append(socket.create_connection((host, int(port))))
            polls = int(b.js("return document.body.dataset.polls"))
            b.wait(f"return +document.body.dataset.polls >= {polls + 8}", "8 more polls")
            # and not one poll failed meanwhile (the page counts them)
            assert b.js("return document.body.dataset.errors || '0'") == errors
            assert b.js("return document.getElementById('status').className") == ""
            assert "live:" in b.js("return document.getElementById('status').textContent")
        finally:
            for sk in idle:
                sk.close()


def test_a_stopped_worker_s_rates_are_no_data_not_its_last_values(job, browser):
    cell = "document.querySelector('td[data-link=\"worker{}-server0\"]')?.dataset.rate"
    with nullcontext(browser) as b:
        b.get(job.base + "?interval=0.25")
        b.wait(f"return +({cell.format(1)}) > 0", "worker1's link busy")
        os.kill(job.pid(1), signal.SIGSTOP)
        try:
            b.wait(f"return {cell.format(1)} === 'none'", "worker1's rates: no data")
            s = job.state()
            w1 = next(w for w in s["workers"] if w["rank"] == 1)
            assert w1["rates"] is None
            text = b.js(
                "return document.querySelector('td[data-link=\"worker1-server0\"]').textContent"
            )
            assert text.startswith("no data"), text
            # worker 0 still reports: its rates are numbers (it waits for worker 1: ~0)
            b.wait(f"return !['none', '', undefined].includes({cell.format(0)})", "worker0's rates")
        finally:
            os.kill(job.pid(1), signal.SIGCONT)
        b.wait(f"return +({cell.format(1)}) > 0", "worker1's rates again")


def test_a_kill_shows_the_failure_on_the_page_and_fires_the_alerts(job, browser):
    with nullcontext(browser) as b:
        b.get(job.base + "?interval=0.25")
        b.wait("return +document.body.dataset.polls >= 2", "two polls")
        if job.prom is not None:  # Prometheus has scraped the job alive
            deadline = time.monotonic() + 30
            while not job.prom.query('hetps_node_dead{node="worker1"} == 0'):
                assert time.monotonic() < deadline, "Prometheus never scraped the job"
                time.sleep(0.2)  # between queries
        os.kill(job.pid(1), signal.SIGKILL)
        b.wait("return document.body.dataset.ended === 'failed'", "the page says: failed", 60)
        status = b.js("return document.getElementById('status').textContent")
        assert status.startswith("the job ended: failure (exit code") and "worker1" in status
        events = b.js("return document.getElementById('events').textContent")
        assert "worker1 dead" in events
        assert not ADDRESS.search(status + events), status + events
        code = job.proc.wait(timeout=60)
        assert code != 0
        # the endpoint is gone; the page keeps what it said, not "stopped answering"
        b.wait(
            "return document.getElementById('status').textContent.startsWith('the job ended')",
            "the ending kept",
        )
        assert b.severe_logs() == []
    out = "".join(job.out.lines)
    assert ADDRESS.search(out), "the launcher's own output names addresses (the test's control)"
    if job.prom is None:
        pytest.skip("prometheus is not installed: the alerts were not checked")
    # the job's series went stale (its endpoint is gone), and the death is still an alert
    deadline = time.monotonic() + 30
    while True:
        up = job.prom.query('up{job="hetps"}')
        firing = job.prom.query('ALERTS{alertstate="firing"}')
        names = sorted((a["metric"]["alertname"], a["metric"].get("node", "")) for a in firing)
        if up and up[0]["value"][1] == "0" and len(names) == 2:
            break
        assert time.monotonic() < deadline, f"up {up}, firing {names}"
        time.sleep(0.2)  # between queries
    assert not job.prom.query("hetps_node_dead")  # stale: no sample now
    assert names == [("HetpsJobFailed", ""), ("HetpsNodeDead", "worker1")]
