"""``hetps train --tensorboard`` and ``hetps trace`` on real runs, read back and checked against
the run's own logs (TensorBoard's own reader; the trace-event checker)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

DATA = Path("/usr/share/datasets/fashion-mnist")
pytestmark = pytest.mark.skipif(
    not DATA.exists(),
    reason="Fashion-MNIST not installed (scripts/setup.sh --tests installs it as root)",
)


def _hetps(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    res = subprocess.run(
        [sys.executable, "-m", "hetps.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert res.returncode == 0, res.stdout + res.stderr
    return res


def _records(run: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (run / f"worker-{rank}.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module", params=["sync", "esync"])
def trained(request, tmp_path_factory):
    """A 2-worker run of 12 rounds with --tensorboard (where the package is installed):
    (mode, run dir, tensorboard dir)."""
    mode = request.param
    d = tmp_path_factory.mktemp(f"obs-{mode}")
    tb = ["--tensorboard", str(d / "tb")] if importlib.util.find_spec("tensorboard") else []
    _hetps(
        "train", "-m", mode, "-n", "mlp", "--workers", "2", "--max-rounds", "12", "-e", "4",
        "--train-limit", "2400", "--test-limit", "300", "-b", "32", "--progress", "lines",
        "-ld", str(d / "logs"), *tb,
    )  # fmt: skip
    return mode, d / "logs" / f"{mode}-mlp-w2", d / "tb"


def test_tensorboard_events_hold_the_logged_values(trained):
    pytest.importorskip("tensorboard", reason="pip install 'hetps[tensorboard]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    mode, run, tb = trained
    assert sorted(p.name for p in (tb / run.name).iterdir()) == ["worker0", "worker1"]
    for rank in (0, 1):
        recs = _records(run, rank)
        ea = EventAccumulator(str(tb / run.name / f"worker{rank}"))
        ea.Reload()
        tags = set(ea.Tags()["scalars"])
        want = {"train/loss", "speed/samples_per_s", "time/step_s", "time/round_s"}
        want |= {"time/compute_s", "time/push_s", "time/wait_s", "time/pull_s"}
        assert want <= tags, tags
        loss = ea.Scalars("train/loss")
        assert [e.step for e in loss] == [r["iter"] for r in recs]
        assert [e.value for e in loss] == pytest.approx([r["loss"] for r in recs], rel=1e-6)
        # the point's wall time is the round's end: the worker's start + t, the same start
        # for every point, and that is the run's (rank 0's) start up to the barrier's skew
        starts = [e.wall_time - r["t"] for e, r in zip(loss, recs, strict=True)]
        assert max(starts) - min(starts) < 1e-3
        started = json.loads((run / "run.json").read_text())["started_at"]
        assert starts[0] == pytest.approx(started, abs=1e-3 if rank == 0 else 0.1)
        sps = ea.Scalars("speed/samples_per_s")
        assert [e.value for e in sps] == pytest.approx(
            [r["samples"] / r["srit_s"] for r in recs], rel=1e-5
        )
        step = ea.Scalars("time/step_s")
        assert [e.value for e in step] == pytest.approx(
            [r["srit_s"] / r["local_steps"] for r in recs], rel=1e-5
        )
        waits = ea.Scalars("time/wait_s")
        assert [e.value for e in waits] == pytest.approx([r["wait_s"] for r in recs], rel=1e-5)
        for phase in ("push_s", "pull_s"):
            got = [e.value for e in ea.Scalars(f"time/{phase}")]
            assert got == pytest.approx([r[phase] for r in recs], rel=1e-5)
            if mode == "sync":  # gradients go out from backward's hooks: still timed
                assert all(v > 0 for v in got), (phase, got)
        evaluated = [(r["iter"], r["accuracy"]) for r in recs if "accuracy" in r]
        if rank == 0:
            assert len(evaluated) == 3  # rounds 4, 8, 12
            acc = ea.Scalars("eval/accuracy")
            assert [(e.step, pytest.approx(e.value, rel=1e-6)) for e in acc] == evaluated
        else:
            assert not evaluated and "eval/accuracy" not in tags


def test_trace_of_a_real_run_matches_its_logs(trained, tmp_path):
    from tracecheck import counter_totals, validate_trace

    mode, run, _ = trained
    out = tmp_path / "trace.json"
    res = _hetps("trace", str(run), "-o", str(out))
    assert f"wrote {out} (24 rounds)" in res.stdout
    trace = json.loads(out.read_text())
    validate_trace(trace)
    events = trace["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert sorted(n.split(":")[0] for n in procs.values()) == ["worker 0", "worker 1"]
    for pid, name in procs.items():
        rank = int(name.split(":")[0].split()[1])
        recs = _records(run, rank)
        rounds = [e for e in events if e["pid"] == pid and e.get("cat") == "round"]
        assert [e["name"] for e in rounds] == [f"round {r['iter']}" for r in recs]
        phases = [e for e in events if e["pid"] == pid and e.get("cat") == "phase"]
        assert not any(e["args"].get("derived") for e in phases)  # hetps train logs spans
        for rec in recs:
            mine = [e for e in phases if e["args"]["iter"] == rec["iter"]]
            assert len(mine) == len(rec["spans"])
            for p in ("compute", "push", "wait", "pull"):
                total = sum(e["dur"] for e in mine if e["name"] == p) / 1e6
                assert total == pytest.approx(rec[f"{p}_s"], abs=2e-5 * (1 + len(mine)))
        # the mode's phases are there: sync pushes from backward's hooks, waits for the
        # averaged gradients and places them (pull); ESync waits for the state server and
        # exchanges (pushes) the model difference
        names = {e["name"] for e in phases}
        want = (
            {"compute", "push", "wait", "pull"} if mode == "sync" else {"compute", "wait", "push"}
        )
        assert names == want
        # the counter track of the link: the traffic log's bytes, and (push and pull) about
        # what the worker's own counters saw in its records (the scheduler's few bytes apart)
        traffic = [json.loads(x) for x in (run / f"traffic-worker{rank}.jsonl").read_text().split()]
        got = counter_totals(trace)[f"bytes worker{rank}↔server0"]
        assert got["push_bytes"] == sum(b["push_bytes"] for b in traffic)
        assert got["pull_bytes"] == sum(b["pull_bytes"] for b in traffic)
        sent = sum(r["bytes_sent"] for r in recs)
        recv = sum(r["bytes_recv"] for r in recs)
        assert 0.99 * sent <= got["push_bytes"] <= sent
        assert 0.99 * recv <= got["pull_bytes"] <= recv
