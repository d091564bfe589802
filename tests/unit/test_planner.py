"""The scheduler's load planner, driven directly (no processes): which links count, and the
hysteresis that keeps a plan unless a new one is predicted to be clearly faster."""

from __future__ import annotations

import numpy as np
import pytest

from hetps.balance.service import Planner
from hetps.balance.slicing import layout

MB = 1e6


def _planner(
    scheme: str, margin: float, colocate: bool = False, patience: int = 1, n: int | None = None
) -> Planner:
    p = Planner(
        scheme,
        num_workers=n or 2,
        num_servers=n or 3,
        colocate=colocate,
        slice_elems=100,
        margin=margin,
        patience=patience,
    )
    p.slices = layout([12000], 100)  # 120 slices, 40 per server
    p.assignment = np.array([0, 1, 2] * 40, dtype=np.int64)
    return p


def _observe(p: Planner, rates_mb: dict[tuple[int, int], float]) -> None:
    for (i, j), r in rates_mb.items():
        p.table.observe(i, j, r * MB, 0.0, 1.0)


class _Sched:
    """What the planner needs of the scheduler: its workers, and where answers go."""

    def __init__(self, workers: int = 0) -> None:
        from hetps.cluster import protocol as P

        self.nodes = {P.worker_id(r): type("N", (), {"role": "worker"})() for r in range(workers)}
        self.dead: set = set()
        self.finished: set = set()
        self.rejoined: dict = {}  # (node -> times taken back)
        self.answers: list = []
        self.to: list = []  # who got each answer
        self.raw: list = []  # each answer as sent: (body, arrays)

    def reply(self, msg, body, arrays=None):
        from hetps.balance.wire import unpack_plan
        from hetps.transport.codec import Message

        self.raw.append((body, arrays or []))
        self.to.append(msg.sender)
        self.answers.append(unpack_plan(Message(msg.cmd, body=body, arrays=arrays or [])))


def _report(p: Planner, sched: _Sched, rank: int, rnd: int, samples: list, **body) -> None:
    """Worker ``rank``'s balance report of round ``rnd``."""
    from hetps.cluster import commands
    from hetps.cluster import protocol as P
    from hetps.transport.codec import Message

    msg = Message("balance_report", body={"round": rnd, "samples": samples, **body})
    msg.sender = P.worker_id(rank)
    assert commands.decode(msg) is None  # (as the scheduler's dispatch does first)
    p.handle(sched, msg)


def test_unused_links_are_zero_and_used_unmeasured_links_are_filled():
    p = _planner("optimal", 0.05)
    # servers 0..2, workers 3..4; only server<->worker links carry traffic
    _observe(p, {(0, 3): 10, (3, 0): 30})
    m = p.link_matrix()
    assert m[0, 1] == 0 and m[3, 4] == 0 and m[1, 2] == 0  # server-server, worker-worker
    assert m[0, 3] == 10 * MB and m[3, 0] == 30 * MB
    assert m[2, 4] == 20 * MB  # the median of the measured used links
    assert np.isinf(m[0, 0])


def test_colocated_uses_every_pair():
    p = Planner("optimal", 3, 3, colocate=True, slice_elems=100)
    assert p.used_links().sum() == 6  # 3 x 3 minus the diagonal


def _slow_server_rates(slow: float) -> dict[tuple[int, int], float]:
    rates = {}
    for s in range(3):
        for w in (3, 4):
            rates[(s, w)] = slow if s == 2 else 100.0
            rates[(w, s)] = 100.0
    return rates


def test_a_clearly_better_plan_is_adopted():
    p = _planner("optimal", 0.05)
    _observe(p, _slow_server_rates(1.0))
    out = p.plan()
    assert out["epoch"] == 1 and out["kept"] == 0
    assert out["shares"][2] < 0.1  # the slow server is (nearly) emptied


def test_a_marginally_better_plan_is_not_adopted():
    # server 2 sends at 95% of the others: the optimum moves two slices off it for a
    # predicted gain of about 2.7%, below the 5% margin, so the assignment (and epoch) stay
    p = _planner("optimal", 0.05)
    _observe(p, _slow_server_rates(95.0))
    before = p.assignment.copy()
    out = p.plan()
    assert out["epoch"] == 0 and out["kept"] == 1
    assert out["assign"] == before.tolist()
    # with no margin the same estimate does change the plan
    q = _planner("optimal", 0.0)
    _observe(q, _slow_server_rates(95.0))
    assert q.plan()["epoch"] == 1


def test_average_never_consults_the_margin():
    p = _planner("average", 0.05)
    _observe(p, _slow_server_rates(1.0))
    out = p.plan()
    assert out["epoch"] == 0 and out["kept"] == 0 and out["shares"] == [1 / 3] * 3


def test_link_rate_is_bytes_over_busy_time():
    from hetps.balance.links import union_lengths

    group, t0, t1 = (
        np.array([0, 0, 0, 1, 1]),
        np.array([0, 0.5, 3, 0, 1.0]),
        np.array([1, 2, 4, 4, 2.0]),
    )
    assert union_lengths(group, t0, t1, 2).tolist() == [3.0, 4.0]


