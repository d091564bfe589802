"""Metrics layer: writers and readers of run directories, traffic buckets, summaries."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from hetps.metrics import (
    ITERATION_KEYS,
    IterationLog,
    MetricsError,
    RunNotFoundError,
    RunWriter,
    TrafficRecorder,
    find_runs,
    load_run,
    load_traffic,
    new_run_dir,
    run_meta,
    summarize,
)
from hetps.metrics.summary import format_summary, write_json


def rec(rank: int, it: int, t: float, **kw) -> dict:
    """An iteration record with every required key; ``kw`` overrides."""
    r = {
        "rank": rank,
        "iter": it,
        "epoch": 0,
        "t": t,
        "samples": 64,
        "loss": 1.0,
        "local_steps": 1,
        "compute_s": 0.1,
        "push_s": 0.01,
        "pull_s": 0.01,
        "wait_s": 0.0,
        "bytes_sent": 0,
        "bytes_recv": 0,
    }
    r.update(kw)
    return r


def meta(**kw) -> dict:
    base = {
        "mode": "sync",
        "network": "mlp",
        "workers": 2,
        "servers": 1,
        "batch_size": 64,
        "started_at": 1000.0,
    }
    base.update(kw)
    return run_meta(**base)


# --------------------------------------------------------------------------------------------
# Writers and readers


def test_run_meta_defaults_and_validation():
    m = run_meta("esync", "lenet", 3, 1, 32, slowdown=[1, 1, 4], started_at=5.0, scheme="aware")
    assert m["slowdown"] == [1, 1, 4] and m["split_by_class"] is False
    assert m["devices"] == {"0": "worker0", "1": "worker1", "2": "worker2 (slowdown x4)"}
    assert m["scheme"] == "aware" and m["started_at"] == 5.0
    assert run_meta("sync", "mlp", 2, 1, 8)["slowdown"] == [1.0, 1.0]
    with pytest.raises(MetricsError, match="mode 'bogus'"):
        run_meta("bogus", "mlp", 1, 1, 8)
    with pytest.raises(MetricsError, match="slowdown has 1 value"):
        run_meta("sync", "mlp", 2, 1, 8, slowdown=[2])
    with pytest.raises(MetricsError, match="missing key"):
        RunWriter("/nonexistent/never", {"mode": "sync"})


def test_round_trip(tmp_path):
    d = tmp_path / "run"
    w = RunWriter(d, meta(devices={0: "gpu0", 1: "cpu1 (slowdown x8)"}, slowdown=[1, 8]))
    assert json.loads((d / "run.json").read_text())["devices"] == {
        "0": "gpu0",
        "1": "cpu1 (slowdown x8)",
    }
    written = {0: [], 1: []}
    for rank in (0, 1):
        with IterationLog(w.run_dir, rank) as log:
            assert log.started_at == 1000.0
            for it in range(3):
                r = rec(rank, it, 1.0 + it, bytes_sent=10 * it, plan=[0.5, 0.5])
                if rank == 0 and it == 2:
                    r["accuracy"] = 0.5
                written[rank].append(log.write(r))
    run = load_run(d)
    assert run.meta["mode"] == "sync" and run.meta["devices"]["1"] == "cpu1 (slowdown x8)"
    assert run.records == written
    assert run.records[0][1]["plan"] == [0.5, 0.5]
    assert run.ranks == [0, 1] and run.workers == 2 and run.heterogeneous
    assert run.device_label(0) == "gpu0" and run.device_label(7) == "worker7"
    assert run.truncated == []


def test_write_converts_numpy_nan_and_flushes_each_line(tmp_path):
    log = IterationLog(tmp_path, 0, started_at=0.0)
    out = log.write(
        rec(0, np.int64(0), np.float32(0.5), loss=float("nan"), samples=np.int64(64.0))
        | {"accuracy": np.float64(0.25), "link_matrix": np.eye(2)}
    )
    assert out["loss"] is None and out["accuracy"] == 0.25 and out["t"] == 0.5
    assert out["link_matrix"] == [[1.0, 0.0], [0.0, 1.0]]
    assert type(out["iter"]) is int and type(out["samples"]) is int
    # flushed without close: another reader sees the full line now
    line = (tmp_path / "worker-0.jsonl").read_text()
    assert line.endswith("\n") and json.loads(line)["loss"] is None
    log.close()
    log.close()  # idempotent
    with pytest.raises(MetricsError, match="after close"):
        log.write(rec(0, 1, 1.0))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"accuracy": 85.3}, "divide a percentage"),
        ({"rank": 1}, "rank 1"),
        ({"t": "soon"}, "t must be a number"),
        ({"samples": 1.5}, "samples must be an integer"),
        ({"compute_s": -1}, "compute_s must be >= 0"),
        ({"loss": True}, "loss must be a number"),
        ({"extra": object()}, "cannot write"),
    ],
)
def test_write_rejects_bad_records(tmp_path, change, match):
    with IterationLog(tmp_path, 0, started_at=0.0) as log, pytest.raises(MetricsError, match=match):
        log.write(rec(0, 0, 1.0) | change)


def test_write_names_every_missing_key(tmp_path):
    r = rec(0, 0, 1.0)
    del r["push_s"], r["bytes_recv"]
    with IterationLog(tmp_path, 0) as log, pytest.raises(MetricsError) as e:
        log.write(r)
    assert "push_s, bytes_recv" in str(e.value)
    assert set(ITERATION_KEYS) >= {"push_s", "bytes_recv"}


def test_truncated_last_line_is_tolerated(tmp_path):
    w = RunWriter(tmp_path, meta(workers=1))
    with IterationLog(w.run_dir, 0) as log:
        for it in range(3):
            log.write(rec(0, it, float(it + 1)))
    path = tmp_path / "worker-0.jsonl"
    with open(path, "a") as fh:
        fh.write('{"rank": 0, "iter": 3, "ep')  # killed mid-write
    run = load_run(tmp_path)
    assert [r["iter"] for r in run.records[0]] == [0, 1, 2]
    assert run.truncated == [path]
    # a corrupt line elsewhere is an error naming file and line
    lines = path.read_text().splitlines()
    lines[1] = lines[1][:10]
    path.write_text("\n".join(lines[:3]) + "\n")
    with pytest.raises(MetricsError, match=r"worker-0\.jsonl:2: not JSON"):
        load_run(tmp_path)


def test_a_record_or_bucket_without_a_key_is_named_after_every_line_parsed(tmp_path):
    RunWriter(tmp_path, meta(workers=1))
    path, short = tmp_path / "worker-0.jsonl", rec(0, 1, 2.0)
    del short["push_s"], short["bytes_recv"]
    path.write_text("\n".join(json.dumps(r) for r in (rec(0, 0, 1.0), short)) + "\n")
    with pytest.raises(MetricsError) as e:
        load_run(tmp_path)
    assert str(e.value) == f"{path}: record 2 misses push_s, bytes_recv"
    # a line that is no JSON, after a short record: the corrupt file is what is said
    path.write_text("\n".join([json.dumps(short), "{not json", json.dumps(rec(0, 2, 3.0))]))
    with pytest.raises(MetricsError, match=r"worker-0\.jsonl:2: not JSON"):
        load_run(tmp_path)
    path.unlink()
    traffic = tmp_path / "traffic-server1.jsonl"
    traffic.write_text(json.dumps({"t": 0.0, "dt": 0.1, "peer": 1, "push_bytes": 3}) + "\n")
    with pytest.raises(MetricsError) as e:
        load_traffic(tmp_path)
    assert str(e.value) == f"{traffic}: bucket 1 misses pull_bytes"


def test_missing_run_json_is_a_clear_error(tmp_path):
    (tmp_path / "worker-0.jsonl").write_text(json.dumps(rec(0, 0, 1.0)) + "\n")
    with pytest.raises(RunNotFoundError, match="no run.json") as e:
        load_run(tmp_path)
    assert isinstance(e.value, FileNotFoundError)
    (tmp_path / "run.json").write_text("{not json")
    with pytest.raises(MetricsError, match="not valid JSON"):
        load_run(tmp_path)


def test_runwriter_refuses_to_mix_runs(tmp_path):
    w = RunWriter(tmp_path, meta(workers=1))
    with IterationLog(w.run_dir, 0) as log:
        log.write(rec(0, 0, 1.0))
    (tmp_path / "traffic-worker0.jsonl").write_text("")
    with pytest.raises(MetricsError, match="already exists"):
        RunWriter(tmp_path, meta(workers=1))
    w2 = RunWriter(tmp_path, meta(workers=1, mode="esync"), overwrite=True)
    assert load_run(tmp_path).records == {} and load_run(tmp_path).mode == "esync"
    assert not (tmp_path / "traffic-worker0.jsonl").exists()
    w2.update(finished_at=2000.0)
    assert load_run(tmp_path).meta["finished_at"] == 2000.0


def test_iteration_log_reads_start_from_run_json(tmp_path):
    RunWriter(tmp_path, meta(started_at=123.0))
    log = IterationLog(tmp_path, 1)
    assert log.started_at == 123.0 and log.now() > 0
    log.close()


def test_find_runs_any_depth_and_new_run_dir(tmp_path):
    for sub in ("a", "b/c/d", "b/e"):
        RunWriter(tmp_path / sub, meta())
    (tmp_path / "b" / "not-a-run").mkdir()
    assert find_runs(tmp_path) == [tmp_path / "a", tmp_path / "b/c/d", tmp_path / "b/e"]
    assert find_runs(tmp_path / "a") == [tmp_path / "a"]
    with pytest.raises(FileNotFoundError):
        find_runs(tmp_path / "nope")
    d1 = new_run_dir(tmp_path, "async", "resnet50-v1")
    d1.mkdir()
    d2 = new_run_dir(tmp_path, "async", "resnet50-v1")
    assert d1.name.startswith("async-resnet50-v1-") and d2 != d1 and not d2.exists()


def test_metrics_does_not_import_matplotlib_or_other_layers():
    code = (
        "import sys, hetps.metrics, hetps.metrics.cli\n"
        "bad = [m for m in sys.modules if m.startswith('matplotlib') or "
        "(m.startswith('hetps.') and not m.startswith(('hetps.metrics', 'hetps.config')))]\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --------------------------------------------------------------------------------------------
# Traffic


def test_traffic_buckets_exact(tmp_path):
    tr = TrafficRecorder(run_start=100.0, bucket_s=0.25, path=tmp_path / "traffic-worker0.jsonl")
    tr.record(100.0, 8, "push", 10)
    tr.record(100.2, 8, "push", 5)
    tr.record(100.25, 8, "pull", 7)
    tr.record(100.6, 10, "push", 3)
    tr.record(100.7, "server1", "pull", 4)
    tr.record(99.9, 8, "push", 1)  # before the start: bucket -1
    assert tr.buckets() == [
        {"t": -0.25, "dt": 0.25, "peer": 8, "push_bytes": 1, "pull_bytes": 0},
        {"t": 0.0, "dt": 0.25, "peer": 8, "push_bytes": 15, "pull_bytes": 0},
        {"t": 0.25, "dt": 0.25, "peer": 8, "push_bytes": 0, "pull_bytes": 7},
        {"t": 0.5, "dt": 0.25, "peer": 10, "push_bytes": 3, "pull_bytes": 0},
        {"t": 0.5, "dt": 0.25, "peer": "server1", "push_bytes": 0, "pull_bytes": 4},
    ]
    assert tr.totals() == {"push": 19, "pull": 11}
    with pytest.raises(MetricsError, match="'push' or 'pull'"):
        tr.record(100.0, 8, "send", 1)
    assert tr.close() == tmp_path / "traffic-worker0.jsonl"
    tr.record(100.0, 8, "push", 1000)  # ignored after close
    assert tr.totals() == {"push": 19, "pull": 11}
    assert load_traffic(tmp_path) == {"worker0": tr.buckets()}


def test_traffic_default_bucket_times_are_clean():
    tr = TrafficRecorder(run_start=0.0)
    tr.record(0.151, 9, "push", 1)  # bucket 3 of 50 ms
    assert tr.buckets()[0]["t"] == 0.15 and tr.buckets()[0]["dt"] == 0.05
    with pytest.raises(MetricsError):
        TrafficRecorder(0.0, bucket_s=0)
    with pytest.raises(MetricsError, match="no path"):
        tr.write()


def test_traffic_thread_safe(tmp_path):
    tr = TrafficRecorder(run_start=0.0, bucket_s=1.0)
    threads, n = 8, 20000
    barrier = threading.Barrier(threads)

    def work(k: int) -> None:
        barrier.wait()
        for i in range(n):
            tr.record(float(i % 4) + 0.5, i % 3, "push" if i % 2 else "pull", k + 1)

    ts = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    per_thread = sum(range(1, threads + 1))
    assert tr.totals() == {"push": n // 2 * per_thread, "pull": n // 2 * per_thread}
    # expected per (bucket, peer): the same calls made once, sequentially, times sum(k + 1)
    want: dict[tuple[float, int], list[int]] = {}
    for i in range(n):
        v = want.setdefault((float(i % 4), i % 3), [0, 0])
        v[0 if i % 2 else 1] += per_thread
    got = {(b["t"], b["peer"]): [b["push_bytes"], b["pull_bytes"]] for b in tr.buckets()}
    assert got == want and len(got) == 12
    path = tr.write(tmp_path / "traffic-server3.jsonl")
    assert load_traffic(tmp_path)["server3"] == tr.buckets() and path.exists()


# --------------------------------------------------------------------------------------------
# Summary


def make_logdir(root: Path) -> Path:
    """A hand-made LOGDIR with three runs whose summaries are worked out in the tests."""
    # Run A (esync, 2 workers): rank 0 ends at t=4, rank 1 at t=5 (the wall time).
    a = RunWriter(
        root / "esync" / "a",
        meta(
            mode="esync",
            slowdown=[1, 2],
            devices={0: "worker0 (cpu)", 1: "worker1 (cpu, slowdown x2)"},
        ),
    )
    with IterationLog(a.run_dir, 0) as log:
        for it, (t, comp, acc) in enumerate(
            [(1.0, 0.5, 0.5), (2.0, 0.5, None), (3.0, 1.0, 0.75), (4.0, 0.5, 0.82)]
        ):
            r = rec(0, it, t, compute_s=comp, bytes_sent=1000, bytes_recv=2000)
            if acc is not None:
                r["accuracy"] = acc
            log.write(r)
    with IterationLog(a.run_dir, 1) as log:
        log.write(rec(1, 0, 2.5, samples=32, compute_s=2.0, bytes_sent=500, bytes_recv=500))
        log.write(rec(1, 1, 5.0, samples=32, compute_s=2.0, bytes_sent=500, bytes_recv=500))
    # Run B (sync, 1 worker, split by class): srit_s given; accuracy never reaches 0.7.
    b = RunWriter(root / "sync" / "deep" / "b", meta(workers=1, split_by_class=True))
    with IterationLog(b.run_dir, 0) as log:
        log.write(rec(0, 0, 2.0, srit_s=1.5, accuracy=0.3, scheme="aware"))
        log.write(rec(0, 1, 4.0, srit_s=2.5, accuracy=0.6, comm_s=0.5, overhead_s=0.2))
    # Run C (local): no iteration finished.
    RunWriter(root / "c", meta(mode="local", workers=1))
    return root


def test_summary_exact(tmp_path):
    s = summarize(make_logdir(tmp_path))
    assert [r["mode"] for r in s["runs"]] == ["local", "esync", "sync"]  # sorted by path
    c, a, b = s["runs"]

    assert a["run_dir"] == str(tmp_path / "esync" / "a")
    assert a["network"] == "mlp" and a["workers"] == 2
    assert a["time_to_accuracy"] == {"0.7": 3.0, "0.8": 4.0, "0.85": None}
    assert a["final_accuracy"] == 0.82 and a["max_accuracy"] == 0.82
    assert a["wall_time_s"] == 5.0 and a["samples"] == 4 * 64 + 2 * 32
    assert a["throughput_samples_per_s"] == 320 / 5.0
    assert a["traffic_mb_per_s"]["push"] == pytest.approx(5000 / 5.0 / 1e6, rel=1e-12)
    assert a["traffic_mb_per_s"]["pull"] == pytest.approx(9000 / 5.0 / 1e6, rel=1e-12)
    assert a["computing_time_ratio"] == {
        "worker0 (cpu)": 2.5 / 4.0,
        "worker1 (cpu, slowdown x2)": 4.0 / 5.0,
    }
    assert a["asrit_s"] == (4.0 - 1.0) / 3
    assert a["accuracy_curve"] == [[1.0, 0.5], [3.0, 0.75], [4.0, 0.82]]
    assert a["heterogeneity_note"] == "emulated heterogeneity: --slowdown 1,2"
    assert a["scheme"] is None and a["split_by_class"] is False

    assert b["time_to_accuracy"] == {"0.7": None, "0.8": None, "0.85": None}
    assert b["final_accuracy"] == 0.6 and b["max_accuracy"] == 0.6
    assert b["asrit_s"] == 2.0  # mean of srit_s, not of the t gaps
    assert b["throughput_samples_per_s"] == 128 / 4.0
    assert b["computing_time_ratio"] == {"worker0": 0.2 / 4.0}
    assert b["comm_time_s"] == 0.5 and b["overhead_ratio"] == 0.2 / 4.0
    assert b["scheme"] == "aware" and b["split_by_class"] is True
    assert b["speed_samples_per_min"] == 128 / 4.0 * 60

    assert c["final_accuracy"] is None and c["max_accuracy"] is None
    assert c["throughput_samples_per_s"] is None and c["asrit_s"] is None
    assert c["traffic_mb_per_s"] == {"push": None, "pull": None}
    assert c["computing_time_ratio"] == {} and c["time_to_accuracy"]["0.8"] is None

    # the interface keys are all there, and the JSON is standard
    for r in s["runs"]:
        assert {
            "mode",
            "network",
            "workers",
            "run_dir",
            "time_to_accuracy",
            "final_accuracy",
            "max_accuracy",
            "throughput_samples_per_s",
            "traffic_mb_per_s",
            "computing_time_ratio",
            "asrit_s",
        } <= set(r)
    p = write_json(s, tmp_path / "out" / "s.json")
    assert json.loads(p.read_text()) == s

    text = format_summary(s)
    assert "esync" in text and "never" in text and "worker1 (cpu, slowdown x2) 0.800" in text
    assert "emulated heterogeneity: --slowdown 1,2" in text


def test_summary_asrit_single_record_and_no_rank0(tmp_path):
    w = RunWriter(tmp_path, meta(workers=3))
    with IterationLog(w.run_dir, 2) as log:  # only rank 2 wrote: evaluation falls back to it
        log.write(rec(2, 0, 1.5, accuracy=0.9))
    (r,) = summarize(tmp_path)["runs"]
    assert r["asrit_s"] is None and r["time_to_accuracy"]["0.85"] == 1.5
    assert r["computing_time_ratio"] == {"worker2": 0.1 / 1.5}


def test_summary_skips_bad_runs_when_asked(tmp_path):
    make_logdir(tmp_path)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "run.json").write_text('{"mode": "sync"}')
    with pytest.raises(MetricsError, match="missing key"):
        summarize(tmp_path)
    errors: list[str] = []
    assert len(summarize(tmp_path, errors=errors)["runs"]) == 3
    assert len(errors) == 1 and "broken" in errors[0]
