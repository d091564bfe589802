"""benchmarks/wire_goals.py judges each goal from the three benchmarks' reports: the ratio the
goal names, its direction, and the 16-core goals left unjudged on a smaller machine."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from wire_goals import goals_from  # noqa: E402

KV = {
    "security": [
        {
            "shape": "2w/2s",
            "size_mb": mb,
            "mxnet_median_s": mx,
            "median_s": {"secure-tcp": st, "plain-tcp": pt, "secure": sh},
        }
        for mb, mx, st, pt, sh in (
            (16, 0.035, 0.050, 0.030, 0.012),
            (64, 0.200, 0.180, 0.120, 0.060),
            (256, 0.780, 0.700, 0.420, 0.300),
        )
    ],  # fmt: skip
    "throughput": [
        {"shape": "2w/2s", "size_mb": mb, "median_s": {"zmq": z}}
        for mb, z in ((16, 0.02), (64, 0.10), (256, 0.40))
    ],
}
UPD = {"cases": [{"case": "sgd momentum", "hetps_over_torch": 0.5},
                 {"case": "adam", "hetps_over_torch": 1.6}]}  # fmt: skip
SCALE = {"rows": [{"workers": 1, "servers": 1, "round_s": 0.030},
                  {"workers": 1, "servers": 4, "round_s": 0.010}]}  # fmt: skip


def _by_goal(goals):
    return {g["goal"]: g for g in goals}


def test_each_goal_gets_its_ratio_and_verdict():
    g = _by_goal(goals_from(KV, UPD, SCALE, cores=2))
    r16 = g["secured over TCP, 16 MB: MXNet / hetps >= 1.0"]
    assert abs(r16["ratio"] - 0.035 / 0.050) < 1e-12 and r16["verdict"] == "MISSED"
    r256 = g["secured over TCP, 256 MB: MXNet / hetps >= 1.0"]
    assert abs(r256["ratio"] - 0.78 / 0.70) < 1e-12 and r256["verdict"] == "met"
    shm = g["shared memory, 64 MB: MXNet / hetps holds (>= 1.9)"]
    assert abs(shm["ratio"] - 0.2 / 0.06) < 1e-12 and shm["verdict"] == "met"
    assert g["server SGD with momentum step: hetps / bare torch <= 1.5"]["verdict"] == "met"
    assert g["server Adam step: hetps / bare torch <= 1.5"]["verdict"] == "MISSED"
    # the 16-core goals are measured but not judged on 2 cores
    echo = g["secured over TCP, 64 MB: of the raw echo >= 0.8"]
    assert abs(echo["ratio"] - 0.10 / 0.18) < 1e-12 and echo["verdict"] == "16-core goal"
    scale = g["45 MB round, 1 worker: 1 server / 4 servers >= 2.5"]
    assert abs(scale["ratio"] - 3.0) < 1e-12 and scale["verdict"] == "16-core goal"


def test_sixteen_core_goals_are_judged_on_sixteen_cores_and_missing_runs_say_so():
    g = _by_goal(goals_from(KV, None, SCALE, cores=16))
    assert g["45 MB round, 1 worker: 1 server / 4 servers >= 2.5"]["verdict"] == "met"
    assert g["plain over TCP, 256 MB: of the raw echo >= 0.95"]["verdict"] == "met"  # 0.95
    assert g["secured over TCP, 256 MB: of the raw echo >= 0.8"]["verdict"] == "MISSED"
    assert g["server Adam step: hetps / bare torch <= 1.5"]["verdict"] == "not measured"
