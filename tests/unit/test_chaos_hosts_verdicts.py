"""benchmarks/chaos_hosts.py's judgement of a trial on hosts: the survivors' states compared
bit for bit (one element changed in one worker's weights or optimizer state is named), and
a trial counts as expected only when every check of its scenario holds."""

from __future__ import annotations

import importlib.util
import pickle
import sys
from pathlib import Path

import torch

_BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, _BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


_load("chaos_multi")
ch = _load("chaos_hosts")


def _state(rnd: int = 40) -> dict:
    return {
        "round": rnd,
        "model": {"fc.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3) / 7},
        "optimizer": {"state": {0: {"momentum_buffer": torch.full((2, 3), 0.25)}}},
    }


def _folder(root: Path, ranks: tuple[int, ...]) -> Path:
    folder = root / "ckpt-00000040"
    folder.mkdir(parents=True)
    for k in ranks:
        (folder / f"worker-{k}.pkl").write_bytes(pickle.dumps(_state()))
    return folder


def test_survivors_agree_bit_for_bit_and_one_changed_element_is_named(tmp_path):
    folder = _folder(tmp_path / "ok", (0, 2, 3))  # worker 1 was let go
    assert ch.survivors_agree(folder) == {"agree": True, "survivors": 3, "why": None}

    weights = _folder(tmp_path / "w", (0, 2, 3))
    st = pickle.loads((weights / "worker-2.pkl").read_bytes())
    w = st["model"]["fc.weight"]
    w[1, 2] = torch.nextafter(w[1, 2], torch.tensor(100.0))
    (weights / "worker-2.pkl").write_bytes(pickle.dumps(st))
    got = ch.survivors_agree(weights)
    assert not got["agree"] and got["why"] == "differ from worker-0: worker-2 weights", got

    opt = _folder(tmp_path / "o", (1, 3))
    st = pickle.loads((opt / "worker-3.pkl").read_bytes())
    st["optimizer"]["state"][0]["momentum_buffer"][0, 0] += 1e-7
    (opt / "worker-3.pkl").write_bytes(pickle.dumps(st))
    got = ch.survivors_agree(opt)
    assert not got["agree"] and "worker-3 optimizer" in got["why"], got

    stale = _folder(tmp_path / "r", (0, 1))
    (stale / "worker-1.pkl").write_bytes(pickle.dumps(_state(35)))
    assert "worker-1 round 35 != 40" in ch.survivors_agree(stale)["why"]

    assert not ch.survivors_agree(None)["agree"]
    assert not ch.survivors_agree(_folder(tmp_path / "none", ()))["agree"]


def _row(scenario: str, **kw) -> dict:
    row = {
        "scenario": scenario,
        "killed": True,
        "outcome": ch.SCENARIOS[scenario][4],
        "expected": ch.SCENARIOS[scenario][4],
        "orphans": 0,
        "shm_left": 0,
        "named": True,
        "end_after_kill_s": 2.0,
        "hostagg": True,
        "taken_over": True,
        "agree": True,
        "bit_for_bit": True,
    }
    row.update(kw)
    return row


def test_a_trial_is_as_expected_only_when_every_check_of_its_scenario_holds():
    for scenario in ch.SCENARIOS:
        assert ch.verdict(_row(scenario)), scenario
        for bad in ({"orphans": 1}, {"shm_left": 1}, {"killed": False}, {"outcome": "hung"}):
            assert not ch.verdict(_row(scenario, **bad)), (scenario, bad)
    # without --elastic: the job fails fast, naming the worker, and aggregation was on
    for bad in (
        {"named": False},
        {"end_after_kill_s": ch.FAIL_FAST_S + 1},
        {"end_after_kill_s": None},
        {"hostagg": False},
        {"outcome": "completed"},
    ):
        assert not ch.verdict(_row("worker", **bad)), bad
    # --elastic: the host's other worker took its parts over (said), and the survivors agree
    for scenario in ("worker, elastic", "worker stopped, elastic"):
        assert not ch.verdict(_row(scenario, taken_over=False))
        assert not ch.verdict(_row(scenario, agree=False))
        assert not ch.verdict(_row(scenario, named=False))
    # a stopped worker without --elastic: as a killed one, the job fails fast naming it
    assert not ch.verdict(_row("worker stopped", end_after_kill_s=ch.FAIL_FAST_S + 1))
    assert not ch.verdict(_row("worker stopped", named=False))
    assert not ch.verdict(_row("server, replicas", bit_for_bit=False))

    rows = [
        _row("worker", end_after_kill_s=3.5, as_expected=True),
        _row("worker", orphans=2, end_after_kill_s=1.0, as_expected=False),
        _row("server, replicas", as_expected=True),
    ]
    s = ch.summarize(rows)
    assert set(s) == {"worker", "server, replicas"}
    assert s["worker"]["trials"] == 2 and s["worker"]["as_expected"] == 1
    assert s["worker"]["orphans"] == 2 and s["worker"]["end_max_s"] == 3.5
    assert s["worker"]["failed"] == 2 and s["server, replicas"]["completed"] == 1
