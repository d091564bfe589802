"""Scale by simulation: the real scheduler and planner with 16 to 1,024 simulated nodes.

    python benchmarks/scale_sim.py [--sizes 16,64,256,1024] [--quick] [--out FILE]

Part 1 (cluster): for each N, a real ``hetps scheduler`` process (``make_scheduler``: the
ESync state service and the load planner, ``HETPS_BALANCE`` on) on 127.0.0.1 with an
ephemeral port, and N simulated nodes (N/4 servers, the rest workers, ``--servers-frac``) in
this process. Each simulated node has its own DEALER connection to the scheduler and speaks
the real wire protocol through hetps' own codec (:mod:`hetps.transport.codec`); the nodes
share one ROUTER that the scheduler connects back to, once per node, each connection with
the node's own routing id (so the scheduler holds N connections, as with real nodes). Phases:

- registration: every node sends ``add_node`` at once; the figure is the time from the first
  send until every node holds the node table (``nodes``);
- barrier: every node enters a barrier of group ``all``; the figure is the time from the
  last node's entry until every node got ``barrier_done`` (repeated, median);
- heartbeats: every node sends one heartbeat per interval (spread over the interval, as
  independent nodes would be); the figure is the scheduler's CPU seconds (user + system,
  /proc/<pid>/stat) per interval, and every heartbeat must be answered;
- link reports: every worker sends a ``balance_report`` as a worker's BalanceAgent does (the
  slice layout on the first, one push and one pull sample per server, each server's bytes
  and seconds), a round's reports made first and then sent together (``--spread-ms T``:
  sent evenly over T ms, this process sleeping between two sends; ``--paced``: each sent as
  soon as it is made, spread over the 0.3-0.4 s this process takes to make them at 4,096
  workers); the figures are the time from the last report until every worker has its
  plan, the planner's own time per plan (``plan_s`` of the answer), the plan message's
  size, and the scheduler's CPU per round.

A node has a message when it was read off the socket plus the time its own decode took (as a
real node, which decodes only its own): the messages are read as they are queued and decoded
after, so no node's figure holds the other nodes' decodes. The simulating process's objects
are left out of the interpreter's full collections after registration and before each report
round (``gc.freeze``): with every node's state in one process a collection took 30-80 ms.

With hosts of several workers (``--workers-per-host``), a host's barrier arrival and link
report go through its leader, as cluster/hostlead.py does (``HETPS_HOST_CONTROL``): the host's
lowest worker sends one arrival (``host``: the host's workers) and one report (the host's
workers' samples merged per (host, server) pair and each worker's longest server time, by the
leader's own functions, ``host_rows``), and passes the one answer on to the host's other
workers, who hold it once the leader read it (the local hand-off itself is not simulated).
``--per-process-control``: every worker sends its own; ``--unmerged``: a leader sends its
workers' samples and times as they are. The scheduler's CPU per report round is also given
per thread (``schedstat``): its main loop, ZeroMQ's I/O threads, the rest (the services').

Part 3 (planner, ``--planner``): the scheduler's services' thread alone in this process, by
thread time (:func:`run_planner`): a round's host reports handed to the planner as the
scheduler hands them; the CPU per round and that of the last report, which releases the round.

Part 2 (plans): every plan function of :mod:`hetps.balance` (average, elastic, aware,
optimal) timed directly for S = N/4 servers and W = N - S workers, on a heterogeneous
network of per-node caps (what the planner builds), plus per-link caps: ``optimal-link`` and
``aware-link`` with separate roles (still separable: optimal is the closed form),
``optimal-lp`` with co-located roles (coupled: the exact LP, at any size) and
``optimal-coupled``, the same network as the library plans it (the LP up to
``LP_MAX_ENTRIES``, then a cheap fallback, docs/BALANCE.md §2.4). Each case runs in a child
process with a time cap; once a case exceeds the cap, larger N are skipped and the output
says so.

The tables give medians per N, the growth exponent (log-log slope between the smallest and
the largest N measured) and the goals. The scheduler gets ``PS_HEARTBEAT_TIMEOUT=3600``: the
simulated nodes send heartbeats only in their own phase.
"""

from __future__ import annotations

import argparse
import gc
import math
import multiprocessing as mp
import os
import re
import resource
import secrets
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import msgspec
import numpy as np
import zmq

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

from _common import PINNED_THREADS, fmt, machine_info, median, print_table, write_json  # noqa: E402

from hetps.balance.plans import PLANS  # noqa: E402
from hetps.balance.reports import longest_named  # noqa: E402
from hetps.balance.wire import unpack_plan  # noqa: E402
from hetps.cluster import protocol as P  # noqa: E402
from hetps.cluster.commands import NodeTable  # noqa: E402
from hetps.cluster.enrol import unpack_groups, unpack_routes, workers_of  # noqa: E402
from hetps.cluster.hostlead import merge_host  # noqa: E402
from hetps.transport.codec import BadMessage, Message, decode, encode  # noqa: E402

PORT_LINE = re.compile(r"hetps scheduler port (\d+)")
ITERATION_S = 1.0  # the iteration the goals are stated against
PLAN_GOAL_S = 0.01 * ITERATION_S  # an Aware re-plan under 1% of a 1 s iteration
SLICE_ELEMS = 1 << 16  # HETPS_SLICE_ELEMS' default: 256 KiB float32 slices
SLICES_PER_SERVER = 4  # the simulated model: this many slices per server
RECV_MAX_BYTES = 1 << 31  # what a worker accepts (HETPS_MAX_MESSAGE_BYTES' default)
PASSED_ON = (P.BARRIER_DONE, P.BALANCE_REPORT)  # what a host's leader passes on to its host


