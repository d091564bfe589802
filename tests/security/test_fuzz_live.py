"""Property-based fuzzing of a live server's and a live scheduler's handlers (hypothesis).

Real processes over real sockets: ``hetps scheduler`` and ``hetps server`` run as their own
processes (plain mode on loopback); this process is the job's one worker and the fuzzer.

* As the registered worker, over its own connections: every data-plane and control command
  and unknown ones, with wrong types in every body field, wrong array counts, dtypes and
  sizes, valid-looking requests for unknown keys, parts, ranges and rounds, replies to nothing.
* As an outsider, over a connection of no node: random frames and valid-looking messages.

After each example the worker's own push and pull of a key the fuzzer never touches must
complete: no crash, no hang. After each test (so a failure is charged to the test that caused
it): no handler raised meanwhile (no traceback, no "server error" answer), every message
refused by the server or the scheduler was logged with its own line, and the server's peak
memory grew by a bounded amount. Both exit 0 when the job ends.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetps.cluster.requests import Future
from hetps.tables.rowsparse import Table
from hetps.transport.codec import WIRE_DTYPES, Message
from roles import loopback_config, role_env, worker_store

from .lines import Lines as _Lines

LIVE = settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

SERVER_CMDS = [
    "batch", "init", "push", "pull", "set_optimizer", "get_states", "set_states", "forecast", "probe",
    "drop", "pace", "worker_done", "exit", "node_dead", "receipt", "add_node", "nodes",
    "sinit", "spush", "spull",
]  # fmt: skip
SCHED_CMDS = [
    "barrier", "heartbeat", "esync_report", "balance_report", "add_node", "nodes", "exit",
    "node_dead", "refused", "worker_done", "push", "metrics_report",
]  # fmt: skip

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.integers(-3, 40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.binary(max_size=12),
)
values = st.recursive(
    scalars,
    lambda kids: st.one_of(
        st.lists(kids, max_size=3), st.dictionaries(st.text(max_size=4), kids, max_size=3)
    ),
    max_leaves=8,
)
keys = st.one_of(st.sampled_from(["w", "t", "ghost", 0, -1, "x" * 300]), values)
#: containers where a scalar belongs: what slips past a check that only reads a value
containers = st.one_of(
    st.lists(scalars, max_size=2), st.dictionaries(st.text(max_size=3), scalars, max_size=2)
)
FIELDS = {
    "k": st.one_of(st.just("w"), keys),
    "part": st.one_of(st.integers(-1, 3), values),
    "off": st.one_of(st.integers(-2, 12), values),
    "n": st.one_of(st.integers(-2, 12), st.integers(2**31, 2**63), values),
    "size": st.one_of(st.integers(0, 12), st.integers(2**40, 2**62), values),
    # a row-sparse table's declaration (sinit)
    "rows": st.one_of(st.none(), st.integers(-1, 60), st.integers(2**40, 2**62), values),
    "cols": st.one_of(st.integers(-1, 9), st.integers(2**20, 2**40), values),
    "nparts": st.one_of(st.integers(-1, 3), values),
    "scale": st.one_of(st.floats(allow_nan=True, allow_infinity=True), values),
    "seed": st.one_of(st.integers(-1, 2**64 - 1), values),
    "bound": st.one_of(st.integers(-1, 4096), values),
    "opt": values,
    "shape": st.one_of(st.lists(st.integers(-1, 9), max_size=3), values),
    "dtype": st.one_of(st.sampled_from(sorted(WIRE_DTYPES) + ["complex64"]), values),
    "sync": values,
    "ce": values,
    "comp": values,
    "pp": values,
    "rcpt": values,
    "tag": values,
    "slices": st.one_of(st.lists(st.lists(keys, max_size=3), max_size=3), values),
    "reply_bytes": st.one_of(st.integers(-1, 1 << 16), values),
    "rate": values,
    "spread": values,
    "node": values,
    "group": st.one_of(st.sampled_from(["worker", "server", "all", "x"]), values),
    "rank": values,
    "round": st.one_of(st.integers(0, 3), values),
    "step_s": values,
    "elapsed_s": values,
    "role": st.one_of(st.sampled_from(["worker", "server"]), values),
    "host": values,
    "port": values,
    "back": values,
    "sizes": values,
    "samples": values,
    "items": st.one_of(st.lists(st.lists(values, max_size=5), max_size=3), values),
    # metrics_report (the scheduler serves live metrics in this job)
    "seq": st.one_of(st.integers(-1, 2**63), values),
    "t": st.one_of(st.floats(allow_nan=True, allow_infinity=True), values),
    "rounds": st.one_of(st.integers(-1, 2**63), values),
    "round_s": values,
    "links": st.one_of(
        st.lists(st.lists(st.one_of(st.integers(-1, 2**63), values), max_size=4), max_size=3),
        values,
    ),
    "h": st.one_of(
        st.dictionaries(
            st.sampled_from(["push", "pull", "round", "x"]),
            st.lists(st.one_of(st.lists(st.integers(-1, 2**54), max_size=20), values), max_size=3),
            max_size=3,
        ),
        values,
    ),
}
FIELDS = {name: st.one_of(strategy, containers) for name, strategy in FIELDS.items()}
bodies = st.fixed_dictionaries({}, optional=FIELDS)
#: each command's own fields: always present (each one right or wrong), the others may be
OWN = {
    "push": ["k", "part", "off", "n", "sync", "ce", "shape", "dtype", "comp", "pp", "rcpt", "tag"],
    "pull": ["k", "part", "off", "n", "shape", "dtype", "tag"],
    "init": ["k", "part", "off", "n", "size", "shape", "dtype"],
    "forecast": ["tag"],
    "probe": ["reply_bytes", "tag", "spread"],
    "drop": ["slices"],
    "get_states": ["slices"],
    "pace": ["rate"],
    "worker_done": ["node"],
    "node_dead": ["node"],
    "barrier": ["group"],
    "esync_report": ["rank", "round", "step_s", "elapsed_s"],
    "add_node": ["role", "host", "port", "back"],
    "batch": ["items"],
    "sinit": ["k", "part", "nparts", "rows", "cols", "dtype", "scale", "seed", "bound"],
    "spush": ["k", "part", "sync"],
    "spull": ["k", "part"],
    "balance_report": ["round", "sizes", "samples"],
    "metrics_report": ["seq", "t", "rounds", "links", "h"],
}  # fmt: skip


def command(cmds: list[str]):
    """(command, body) with the command's own fields present."""
    return st.sampled_from(cmds).flatmap(
        lambda c: st.tuples(
            st.just(c),
            st.fixed_dictionaries(
                {f: FIELDS[f] for f in OWN.get(c, [])},
                optional={f: v for f, v in FIELDS.items() if f not in OWN.get(c, [])},
            ),
        )
    )


