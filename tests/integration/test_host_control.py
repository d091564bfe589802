"""One barrier arrival per host (cluster/hostlead.py): 2 hosts of 2 worker processes and a
server process against a real scheduler (in this process, to count what it receives); the
host's leader killed mid-job leaves no worker hanging: the others fail naming it. A local
worker killed mid-round under a balance plan with host aggregation: with --elastic the others
go on with the flat job's values and the planner counts its host per process again."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from hetps.cluster import protocol as P
from hetps.roles import make_scheduler
from procs import wait_gone
from roles import loopback_config, role_env

WORKERS, PER_HOST, BARRIERS = 4, 2, 4

SCRIPT = textwrap.dedent("""
    import hashlib, signal, sys, hetps.kv
    import numpy as np
    kv = hetps.kv.create('dist_sync')
    if len(sys.argv) > 2:  # (a barrier of its own: the barriers below count from 2)
        kv.init('v', np.zeros(6000, np.float32))
    if kv.balance:  # rounds of pushes and pulls, each with a link report
        kv.init('w', np.zeros(40000, np.float32))  # (a push a link sample: 64 KB a server)
        for step in range(int(sys.argv[1])):
            kv.rebalance()
            kv.push('w', np.arange(40000, dtype=np.float32) * (kv.rank + 1))
            w = kv.pull('w')
        print('DIGEST', kv.rank, hashlib.sha256(w.tobytes()).hexdigest(), flush=True)  # every element
    for i in range(int(sys.argv[1])):
        kv.barrier()
    print('PASSED', kv.rank, flush=True)
    if len(sys.argv) > 2:  # worker 0 waits here to be killed; the others at the next barrier
        if kv.rank == 0:
            signal.pause()
        kv.barrier()
        print('AFTER', kv.rank, flush=True)
        kv.push('v', np.full(6000, kv.rank + 1, np.float32))  # (elastic: they go on)
        print('VALUES', kv.rank, kv.pull('v').tolist(), flush=True)
        kv.barrier()
    kv.close()