def test_node_rates_come_from_busy_time_across_all_flows():
    p = _planner("optimal", 0.1, colocate=False)
    # node 0 (server 0) sends 1 MB to worker 3 in [0, 1] and 1 MB to worker 4 in [0.5, 1.5]:
    # 2 MB over 1.5 s busy. Node 3 receives only the first: 1 MB over 1 s.
    p.links.observe_nodes([(0, 3, 0.0, 1.0, 1e6), (0, 4, 0.5, 1.5, 1e6)])
    assert p.links.up[0] == pytest.approx(2e6 / 1.5)
    assert p.links.down[3] == pytest.approx(1e6) and p.links.down[4] == pytest.approx(1e6)
    assert np.isnan(p.links.up[1])
    net = p.links.node_network()
    assert net is not None and net.up[1] == pytest.approx(np.median([2e6 / 1.5, 1e6, 1e6]))
    # too few bytes in a round: no sample
    p.links.observe_nodes([(1, 3, 0.0, 1.0, 1000.0)])
    assert np.isnan(p.links.up[1])


def test_plans_use_the_node_rates():
    p = _planner("optimal", 0.0, colocate=False)
    p.patience = 1
    # server 2 sends at 1 MB/s, servers 0 and 1 at 100 MB/s; workers receive fast
    samples = []
    for s, rate in ((0, 100e6), (1, 100e6), (2, 1e6)):
        samples.append((s, 3, 0.0, 1e6 / rate, 1e6))
    samples.append((0, 4, 0.0, 0.01, 1e6))
    p.links.observe_nodes(samples)
    out = p.plan()
    assert out["shares"][2] < 0.05 and p.report_fields()["node_rates"]["up"][2] == pytest.approx(
        1e6
    )


def test_patience_needs_the_gain_in_consecutive_reports():
    # server 2 at 70% of the others: a real but modest gain (below BIG_GAIN)
    p = _planner("optimal", 0.05, patience=2)
    _observe(p, _slow_server_rates(70.0))
    first = p.plan()
    assert first["epoch"] == 0 and first["kept"] == 1  # one report is not enough
    second = p.plan()
    assert second["epoch"] == 1 and second["shares"][2] < 0.3


def test_capacity_is_the_larger_of_busy_rate_and_recent_probes():
    p = _planner("optimal", 0.1)
    p.links.observe_nodes([(0, 3, 0.0, 1.0, 1e6)])  # data: server 0 sent at 1 MB/s
    p.links.observe_probe(2, 4, 9e6)  # worker 4 can receive at 9 MB/s at least
    p.links.observe_probe(2, 3, 9e6)
    p.links.observe_probe(0, 4, 3e6)  # so server 0's 3 MB/s probe to it was server 0's own limit
    p.links.observe_probe(1, 3, 0.5e6)
    up, down = p.links.capacity()
    assert up[0] == pytest.approx(3e6) and up[1] == pytest.approx(0.5e6)
    assert down[4] == pytest.approx(9e6)  # the fastest probe into it


def test_probe_window_is_a_cycle_and_keeps_a_fast_peer_among_slow_ones():
    # 8 co-located nodes: a cycle of 7 probes; 3 nodes: 2
    assert _planner("optimal", 0.1, colocate=True, n=8).links.probe_window == 7
    p = _planner("optimal", 0.1, colocate=True, n=3)
    assert p.links.probe_window == 2
    # node 2 receives from a slow node (1 MB/s) and a fast one (10 MB/s): it is fast
    p.links.observe_probe(0, 2, 1e6)
    p.links.observe_probe(1, 2, 10e6)
    assert p.links.capacity()[1][2] == pytest.approx(10e6)
    # node 0 slows down: within one cycle its probes (to anyone) read slow
    p.links.observe_probe(0, 1, 8e6)
    p.links.observe_probe(0, 2, 1e6)
    assert p.links.capacity()[0][0] == pytest.approx(8e6)
    p.links.observe_probe(0, 1, 1e6)
    assert p.links.capacity()[0][0] == pytest.approx(1e6)


def test_old_probes_age_out_of_the_window():
    p = _planner("optimal", 0.1)
    p.links.observe_probe(0, 4, 8e6)
    assert p.links.capacity()[0][0] == pytest.approx(8e6)
    for _ in range(p.links.probe_window):  # its link got slow
        p.links.observe_probe(0, 4, 1e6)
    assert p.links.capacity()[0][0] == pytest.approx(1e6)


def test_probe_samples_are_told_apart_in_reports():
    from hetps.cluster import protocol as P

    p = _planner("optimal", 0.1)
    w0, s2 = P.worker_id(0), P.server_id(2)
    _report(p, _Sched(), 0, 1, [[w0, s2, 1e5, 0.0, 0.1, 1]])
    assert p.links._probe_up[3] == [pytest.approx(1e6)] and p.links._probe_down[2] == [
        pytest.approx(1e6)
    ]
    assert np.isnan(p.table.estimate(3, 2))  # not a data sample