def raise_fd_limit(need: int) -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE towards the hard one (children inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, need)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_mb(pid: int) -> float:
    """The peak resident memory of process ``pid`` (``VmHWM``), in MB."""
    with open(f"/proc/{pid}/status") as f:
        kb = next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:"))
    return kb / 1024


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of process ``pid``'s live threads, from the scheduler's own nanosecond
    accounting (``schedstat``, not clock ticks), by part: ``main`` (the scheduler's loop:
    receive, decode, dispatch), ``zmq`` (ZeroMQ's I/O threads), ``other`` (the services'
    thread, where the planner runs, and the rest); ``all`` is their sum."""
    out = {"main": 0.0, "zmq": 0.0, "other": 0.0}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:  # (a thread that just ended)
            continue
        part = "main" if int(tid) == pid else "zmq" if comm.startswith("ZMQbg") else "other"
        out[part] += ns / 1e9
    out["all"] = sum(out.values())
    return out


# --------------------------------------------------------------------------- the scheduler


class SchedulerProcess:
    """``python -m hetps.cli scheduler`` with the planner on, on an ephemeral port."""

    def __init__(
        self,
        servers: int,
        workers: int,
        scheme: str = "aware",
        heartbeat_s: float = 1.0,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.scheme = scheme
        env = {
            **os.environ,
            **PINNED_THREADS,
            "PYTHONPATH": os.pathsep.join(
                [str(HERE.parent / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
            "DMLC_ROLE": "scheduler",
            "DMLC_PS_ROOT_URI": "127.0.0.1",
            "DMLC_PS_ROOT_PORT": "0",
            "DMLC_NUM_SERVER": str(servers),
            "DMLC_NUM_WORKER": str(workers),
            "HETPS_BALANCE": scheme,
            "HETPS_SLICE_ELEMS": str(SLICE_ELEMS),
            "PS_HEARTBEAT_INTERVAL": str(heartbeat_s),
            "PS_HEARTBEAT_TIMEOUT": "3600",
            "HETPS_CONNECT_TIMEOUT": "600",
            **(extra_env or {}),
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hetps.cli", "scheduler"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self.port: int | None = None
        self._port_seen = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._port_seen.wait(30) or self.port is None:
            self.stop()
            raise RuntimeError("the scheduler printed no port:\n" + "\n".join(self.lines[-20:]))

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            del self.lines[:-200]
            m = PORT_LINE.search(line)
            if m and self.port is None:
                self.port = int(m.group(1))
                self._port_seen.set()
        self._port_seen.set()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def cpu(self) -> float:
        return cpu_seconds(self.proc.pid)

    def threads_cpu(self) -> dict[str, float]:
        return thread_cpu(self.proc.pid)

    def stop(self) -> None:
        """Terminate the scheduler (SIGTERM, then SIGKILL); safe to call twice."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._reader.join(2)


# --------------------------------------------------------------------------- simulated nodes


@dataclass
class Got:
    """One message a simulated node received."""

    t: float
    cmd: str
    req: int
    reply: bool
    raw_bytes: int
    body: dict | None  # None: the codec refused it (``error`` says why)
    error: str | None = None
    local: bool = False  # passed on by its host's leader, not from the scheduler


@dataclass
class SimNode:
    index: int
    role: str
    rank: int
    back: bytes  # the routing id the scheduler connects back with
    sock: zmq.Socket
    id: int = 0  # the node id the table gave it
    got: dict[str, list[Got]] = field(default_factory=dict)