arrays = st.lists(
    st.tuples(st.sampled_from(sorted(WIRE_DTYPES)), st.lists(st.integers(0, 12), max_size=2)).map(
        lambda t: np.ones(t[1], WIRE_DTYPES[t[0]])
    ),
    max_size=2,
)
messages = st.tuples(st.one_of(st.text(max_size=8), st.just("")), bodies, arrays, st.booleans())


class Job:
    """A scheduler and a server process, and this process as the job's worker."""

    def __init__(self, tmp) -> None:
        hb = dict(PS_HEARTBEAT_INTERVAL=1, PS_HEARTBEAT_TIMEOUT=60)
        self.procs: list[subprocess.Popen] = []
        # live metrics on: the scheduler takes metrics reports (fuzzed too) and this worker
        # sends its own meanwhile
        live = dict(HETPS_METRICS_PORT=0, HETPS_METRICS_INTERVAL=0.2)
        # (every refusal its own line: the checks count them against what was sent)
        lines = dict(HETPS_REFUSAL_LINES=0)
        self.sched = self._start(role_env("scheduler", clean=True, **hb, **live, **lines))
        self.sched_log = _Lines(self.sched.stdout)
        port = int(self.sched_log.wait(r"hetps scheduler port (\d+)").group(1))
        self.server = self._start(role_env("server", port, clean=True, **hb))
        self.server_log = _Lines(self.server.stdout)
        cfg = loopback_config(
            "worker", port, heartbeat_interval=1.0, heartbeat_timeout=60.0, connect_timeout=30
        )
        self.kv = worker_store("dist_sync", cfg)
        self.kv.init("health", np.zeros(4, np.float32))
        self.kv.init("w", np.zeros(8, np.float32))
        self.kv.init("t", Table(50, 4, scale=0.1))  # a row-sparse key (spush, spull, sinit)
        self.sid = self.kv.server_ids[0]
        self.errors: list[str] = []  # error answers the worker got
        self.round = 0
        self.hwm0 = _hwm_kb(self.server.pid)
        self.ctx = zmq.Context()
        self.stranger = self.ctx.socket(zmq.DEALER)  # a connection of no node
        self.stranger.setsockopt(zmq.LINGER, 0)
        self.stranger.connect(f"tcp://127.0.0.1:{self.kv.node.servers()[0].port}")
        self.stranger_sched = self.ctx.socket(zmq.DEALER)
        self.stranger_sched.setsockopt(zmq.LINGER, 0)
        self.stranger_sched.connect(f"tcp://127.0.0.1:{port}")
        self.raw_sent = {"server": 0, "scheduler": 0}
        self.ran: set[str] = set()  # the tests that used the job (checked at their end)

    def _start(self, env: dict) -> subprocess.Popen:
        p = subprocess.Popen(
            [sys.executable, "-m", "hetps.cli", env["DMLC_ROLE"]],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.procs.append(p)
        return p

    def collect(self, futs: list[Future]) -> None:
        for f in futs:
            if f.done():
                try:
                    f.wait(0)
                except Exception as exc:  # noqa: BLE001 - an error answer
                    self.errors.append(str(exc))
            else:  # legitimately unanswered (a partial round, a forecast): forget it
                self.kv.node.requests.discard(f.req)

    def healthy(self) -> None:
        """The worker's own round on a key nobody fuzzes completes (after every message the
        fuzzer sent before it on the same connection was handled)."""
        self.round += 1
        self.kv.push("health", np.full(4, self.round, np.float32))
        assert (self.kv.pull("health") == self.round).all()

    def mark(self) -> tuple:
        """Where the logs and counts stand now (see :meth:`check_since`)."""
        return len(self.sched_log.lines), len(self.server_log.lines), len(self.errors)

    def check_since(self, mark: tuple) -> None:
        """What every test must leave behind, checked at its end (so a failure is charged to
        the test that caused it): the worker's own round still completes; no handler raised
        since ``mark`` (no traceback in either log, no "server error" answer); every message
        from the stranger so far has its log line, and every error answer its "refused"
        line; the server's peak memory grew by less than 64 MB."""
        self.healthy()
        unknown = r"dropped a bad message from an unknown connection|from a connection of no node"
        for log_, to in ((self.server_log, "server"), (self.sched_log, "scheduler")):
            seen = log_.wait_count(unknown, self.raw_sent[to])
            assert seen >= self.raw_sent[to], (to, seen, self.raw_sent[to])
        n_sched, n_server, n_errors = mark
        text = "".join(self.sched_log.lines[n_sched:] + self.server_log.lines[n_server:])
        assert "Traceback" not in text and "error handling" not in text, _tracebacks(text)
        new_errors = self.errors[n_errors:]
        assert not [e for e in new_errors if "server error in" in e], new_errors
        deadline = time.monotonic() + 20
        while self.logged_refusals(n_sched, n_server) < len(new_errors):
            seen = self.logged_refusals(n_sched, n_server)
            assert time.monotonic() < deadline, (seen, new_errors)
            time.sleep(0.02)  # polls the logs' reader threads
        grown = (_hwm_kb(self.server.pid) - self.hwm0) / 1024
        assert grown < 64, f"the server's peak memory grew by {grown:.0f} MB"

    def logged_refusals(self, n_sched: int = 0, n_server: int = 0) -> int:
        """The "refused" lines of both logs, from line ``n_sched`` and ``n_server`` on."""
        lines = self.server_log.lines[n_server:] + self.sched_log.lines[n_sched:]
        return len([ln for ln in lines if "refused" in ln])

    def close(self) -> None:
        try:
            self.kv.close()
            for p in self.procs:
                assert p.wait(timeout=30) == 0, "".join(
                    self.sched_log.lines + self.server_log.lines
                )
        finally:
            for s in (self.stranger, self.stranger_sched):
                s.close(0)
            self.ctx.term()
            for p in self.procs:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
                    p.wait()


def _tracebacks(text: str) -> str:
    """The tracebacks in a log, each with the line that introduced it."""
    out, lines = [], text.splitlines()
    for i, ln in enumerate(lines):
        if ln.startswith("Traceback"):
            end = next((j for j in range(i + 1, len(lines)) if not lines[j].startswith(" ")), i)
            out += lines[max(0, i - 1) : end + 1]
    return "\n".join(out[-200:])


def _hwm_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(ln for ln in f if ln.startswith("VmHWM:")).split()[1])