def test_a_spread_probe_reads_a_node_faster_than_every_peer():
    """3 co-located nodes; node 0 can send 12 MB/s, its peers receive 8 each: its single-flow
    probes read 8. Its spread (two flows at once) reads their total over their common span,
    and counts while node 0 stays censored (its probes as fast as its fastest peer's)."""
    p = _planner("optimal", 0.1, colocate=True, n=3)
    p.links.observe_probe(0, 1, 8e6)
    p.links.observe_probe(0, 2, 8e6)
    p.links.observe_probe(1, 2, 8e6)
    p.links.observe_probe(2, 1, 8e6)
    assert p.links.capacity()[0][0] == pytest.approx(8e6)
    assert list(p.links.censored()[0]) == [True, True, True]  # each as fast as its fastest peer
    # fan-out from 0: 1 MB to each of 1 and 2, over 0.0-0.17 s and 0.01-0.16 s; after 0.16 s
    # the flow to node 1 ran alone, at most 1.1 x 8 MB/s, so by then 2 MB - 88 kB had arrived
    p.links.observe_spread([(0, 1, 0.0, 0.17, 1e6, False), (0, 2, 0.01, 0.16, 1e6, False)])
    up, down = p.links.capacity()
    reading = (2e6 - 1.1 * 8e6 * 0.01) / 0.16
    assert up[0] == pytest.approx(reading)  # ~11.95 MB/s, not 8
    assert np.isnan(p.links.spread_down[1]) and np.isnan(
        p.links.spread_down[2]
    )  # lone flows: no reading
    assert p.links.spreads_seen == 1
    p.plan()
    rates = p.report_fields()["node_rates"]  # reports show where a cap came from
    assert rates["spread_up"][0] == pytest.approx(reading) and rates["spread_down"][1] is None
    assert rates["probe_up"][0] == pytest.approx(8e6) and rates["up"][0] == rates["spread_up"][0]
    # node 0 slows down: its single-flow probes now read well below its peers', so it is not
    # censored any more and the old spread reading no longer counts
    for j in (1, 2):
        p.links.observe_probe(0, j, 2e6)
        p.links.observe_probe(3 - j, j, 8e6)  # the other peer still reaches j at 8
    assert not p.links.censored()[0][0]
    assert p.links.capacity()[0][0] == pytest.approx(2e6)


def test_spread_readings_age_out_and_a_late_first_stamp_gives_none():
    p = _planner("optimal", 0.1, colocate=True, n=3)
    for src, dst in [(0, 1), (0, 2), (1, 2), (2, 1), (1, 0), (2, 0)]:
        p.links.observe_probe(src, dst, 8e6)  # everyone as fast as everyone: all censored
    p.links.observe_spread([(0, 1, 0.0, 0.1, 1e6, False), (0, 2, 0.0, 0.1, 1e6, False)])
    assert p.links.capacity()[0][0] == pytest.approx(2e7)
    # node 0 slowed to its peers' speed: nothing in the single-flow probes shows it, but
    # the old reading expires once every censored node has had a turn (2 x 3 + 1 spreads)
    for _ in range(7):
        p.links.observe_spread([], done=True)  # spreads of other nodes (their flows do not matter)
    assert p.links.capacity()[0][0] == pytest.approx(2e7)
    p.links.observe_spread([], done=True)
    assert p.links.capacity()[0][0] == pytest.approx(8e6)
    # the earliest flow's forecast was stamped late: its span is short, the reading high
    p.links.observe_spread([(0, 1, 0.0, 0.1, 1e6, True), (0, 2, 0.05, 0.1, 1e6, False)])
    assert p.links.capacity()[0][0] == pytest.approx(8e6)
    assert p.links.spreads_seen == 10  # every spread made counts as a turn, with or without flows
    p.links.observe_spread([])  # a round without a spread
    assert p.links.spreads_seen == 10


def test_spread_targets_skip_workers_that_finished():
    p = _planner("optimal", 0.1, colocate=True, n=3)
    for src, dst in [(0, 1), (0, 2), (1, 2), (2, 1), (1, 0), (2, 0)]:
        p.links.observe_probe(src, dst, 8e6)
    assert p.spread_targets() == ["out", 0, [1, 2]]
    assert p.spread_targets(live={1, 2}) == ["out", 1, [0, 2]]  # worker 0 is done
    p.links.spreads_seen = 1  # an "in" turn, for server 0: but only worker 2 could send to it
    assert p.spread_targets() == ["in", 0, [1, 2]]
    assert p.spread_targets(live={0, 2}) == ["out", 0, [1, 2]]  # so the other direction


