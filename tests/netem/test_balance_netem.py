"""Network-aware load distribution on real shaped links: plans follow the bandwidth."""

from __future__ import annotations

import io
import json
import re
import sys

import pytest

from hetps.launch.contract import LaunchSpec
from hetps.launch.local import run_cluster

pytestmark = pytest.mark.netem

SCRIPT = """
import json, os, time
import numpy as np
import hetps.kv
kv = hetps.kv.create('dist_sync')
sizes = [int(x) for x in os.environ['SIZES'].split(',')]
keys = [f'k{i}' for i in range(len(sizes))]
for k, n in zip(keys, sizes):
    kv.init(k, np.zeros(n, np.float32))
t0 = time.time()
rnd = 0
while True:  # the stop is decided together below, never by one worker's own clock
    plan = kv.rebalance()
    for k, n in zip(keys, sizes):
        kv.push(k, np.ones(n, np.float32))
    assert all((kv.pull(k) == kv.num_workers).all() for k in keys)
    if kv.rank == 0:
        print('PLAN ' + json.dumps({'t': time.time() - t0, 'shares': plan['shares'],
                                    'epoch': plan['epoch'], 'recal': plan['recalibrations'],
                                    'surprise': plan['surprise']}), flush=True)
    rnd += 1
    # every worker must run the same rounds: rank 0 decides when to stop
    flag = np.array([1.0 if time.time() - t0 >= float(os.environ['RUN_S']) else 0.0], np.float32)
    if rnd == 1:
        kv.init('stop', np.zeros(1, np.float32))
    kv.pushpull('stop', flag)
    if flag[0] > 0:
        break
"""


def _run_dynamic(tmp_path, rates_mbit: list, period_s: float, env: dict) -> list[dict]:
    """SCRIPT on 3 co-located nodes (optimal plans) under a dynamic scenario; rank 0's
    plans, one per round. ``env`` gives SIZES (the keys' element counts) and RUN_S."""
    scen = tmp_path / "dynamic.toml"
    scen.write_text(
        f'[network]\nkind = "dynamic"\nrates_mbit = {rates_mbit}\nperiod_s = {period_s}\n'
    )
    script = tmp_path / "w.py"
    script.write_text(SCRIPT)
    out = io.StringIO()
    spec = LaunchSpec(
        num_workers=3,
        num_servers=3,
        command=[sys.executable, str(script)],
        env={"PS_HEARTBEAT_TIMEOUT": "30", **env},
        start_timeout=60,
    )
    rc = run_cluster(
        spec, netem=str(scen), colocate=True, balance="optimal", slice_elems=20000, out=out
    )
    text = out.getvalue()
    assert rc == 0, text
    return _plans(text)


def _plans(out: str) -> list[dict]:
    return [json.loads(m) for m in re.findall(r"PLAN (\{.*\})", out)]


@pytest.mark.parametrize(
    "bulk",
    # (the channels under HETPS_BALANCE are not the default: the run outside CI's time)
    ["-1", pytest.param("1", marks=pytest.mark.slow)],
    ids=["curve", "bulk-channels"],
)
def test_plans_follow_a_bandwidth_change(tmp_path, bulk):
    """Node 1 is slow, then (8 s after the emulator starts) node 0 is: the plan follows within
    a few rounds. Note that a dynamic scenario cycles through its rates: with period 8 s the
    rates flip back 16 s after the emulator starts, about 14 s into the job, so this run stops
    at 16 s and asserts that each phase's plan reacted, not that it stayed. With the bulk
    channels (HETPS_BULK_CHANNELS=1) the slices' arrays take a second connection and are timed
    from the marks that lead them there (docs/BALANCE.md, "Measurement")."""
    # probe every round: the plan must see the flip within the run's few seconds
    env = {
        "SIZES": "150000,50000",
        "RUN_S": "16",
        "HETPS_PROBE_PROB": "1.0",
        "HETPS_BULK_CHANNELS": bulk,
    }
    plans = _run_dynamic(tmp_path, [[150, 15, 150], [15, 150, 150]], 8, env)
    assert len(plans) >= 6, plans

    # node 1 is slow until the rates flip, 8 s after the emulator starts (the job starts
    # ~2 s later), then node 0 is: in each phase the planner must take the slow node's share
    # (0.3-0.4 at the start) down to a few percent. Node 2 is fast throughout. Measured: the
    # first plan moves within 2 rounds; after the flip the plan follows 3-4 rounds (~4 s) later
    # (a probe cycle of 2 rounds, one report, one round of pipelining).
    before = [p for p in plans if p["t"] < 5.0]
    after = [p for p in plans if p["t"] > 9.0]
    timeline = "; ".join(
        f"{p['t']:.1f}s e{p['epoch']} {[round(x, 2) for x in p['shares']]}" for p in plans
    )
    assert any(p["shares"][1] <= 0.15 for p in before), timeline
    assert any(p["shares"][0] <= 0.15 for p in after), timeline
    assert plans[-1]["epoch"] >= 2, timeline


