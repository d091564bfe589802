"""The live dashboard and the report, in a real browser.

`hetps launch -n 2 -s 2 --balance average --metrics-port 0` runs a job whose workers log their
rounds with RoundLog (compute, push, wait, pull) until the test writes a file; Debian's
headless Chromium, driven by chromedriver over WebDriver (tests/chrome.py), opens the
scheduler's dashboard while the job runs and checks that its numbers update and agree with the
job's own endpoints, that the timeline draws every phase, and that the page logs no console
error; then `hetps report` writes the run's HTML file and the browser opens that. Screenshots
go to the test's tmp dir. No sleeps: every wait polls a condition with a deadline.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from chrome import Chrome, missing
from hetps.metrics.top import parse
from security.lines import Lines

pytest.importorskip("prometheus_client")
pytestmark = pytest.mark.skipif(missing() is not None, reason=missing() or "")

SCRIPT = """
import os, time
import numpy as np
import hetps.kv
from hetps.metrics.roundlog import RoundLog

kv = hetps.kv.create("dist_sync")
here = os.environ["DASH_DIR"]
with open(os.path.join(here, f"pid{kv.rank}"), "w") as f:
    f.write(str(os.getpid()))
log = RoundLog(kv, os.path.join(here, "runs"), "dash", mode="sync", network="tanh", batch_size=64)
kv.init(0, np.zeros(20000, np.float32))
kv.init(1, np.zeros(5000, np.float32))
kv.init(2, np.zeros(1, np.float32))  # the stop flag: every worker stops after the same round
out = [np.empty(20000, np.float32), np.empty(5000, np.float32), np.empty(1, np.float32)]
a = np.random.default_rng(kv.rank).standard_normal((128, 128)).astype(np.float32)
go = os.path.join(here, "go")
deadline = time.monotonic() + 90
r = 0
while True:
    assert time.monotonic() < deadline, "the test never said go"
    kv.rebalance()
    with log.phase("compute"):
        b = a
        for _ in range(2 + 4 * kv.rank):  # worker 1 computes longer: worker 0 waits for it
            b = np.tanh(b @ a / 128)
    stop = np.full(1, float(kv.rank == 0 and os.path.exists(go)), np.float32)
    with log.phase("push"):
        kv.push([0, 1, 2], [np.ones(20000, np.float32), np.ones(5000, np.float32), stop])
    with log.pull():
        kv.pull([0, 1, 2], out=out)
    assert out[1][0] == 2, out[1][0]  # the round's sum of two workers' ones (no optimizer)
    r += 1
    log.end_round(samples=64, loss=1.0 / r, epoch=0)
    if out[2][0] > 0:
        break
log.close()
kv.barrier()
kv.close()
"""

COLORS = {"compute": (0x4C, 0x72, 0xB0), "push": (0xDD, 0x84, 0x52), "wait": (0xB8, 0xB8, 0xB8),
          "pull": (0x55, 0xA8, 0x68)}  # fmt: skip

# the page's numbers, read at one moment
READ = """
const rows = [...document.querySelectorAll('#workers tbody tr')].map(
  tr => [+tr.dataset.rank, +tr.querySelector('td.rounds').textContent]);
const servers = [...document.querySelectorAll('#servers tbody tr')].map(
  tr => [+tr.dataset.rank, +tr.querySelector('td.rounds').textContent]);
const nodes = [...document.querySelectorAll('#nodes tbody tr')].map(
  tr => [tr.dataset.node, tr.dataset.state]);
return {rounds: +document.getElementById('rounds').textContent,
        rate: +document.getElementById('rate').textContent,
        workers: rows, nodes: nodes, servers: servers,
        links: document.getElementById('links').textContent,
        plan: document.getElementById('plan').textContent,
        polls: +document.body.dataset.polls};