def test_spread_targets_take_censored_nodes_in_turn_one_direction_at_a_time():
    """Directions alternate; within one, the censored node whose last turn is oldest."""
    p = _planner("optimal", 0.1, colocate=True, n=4)
    assert p.spread_targets() is None  # nothing known: nothing censored
    # sending: node 1 reads 9 (its fastest receiver takes 9.5: censored), node 2 reads 9.2,
    # node 0 reads 3 (clearly its own limit); receiving: only node 3 is near its best sender
    for src, dst, r in [(1, 3, 9e6), (2, 3, 9.2e6), (0, 3, 3e6), (3, 0, 2e6), (1, 0, 9.5e6)]:
        p.links.observe_probe(src, dst, r)
    cen_up, cen_down = p.links.censored()
    assert list(np.flatnonzero(cen_up)) == [1, 2] and list(np.flatnonzero(cen_down)) == [0, 3]
    picks = []
    for k in range(6):
        p.links.spreads_seen = k
        picks.append(p.spread_targets())
        p.links._last_turn[(picks[-1][0], picks[-1][1])] = k  # what the next report tells it
    # the peers: the fastest at the other end, until they sum to twice the node's estimate
    assert picks == [
        ["out", 1, [0, 2, 3]],  # 9.5 + 9.35 (unknown: the median) < 2 x 9.5: a third one
        ["in", 0, [1, 2, 3]],
        ["out", 2, [0, 1]],  # 9.5 + 9.35 >= 2 x 9.2
        ["in", 3, [1, 2]],
        ["out", 1, [0, 2, 3]],
        ["in", 0, [1, 2, 3]],
    ]
    assert _planner("average", 0.1, colocate=True, n=4).spread_targets() is None
    # 2 co-located nodes: a spread would be one flow, which reads nothing new
    two = _planner("optimal", 0.1, colocate=True, n=2)
    two.links.observe_probe(0, 1, 5e6)
    two.links.observe_probe(1, 0, 5e6)
    assert two.spread_targets() is None
    # separate workers and servers: a worker rank to fan out from, a server rank to fan in
    q = _planner("aware", 0.1)  # 2 workers (matrix rows 3, 4), 3 servers (0-2)
    q.links.observe_probe(4, 1, 5e6)
    q.links.observe_probe(3, 0, 5e6)
    assert q.spread_targets() == ["out", 0, [0, 1]]  # worker 0 = row 3: as fast as server 0


def test_spread_samples_are_collected_per_round_and_read_when_it_is_complete():
    from hetps.cluster import protocol as P

    p = _planner("optimal", 0.1, colocate=True, n=3)
    sched = _Sched(workers=3)
    # fan-in to node 0 from workers 1 and 2, each reporting its own flow
    flows = {
        1: [P.worker_id(1), P.server_id(0), 1e6, 0.0, 0.1, 2],
        2: [P.worker_id(2), P.server_id(0), 1e6, 0.05, 0.2, 2],
    }
    for r in range(3):
        # each sender says which spread it took part in
        extra = {"spread_done": ["in", 0]} if r in flows else {}
        _report(p, sched, r, 1, [flows[r]] if r in flows else [], **extra)
    assert p.links.spread_down[0] == pytest.approx(1e7)  # 2 MB over 0.2 s, from two reports
    assert np.isnan(p.links.spread_up[1]) and p.links._probe_up == [[], [], []]
    assert len(sched.answers) == 3 and p.links.spreads_seen == 1
    assert p.links._last_turn == {("in", 0): 0}  # node 0's receiving side had the latest turn


def test_a_node_censored_late_gets_the_next_turn():
    p = _planner("optimal", 0.1, colocate=True, n=4)
    for src, dst, r in [(1, 3, 9e6), (3, 0, 9e6), (0, 1, 3e6), (2, 0, 3e6)]:
        p.links.observe_probe(src, dst, r)
    assert list(np.flatnonzero(p.links.censored()[0])) == [1, 3]
    p.links._last_turn = {("out", 1): 0, ("out", 3): 2}  # both had turns
    p.links.observe_probe(2, 1, 9e6)  # node 2 turns out to be as fast: censored too
    p.links.spreads_seen = 4
    assert p.spread_targets()[:2] == ["out", 2]  # never had a turn: it goes first


def test_spread_rate_takes_the_lone_tail_off():
    """A real fan-out of node 0 (4-node spread test, 131 kB per flow, peers' caps ~5 MB/s):
    the flow to 1 took its peer's whole cap and ended first; the flow to 2 ran alone for the
    last 17.4 ms. Over the whole span it reads 51.2 Mbit/s; up to the second-to-last end,
    with at most 1.1 x 5 MB/s delivered after it, 54.0 (goodput 57.4)."""
    from hetps.balance.links import spread_rate

    b = 131144.0
    flows = [
        (0, 1, 0.0, 0.0260, b, False),
        (0, 3, 0.0035, 0.0441, b, False),
        (0, 2, 0.0026, 0.0615, b, False),
    ]
    caps = np.array([np.nan, 5e6, 5e6, 5e6])
    plain = 3 * b / 0.0615
    tail_off = (3 * b - 1.1 * 5e6 * (0.0615 - 0.0441)) / 0.0441
    assert spread_rate(flows, caps, 1) == pytest.approx(tail_off)
    assert tail_off * 8 / 1e6 == pytest.approx(54.0, abs=0.1) and plain < tail_off
    # flows that end together: nothing to take off, the plain reading stands
    even = [(0, 1, 0.0, 0.054, b, False), (0, 2, 0.0, 0.054, b, False)]
    assert spread_rate(even, caps, 1) == pytest.approx(2 * b / 0.054)
    # a peer of unknown cap: the plain reading
    assert spread_rate(flows, np.full(4, np.nan), 1) == pytest.approx(plain)
    # an "in" spread: the peers are the senders (tuple index 0), their up caps
    into = [(1, 0, 0.0, 0.03, b, False), (2, 0, 0.0, 0.05, b, False)]
    up = np.array([np.nan, 4e6, 4e6, np.nan])
    want = max(2 * b / 0.05, (2 * b - 1.1 * 4e6 * 0.02) / 0.03)
    assert spread_rate(into, up, 0) == pytest.approx(want)


