"""benchmarks/scale_sim.py's core at N=16 for real: a `hetps scheduler` process with the planner
on, 16 simulated nodes over real ZeroMQ sockets. Structure only; no timing is asserted."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "scale_sim.py"


def _load():
    spec = importlib.util.spec_from_file_location("scale_sim", _PATH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["scale_sim"] = mod
    spec.loader.exec_module(mod)
    return mod


sim = _load()


@pytest.mark.parametrize(
    ("how", "made_first"),
    [({}, 12), ({"spread": 0.06}, 12), ({"paced": True}, 1)],
    ids=["together", "spread", "paced"],
)
def test_sixteen_nodes_register_barrier_heartbeat_and_get_plans(how, made_first):
    """A round's 12 reports made first and sent together, or evenly over 60 ms
    (``--spread-ms``), or each sent as soon as it is made (``--paced``): every worker gets
    its plan, and the reports went as asked."""
    res = sim.run_cluster(
        16, barriers=2, hb_interval=0.25, hb_periods=2, rounds=2, timeout=20.0, **how
    )
    reg, bar, hb, rep = res["register"], res["barrier"], res["heartbeat"], res["report"]
    assert res["servers"] == 4 and res["workers"] == 12
    assert reg["ok"] and reg["registered"] == 16 and reg["bad_tables"] == []
    assert bar["ok"] and bar["released"] == 16
    assert hb["ok"] and hb["acked"] == hb["sent"] == 2 * 16
    assert rep["ok"], rep["errors"]
    assert rep["rounds"] == 2 and rep["shares_ok"] and rep["n_slices"] == 16
    assert rep["msg_bytes"] > 0 and rep["plan_s"] is not None
    assert rep["made_first_all"] == [made_first] * 2  # (reports made before a round's first send)
    if "spread" in how:  # (each send waits for its time: the last at least 60 ms after the first)
        assert min(rep["send_spread_s_all"]) >= 0.05
    assert len(rep["report_bytes_all"]) == 2 * 12 and min(rep["report_bytes_all"]) > 0
    assert res["scheduler_alive"]  # it ran the whole time
    assert res["scheduler_exit"] is not None  # and run_cluster stopped it after


def test_a_node_that_skips_the_barrier_leaves_everyone_waiting():
    res = sim.run_cluster(
        16, barriers=1, timeout=3.0, skip_barrier=frozenset({5}), phases=("register", "barrier")
    )
    assert res["register"]["ok"]
    assert not res["barrier"]["ok"] and res["barrier"]["released"] == 0
    assert "heartbeat" not in res and "report" not in res
    assert res["scheduler_exit"] is not None  # stopped even though the phase failed


def test_hosts_register_with_their_groups_and_are_planned_per_host():
    """32 workers in hosts of 4 (8 hosts), 4 servers: every table carries the workers' groups,
    a barrier and a link report round are one message and one answer per host (its
    leader's), and rank 0's answer (small enough to carry the node rates) has one row per host and
    server, 12, not one per worker (36): the real scheduler plans per (host, server)."""
    res = sim.run_cluster(
        32, per_host=4, per_server=8, barriers=1, hb_interval=0.25, hb_periods=1, rounds=2,
        timeout=30.0,
    )  # fmt: skip
    reg, rep, bar = res["register"], res["report"], res["barrier"]
    assert res["servers"] == 4 and res["workers"] == 32 and res["hosts"] == 8
    assert reg["ok"] and reg["bad_tables"] == [], reg
    # a barrier: every node released, by one answer per host and per server
    assert bar["ok"] and bar["released"] == 36 and bar["answers"] == 8 + 4, bar
    assert rep["ok"], rep["errors"]
    assert rep["rows"] == 12, rep
    assert rep["answers"] == 8, rep  # a report round: one report and one plan per host
    assert rep["msg_bytes_max"] < 256 * 1024


def test_a_round_of_many_reports_spread_out_is_gathered_and_every_worker_gets_its_plan():
    """21 workers, each a host of its own: a round brings 21 reports (at least the planner's
    GATHER_MIN_REPORTS), so from round 2 on the real scheduler holds HETPS_GATHER_HOLD_MS
    after each report it keeps; with the reports spread over 60 ms every worker still gets
    its plan in every round (a hold that never ended would leave the round waiting)."""
    res = sim.run_cluster(
        28, barriers=1, hb_interval=0.25, hb_periods=1, rounds=3, timeout=20.0, spread=0.06
    )
    rep = res["report"]
    assert res["workers"] == 21 and res["register"]["ok"], res
    assert rep["ok"], rep["errors"]
    assert rep["rounds"] == 3 and rep["shares_ok"]
    assert rep["made_first_all"] == [21] * 3
    assert res["scheduler_alive"]
