"""A host's link samples merged by its leader (cluster/hostlead.py ``merge_host``) before they
reach the planner: every node's bytes and busy time, so every node rate and every plan, are
those of the host's workers' own samples; probes and spread flows pass unchanged."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from hetps.balance.reports import times_shrink
from hetps.balance.service import Planner
from hetps.balance.wire import unpack_plan
from hetps.cluster import commands
from hetps.cluster import protocol as P
from hetps.cluster.hostlead import HostLead, Report, merge_host
from hetps.cluster.protocol import NodeInfo
from hetps.transport.codec import Message

S, W, K = 3, 6, 3  # servers, workers, workers per host
GROUPS = [r // K for r in range(W)]


def _host_samples(rng: np.random.Generator, host: int, rnd: int) -> list[np.ndarray]:
    """Each worker of ``host``: a few pushes and pulls per server at random, overlapping
    times (some touching, some apart), a probe, a spread flow and rows the planner drops."""
    out = []
    base = 1000.0 * rnd
    for r in range(host * K, host * K + K):
        rows = []
        for s in range(S):
            for _ in range(int(rng.integers(1, 5))):
                t0 = base + float(rng.choice([0.0, 0.5, 1.0])) + rng.random() * 0.3
                t1 = t0 + (0.05 + rng.random() * 0.4) * (4.0 if s == 0 else 1.0)  # a slow server
                nbytes = float(rng.integers(1, 1 << 20))
                if rng.random() < 0.5:
                    rows.append([P.worker_id(r), P.server_id(s), nbytes, t0, t1, 0])
                else:
                    rows.append([P.server_id(s), P.worker_id(r), nbytes, t0, t1, 0])
        rows.append([P.worker_id(r), P.server_id(0), 5e5, base + 2, base + 2.01, 1])  # probe
        rows.append([P.server_id(1), P.worker_id(r), 7e5, base + 3, base + 3.1, 2])  # spread
        rows.append([P.worker_id(r), P.server_id(2), 0.0, base, base + 1, 0])  # no bytes
        rows.append([P.worker_id(r), P.server_id(2), 9.0, base + 1, base + 1, 0])  # no time
        order = rng.permutation(len(rows))
        out.append(np.array(rows, dtype=np.float64)[order])
    return out


def _data(a: np.ndarray) -> np.ndarray:
    """The data transfers the planner reads (kind 0, bytes and time)."""
    return (a[:, 5] == 0) & (a[:, 2] > 0) & (a[:, 4] > a[:, 3])


def _union(intervals: np.ndarray) -> float:
    total, end = 0.0, -np.inf
    for a, b in sorted(intervals.tolist()):
        total += max(0.0, b - max(a, end))
        end = max(end, b)
    return total


def test_merged_rows_keep_every_nodes_bytes_and_busy_time():
    rng = np.random.default_rng(7)
    for trial in range(20):
        raw = np.concatenate(_host_samples(rng, trial % 2, trial + 1))
        ids = [P.worker_id(r) for r in range((trial % 2) * K, (trial % 2) * K + K)]
        merged = merge_host(raw, ids)
        m, d = merged[_data(merged)], raw[_data(raw)]
        assert len(m) < len(d)  # merged: fewer rows
        # the host's workers are named by its first; each pair's transfers never overlap
        assert set(m[:, :2].ravel()) - {float(P.server_id(s)) for s in range(S)} == {ids[0]}
        for pair in {(a, b) for a, b in m[:, :2].tolist()}:
            rows = m[(m[:, 0] == pair[0]) & (m[:, 1] == pair[1])]
            rows = rows[np.argsort(rows[:, 3])]
            assert (rows[1:, 3] > rows[:-1, 4]).all(), rows
        for col in (0, 1):  # per sending (0) and receiving (1) node: bytes and busy union
            nodes = np.where(np.isin(d[:, col], ids), ids[0], d[:, col])  # (the host's: one)
            for n in set(nodes.tolist()):
                mine_d, mine_m = d[nodes == n], m[m[:, col] == n]
                assert mine_m[:, 2].sum() == mine_d[:, 2].sum()
                assert _union(mine_m[:, 3:5]) == pytest.approx(_union(mine_d[:, 3:5]), rel=1e-12)
        # probes, spread flows and the rows the planner drops: unchanged, in their order
        assert np.array_equal(merged[~_data(merged)], raw[~_data(raw)])


class _Sched:
    def __init__(self) -> None:
        self.nodes = {
            P.worker_id(r): NodeInfo(P.worker_id(r), "worker", r, "h", 1, g)
            for r, g in enumerate(GROUPS)
        }
        self.dead: set = set()
        self.finished: set = set()
        self.rejoined: dict = {}  # (node -> times taken back)
        self.answers: list = []

    def reply(self, msg, body, arrays=None):
        self.answers.append(unpack_plan(Message(msg.cmd, body=body, arrays=arrays or [])))


def _report(rnd: int, host: int, parts: list[np.ndarray], merge: bool) -> Message:
    """Host ``host``'s one report as its leader sends it (cluster/hostlead.py)."""
    ids = [P.worker_id(r) for r in range(host * K, host * K + K)]
    times = [np.array([[s, 1e6, 0.1 + 0.01 * r] for s in range(S)]) for r in range(K)]
    samples = np.concatenate(parts)
    rows = [[len(p), len(t)] for p, t in zip(parts, times, strict=True)]
    if merge:
        samples = merge_host(samples, ids)
        rows = [[len(samples) if i == 0 else 0, r[1]] for i, r in enumerate(rows)]
    body = {"round": rnd, "host": ids, "host_rows": rows}
    if rnd == 1:
        body.update(sizes=[12 * 1024], assign=[i % S for i in range(12)])
    msg = Message(P.BALANCE_REPORT, body=body, arrays=[samples, np.concatenate(times)])
    msg.sender = ids[0]
    assert commands.decode(msg) is None
    return msg