class SimCluster:
    """N simulated nodes speaking the real protocol to one scheduler, in this process."""

    def __init__(
        self,
        port: int,
        servers: int,
        workers: int,
        per_host: int = 1,
        host_control: bool = True,
        merge: bool = True,
    ) -> None:
        n = servers + workers
        # hosts of ``per_host`` workers (HETPS_HOST_GROUP r // per_host); 1: no groups, every
        # worker a host of its own
        self.per_host = per_host
        # a host's workers arrive at a barrier through its leader (HETPS_HOST_CONTROL):
        # leader node index -> the host's other workers, to whom it passes the release on
        self.host_control = host_control and per_host > 1
        self.merge = merge  # a leader merges its host's samples per (host, server) pair
        self.followers: dict[int, list[SimNode]] = {}
        self.ctx = zmq.Context(io_threads=2)
        self.ctx.set(zmq.MAX_SOCKETS, n + 64)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.RCVHWM, 0)
        # the scheduler connects back to every simulated node at once, all on this one
        # listener: a queue of pending connections for each of them (ZeroMQ's default of 100
        # drops the rest, whose connections come a TCP retry of 1, 3, 7... s later), where
        # each real node listens alone
        self.router.setsockopt(zmq.BACKLOG, n + 64)
        self.router.bind("tcp://127.0.0.1:*")
        self.my_port = int(self.router.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
        self.nodes: list[SimNode] = []
        self.by_back: dict[bytes, SimNode] = {}
        for i in range(n):
            role = "server" if i < servers else "worker"
            rank = i if role == "server" else i - servers
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.ROUTING_ID, b"h" + secrets.token_bytes(15))
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.connect(f"tcp://127.0.0.1:{port}")
            node = SimNode(i, role, rank, b"h" + secrets.token_bytes(15), sock)
            self.nodes.append(node)
            self.by_back[node.back] = node
        self.servers = [x for x in self.nodes if x.role == "server"]
        self.workers = [x for x in self.nodes if x.role == "worker"]
        if self.host_control:
            for x in self.workers:
                if x.rank % per_host:
                    self.followers[x.index - x.rank % per_host].append(x)
                else:
                    self.followers[x.index] = []
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self.unknown = 0
        self.total: Counter[str] = Counter()  # messages received per command
        self.keep_refused: bytes | None = None
        self._thread = threading.Thread(target=self._recv_loop, daemon=True, name="sim-recv")
        self._thread.start()

    # -- receiving ------------------------------------------------------------------------
    def _recv_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            while True:
                # what is queued, each message stamped as it is read off the socket; then
                # each is decoded, its node holding it at its arrival plus its own decode
                # (every real node decodes its own, at once: decoding them here one after
                # another would put the others' decodes before a node's "has it")
                batch = []
                while len(batch) < 512:
                    try:
                        frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    batch.append((time.perf_counter(), frames))
                if not batch:
                    break
                for arrived, frames in batch:
                    self._take(arrived, frames)
                with self._cond:  # once per batch: a waiter's check costs no O(N) per message
                    self._cond.notify_all()

    def _take(self, arrived: float, frames: list) -> None:
        """One message read at ``arrived``: decoded as its node would, and kept."""
        start = time.perf_counter()
        node = self.by_back.get(frames[0].bytes)
        raw = sum(len(f) for f in frames[1:])
        try:
            msg = decode(frames[1:], RECV_MAX_BYTES)
            # a plan as the worker's BalanceAgent reads it (hetps.balance.wire)
            body = unpack_plan(msg) if msg.cmd == P.BALANCE_REPORT else msg.body
            now = arrived + time.perf_counter() - start
            got = Got(now, msg.cmd, msg.req, msg.reply, raw, body)
        except BadMessage as exc:  # what a real node's van would drop
            got = Got(arrived, "?", 0, False, raw, None, str(exc))
            if self.keep_refused is None:  # one, to read its figures (plan_s)
                self.keep_refused = frames[1].bytes
        with self._cond:
            if node is None:
                self.unknown += 1
            else:
                node.got.setdefault(got.cmd, []).append(got)
                self.total[got.cmd] += 1
                if got.cmd in PASSED_ON and node.index in self.followers:
                    self._pass_on(node, got)

    def _pass_on(self, leader: SimNode, got: Got) -> None:
        """A host's leader passes its host's release on to the host's other workers, as
        cluster/hostlead.py does (there: a frame on each one's local socket; here: each gets
        it when the leader has read it)."""
        for x in self.followers[leader.index]:
            mine = Got(got.t, got.cmd, got.req, got.reply, got.raw_bytes, got.body, local=True)
            x.got.setdefault(got.cmd, []).append(mine)
            self.total[got.cmd] += 1

    def wait_for(self, pred: Callable[[], bool], timeout: float) -> bool:
        """Wait until ``pred()`` (checked under the receive lock) holds, or ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not pred():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.5))
            return True

    def count(self, cmd: str, nodes: list[SimNode] | None = None, since: int = 0) -> int:
        """Nodes that received ``cmd`` more than ``since`` times (call under the lock)."""
        return sum(1 for x in (nodes or self.nodes) if len(x.got.get(cmd, ())) > since)

    def clear(self, cmd: str) -> None:
        with self._cond:
            for x in self.nodes:
                x.got.pop(cmd, None)

    # -- sending --------------------------------------------------------------------------
    @staticmethod
    def send(node: SimNode, msg: Message) -> float:
        node.sock.send_multipart(encode(msg), copy=True)
        return time.perf_counter()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        for x in self.nodes:
            x.sock.close(linger=0)
        self.router.close(linger=0)
        self.ctx.term()

    # -- phases ---------------------------------------------------------------------------
    def register(self, timeout: float) -> dict:
        """Every node registers at once; returns timings and what the tables said."""
        t0 = time.perf_counter()
        for x in self.nodes:
            body = {
                "role": x.role,
                "host": "127.0.0.1",
                "port": self.my_port,
                "back": x.back,
                "want_rank": x.rank,
            }
            if x.role == "worker" and self.per_host > 1:
                body["host_group"] = x.rank // self.per_host
            self.send(x, Message(P.ADD_NODE, req=1, body=body))
        t_sent = time.perf_counter()
        ok = self.wait_for(lambda: self.total[P.NODES] >= len(self.nodes), timeout)
        with self._cond:
            tables = [x.got.get(P.NODES, [None])[0] for x in self.nodes]
        have = [g for g in tables if g is not None and g.body is not None]
        n = len(self.nodes)
        problems = []
        known: dict[bytes, bool] = {}  # a table (the same bytes for every node) read once
        known_groups: dict[bytes, int] = {}  # the host groups likewise: workers listed
        for x, g in zip(self.nodes, tables, strict=True):
            if g is None or g.body is None:
                continue
            x.id = int(g.body["id"])
            want = P.server_id(x.rank) if x.role == "server" else P.worker_id(x.rank)
            peers = len(self.workers) if x.role == "server" else len(self.servers)
            listed = g.body["nodes"]
            # a table lists the servers, and a node makes the workers' entries from their
            # count and host-group runs (as enrol does), a server their addresses too, and
            # its routing ids with them from its key
            compact = x.role == "worker" or "key" in g.body
            rows_want = len(self.servers) if compact else n
            if not compact:  # (a full table, as an older scheduler sent a server)
                peers = len(self.workers)
            if isinstance(listed, bytes):
                if listed not in known:
                    rows = msgpack.unpackb(listed, raw=False)
                    known[listed] = len(rows) == rows_want and all(len(r) == 5 for r in rows)
                whole = known[listed]
            else:
                whole = len(listed) == rows_want
            if compact:
                runs = g.body.get("group_runs", b"")  # (the same bytes for every node)
                if runs not in known_groups:
                    made = workers_of(msgspec.convert(g.body, NodeTable))
                    grouped = [w.group for w in made] == [w.rank // self.per_host for w in made]
                    known_groups[runs] = len(made) if grouped or self.per_host == 1 else -1
                count = known_groups[runs]
                if x.role == "worker":
                    whole = whole and g.body.get("me", [None])[0] == want
                else:
                    peers = len(self.servers) - 1 if g.body.get("replicas", 1) > 1 else 0
            else:
                packed = g.body.get("groups", [])  # (int32 pairs, the same bytes for every server)
                if not isinstance(packed, bytes):
                    count = len(dict(unpack_groups(packed)))
                elif packed in known_groups:
                    count = known_groups[packed]
                else:
                    count = known_groups[packed] = len(dict(unpack_groups(packed)))
                count = len(self.workers) if self.per_host == 1 else count
            grouped = count == len(self.workers)
            if (
                x.id != want
                or not whole
                or len(unpack_routes(g.body["out"])) != peers
                or not grouped
            ):
                problems.append(x.index)
        t_last = max((g.t for g in have), default=float("nan"))
        return {
            "ok": ok and len(have) == n and not problems,
            "registered": len(have),
            "bad_tables": problems,
            "latency_s": t_last - t0,
            "send_s": t_sent - t0,
            "table_bytes": median(g.raw_bytes for g in have),
            "table_bytes_server": median(
                g.raw_bytes
                for x, g in zip(self.nodes, tables, strict=True)
                if x.role == "server" and g is not None and g.body is not None
            ),
            "table_bytes_total": sum(g.raw_bytes for g in have),
        }

    def barrier(self, rnd: int, timeout: float, skip: frozenset[int] = frozenset()) -> dict:
        """Every node but ``skip`` (indices) enters a barrier of group ``all``."""
        since = {x.index: len(x.got.get(P.BARRIER_DONE, ())) for x in self.nodes}
        base = self.total[P.BARRIER_DONE]
        entering = [x for x in self.nodes if x.index not in skip]
        t_first = time.perf_counter()
        for x in entering:
            body: dict[str, Any] = {"group": "all", "n": rnd + 1}
            if x.index in self.followers:  # a host's leader: one arrival for its host
                host = [x, *self.followers[x.index]]
                body["host"] = [y.id for y in host if y.index not in skip]
            elif self.host_control and x.role == "worker":
                continue  # handed to its leader (a local hand-off, not the scheduler's)
            t_last_in = self.send(x, Message(P.BARRIER, req=100 + rnd, body=body))

        ok = self.wait_for(lambda: self.total[P.BARRIER_DONE] - base >= len(self.nodes), timeout)
        with self._cond:
            got = [
                x.got[P.BARRIER_DONE][since[x.index]]
                for x in self.nodes
                if len(x.got.get(P.BARRIER_DONE, ())) > since[x.index]
            ]
        wrong = [g for g in got if g.req != 100 + rnd or not g.reply]
        t_out = max((g.t for g in got), default=float("nan"))
        return {
            "ok": ok and not wrong,
            "released": len(got),
            "answers": sum(1 for g in got if not g.local),  # the scheduler's messages
            "latency_s": t_out - t_last_in,
            "from_first_s": t_out - t_first,
        }

    def heartbeats(self, sched: SchedulerProcess, interval: float, periods: int) -> dict:
        """One heartbeat per node per ``interval``, spread evenly; scheduler CPU per period."""
        self.clear(P.HEARTBEAT_ACK)
        base = self.total[P.HEARTBEAT_ACK]
        n = len(self.nodes)
        idle0, t_idle0 = sched.cpu(), time.perf_counter()
        time.sleep(interval)
        idle = (sched.cpu() - idle0) / (time.perf_counter() - t_idle0) * interval
        c0, t0 = sched.cpu(), time.perf_counter()
        late = 0.0
        sent = 0
        for p in range(periods):
            for i, x in enumerate(self.nodes):
                due = t0 + p * interval + interval * i / n
                wait = due - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                else:
                    late = max(late, -wait)
                self.send(x, Message(P.HEARTBEAT, req=0))
                sent += 1
        t_end = t0 + periods * interval
        if time.perf_counter() < t_end:
            time.sleep(t_end - time.perf_counter())
        ok = self.wait_for(lambda: self.total[P.HEARTBEAT_ACK] - base >= sent, 10 * interval)
        c1, t1 = sched.cpu(), time.perf_counter()
        with self._cond:
            acked = sum(len(x.got.get(P.HEARTBEAT_ACK, ())) for x in self.nodes)
        per_period = (c1 - c0) / (t1 - t0) * interval
        return {
            "ok": ok,
            "sent": sent,
            "acked": acked,
            "cpu_per_period_s": per_period,
            "idle_cpu_per_period_s": idle,
            "cpu_per_heartbeat_us": (per_period - idle) / n * 1e6,
            "sender_late_s": late,
            "keeps_up": bool(ok and per_period < 0.5 * interval),
        }

    def reports(
        self,
        sched: SchedulerProcess,
        rounds: int,
        timeout: float,
        seed: int,
        paced: bool = False,
        spread: float = 0.0,
    ) -> dict:
        """Every worker reports ``rounds`` times as a BalanceAgent does; plans come back. A
        round's reports are made first and then sent: together, or evenly over ``spread``
        seconds (this process sleeps until each one's time: nothing of its own runs between
        two sends); ``paced``: each one is sent as soon as it is made, so they reach the
        scheduler spread over the time this process takes to make them all (its CPU shared
        with the scheduler's)."""
        S = len(self.servers)
        n_slices = SLICES_PER_SERVER * S
        rng = np.random.default_rng(seed)
        n = len(self.nodes)
        caps = 1.25e8 * rng.choice([1.0, 0.5, 0.25, 0.1], size=(2, n), p=[0.55, 0.25, 0.15, 0.05])
        up, down = caps
        k = self.per_host  # a host's workers share its link: each gets its share of it
        first = np.array([x.index - x.rank % k for x in self.workers])
        up[[x.index for x in self.workers]] = up[first] / k
        down[[x.index for x in self.workers]] = down[first] / k
        srv_idx = np.array([s.index for s in self.servers])
        srv_ids = np.array([s.id for s in self.servers], dtype=float)
        part = SLICES_PER_SERVER * SLICE_ELEMS * 4  # bytes a worker pushes to each server
        W = len(self.workers)
        assign0 = [i % S for i in range(n_slices)]
        out: dict[str, list] = {
            "latency_s": [],
            "plan_s": [],
            "msg_bytes": [],
            "msg_bytes_max": [],
            "report_bytes": [],
            "cpu_s": [],
            **{f"cpu_{part}_s": [] for part in ("all", "main", "zmq", "other")},
            "answers": [],  # the scheduler's plan messages (one per host: its leader's)
            "send_spread_s": [],  # a round's first report sent -> its last
            "made_first": [],  # reports made before a round's first send (paced: 1)
        }
        errors: list[str] = []
        shares_ok = True
        rows = 0
        for rnd in range(1, rounds + 1):
            self.clear(P.BALANCE_REPORT)
            gc.freeze()  # (what the last round kept: as after registration, run_cluster)
            before = self.total[P.BALANCE_REPORT] + self.total["?"]
            base = time.time()
            c0, th0 = sched.cpu(), sched.threads_cpu()
            t_first = t_last = 0.0
            # per server: rank, bytes, seconds of the last round (the agent's second array)
            stats = np.array(
                [[s.rank, part * W, part * W / (down[s.index] + 1.0)] for s in self.servers],
                dtype=np.float64,
            )
            host: list[np.ndarray] = []
            outbox: list[tuple[SimNode, Message]] = []
            for w in self.workers:
                # a push and a pull sample per server, as one float64 array (the agent's form)
                push = np.minimum(up[w.index] / S, down[srv_idx] / W)
                pull = np.minimum(up[srv_idx] / W, down[w.index] / S)
                samples = np.zeros((2 * S, 6))
                samples[0::2, 0], samples[0::2, 1] = w.id, srv_ids
                samples[1::2, 0], samples[1::2, 1] = srv_ids, w.id
                samples[:, 2], samples[:, 3] = part, base
                samples[0::2, 4], samples[1::2, 4] = base + part / push, base + part / pull
                body: dict[str, Any] = {"round": rnd}
                if rnd == 1:
                    body["sizes"] = [n_slices * SLICE_ELEMS]
                    body["assign"] = assign0
                host.append(samples)
                if self.host_control and (w.rank + 1) % k and w.rank + 1 < W:
                    continue  # handed to its host's leader (a local hand-off)
                arrays = [samples, stats]
                if self.host_control:  # the leader: one report for its host (hostlead.py)
                    ids = [self.workers[w.rank - i].id for i in range(len(host) - 1, -1, -1)]
                    merged = np.concatenate(host)
                    rows = [[2 * S, S]] * len(host)
                    times = [stats] * len(host)
                    if self.merge:  # (as the leader merges: cluster/hostlead.py)
                        merged = merge_host(merged, ids)
                        if PLANS[sched.scheme].needs != "history":  # (each one's longest)
                            times = [longest_named(t, S) for t in times]
                        rows = [[len(merged) if i == 0 else 0, len(t)] for i, t in enumerate(times)]
                    body.update(host=ids, host_rows=rows)
                    arrays = [merged, np.concatenate(times)]
                    w = self.workers[w.rank - len(host) + 1]  # (sent by the host's lowest)
                host = []
                outbox.append(
                    (w, Message(P.BALANCE_REPORT, req=1000 + rnd, body=body, arrays=arrays))
                )
                if paced:
                    if not t_first:
                        out["made_first"].append(len(outbox))
                    t_last = self.send(*outbox[-1])
                    t_first = t_first or t_last
                    out["report_bytes"].append(outbox.pop()[1].nbytes)  # (set by its encode)
            if outbox:
                out["made_first"].append(len(outbox))
            gap = spread / max(1, len(outbox) - 1)
            start = time.perf_counter()
            for nth, (w, msg) in enumerate(outbox):  # (k is the host's size)
                wait = start + nth * gap - time.perf_counter()
                if gap and wait > 0:  # (each send's own time: no drift from oversleeping)
                    time.sleep(wait)
                t_last = self.send(w, msg)
                t_first = t_first or t_last
                out["report_bytes"].append(msg.nbytes)
            out["send_spread_s"].append(t_last - t_first)
            ok = self.wait_for(
                lambda before=before: self.total[P.BALANCE_REPORT] + self.total["?"] - before >= W,
                timeout,
            )
            bad = self.wait_for(lambda: self.count("?", self.workers) > 0, 0)
            with self._cond:
                got = [
                    x.got[P.BALANCE_REPORT][0] for x in self.workers if x.got.get(P.BALANCE_REPORT)
                ]
                refused = [x.got["?"][-1] for x in self.workers if x.got.get("?")]
            out["cpu_s"].append(sched.cpu() - c0)
            th1 = sched.threads_cpu()
            for which, secs in th1.items():
                out[f"cpu_{which}_s"].append(secs - th0[which])
            if ok:  # every worker got its answer, decodable or not
                out["latency_s"].append(max(g.t for g in got + refused) - t_last)
            if refused:
                errors.append(
                    f"round {rnd}: {len(refused)} plans refused by the codec: {refused[0].error}"
                )
                out["msg_bytes"].append(refused[0].raw_bytes)
                if self.keep_refused is not None:  # the planner's own time, all the same
                    head = msgpack.unpackb(self.keep_refused, raw=False, strict_map_key=False)
                    b = head.get("b", {})
                    if isinstance(b.get("plan"), bytes):  # packed (hetps.balance.wire)
                        b = msgpack.unpackb(b["plan"], raw=False, strict_map_key=False)
                    out["plan_s"].append(b.get("plan_s"))
                    self.keep_refused = None
                for x in self.workers:
                    x.got.pop("?", None)
            if not ok or bad:
                errors.append(f"round {rnd}: {len(got)} of {W} workers got a plan")
                break
            out["answers"].append(sum(1 for g in got if not g.local))
            out["msg_bytes"].append(median(g.raw_bytes for g in got))
            out["msg_bytes_max"].append(max(g.raw_bytes for g in got))  # rank 0's: the matrix
            rates = next((g.body.get("node_rates") for g in got if g.body), None) or {}
            rows = len(rates.get("up", ()))  # (rank 0's, while the model is small)
            b = got[0].body or {}
            if "error" in b:
                errors.append(f"round {rnd}: planner error: {b['error']}")
                break
            out["plan_s"].append(b.get("plan_s"))
            for g in got:
                gb = g.body or {}
                if (
                    len(gb.get("assign", ())) != n_slices
                    or abs(sum(gb.get("shares", ())) - 1.0) > 1e-9
                    or len(gb.get("shares", ())) != S
                ):
                    shares_ok = False
        return {
            "ok": not errors and shares_ok and len(out["latency_s"]) == rounds,
            "errors": errors,
            "shares_ok": shares_ok,
            "rounds": len(out["latency_s"]),
            "rows": rows,  # rows of the link model rank 0 was told (0: not told)
            "n_slices": n_slices,
            **{k + "_all": v for k, v in out.items()},
            **{k: median(v) for k, v in out.items()},
        }


def run_cluster(
    n: int,
    servers_frac: float = 0.25,
    per_host: int = 1,
    per_server: int = 0,
    scheme: str = "aware",
    barriers: int = 5,
    hb_interval: float = 1.0,
    hb_periods: int = 3,
    rounds: int = 3,
    timeout: float = 120.0,
    seed: int = 0,
    skip_barrier: frozenset[int] = frozenset(),
    phases: tuple[str, ...] = ("register", "barrier", "heartbeat", "report"),
    host_control: bool = True,
    merge: bool = True,
    paced: bool = False,
    spread: float = 0.0,
) -> dict:
    """One cluster of ``n`` simulated nodes against a real scheduler process; with
    ``per_server`` M, ``n`` workers and n / M servers; workers in hosts of ``per_host``."""
    if per_server:
        workers, servers = n, max(1, n // per_server)
    else:
        servers = max(1, round(n * servers_frac))
        workers = n - servers
    raise_fd_limit(8 * (servers + workers) + 256)
    sched = SchedulerProcess(servers, workers, scheme, hb_interval)
    sim = None
    res: dict[str, Any] = {
        "n": n,
        "servers": servers,
        "workers": workers,
        "hosts": -(-workers // per_host),
        "scheme": scheme,
        "host_control": host_control and per_host > 1,
        "merge": merge,
    }
    try:
        sim = SimCluster(sched.port or 0, servers, workers, per_host, host_control, merge)
        c0 = sched.cpu()
        res["register"] = reg = sim.register(timeout)
        # the simulated nodes' state is made: full collections leave it out (4,224 nodes in one
        # process: a collection walked it for 30-80 ms while answers were arriving, where each
        # real node holds its own state alone)
        gc.freeze()
        reg["sched_cpu_s"] = sched.cpu() - c0
        if not reg["ok"]:
            return res
        if "barrier" in phases:
            bars = [sim.barrier(i, timeout, skip_barrier) for i in range(barriers)]
            res["barrier"] = {
                "ok": all(b["ok"] for b in bars),
                "released": min(b["released"] for b in bars),
                "answers": max(b["answers"] for b in bars),
                "latency_s": median(b["latency_s"] for b in bars),
                "from_first_s": median(b["from_first_s"] for b in bars),
                "latency_all_s": [b["latency_s"] for b in bars],
            }
            if not res["barrier"]["ok"]:
                return res
        if "heartbeat" in phases:
            res["heartbeat"] = sim.heartbeats(sched, hb_interval, hb_periods)
        if "report" in phases:
            res["report"] = sim.reports(sched, rounds, timeout, seed, paced, spread)
        res["sched_peak_mb"] = peak_mb(sched.pid)
    finally:
        res["scheduler_alive"] = sched.proc.poll() is None
        res["scheduler_log"] = [ln for ln in sched.lines if "port" not in ln][-10:]
        if sim is not None:
            sim.close()
        sched.stop()
        res["scheduler_exit"] = sched.proc.returncode
    return res


# --------------------------------------------------------------------------- the planner alone


class _PlannerPort:
    """What the planner uses of the scheduler (JobPort): the node table, the answers counted."""

    def __init__(self, servers: int, workers: int, per_host: int) -> None:
        from hetps.cluster.protocol import NodeInfo

        self.nodes = {
            P.worker_id(r): NodeInfo(P.worker_id(r), "worker", r, "h", 1, r // per_host)
            for r in range(workers)
        }
        self.nodes.update(
            {P.server_id(r): NodeInfo(P.server_id(r), "server", r, "h", 2) for r in range(servers)}
        )
        self.dead: set = set()
        self.finished: set = set()
        self.rejoined: dict = {}  # (node -> times taken back)
        self.answers = 0

    def reply(self, msg: Message, body: dict | None = None, arrays: list | None = None) -> None:
        self.answers += 1


def run_planner(workers: int, per_host: int, per_server: int, rounds: int, seed: int) -> dict:
    """Part 3 (``--planner``): the scheduler's services' thread alone, in this process, by
    thread time (the machine's load moves it far less than wall time): a round's host reports
    (as the cluster part makes them: merged by each host's leader) handed to
    ``Planner.handle`` as the scheduler's services' thread hands them, the answers counted,
    not sent. Per round (the first left out: it reads the layout): the CPU of all its
    reports, and of the last one's, which releases the round (the planner's part of the
    last report -> every plan)."""
    from hetps.balance.service import Planner
    from hetps.cluster.commands import decode as decode_body

    servers = max(1, workers // per_server) if per_server else max(1, workers // 3)
    port = _PlannerPort(servers, workers, per_host)
    planner = Planner("aware", workers, servers, False, SLICE_ELEMS)
    rng = np.random.default_rng(seed)
    srv = np.array([P.server_id(r) for r in range(servers)], dtype=float)
    part = SLICES_PER_SERVER * SLICE_ELEMS * 4
    stats = np.array([[s, part * workers, 0.3] for s in range(servers)])
    times = longest_named(stats, servers)
    all_s, last_s = [], []
    for rnd in range(1, rounds + 2):
        msgs = []
        for first in range(0, workers, per_host):
            ids = [P.worker_id(w) for w in range(first, min(first + per_host, workers))]
            rows = []
            for wid in ids:
                push, pull = rng.uniform(1e6, 1e8, (2, servers))
                a = np.zeros((2 * servers, 6))
                a[0::2, 0], a[0::2, 1], a[1::2, 0], a[1::2, 1] = wid, srv, srv, wid
                a[:, 2], a[:, 3] = part, 1000.0 * rnd
                a[0::2, 4], a[1::2, 4] = a[0::2, 3] + part / push, a[1::2, 3] + part / pull
                rows.append(a)
            merged = merge_host(np.concatenate(rows), ids)
            body: dict[str, Any] = {"round": rnd, "host": ids}
            body["host_rows"] = [
                [len(merged) if i == 0 else 0, len(times)] for i in range(len(ids))
            ]
            if rnd == 1:
                n_slices = SLICES_PER_SERVER * servers
                body.update(
                    sizes=[n_slices * SLICE_ELEMS], assign=[i % servers for i in range(n_slices)]
                )
            msg = Message(
                P.BALANCE_REPORT, req=rnd, body=body, arrays=[merged, np.tile(times, (len(ids), 1))]
            )
            msg.sender = ids[0]
            assert decode_body(msg) is None
            msgs.append(msg)
        t0 = time.thread_time()
        for msg in msgs[:-1]:
            planner.handle(port, msg)
        t1 = time.thread_time()
        planner.handle(port, msgs[-1])
        t2 = time.thread_time()
        all_s.append(t2 - t0)
        last_s.append(t2 - t1)
    ok = port.answers == len(msgs) * (rounds + 1)
    return {"workers": workers, "servers": servers, "ok": ok, "round_cpu_s_all": all_s[1:],
            "release_cpu_s_all": last_s[1:], "round_cpu_s": median(all_s[1:]),
            "release_cpu_s": median(last_s[1:])}  # fmt: skip


# --------------------------------------------------------------------------- plan functions


def _network(n: int, servers: int, seed: int, per_link: bool):
    from hetps.balance import Network

    rng = np.random.default_rng(seed)
    levels, probs = [1.0, 0.5, 0.25, 0.1], [0.55, 0.25, 0.15, 0.05]
    up = 1.25e8 * rng.choice(levels, size=n, p=probs)
    down = 1.25e8 * rng.choice(levels, size=n, p=probs)
    if not per_link:
        return Network(up, down)
    link = 1.25e8 * rng.choice(levels, size=(n, n), p=probs)
    return Network(np.full(n, np.inf), np.full(n, np.inf), link)


def _plan_case(case: str, n: int, servers_frac: float, reps: int, budget: float, seed: int):
    """Time one plan function (runs in a child process); returns the seconds of each call."""
    from hetps.balance import assign, layout, make_plan

    S = max(1, round(n * servers_frac))
    coupled = case in ("optimal-lp", "optimal-coupled")
    if coupled:  # co-located per-link caps: link i -> j carries x_i + x_j, the LP's case
        S = n
    total = float(SLICES_PER_SERVER * S * SLICE_ELEMS)
    srv, wrk = list(range(S)), (list(range(n)) if coupled else list(range(S, n)))
    per_link = case in ("optimal-lp", "optimal-coupled", "optimal-link", "aware-link")
    net = _network(n, S, seed, per_link) if case not in ("average", "elastic") else None
    rng = np.random.default_rng(seed)
    history = [
        [(x, 0.002 + x * rng.uniform(1e-8, 4e-8)) for x in rng.uniform(0.5, 1.5, 20) * total / S]
        for _ in range(S)
    ]
    slices = layout([int(total)], SLICE_ELEMS)
    previous = [i % S for i in range(len(slices))]
    name = {"aware-link": "aware", "aware+assign": "aware"}.get(case, case)
    opts: dict[str, Any] = {}
    if case.startswith("optimal"):
        name = "optimal"
        if case == "optimal-lp":
            opts["lp_max_entries"] = None  # the exact LP at any size

    def one() -> np.ndarray:
        shares = (
            make_plan(name, total, network=net, servers=srv, workers=wrk, history=history, **opts)
            if name != "average"
            else make_plan("average", total, servers=srv)
        )
        if case == "aware+assign":
            assign(slices, shares, previous=previous, probe_num=1)
        return shares

    times = []
    t_start = time.perf_counter()
    shares = None
    for _ in range(reps):
        t0 = time.perf_counter()
        shares = one()
        times.append(time.perf_counter() - t0)
        if time.perf_counter() - t_start > budget:
            break
    assert shares is not None and abs(float(np.sum(shares)) - total) <= 1e-6 * total
    return times


def _child(conn, args) -> None:
    try:
        conn.send(("ok", _plan_case(*args)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    conn.close()


PLAN_CASES = (
    "average",
    "elastic",
    "aware",
    "aware+assign",
    "optimal",
    "optimal-link",  # per-link caps, separate roles: separable, the closed form
    "aware-link",  # the same network
    "optimal-lp",  # per-link caps, co-located: coupled, the exact LP at any size
    "optimal-coupled",  # the same, as the library plans it (LP up to LP_MAX_ENTRIES)
)


def run_plans(
    sizes: list[int],
    servers_frac: float,
    reps: int,
    cap_s: float,
    budget_s: float,
    seed: int,
    mem_cap_bytes: float = 2e9,
) -> dict:
    """Time every plan case for every N; a case that exceeds ``cap_s`` (or the memory cap of
    its dense model) is not tried at larger N."""
    ctx = mp.get_context("fork")
    out: dict[str, dict] = {c: {} for c in PLAN_CASES}
    for case in PLAN_CASES:
        stopped = None
        for n in sizes:
            S = max(1, round(n * servers_frac))
            if stopped is not None:
                out[case][n] = {"skipped": stopped}
                continue
            if case in ("optimal-lp", "optimal-coupled", "optimal-link", "aware-link"):
                rows = n * (n - 1)
                need = rows * (S + 1) * 8 * 2  # A (and HiGHS' copy)
                if need > mem_cap_bytes:
                    stopped = f"its dense model needs ~{need / 1e9:.1f} GB (N={n})"
                    out[case][n] = {"skipped": stopped}
                    continue
            parent, child = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_child, args=(child, (case, n, servers_frac, reps, budget_s, seed))
            )
            t0 = time.perf_counter()
            proc.start()
            child.close()
            got = parent.recv() if parent.poll(cap_s + 30) else None
            proc.join(1)
            if proc.is_alive():
                proc.kill()
                proc.join()
            wall = time.perf_counter() - t0
            if got is None:
                stopped = f"N={n} ran over the {cap_s:g} s cap (killed after {wall:.0f} s)"
                out[case][n] = {"killed": True, "wall_s": wall}
                continue
            kind, val = got
            if kind == "error":
                out[case][n] = {"error": val}
                stopped = f"N={n} failed: {val}"
                continue
            med = median(val)
            out[case][n] = {"median_s": med, "min_s": min(val), "reps": len(val)}
            print(
                f"  plan {case:13s} N={n:5d}: median {med * 1e3:9.3f} ms ({len(val)} reps)",
                flush=True,
            )
            if med > cap_s:
                stopped = f"N={n} took {med:.2f} s > the {cap_s:g} s cap"
    return out


# --------------------------------------------------------------------------- report


def slope(points: list[tuple[int, float]]) -> float | None:
    """Log-log slope between the smallest and the largest N with a positive value."""
    pts = [(n, v) for n, v in points if v is not None and v > 0]
    if len(pts) < 2:
        return None
    (n0, v0), (n1, v1) = pts[0], pts[-1]
    return math.log(v1 / v0) / math.log(n1 / n0)


def _ms(x: float | None) -> str:
    return fmt(None if x is None else x * 1e3, ".2f")


def lp_verdict(plans: dict, sizes: list[int]) -> str:
    lp = plans.get("optimal-lp", {})
    slow = [
        n
        for n in sizes
        if lp.get(n, {}).get("median_s", 0) > PLAN_GOAL_S
        or "killed" in lp.get(n, {})
        or "skipped" in lp.get(n, {})
    ]
    fast = [n for n in sizes if 0 < lp.get(n, {}).get("median_s", 1e9) <= PLAN_GOAL_S]
    cp = plans.get("optimal-coupled", {})
    alt = ", ".join(
        f"N={n} {_ms(cp[n].get('median_s'))} ms"
        for n in sizes
        if cp.get(n, {}).get("median_s") is not None
    )
    opt = plans.get("optimal", {})
    cf = ", ".join(
        f"N={n} {_ms(opt[n].get('median_s'))} ms"
        for n in sizes
        if opt.get(n, {}).get("median_s") is not None
    )
    first = f"from N={slow[0]}" if slow else "at no N measured"
    return (
        f"exact LP (optimal, co-located per-link caps) over {PLAN_GOAL_S * 1e3:g} ms {first}"
        f" (under it at N={fast or 'none'}). The planner never calls the LP: it plans on "
        f"per-node caps, where optimal is a closed form ({cf}). The library's optimal on a "
        f"coupled model uses the LP up to LP_MAX_ENTRIES (N=64 co-located), then the better "
        f"of equal and proportional shares: {alt or 'not measured'}."
    )


def report(results: dict) -> None:
    sizes = results["sizes"]
    clusters = {c["n"]: c for c in results["clusters"]}
    rows = []
    metrics: list[tuple[str, Callable[[dict], float | None], Callable]] = [
        ("registration (s)", lambda c: c.get("register", {}).get("latency_s"), fmt),
        ("scheduler peak memory (MB)", lambda c: c.get("sched_peak_mb"), lambda x: fmt(x, ".0f")),
        ("sched CPU for registration (s)", lambda c: c.get("register", {}).get("sched_cpu_s"), fmt),
        (
            "node table (bytes: the median node's, a worker's)",
            lambda c: c.get("register", {}).get("table_bytes"),
            lambda x: fmt(x, ".0f"),
        ),
        (
            "node table per server (bytes: the median server's)",
            lambda c: c.get("register", {}).get("table_bytes_server"),
            lambda x: fmt(x, ".0f"),
        ),
        ("barrier, last in -> all out (ms)", lambda c: c.get("barrier", {}).get("latency_s"), _ms),
        (
            "sched CPU per 1 s heartbeat period (s)",
            lambda c: c.get("heartbeat", {}).get("cpu_per_period_s"),
            fmt,
        ),
        (
            "sched CPU per heartbeat (us)",
            lambda c: c.get("heartbeat", {}).get("cpu_per_heartbeat_us"),
            lambda x: fmt(x, ".1f"),
        ),
        (
            "plans: last report -> all plans (ms)",
            lambda c: c.get("report", {}).get("latency_s"),
            _ms,
        ),
        ("planner plan() (ms)", lambda c: c.get("report", {}).get("plan_s"), _ms),
        ("sched CPU per report round (s)", lambda c: c.get("report", {}).get("cpu_s"), fmt),
        *(
            (
                f"  the same, by thread (ms): {part}",
                lambda c, part=part: c.get("report", {}).get(f"cpu_{part}_s"),
                _ms,
            )
            for part in ("all", "main", "zmq", "other")
        ),
        (
            "a round's reports sent over (ms: first -> last)",
            lambda c: c.get("report", {}).get("send_spread_s"),
            _ms,
        ),
        (
            "plan message (bytes/worker)",
            lambda c: c.get("report", {}).get("msg_bytes"),
            lambda x: fmt(x, ".0f"),
        ),
        (
            "largest plan message (bytes: rank 0's, with the link matrix up to 128 rows)",
            lambda c: c.get("report", {}).get("msg_bytes_max"),
            lambda x: fmt(x, ".0f"),
        ),
        (
            "report message (bytes: a worker's, or its host's leader's for the host)",
            lambda c: c.get("report", {}).get("report_bytes"),
            lambda x: fmt(x, ".0f"),
        ),
    ]
    print("\n== cluster (real scheduler process, simulated nodes; medians) ==")
    for name, get, f in metrics:
        vals = [(n, get(clusters[n]) if n in clusters else None) for n in sizes]
        s = slope(vals)
        rows.append([name, *[f(v) if v is not None else "-" for _, v in vals], fmt(s, ".2f")])
    print_table(["metric", *[f"N={n}" for n in sizes], "slope"], rows)
    for n in sizes:
        c = clusters.get(n, {})
        errs = c.get("report", {}).get("errors") or []
        ok = {k: c.get(k, {}).get("ok") for k in ("register", "barrier", "heartbeat", "report")}
        print(f"  N={n}: {ok}" + (f"; {errs}" if errs else ""))
    plans = results.get("plans") or {}
    if plans:
        print("\n== plan functions (direct, per-node caps unless marked; medians in ms) ==")
        prow = []
        for case in PLAN_CASES:
            cells = []
            pts = []
            for n in sizes:
                r = plans[case].get(n, {})
                v = r.get("median_s")
                pts.append((n, v))
                cells.append(
                    _ms(v)
                    if v is not None
                    else "killed"
                    if r.get("killed")
                    else "skipped"
                    if r.get("skipped")
                    else "error"
                )
            prow.append([case, *cells, fmt(slope(pts), ".2f")])
        print_table(["plan", *[f"N={n}" for n in sizes], "slope"], prow)
        for case in PLAN_CASES:
            notes = {r.get("skipped") for r in plans[case].values() if r.get("skipped")}
            for note in notes:
                print(f"  {case}: larger N skipped: {note}")
    print("\n== goals ==")
    for line in goals(results):
        print("  " + line)


def goals(results: dict) -> list[str]:
    sizes = results["sizes"]
    big = max(sizes)
    clusters = {c["n"]: c for c in results["clusters"]}
    c = clusters.get(big, {})
    plans = results.get("plans") or {}
    out = []
    aw = plans.get("aware+assign", {}).get(big, {}).get("median_s")
    planner = c.get("report", {}).get("plan_s")
    verdict = aw is not None and aw < PLAN_GOAL_S and planner is not None and planner < PLAN_GOAL_S
    out.append(
        f"Aware re-plan < {PLAN_GOAL_S * 1e3:g} ms at N={big}: plan+assign {_ms(aw)} ms, "
        f"the planner's plan() in the scheduler {_ms(planner)} ms -> "
        + ("HOLDS" if verdict else "MISSED")
    )
    hb = c.get("heartbeat", {})
    out.append(
        f"scheduler keeps up with 1 s heartbeats at N={big}: "
        f"{fmt(hb.get('cpu_per_period_s'))} CPU s per period, "
        f"{hb.get('acked')}/{hb.get('sent')} answered -> "
        + ("HOLDS" if hb.get("keeps_up") else "MISSED")
    )
    out.append(lp_verdict(plans, sizes) if plans else "LP: not measured (--skip plans)")
    results["goals"] = out
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="16,64,256,1024", help="total nodes, comma-separated")
    ap.add_argument("--quick", action="store_true", help="N=16,64, fewer repeats (CI)")
    ap.add_argument("--servers-frac", type=float, default=0.25, help="share of servers")
    ap.add_argument(
        "--workers-per-host",
        type=int,
        default=1,
        metavar="K",
        help="workers in hosts of K (HETPS_HOST_GROUP); 1: every worker a host of its own",
    )
    ap.add_argument(
        "--workers-per-server",
        type=int,
        default=0,
        metavar="M",
        help="the sizes count workers, with one server per M of them (instead of --servers-frac)",
    )
    ap.add_argument(
        "--per-process-control",
        action="store_true",
        help="every worker sends its own barrier arrival (HETPS_HOST_CONTROL=0), not its host's "
        "leader one for the host",
    )
    ap.add_argument(
        "--unmerged",
        action="store_true",
        help="a host's leader sends its workers' samples and server times as they are, not "
        "merged per (host, server) pair and each worker's longest",
    )
    ap.add_argument(
        "--paced",
        action="store_true",
        help="each report sent as soon as this process made it (spread over the round's "
        "making), not a round's reports made first and sent together",
    )
    ap.add_argument(
        "--spread-ms",
        type=float,
        default=0.0,
        help="a round's reports, made first, sent evenly over this many ms (0: together)",
    )
    ap.add_argument("--scheme", default="aware", help="HETPS_BALANCE of the scheduler")
    ap.add_argument("--barriers", type=int, default=5)
    ap.add_argument("--hb-interval", type=float, default=1.0)
    ap.add_argument("--hb-periods", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3, help="balance report rounds")
    ap.add_argument("--timeout", type=float, default=120.0, help="per phase wait (s)")
    ap.add_argument("--plan-reps", type=int, default=20)
    ap.add_argument(
        "--plan-cap",
        type=float,
        default=30.0,
        help="a plan case slower than this (s) is not tried at larger N",
    )
    ap.add_argument(
        "--plan-budget", type=float, default=10.0, help="seconds of repeats per plan case"
    )
    ap.add_argument("--skip", nargs="*", default=[], choices=["cluster", "plans"])
    ap.add_argument(
        "--planner",
        action="store_true",
        help="also the planner alone per size (thread time; --workers-per-host, --rounds)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write every figure as JSON")
    args = ap.parse_args(argv)
    sizes = [16, 64] if args.quick else [int(x) for x in args.sizes.split(",")]
    if args.quick:
        args.barriers, args.hb_periods, args.rounds, args.plan_reps = 3, 2, 2, 5
    sizes = sorted(set(sizes))
    info = machine_info()
    print(
        f"scale_sim: sizes {sizes}, {args.servers_frac:g} servers; {info['cpu']}, "
        f"{info['cores']} cores, load {info['loadavg']}",
        flush=True,
    )
    results: dict[str, Any] = {"sizes": sizes, "args": vars(args), "machine": info, "clusters": []}
    if "cluster" not in args.skip:
        for n in sizes:
            t0 = time.perf_counter()
            c = run_cluster(
                n,
                args.servers_frac,
                args.workers_per_host,
                args.workers_per_server,
                args.scheme,
                args.barriers,
                args.hb_interval,
                args.hb_periods,
                args.rounds,
                args.timeout,
                args.seed,
                host_control=not args.per_process_control,
                merge=not args.unmerged,
                paced=args.paced,
                spread=args.spread_ms / 1000.0,
            )
            c["wall_s"] = time.perf_counter() - t0
            results["clusters"].append(c)
            print(f"cluster N={n}: done in {c['wall_s']:.1f} s", flush=True)
    if args.planner:
        results["planner"] = []
        for n in sizes:
            got = run_planner(
                n, args.workers_per_host, args.workers_per_server, args.rounds, args.seed
            )
            results["planner"].append(got)
            print(
                f"planner W={n}, {got['servers']} servers: CPU per round "
                f"{got['round_cpu_s'] * 1e3:.1f} ms, of it the round's last report (its release) "
                f"{got['release_cpu_s'] * 1e3:.1f} ms (medians of {len(got['round_cpu_s_all'])} "
                f"rounds; answers {'all' if got['ok'] else 'MISSING'})",
                flush=True,
            )
    if "plans" not in args.skip:
        results["plans"] = run_plans(
            sizes, args.servers_frac, args.plan_reps, args.plan_cap, args.plan_budget, args.seed
        )
    results["machine"]["loadavg_end"] = os.getloadavg()
    report(results)
    if args.out:
        write_json(args.out, results)
        print(f"wrote {args.out}")
    ok = all(c.get("register", {}).get("ok") for c in results["clusters"])
    ok = ok and all(p["ok"] for p in results.get("planner", []))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