def test_a_rate_cut_makes_the_planner_probe_a_new_cycle(tmp_path):
    """Node 0 drops from 150 to 15 Mbit/s 5 s after the emulator starts, with the default
    probing (every 4th round). Its old fast probes would hold its cap up for a whole window;
    instead the rounds after the cut take far longer than the plan predicts, the planner
    asks every worker to probe a new cycle, and the plan made from it (or, when a busy host
    misreads that cycle, from the next) takes node 0's share down (docs/BALANCE.md §7.3)."""
    rates = [[150, 150, 150], [15, 150, 150], [15, 150, 150], [15, 150, 150]]
    plans = _run_dynamic(tmp_path, rates, 5, {"SIZES": "400000", "RUN_S": "14"})
    timeline = "; ".join(
        f"{p['t']:.1f}s e{p['epoch']} r{p['recal']} s{p['surprise'] or 0:.1f} "
        f"{[round(x, 2) for x in p['shares']]}"
        for p in plans
    )
    # the cut: the first round that took 3x the median of the rounds before it (the job
    # starts 1-2 s after the emulator, so it comes 3-4 s into the job; the rates stay cut
    # until 20 s after the emulator started, after the job)
    gaps = [b["t"] - a["t"] for a, b in zip(plans, plans[1:], strict=False)]
    cut = next((k + 1 for k in range(5, len(gaps)) if gaps[k] > 3 * sorted(gaps[:k])[k // 2]), None)
    assert cut is not None and cut + 2 < len(plans), f"no cut seen: {timeline}"
    before = plans[cut - 1]["recal"]  # (a false alarm before the cut would cost one cycle)
    cycled = [k for k in range(cut, len(plans)) if plans[k]["recal"] > before]
    assert cycled, f"no new probe cycle after the cut: {timeline}"
    k = cycled[0]  # the first answer that counts a cycle that came back after the cut
    assert k - cut <= 3, f"the cut was seen late: {timeline}"
    # that answer carries the plan made from the cycle; on this shared 2-core host the first
    # cycle after the cut was seen to misread which node is slow (1 run in about 11: node 1
    # taken down to 0.1, node 0 kept at 0.35-0.45; why is not known), and the next cycle,
    # 4-5 plans on, set node 0 right: two cycles' plans
    later = plans[k : k + 7]
    assert any(p["shares"][0] <= 0.15 for p in later), timeline


MEASURE = """
import json, time, numpy as np, hetps.kv
kv = hetps.kv.create('dist_sync')
kv.init('a', np.zeros(500000, np.float32))
for r in range(8):
    plan = kv.rebalance()  # a probing round: the probe goes out now
    if kv.rank == 0 and r >= 3:  # the estimates of the last rounds
        print('NODES ' + json.dumps(plan['node_rates']), flush=True)
    time.sleep(0.1)  # the forward and backward pass a training step spends here
    kv.push('a', np.ones(500000, np.float32)); kv.pull('a')
if kv.rank == 0:
    plan = kv.rebalance()
    print('MATRIX ' + json.dumps(plan['link_matrix']), flush=True)
    print('NODES ' + json.dumps(plan['node_rates']), flush=True)
"""


def _measure(tmp_path, rates_mbit: list[int], balance: str) -> str:
    """Run MEASURE on co-located nodes with these static rates; the cluster's output."""
    scen = tmp_path / "static.toml"
    scen.write_text(f'[network]\nkind = "static"\nrates_mbit = {rates_mbit}\n')
    script = tmp_path / "m.py"
    script.write_text(MEASURE)
    out = io.StringIO()
    n = len(rates_mbit)
    spec = LaunchSpec(
        num_workers=n,
        num_servers=n,
        command=[sys.executable, str(script)],
        env={"PS_HEARTBEAT_TIMEOUT": "30", "HETPS_PROBE_PROB": "1.0"},
        start_timeout=60,
    )
    rc = run_cluster(
        spec, netem=str(scen), colocate=True, balance=balance, slice_elems=20000, out=out
    )
    text = out.getvalue()
    assert rc == 0, text
    return text


def test_link_measurement_within_15_percent_of_tc_rate(tmp_path):
    text = _measure(tmp_path, [40, 400], "aware")
    (raw,) = re.findall(r"MATRIX (\[.*\])", text)
    m = json.loads(raw)
    from hetps.netem import goodput_mbit

    # node 0 sends and receives at 40 Mbit/s (both directions of 0<->1); tc counts whole
    # Ethernet frames, so the payload a receiver can see is goodput_mbit(40) (~0.956 of it)
    tc_rate = goodput_mbit(40) * 1e6 / 8
    rounds = [json.loads(x) for x in re.findall(r"NODES (\{.*\})", text)]
    assert len(rounds) == 6, text
    # what the plans use: node 0's sending and receiving caps (the larger of its busy-time
    # rate and its fastest probe; a probe has the link to itself), over the last 6 rounds:
    # their median (one round in ~20 reads ~16% low when both probes of the 2-probe window
    # shared the machine's 2 cores with a busy neighbour)
    import statistics

    for way in ("up", "down"):
        got = statistics.median(r[way][0] for r in rounds)
        seen = [round(r[way][0] * 8 / 1e6, 1) for r in rounds]
        assert abs(got - tc_rate) / tc_rate < 0.15, (way, seen, "Mbit/s, node 0")
    # the link matrix (reports): per-message medians. A link's two flows (worker 0's pushes,
    # server 0's replies) can overlap on node 0's uplink, and then each reads about half, so
    # the link estimate may only be lower than tc, never far above it
    for got in (m[0][1], m[1][0]):
        assert 0.4 < got / tc_rate < 1.15, (got * 8 / 1e6, "Mbit/s, link")


def test_spread_probes_see_a_node_faster_than_every_peer(tmp_path):
    """Node 0 sends at 60 Mbit/s, its three peers receive at 40: every single-flow probe
    (and every data flow) of node 0 reads at most ~40. The spread probe's flows together
    read node 0's own 60 (docs/BALANCE.md §7.2). A spread reading is a lower bound: TCP
    shares node 0's link unevenly among the flows, which end apart, so it reads 5-15% under
    the goodput (session 6: 50.8-58.8 against 57.4 over 18 runs); never far above it."""
    from hetps.netem import goodput_mbit

    fast, peer = goodput_mbit(60), goodput_mbit(40)
    for attempt in range(2):  # a busy spell of the shared host reads low (CI: 0.76 once)
        (tmp_path / str(attempt)).mkdir()
        text = _measure(tmp_path / str(attempt), [60, 40, 40, 40], "optimal")
        raw_nodes = re.findall(r"NODES (\{.*\})", text)[-1]  # after the last round
        up = [x * 8 / 1e6 for x in json.loads(raw_nodes)["up"]]
        if 0.8 * fast < up[0] < 1.1 * fast:
            break
    assert 0.8 * fast < up[0] < 1.1 * fast, (up, "Mbit/s; node 0 should read", fast)
    assert up[0] > 1.25 * peer, up  # more than any single flow of it could show


def test_train_on_emulated_links_with_balance(tmp_path):
    """`hetps train --netem --colocate --balance aware` as a user runs it; plans are logged."""
    import subprocess
    from pathlib import Path

    if not Path("/usr/share/datasets/fashion-mnist").exists():
        pytest.skip("Fashion-MNIST not installed")
    scen = tmp_path / "s.toml"
    scen.write_text('[network]\nkind = "static"\nrates_mbit = [300, 30]\n')
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "hetps.cli",
            "train",
            "-m",
            "sync",
            "-n",
            "mlp",
            "--workers",
            "2",
            "--colocate",
            "--balance",
            "aware",
            "--slice-size",
            "20000",
            "--netem",
            str(scen),
            "--max-rounds",
            "6",
            "--train-limit",
            "1000",
            "--test-limit",
            "200",
            "-e",
            "3",
            "-ld",
            str(tmp_path),
            "--progress",
            "lines",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    run = tmp_path / "sync-mlp-w2"
    meta = json.loads((run / "run.json").read_text())
    assert meta["scheme"] == "aware" and meta["slice_size"] == 20000
    assert meta["scenario"] == str(scen)
    recs = [json.loads(x) for x in (run / "worker-0.jsonl").read_text().splitlines()]
    assert len(recs) == 6 and all("plan" in r and "link_matrix" in r for r in recs)
    assert all(isinstance(r["recalibrations"], int) for r in recs)  # new probe cycles
    assert abs(sum(recs[-1]["plan"]) - 1) < 1e-9 and recs[-1]["overhead_s"] >= 0