@pytest.fixture(scope="module")
def the_job(tmp_path_factory):
    j = Job(tmp_path_factory.mktemp("fuzz"))
    try:
        yield j
    finally:
        j.close()  # (both processes exit 0 when the job ends)


@pytest.fixture
def job(the_job, request):
    """The job, checked at the end of each test that used it (:meth:`Job.check_since`)."""
    mark = the_job.mark()
    yield the_job
    the_job.ran.add(request.node.originalname)
    the_job.check_since(mark)


@settings(LIVE, max_examples=150)
@given(
    st.lists(
        st.tuples(command(SERVER_CMDS), arrays, st.booleans()),
        min_size=1,
        max_size=4,
    )
)
def test_fuzz_the_servers_handlers_as_its_worker(job, msgs):
    futs = []
    for (cmd, body), arrs, reply in msgs:
        msg = Message(cmd, body=body, arrays=arrs)
        if reply:  # an answer to nothing
            msg.reply, msg.req = True, 10**9
            job.kv.node.van.send(job.sid, msg)
        else:
            futs.append(job.kv.node.request(job.sid, msg))
    job.healthy()
    job.collect(futs)


#: one batch item: a command (mostly a batchable one) with its own fields (or a body that is
#: no map), a request id far from the worker's own, and an array count (mostly right, or
#: wrong, or not a number); or anything at all
BATCHABLE = ["init", "push", "pull"]
batch_items = st.lists(
    st.one_of(
        st.tuples(
            st.one_of(command(BATCHABLE), command(BATCHABLE), command(SERVER_CMDS)),
            st.one_of(*[st.integers(10**8, 10**9)] * 3, values),
            st.one_of(st.just(0), st.just(0), st.integers(-1, 2**40), values),
            st.one_of(st.none(), st.none(), values),  # a body that is no map at all
        ).map(lambda t: [t[0][0], t[1], t[0][1] if t[3] is None else t[3], t[2]]),
        st.one_of(st.none(), values),
    ),
    min_size=0,
    max_size=4,
)