"""

# pixels of each phase's colour on the timeline
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


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


class Job:
    def __init__(self, tmp: Path) -> None:
        self.dir = tmp
        script = tmp / "worker.py"
        script.write_text(SCRIPT)
        env = dict(os.environ)
        env.update(
            DASH_DIR=str(tmp),
            HETPS_METRICS_INTERVAL="0.2",
            PS_HEARTBEAT_INTERVAL="0.2",  # late after 0.6 s of silence
            PS_HEARTBEAT_TIMEOUT="60",
            HETPS_CONNECT_TIMEOUT="30",
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
        self.base = self.out.wait(r"hetps dashboard (http://\S+/)", timeout=60).group(1)
        self.code: int | None = None

    def signal(self, sig: int) -> None:
        for rank in (0, 1):
            os.kill(int((self.dir / f"pid{rank}").read_text()), sig)

    def state(self) -> dict:
        return get_json(self.base + "api/state")

    def finish(self) -> int:
        if self.code is None:
            (self.dir / "go").touch()
            try:
                self.code = self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError("the job did not end:\n" + "".join(self.out.lines)) from None
        return self.code

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    j = Job(tmp_path_factory.mktemp("dash"))
    try:
        deadline = time.monotonic() + 60
        while True:  # both workers have reported rounds with their spans
            s = j.state()
            if len(s["workers"]) == 2 and all(len(w["timeline"]) >= 3 for w in s["workers"]):
                break
            assert time.monotonic() < deadline, f"no timeline within 60 s: {s}"
            time.sleep(0.1)  # between polls of the endpoint
        yield j
    finally:
        j.kill()


def test_the_dashboard_shows_the_running_job(job, tmp_path):
    with Chrome(tmp_path) as b:
        b.get(job.base + "?interval=0.25")
        b.wait(
            "return +document.body.dataset.polls >= 3 && +document.body.dataset.timelineRounds > 0",
            "three polls and a timeline",
        )
        before = job.state()  # the page shows a poll made after this one, before the next
        b.wait(f"return +document.body.dataset.uptime > {before['uptime']}", "a newer poll")
        page = b.js(READ)
        after = job.state()
        # the page shows what the job's endpoint says
        assert before["rounds"] <= page["rounds"] <= after["rounds"], (before, page, after)
        assert page["rounds"] > 0
        for rank, rounds in page["workers"]:
            lo = next(w["rounds"] for w in before["workers"] if w["rank"] == rank)
            hi = next(w["rounds"] for w in after["workers"] if w["rank"] == rank)
            assert lo <= rounds <= hi, (rank, lo, rounds, hi)
        assert sorted(r for r, _ in page["workers"]) == [0, 1]
        assert sorted(page["nodes"]) == [
            ["server0", "alive"], ["server1", "alive"], ["worker0", "alive"], ["worker1", "alive"],
        ]  # fmt: skip
        assert "server0" in page["links"] and "server1" in page["links"]
        assert "in force" in page["plan"], page["plan"]
        # ... and Prometheus' view agrees
        with urllib.request.urlopen(job.base + "metrics", timeout=5) as resp:
            prom = parse(resp.read().decode())
        assert prom.value("hetps_rounds_total") >= page["rounds"]
        # the numbers move while the job runs
        b.wait(f"return +document.body.dataset.rounds > {page['rounds']}", "the rounds going up")
        assert float(b.js("return document.body.dataset.rate")) > 0
        # the timeline draws every phase, the wait included (worker 1 computes longer)
        pixels = b.js(PIXELS, {k: list(v) for k, v in COLORS.items()})
        assert all(n > 20 for n in pixels.values()), pixels
        assert b.severe_logs() == []
        shot = b.screenshot(tmp_path / "dashboard.png")
        assert shot.stat().st_size > 20_000
        # workers stopped: the numbers hold still, and the page shows exactly the job's
        job.signal(signal.SIGSTOP)
        try:
            b.wait(
                "return [...document.querySelectorAll('#nodes tbody tr')].filter("
                "tr => tr.dataset.state === 'late').length === 2",
                "both workers late on the page",
            )
            held = job.state()
            assert [n["state"] for n in held["nodes"]] == ["alive", "alive", "late", "late"]
            b.wait(f"return +document.body.dataset.uptime > {held['uptime']}", "a poll after")
            b.wait(  # the servers' last reports after the workers stopped are in too
                f"return +document.body.dataset.uptime > {held['uptime'] + 0.5}", "a later poll"
            )
            now = job.state()
            page = b.js(READ)
            assert page["rounds"] == held["rounds"] == now["rounds"]
            assert page["workers"] == [[w["rank"], w["rounds"]] for w in held["workers"]]
            # the servers report themselves: every round of every key slice merged, the
            # bytes that came in from the workers
            assert page["servers"] == [[v["rank"], v["rounds"]] for v in now["servers"]]
            assert sorted(v["rank"] for v in now["servers"]) == [0, 1]
            assert sum(v["rounds"] for v in now["servers"]) >= 3 * now["rounds"]  # 3 keys
            assert all(v["bytes_in"] > 0 and v["replicas"] == 1 for v in now["servers"])
        finally:
            job.signal(signal.SIGCONT)
        b.wait(
            "return document.getElementById('events').textContent.includes("
            "'worker1 heard from again')",
            "the event of a worker heard again",
        )
        b.wait(
            "return [...document.querySelectorAll('#nodes tbody tr')].every("
            "tr => tr.dataset.state === 'alive')",
            "every node alive again",
        )
        assert b.severe_logs() == []
        # the job ends: the endpoint answers until the page has read how
        assert job.finish() == 0, "".join(job.out.lines)
        b.wait("return document.body.dataset.ended === 'ok'", "the page says: success")
        status = b.js("return document.getElementById('status').textContent")
        assert status == "the job ended: success: every worker finished", status
        assert b.severe_logs() == []


def test_the_report_of_the_run_opens_in_the_browser(job, tmp_path):
    assert job.finish() == 0, "".join(job.out.lines)
    (run,) = (job.dir / "runs").iterdir()
    out = tmp_path / "report.html"
    res = subprocess.run(
        [sys.executable, "-m", "hetps.cli", "report", str(run), "-o", str(out)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert f"report: {out}" in res.stdout
    text = out.read_text()
    # self-contained: nothing loaded from elsewhere
    assert "<script src=" not in text and "<link " not in text and 'src="http' not in text
    rounds0 = sum(1 for _ in (run / "worker-0.jsonl").open())
    # the scheduler left the dashboard's last state in the run directory
    final = json.loads((run / "live-final.json").read_text())
    assert final["ended"] is True and final["rounds"] == rounds0
    assert [n["state"] for n in final["nodes"] if n["role"] == "worker"] == ["finished"] * 2
    with Chrome(tmp_path) as b:
        b.get(out.as_uri())
        b.wait("return document.body.dataset.ready === '1'", "the report drawn")
        assert int(b.js("return document.body.dataset.rounds")) == rounds0
        # the last 6 rounds of the worker that is ahead, and what the other did meanwhile
        assert int(b.js("return document.body.dataset.timelineRounds")) >= 7
        pixels = b.js(PIXELS, {k: list(v) for k, v in COLORS.items()})
        assert all(n > 20 for n in pixels.values()), pixels
        phases = b.js("return document.querySelectorAll('#phases tbody tr').length")
        assert phases == 2
        assert b.js("return document.querySelectorAll('.u-wrap').length") >= 3  # uPlot charts
        failures = b.js("return document.getElementById('failures').textContent")
        assert "none" in failures, failures
        ended = b.js("return document.getElementById('live-nodes').textContent")
        assert ended.count("finished") == 2, ended
        assert b.severe_logs() == []
        b.screenshot(tmp_path / "report.png")