def _steady(p: Planner, rates: dict[tuple[int, int], float]) -> float:
    """Probe every link once; return the current assignment's predicted round time."""
    for (i, j), r in rates.items():
        p.links.observe_probe(i, j, r)
    pred = p._predict(p.links.node_network(), p.assignment)
    assert pred is not None and pred > 0
    return pred


def test_two_rounds_far_slower_than_predicted_ask_for_a_new_cycle():
    p = _planner("optimal", 0.1, colocate=True, n=3)
    pred = _steady(p, {(i, j): 10e6 for i in range(3) for j in range(3) if i != j})
    rnd = 0
    for k in range(4):  # a steady 1.2-1.3x the prediction: what TCP reaches
        rnd += 1
        assert not p.surprised(rnd, [pred * (1.2 + 0.03 * k), pred * 1.25])
    rnd += 1  # one slow round is a hiccup: neither a surprise nor part of the median
    assert not p.surprised(rnd, [pred * 2.2]) and p.detector.last_surprise > 1.5
    rnd += 1
    assert not p.surprised(rnd, [pred * 1.25]) and len(p.detector._ratios) == 5
    rnd += 1
    assert not p.surprised(rnd, [pred * 2.2, pred * 2.3, pred * 1.2])  # median 2.2x
    rnd += 1
    assert p.surprised(rnd, [pred * 2.2])
    assert p.detector._recal_asked == rnd and p.recalibrations == 0  # asked; none came back yet
    rnd += 1  # asked: no second request while the cycle is on its way
    assert not p.surprised(rnd, [pred * 2.5])
    p.detector._recal_asked = None  # the cycle came back
    rnd += 1  # one round over 2x slower than usual is enough on its own
    assert p.surprised(rnd, [pred * 5.0]) and p.detector._recal_asked == rnd


def test_a_slowdown_a_new_cycle_does_not_explain_becomes_the_new_usual():
    """If the rounds stay slow after a cycle (delay, loss, a slow worker's compute: nothing
    the caps show), the first judged round sets a new baseline instead of asking for cycle
    after cycle; a request whose cycle never comes is given up after a few rounds."""
    p = _planner("optimal", 0.1, colocate=True, n=3)
    pred = _steady(p, {(i, j): 10e6 for i in range(3) for j in range(3) if i != j})
    for rnd in range(1, 5):
        assert not p.surprised(rnd, [pred * 1.2])
    assert p.surprised(5, [pred * 3.0])  # asked
    p.forget_readings()  # its cycle came back: the same caps, and the rounds stay slow
    pred = _steady(p, {(i, j): 10e6 for i in range(3) for j in range(3) if i != j})
    assert p.recalibrations == 1 and p.detector._settle == 2
    # settling after a cycle: not judged at all, however slow (the next round decides)
    assert not p.surprised(6, [pred * 9.0]) and not p.surprised(7, [pred * 3.0])
    assert not p.surprised(8, [pred * 3.0]) and p.detector._ratios == [pytest.approx(3.0)]
    for rnd in range(9, 12):
        assert not p.surprised(rnd, [pred * 3.1])  # the new usual
    # a request whose cycle never comes (the workers do not probe) lapses
    assert p.surprised(12, [pred * 9.0])
    for rnd in range(13, 17):  # (RECAL_WAIT rounds)
        assert not p.surprised(rnd, [pred * 3.0]) and p.detector._recal_asked == 12
    assert not p.surprised(17, [pred * 3.0]) and p.detector._recal_asked is None


def test_no_surprise_without_a_probing_scheme_or_history_or_right_after_a_plan_change():
    p = _planner("average", 0.1, colocate=True, n=3)
    for rnd in range(1, 8):
        assert not p.surprised(rnd, [100.0])
    p = _planner("optimal", 0.1, colocate=True, n=3)
    pred = _steady(p, {(i, j): 10e6 for i in range(3) for j in range(3) if i != j})
    assert not p.surprised(1, [pred * 5]) and not p.surprised(2, [pred * 5])  # no median yet
    p = _planner("optimal", 0.1, colocate=True, n=3)
    pred = _steady(p, {(i, j): 10e6 for i in range(3) for j in range(3) if i != j})
    for rnd in range(1, 5):
        p.surprised(rnd, [pred * 1.2])
    p.detector._settle = 2  # what plan() sets when it changes the assignment
    assert not p.surprised(5, [pred * 3]) and not p.surprised(6, [pred * 3])
    assert not p.surprised(7, [pred * 2.2]) and p.surprised(8, [pred * 2.2])