def test_a_planner_fed_merged_reports_plans_as_with_each_workers_samples():
    rng = np.random.default_rng(3)
    rounds = [[_host_samples(rng, h, rnd) for h in range(W // K)] for rnd in range(1, 6)]
    got = []
    for merge in (False, True):
        p = Planner("aware", W, S, False, slice_elems=1024, patience=1)
        sched = _Sched()
        rates = []
        for rnd, hosts in enumerate(rounds, start=1):
            for h, parts in enumerate(hosts):
                p.handle(sched, _report(rnd, h, parts, merge))
            rates.append(np.r_[p.links.up, p.links.down])
        assert len(sched.answers) == len(rounds) * (W // K)  # one per host
        assert p.n_nodes == S + W // K
        plans = [{k: a[k] for k in ("assign", "shares", "epoch")} for a in sched.answers]
        got.append((np.array(rates), plans, sorted(p._spread), p.links.single()))
    (rates0, plans0, spread0, single0), (rates1, plans1, spread1, single1) = got
    assert np.isfinite(rates0).all()
    np.testing.assert_allclose(rates1, rates0, rtol=1e-12)
    assert plans1 == plans0
    assert len({p["epoch"] for p in plans0}) > 1  # (the plans moved: the rates mattered)
    assert spread1 == spread0
    for a, b in zip(single1, single0, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("balance", ["aware", "elastic"])
def test_a_hosts_report_carries_each_workers_longest_time_unless_the_plan_fits_lines(balance):
    # the leader's report (HostLead._merged) of two workers' server times: aware reads only
    # each one's longest that names a server (rank 5 names none of 2); elastic fits a line per
    # server from all of them
    times = {9: [[0, 1e6, 0.2], [1, 2e6, 0.5], [5, 1e6, 9.0]], 11: [[0, 3e6, 0.3], [1, 1e6, 0.1]]}
    batch = {
        i: Report(s=b"", t=np.array(t, dtype=np.float64).tobytes(), b={"round": 2})
        for i, t in times.items()
    }
    cfg = SimpleNamespace(colocate=False)
    lead = SimpleNamespace(node=SimpleNamespace(cfg=cfg), shrink_times=times_shrink(balance, 2))
    msg = HostLead._merged(lead, 2, [9, 11], batch)
    if balance == "aware":
        assert msg.arrays[1].tolist() == [[1, 2e6, 0.5], [0, 3e6, 0.3]]
        assert msg.body["host_rows"] == [[0, 1], [0, 1]]
    else:
        assert msg.arrays[1].tolist() == times[9] + times[11]
        assert msg.body["host_rows"] == [[0, 3], [0, 2]]