""")


class Job:
    """A scheduler in this process (its host arrivals recorded) and the roles as processes."""

    def __init__(
        self, tmp_path, barriers: int, *script_args: str, code: str = SCRIPT, **env: str
    ) -> None:
        secret = secrets.token_hex(32)
        slice_elems = int(env.pop("HETPS_SLICE_ELEMS", 1000))
        cfg = loopback_config(
            "scheduler",
            num_worker=WORKERS,
            num_server=2,
            secret=secret.encode(),
            heartbeat_timeout=4.0,
            balance=env.get("HETPS_BALANCE", "none"),
            elastic=int(env.get("HETPS_ELASTIC", 0)),
            slice_elems=slice_elems,
        )
        self.sched = make_scheduler(cfg)
        self.arrivals: list[tuple[int, int, list[int]]] = []  # (sender, n, ids it arrives for)
        arrive = self.sched.barriers.arrive

        def counted(msg):
            b = msg.typed
            if b.group == "worker":
                self.arrivals.append((msg.sender, b.n, b.host or [msg.sender]))
            arrive(msg)

        self.sched.barriers.arrive = counted
        self.reports: list[tuple[int, int, list[int]]] = []  # (sender, round, ids)
        self.samples: list[np.ndarray] = []  # each report's link samples, as received
        self.times: list[tuple[np.ndarray, list]] = []  # its server times and host_rows
        if P.BALANCE_REPORT in self.sched.services:
            plan = self.sched.services[P.BALANCE_REPORT]
            self.planner = plan.__self__  # (the scheduler's Planner)

            take = self.sched.quick_parts[P.BALANCE_REPORT]  # (on the loop while idle)

            def keep(msg):
                self.reports.append((msg.sender, msg.typed.round, msg.typed.host or [msg.sender]))
                self.samples.append(np.array(msg.arrays[0]) if msg.arrays else np.zeros((0, 6)))
                times = np.array(msg.arrays[1]) if len(msg.arrays) > 1 else np.zeros((0, 3))
                self.times.append((times, list(msg.typed.host_rows or [])))

            def report(sched, msg):
                keep(msg)
                plan(sched, msg)

            def report_quick(sched, msg):
                keep(msg)
                return take(sched, msg)

            self.sched.services[P.BALANCE_REPORT] = report
            self.sched.quick_parts[P.BALANCE_REPORT] = report_quick
        self.thread = threading.Thread(target=self.sched.run, daemon=True)
        self.thread.start()
        port = self.sched.van.port
        script = tmp_path / "job.py"
        script.write_text(code)
        common = dict(
            servers=2,
            workers=WORKERS,
            HETPS_SLICE_ELEMS=slice_elems,
            clean=True,
            HETPS_SECRET=secret,
            **env,
        )
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-m", "hetps.cli", "server"],
                env=role_env("server", port, **common),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for _ in range(2)
        ]
        for r in range(WORKERS):
            wenv = role_env(
                "worker",
                port,
                **common,
                HETPS_LAUNCH_RANK=r,
                HETPS_HOST_GROUP=r // PER_HOST,
                LOCAL_RANK=r % PER_HOST,
                LOCAL_WORLD_SIZE=PER_HOST,
                PS_HEARTBEAT_TIMEOUT=4,
            )
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, str(script), str(barriers), *script_args],
                    env=wenv,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        self.workers = self.procs[2:]

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
            if p.stdout is not None:
                p.stdout.close()
        self.sched._stop.set()
        self.thread.join(10)
        assert not wait_gone([p.pid for p in self.procs])
        for p in self.procs:  # (what a killed one left: its rings' names)
            for name in glob.glob(f"/dev/shm/hetps-shm-{p.pid}-*"):
                os.unlink(name)


@pytest.fixture
def job(tmp_path):
    made: list[Job] = []
    yield lambda *a, **kw: made.append(Job(tmp_path, *a, **kw)) or made[-1]
    for j in made:
        j.close()


def _finish(j: Job, timeout: float = 120) -> list[str]:
    outs = []
    for p in j.workers:
        out, _ = p.communicate(timeout=timeout)
        outs.append(out)
    return outs


def test_a_barrier_is_one_arrival_per_host(job):
    j = job(BARRIERS)
    outs = _finish(j)
    assert all(p.returncode == 0 for p in j.workers), outs
    assert sorted(int(o.split("PASSED")[1].split()[0]) for o in outs) == list(range(WORKERS))
    # every worker barrier the workers called, as the scheduler received it: from the first
    # barrier on that every local worker reached through its leader, one message per host
    ranks = {nid: info.rank for nid, info in j.sched.nodes.items() if info.role == "worker"}
    by_n: dict[int, list[list[int]]] = {}
    for _sender, n, ids in j.arrivals:
        by_n.setdefault(n, []).append(sorted(ranks[i] for i in ids))
    assert sorted(by_n) == list(range(1, BARRIERS + 1)), j.arrivals
    for n in range(2, BARRIERS + 1):  # (the first may come before a worker connected)
        assert sorted(by_n[n]) == [[0, 1], [2, 3]], (n, j.arrivals)
    # and each message came from its host's leader (its lowest worker)
    leaders = {ranks[s] for s, n, _ in j.arrivals if n >= 2}
    assert leaders == {0, 2}, j.arrivals


def _killed_waiting(j: Job) -> None:
    """Kill worker 0 (host 0's leader) while the others wait at barrier 4 (init's, two, then
    the one worker 0 never reaches)."""
    for p in j.workers:  # every worker passed its barriers; 1 to 3 go to the next
        assert p.stdout is not None
        line = p.stdout.readline()
        while line and "PASSED" not in line:
            line = p.stdout.readline()
        assert "PASSED" in line
    # host 1's leader sent its host's arrival at barrier 4 (worker 1's waits at worker 0)
    deadline = time.monotonic() + 30
    while not any(n == 4 and len(ids) == 2 for _, n, ids in j.arrivals):
        assert time.monotonic() < deadline, j.arrivals
        time.sleep(0.05)  # between looks at what the scheduler received
    os.kill(j.workers[0].pid, signal.SIGKILL)


def test_the_leader_killed_mid_job_fails_the_others_naming_it(job):
    j = job(2, "then-kill")
    _killed_waiting(j)
    outs = _finish(j, timeout=90)  # a hang fails here
    for p, out in zip(j.workers[1:], outs[1:], strict=True):
        assert p.returncode != 0, out
        assert "AFTER" not in out, out
        assert "worker rank 0" in out, out


def test_link_reports_are_one_per_host_and_every_value_is_the_jobs(job):
    rounds = 4
    j = job(rounds, HETPS_BALANCE="aware", HETPS_SLICE_ELEMS="20000")  # (a 80 KB push: sampled)
    outs = _finish(j)
    assert all(p.returncode == 0 for p in j.workers), outs
    # every worker pulled the sum of the four workers' pushes, every element
    want = np.arange(40000, dtype=np.float32) * (1 + 2 + 3 + 4)
    for out in outs:
        digest = re.search(r"DIGEST \d+ ([0-9a-f]{64})", out).group(1)
        assert digest == hashlib.sha256(want.tobytes()).hexdigest(), out
    ranks = {nid: info.rank for nid, info in j.sched.nodes.items() if info.role == "worker"}
    by_round: dict[int, list[list[int]]] = {}
    for sender, rnd, ids in j.reports:
        by_round.setdefault(rnd, []).append(sorted(ranks[i] for i in ids))
        assert ranks[sender] == min(ranks[i] for i in ids), j.reports  # from its leader
    assert sorted(by_round) == list(range(1, rounds + 1)), j.reports
    for rnd in range(2, rounds + 1):  # (the first may come before a worker connected)
        assert sorted(by_round[rnd]) == [[0, 1], [2, 3]], (rnd, j.reports)
    # a host's samples came merged by its leader: its workers named by the leader, and the
    # transfers of each (host, server) pair apart (the planner reads one row per transfer)
    merged = 0
    for (sender, _rnd, ids), samples in zip(j.reports, j.samples, strict=True):
        data = samples[(samples[:, 5] == 0) & (samples[:, 2] > 0) & (samples[:, 4] > samples[:, 3])]
        if len(ids) < 2 or not len(data):
            continue
        merged += 1
        ends = data[:, :2]
        assert not np.isin(ends, [i for i in ids if i != sender]).any(), data
        assert np.isin(ends, [sender]).any(axis=1).all(), data
        for pair in {tuple(x) for x in ends.tolist()}:
            rows = data[(ends == pair).all(axis=1)]
            rows = rows[np.argsort(rows[:, 3])]
            assert (rows[1:, 3] > rows[:-1, 4]).all(), rows
    assert merged >= 2 * (rounds - 1), j.reports
    # and its workers' server times as the planner reads them (aware fits no line per
    # server): each worker's longest, one row that names a server, not one per server
    longest = 0
    for (_sender, _rnd, ids), (times, rows) in zip(j.reports, j.times, strict=True):
        if len(ids) < 2:
            continue
        assert all(r[1] <= 1 for r in rows), (rows, times)
        assert set(times[:, 0].tolist()) <= {0.0, 1.0} and (times[:, 2] > 0).all(), times
        longest += len(times)
    assert longest >= 4 * (rounds - 2), j.times
    # the hosts sum their workers' pushes and push once: their leaders' reports say so
    assert all(j.planner.one_push.values())


def test_the_leader_killed_under_elastic_leaves_the_others_going_on(job):
    """--elastic: worker 0 is let go, the others pass the barrier its host waited at, push
    and pull a round without it (every element the survivors' sum on each of them), and the
    next barrier comes from host 0's next worker and host 1's leader."""
    j = job(2, "then-kill", HETPS_ELASTIC="2")
    _killed_waiting(j)
    outs = _finish(j, timeout=90)  # a hang fails here
    for p, out in zip(j.workers[1:], outs[1:], strict=True):
        assert p.returncode == 0, out
        values = json.loads(re.search(r"VALUES \d+ (\[.*\])", out).group(1))
        assert values == [2.0 + 3.0 + 4.0] * 6000, out
    ranks = {nid: info.rank for nid, info in j.sched.nodes.items() if info.role == "worker"}
    last = sorted(sorted(ranks[i] for i in ids) for _, n, ids in j.arrivals if n == 5)
    assert last == [[1], [2, 3]], j.arrivals


# Under a balance plan with host aggregation and --elastic: worker 3 (host 1's follower)
# pushes round KILL_AT and is killed before its pull; every round's value of every survivor is
# the flat job's sum bit for bit (host 0's two, then host 1's: both until the round worker 3
# gave, then worker 2 alone), and its host's reports say that it pushes its own from then on.
BALANCED_KILL = textwrap.dedent("""
    import json, os, signal, hetps.kv
    import numpy as np
    N, KILL_AT = 4 * 4096, 2
    kv = hetps.kv.create('dist_sync')
    me = 2 * kv.cfg.host_group + kv.cfg.local_rank
    kv.init('w', np.zeros(N, np.float32))
    rngs = [np.random.default_rng(r) for r in range(4)]  # every worker's gradients, known to all
    rounds = []
    for step in range(6):
        kv.rebalance()
        g = [r.standard_normal(N).astype(np.float32) for r in rngs]
        kv.push('w', g[me])
        if step == KILL_AT and me == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        w = kv.pull('w')
        flat = (g[0] + g[1]) + ((g[2] + g[3]) if step <= KILL_AT else g[2])
        rounds.append([int((w.view(np.uint32) != flat.view(np.uint32)).sum()),
                       kv.short_rounds('w')])
    print('ROUNDS', me, json.dumps(rounds), flush=True)
    kv.close()
""")


@pytest.mark.parametrize("elastic", ["2", pytest.param("0", marks=pytest.mark.slow)])
def test_a_local_worker_killed_under_a_balance_plan(job, elastic):
    """--elastic: the others go on, every value the flat job's; else each fails naming it."""
    j = job(0, code=BALANCED_KILL, HETPS_BALANCE="aware", HETPS_ELASTIC=elastic,
            HETPS_SLICE_ELEMS="4096", HETPS_PROBE_PROB="1")  # fmt: skip
    outs = _finish(j, timeout=90)  # a hang fails here
    assert j.workers[3].returncode == -signal.SIGKILL, outs[3]
    if elastic == "0":
        for p, out in zip(j.workers[:3], outs[:3], strict=True):
            assert p.returncode != 0 and "ROUNDS" not in out, out
            assert re.search(r"worker rank 3\b|local rank 1 \(pid \d+\) of host group 1", out), out
        return
    for me, (p, out) in enumerate(zip(j.workers[:3], outs[:3], strict=True)):
        assert p.returncode == 0, out
        rounds = json.loads(re.search(rf"ROUNDS {me} (\[.*\])", out).group(1))
        # every element of every round the flat job's; the round worker 3 died in summed 4
        assert [r[0] for r in rounds] == [0] * 6, rounds
        # and every survivor knows the rounds after it hold 3 workers' gradients
        assert [r[1] for r in rounds] == [[]] * 3 + [[[0, 4 * 4096, 3]]] * 3, rounds
    # the planner counts host 0's one push and host 1's worker 2 pushing its own
    assert {r: j.planner.one_push[r] for r in range(3)} == {0: True, 1: True, 2: False}