def test_a_round_right_after_a_plan_change_surprises_only_if_no_migration_explains_it():
    """A cut that comes with a plan change (the plan made from the slow round itself) must
    not hide behind the migration's rounds: one over SURPRISE_IN_SETTLE (4x) the usual
    ratio asks for a cycle at once; 3x does not (it may be the migration)."""
    p = _planner("optimal", 0.1, colocate=True, n=3)
    pred = _steady(p, {(i, j): 10e6 for i in range(3) for j in range(3) if i != j})
    for rnd in range(1, 5):
        assert not p.surprised(rnd, [pred * 1.2])
    p.detector._settle = 2
    assert not p.surprised(5, [pred * 3.5]) and p.detector._settle == 1
    assert p.surprised(6, [pred * 6.0]) and p.detector._recal_asked == 6
    assert p.detector.last_surprise == pytest.approx(5.0)
    assert len(p.detector._ratios) == 4  # neither settling round joined the median


def test_the_first_round_after_a_plan_change_may_still_run_the_old_plan():
    """Answers are pipelined, so the first report after a plan change may carry a round
    of the old assignment: a change predicted far faster must not read as a surprise."""
    p = _planner("optimal", 0.1)  # servers 0..2, workers 3 and 4
    rates = {(i, j): 10e6 for i in (0, 1) for j in (3, 4)}
    rates.update({(j, i): 10e6 for i in (0, 1) for j in (3, 4)})
    rates.update({(2, 3): 0.5e6, (2, 4): 0.5e6, (3, 2): 0.5e6, (4, 2): 0.5e6})  # server 2 slow
    p.assignment = np.array([0, 1] * 60, dtype=np.int64)  # the new plan: nothing on server 2
    pred_new = _steady(p, rates)
    old = np.full(len(p.slices), 2, dtype=np.int64)  # the old one: everything on server 2
    pred_old = p._predict(p.links.node_network(), old)
    assert pred_old > 5 * pred_new
    for rnd in range(1, 5):
        assert not p.surprised(rnd, [pred_new * 1.2])
    p._before, p.detector._settle = old, 2  # what plan() sets when it changes the assignment
    assert not p.surprised(5, [pred_old * 1.2])  # the old plan's usual round
    assert p.detector.last_surprise == pytest.approx(1.0)
    assert p.surprised(6, [pred_old * 6.0])  # far slower than either plan


def test_a_calibration_report_replaces_old_readings_and_the_plan_follows_at_once():
    """Node 2 was fast (its probes read 10 MB/s both ways); it drops to 1 MB/s and the
    workers re-probe a whole cycle. The first calibration report of the round drops every
    older probe and spread reading (old fast probes would otherwise hold its cap up for a
    whole window), and the next plan is adopted without waiting for a second report."""
    from hetps.cluster import protocol as P

    p = _planner("optimal", 0.05, colocate=True, n=3, patience=2)
    sched = _Sched(workers=3)
    for i in range(3):
        for j in range(3):
            if i != j:
                p.links.observe_probe(i, j, 10e6)
    p.links._spread_up[2].append((12e6, 0))
    before = p.assignment.copy()
    # every worker's cycle: node 2's probes read 1 MB/s; the others' 10
    for r in range(3):
        samples = []
        for s in range(3):
            if s != r:
                rate = 1e6 if 2 in (r, s) else 10e6
                samples.append([P.worker_id(r), P.server_id(s), rate * 0.1, 0.0, 0.1, 1])
        _report(p, sched, r, 7, samples, calibration=True)
    up, down = p.links.capacity()
    assert up[2] == pytest.approx(1e6) and down[2] == pytest.approx(1e6)
    assert up[0] == pytest.approx(10e6) and p.links._spread_up[2] == []
    assert len(sched.answers) == 3
    answer = sched.answers[-1]
    assert answer["epoch"] == 1 and not np.array_equal(p.assignment, before)
    assert answer["shares"][2] < 0.1  # one report was enough


def test_a_probe_far_off_its_links_caps_asks_for_a_new_cycle():
    """Probes measure min(sender's up, receiver's down). One that reads far below what the
    caps say (node 1 got slower, or node 0), or far above one of them (that one got faster),
    makes the planner ask for a new cycle; one within the usual noise does not, nor does
    one in the first rounds (they read low)."""
    from hetps.cluster import protocol as P

    def run(rnd: int, rate: float) -> dict:
        p = _planner("optimal", 0.1, colocate=True, n=3)
        p._released = rnd - 1  # the rounds answered before this one
        for i in range(3):
            for j in range(3):
                if i != j:
                    p.links.observe_probe(i, j, 10e6)
        sched = _Sched(workers=3)
        for r in range(3):
            samples = [[P.worker_id(0), P.server_id(1), rate * 0.1, 0.0, 0.1, 1]] if r == 0 else []
            _report(p, sched, r, rnd, samples)
        assert len(sched.answers) == 3
        return sched.answers[-1]

    asked = run(6, 3e6)
    assert asked.get("recalibrate") is True and asked["recalibrations"] == 0  # none came yet
    assert "recalibrate" not in run(6, 6e6)  # 0.6 of the caps: within the noise
    assert "recalibrate" not in run(3, 3e6)  # too early to judge
    assert run(6, 25e6).get("recalibrate") is True  # 2.5x the caps: a node got faster
    assert "recalibrate" not in run(6, 15e6)  # 1.5x: the window's maximum just rises