@LIVE
@given(
    st.lists(
        st.tuples(st.one_of(batch_items, values), st.one_of(st.just([]), arrays)),
        min_size=1,
        max_size=3,
    )
)
def test_fuzz_batches_as_its_worker(job, batches):
    """Hostile batches (wrong types, array counts that do not add up, commands that may not
    be batched, bad items among good ones) are refused with an error answer, or their items
    handled one by one; the server goes on serving."""
    futs = [
        job.kv.node.request(job.sid, Message("batch", body={"items": items}, arrays=arrs))
        for items, arrs in batches
    ]
    job.healthy()
    job.collect(futs)


@LIVE
@given(st.lists(messages, min_size=1, max_size=3))
def test_fuzz_the_servers_handlers_with_unknown_commands(job, msgs):
    futs = [
        job.kv.node.request(job.sid, Message(c or "?", body=b, arrays=a)) for c, b, a, _ in msgs
    ]
    job.healthy()
    job.collect(futs)


@LIVE
@given(st.lists(command(SCHED_CMDS), min_size=1, max_size=4))
def test_fuzz_the_schedulers_handlers_as_a_worker(job, msgs):
    futs = [job.kv.node.request(1, Message(cmd, body=body)) for cmd, body in msgs]
    job.kv.node.barrier("worker", timeout=30)  # the scheduler still serves the job
    job.healthy()
    job.collect(futs)


raw_frames = st.one_of(
    st.lists(st.binary(max_size=200), min_size=1, max_size=4),
    st.tuples(messages, st.sampled_from(["server", "scheduler"])).map(
        lambda t: [
            msgpack.packb(
                {"v": 1, "c": t[0][0] or "push", "s": 9, "r": 1, "p": t[0][3], "b": t[0][1],
                 "a": [[str(a.dtype), list(a.shape)] for a in t[0][2]]},
                use_bin_type=True,
            ),
            *[a.tobytes() for a in t[0][2]],
        ]
    ),
)  # fmt: skip


@LIVE
@given(
    st.lists(
        st.tuples(raw_frames, st.sampled_from(["server", "scheduler"])), min_size=1, max_size=4
    )
)
def test_fuzz_both_from_a_connection_of_no_node(job, sends):
    for frames, to in sends:
        sock = job.stranger if to == "server" else job.stranger_sched
        sock.send_multipart(frames)
        job.raw_sent[to] += 1
    job.healthy()


def test_the_fuzzing_reached_both_and_was_answered(job):
    """Over the whole run so far (each test was checked at its end): the stranger's sends
    reached both processes, and the fuzzed requests drew error answers (each only if the test
    that makes them ran)."""
    job.healthy()
    assert re.search(r"hetps scheduler port", "".join(job.sched_log.lines))
    sent = job.raw_sent
    if "test_fuzz_both_from_a_connection_of_no_node" in job.ran:
        # hypothesis splits the strangers' sends between the two at random: both must have
        # had some, and together many (each one was matched by a log line)
        assert sent["server"] >= 1 and sent["scheduler"] >= 1, sent
        assert sent["server"] + sent["scheduler"] > 40, sent
    if "test_fuzz_the_servers_handlers_as_its_worker" in job.ran:
        assert len(job.errors) > 20, job.errors


def test_live_metrics_still_serve_sane_numbers_after_the_fuzzing(job):
    """Fuzzed metrics reports were refused or taken within their bounds: the endpoint still
    answers, every value is a finite number, and the job's own counts are right."""
    import math
    import urllib.request

    from hetps.metrics.top import parse

    url = job.sched_log.wait(r"hetps metrics (http://\S+)").group(1)
    with urllib.request.urlopen(url, timeout=10) as resp:
        scrape = parse(resp.read().decode())
    values = [v for series in scrape.samples.values() for v in series.values()]
    assert values and all(math.isfinite(v) and v >= 0 for v in values)
    assert scrape.value("hetps_nodes_registered", role="worker") == 1
    assert not any(v for _, v in scrape.series("hetps_node_dead"))