# -- the answer on the wire (hetps.balance.wire) and the live workers ---------------------------


class _CountingNodes(dict):
    """The scheduler's node table, counting the walks over it."""

    walks = 0

    def items(self):
        type(self).walks += 1
        return super().items()


def _big_round(w: int, s: int) -> tuple[Planner, _Sched]:
    """A planner of ``w`` workers and ``s`` servers after every worker reported round 1."""
    from hetps.cluster import protocol as P

    p = Planner("aware", num_workers=w, num_servers=s, colocate=False, slice_elems=100)
    sched = _Sched(workers=w)
    sched.nodes = _CountingNodes(sched.nodes)
    sizes, where = [100 * 4 * s], [i % s for i in range(4 * s)]
    for r in range(w):
        _report(p, sched, r, 1, [], sizes=sizes, assign=where)
    assert sorted(sched.to) == sorted(P.worker_id(r) for r in range(w))
    return p, sched


@pytest.mark.parametrize(("w", "s"), [(100, 20), (300, 100)])
def test_every_worker_gets_the_plan_encoded_once_and_rank_0_alone_the_matrix(w, s):
    """Rank 0's answer carries the link matrix while the model has at most REPORT_MAX_NODES
    rows (N = 120); at N = 400 (the matrix as lists would be ~1.4 MB) every answer is the
    plan alone, O(slices + servers)."""
    from hetps.balance.service import REPORT_MAX_NODES
    from hetps.cluster import protocol as P
    from hetps.transport.codec import MAX_HEADER_BYTES, Message, decode, encode

    p, sched = _big_round(w, s)
    matrix = w + s <= REPORT_MAX_NODES
    packed = {id(body["plan"]) for body, _ in sched.raw}
    assert len(packed) == 1  # one encoding, shared by every answer
    sizes = {}
    for to, (body, arrays), plan in zip(sched.to, sched.raw, sched.answers, strict=True):
        assert plan["assign"] == sched.answers[0]["assign"] and len(plan["shares"]) == s
        frames = encode(Message("balance_report", reply=True, body=body, arrays=arrays))
        back = decode(frames, 1 << 31)  # the codec takes every one (header under 1 MiB)
        assert len(frames[0]) < MAX_HEADER_BYTES
        sizes[P.rank_of(to)] = sum(len(memoryview(f).cast("B")) for f in frames)
        if P.rank_of(to) == 0 and matrix:
            assert arrays[0].shape == (w + s, w + s) and "node_rates" in body
            assert len(plan["link_matrix"]) == w + s and plan["link_matrix"][0][0] is None
            assert back.arrays[0].shape == (w + s, w + s)
        else:
            assert set(body) == {"plan"} and arrays == []
            assert "link_matrix" not in plan and "node_rates" not in plan
    assert max(v for k, v in sizes.items() if k != 0) < 8_000  # O(slices + servers)
    if matrix:
        assert sizes[0] > 8 * (w + s) ** 2  # the matrix, as one float64 array
    else:
        assert sizes[0] < 8_000


def test_the_live_workers_are_read_once_per_change_of_the_node_table():
    from hetps.cluster import protocol as P

    _CountingNodes.walks = 0
    p, sched = _big_round(40, 10)
    assert _CountingNodes.walks == 1  # not once per report
    # a worker finishes: the next release reads the table again and no longer waits for it
    for r in range(39):
        _report(p, sched, r, 2, [])
    assert len(sched.answers) == 40  # round 2 waits for worker 39
    sched.finished.add(P.worker_id(39))
    p.release(sched)
    assert len(sched.answers) == 40 + 39 and _CountingNodes.walks == 2


def test_the_per_link_table_is_made_only_when_read():
    # a worker per row at 4,096 workers is three 4,224 x 4,224 arrays (430 MB) that a planner
    # of more than REPORT_MAX_NODES rows plans without: none until something reads it
    p = Planner("aware", 4096, 128, False, slice_elems=1024)
    assert p._table is None
    p.use_hosts([r // 8 for r in range(4096)])  # (512 hosts: 640 rows)
    assert p._table is None and p.n_nodes == 640
    assert p.table.n_nodes == 640 and p.table is p.table


def test_rounds_released_together_each_plan_on_its_own_rounds_caps():
    """A release reads the caps once per round (its prediction and its plan share them):
    two rounds answered in one release (the worker they waited for finished) get the plans
    of the same rounds answered one at a time, the second on the second round's caps."""
    from hetps.cluster import protocol as P

    def rates(fast: int) -> list:  # each worker's push to every server; ``fast`` is 20x
        rows = []
        for w in range(2):
            for s in range(3):
                secs = 0.05 if s == fast else 1.0
                rows.append([P.worker_id(w), P.server_id(s), MB, 10.0 * w, 10.0 * w + secs, 0])
        return rows

    runs = []
    for together in (False, True):
        p = Planner("aware", 3, 3, colocate=False, slice_elems=100, margin=0.0, patience=1)
        p.slices = layout([12000], 100)
        p.assignment = np.array([0, 1, 2] * 40, dtype=np.int64)
        sched = _Sched(3)
        if not together:
            sched.finished.add(P.worker_id(2))  # (each round answered as it completes)
        for rnd, fast in ((1, 0), (2, 2)):
            for w in range(2):
                _report(p, sched, w, rnd, rates(fast))
        if together:
            assert sched.answers == []  # both rounds wait for worker 2
            sched.finished.add(P.worker_id(2))
            p.release(sched)
        runs.append([{k: v for k, v in a.items() if k != "plan_s"} for a in sched.answers])
    assert runs[0] == runs[1] and len(runs[0]) == 4
    assert runs[0][0]["shares"] != runs[0][2]["shares"]  # (the caps changed between them)


def test_a_worker_sending_rounds_far_ahead_is_refused_past_the_bound():
    """Each round a worker reports is kept until every worker reported it: a worker sending
    round after round ahead of the others is refused past MAX_WAITING_ROUNDS (the error names
    the round), and the rounds every worker reports are still answered."""
    from hetps.balance.service import MAX_WAITING_ROUNDS
    from hetps.cluster import protocol as P

    p, sched = _big_round(2, 2)
    answered = len(sched.answers)
    for rnd in range(2, 2 + MAX_WAITING_ROUNDS + 3):  # worker 0 alone, far ahead
        _report(p, sched, 0, rnd, [])
    assert len(p.pending) == MAX_WAITING_ROUNDS  # (each kept, until the bound)
    refused = [b for b, _ in sched.raw[answered:] if "error" in b]
    assert len(refused) == 3
    assert f"round {2 + MAX_WAITING_ROUNDS}:" in refused[0]["error"]
    _report(p, sched, 1, 2, [])  # round 2, reported by both: answered to both
    assert sorted(sched.to[-2:]) == [P.worker_id(0), P.worker_id(1)]
    assert "error" not in sched.raw[-1][0]


def test_a_report_taken_on_the_loop_leaves_only_the_release_for_the_services_thread():
    """``take`` (the scheduler runs it on its loop) keeps a report and returns the release
    only with the round's last one; nothing is answered before that release runs, and it
    answers every worker as ``handle`` does."""
    from hetps.cluster import commands
    from hetps.cluster import protocol as P
    from hetps.transport.codec import Message

    p, sched = _big_round(6, 3)
    before = len(sched.answers)
    rests = []
    for r in range(6):
        msg = Message("balance_report", body={"round": 2, "samples": []})
        msg.sender = P.worker_id(r)
        assert commands.decode(msg) is None
        rests.append(p.take(sched, msg))
    assert rests[:5] == [None] * 5 and callable(rests[5])
    assert len(sched.answers) == before  # (the release has not run)
    rests[5]()
    assert sorted(sched.to[before:]) == sorted(P.worker_id(r) for r in range(6))
    assert sched.answers[before]["assign"] == sched.answers[0]["assign"]


def test_a_worker_taken_back_and_another_let_go_between_two_reads_change_the_live_set():
    """The live workers are read again when the node table changed, even when its sizes
    did not: a let-go worker taken back (out of ``dead``) and another let go (into it)
    before the planner looked again leave ``dead`` as long as it was. The round then waits
    for the one taken back, not for the one let go (which would never report)."""
    from hetps.cluster import protocol as P

    p = Planner("aware", num_workers=4, num_servers=2, colocate=False, slice_elems=100)
    sched = _Sched(workers=4)
    w1, w2 = P.worker_id(1), P.worker_id(2)
    sched.dead = {w1: "let go"}
    assert w1 not in p.live_workers(sched)
    del sched.dead[w1]  # taken back (takeover.take_back counts it in ``rejoined``)
    sched.rejoined[w1] = 1
    sched.dead[w2] = "let go"
    assert p.live_workers(sched) == {P.worker_id(r) for r in (0, 1, 3)}


@pytest.mark.parametrize("w", [15, 16])
def test_the_loop_gathers_a_rounds_reports_once_a_round_came_in_numbers(w):
    """``gathers`` (the scheduler's loop then holds for more of a round's reports) says yes
    once a round answered had at least GATHER_MIN_REPORTS report messages, not before the
    first round and not for a round of fewer (holding there would save no wake-up)."""
    from hetps.balance.service import GATHER_MIN_REPORTS

    assert GATHER_MIN_REPORTS == 16
    p = Planner("aware", num_workers=w, num_servers=3, colocate=False, slice_elems=100)
    assert not p.gathers()
    _big_round_of(p, w)
    assert p.gathers() == (w >= 16)


def _big_round_of(p: Planner, w: int) -> None:
    sched = _Sched(workers=w)
    sizes, where = [100 * 4 * 3], [i % 3 for i in range(4 * 3)]
    for r in range(w):
        _report(p, sched, r, 1, [], sizes=sizes, assign=where)
    assert len(sched.to) == w  # (the round was answered)
