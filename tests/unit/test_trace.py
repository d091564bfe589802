"""``hetps trace``: the trace-event checker, the trace of a written run, the command's errors."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import pytest

from hetps.metrics import IterationLog, RunWriter, TrafficRecorder, run_meta
from hetps.metrics.cli import main
from hetps.metrics.spans import Spans
from hetps.metrics.trace import build_trace
from tracecheck import TraceFormatError, counter_totals, validate_trace

START = 7000.0


def _ok_trace() -> dict:
    """A small trace using every kind of event the checker knows."""
    return {
        "traceEvents": [
            {"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "worker 0"}},
            {"ph": "M", "name": "process_sort_index", "pid": 1, "args": {"sort_index": 1}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 2, "args": {"name": "push"}},
            {"ph": "X", "name": "round 0", "pid": 1, "tid": 1, "ts": 0, "dur": 100},
            {"ph": "X", "name": "compute", "pid": 1, "tid": 1, "ts": 10, "dur": 40},
            {"ph": "X", "name": "push", "pid": 1, "tid": 1, "ts": 50, "dur": 50},
            {"ph": "X", "name": "round 1", "pid": 1, "tid": 1, "ts": 100, "dur": 10},
            {"ph": "B", "name": "pull", "pid": 1, "tid": 3, "ts": 5},
            {"ph": "B", "name": "copy", "pid": 1, "tid": 3, "ts": 6},
            {"ph": "E", "pid": 1, "tid": 3, "ts": 7},
            {"ph": "E", "name": "pull", "pid": 1, "tid": 3, "ts": 9},
            {"ph": "C", "name": "bytes", "pid": 1, "tid": 0, "ts": 3, "args": {"push": 5}},
            {"ph": "i", "name": "mark", "pid": 1, "tid": 1, "ts": 3, "s": "p"},
        ],
        "displayTimeUnit": "ms",
    }


def _broken(change) -> dict:
    t = copy.deepcopy(_ok_trace())
    change(t["traceEvents"])
    return t


BROKEN = {
    "no ph": (lambda ev: ev[3].pop("ph"), "ph None is not a trace event phase"),
    "unknown ph": (lambda ev: ev[3].update(ph="Q"), "ph 'Q' is not"),
    "no name": (lambda ev: ev[3].pop("name"), "name must be a string"),
    "X without dur": (lambda ev: ev[4].pop("dur"), "dur must be a finite number >= 0"),
    "negative dur": (lambda ev: ev[4].update(dur=-1), "dur must be a finite number >= 0"),
    "negative ts": (lambda ev: ev[4].update(ts=-5), "ts must be a finite number >= 0"),
    "ts a string": (lambda ev: ev[4].update(ts="10"), "ts must be a finite number"),
    "no ts": (lambda ev: ev[5].pop("ts"), "no ts"),
    "pid a string": (lambda ev: ev[4].update(pid="1"), "pid must be an integer"),
    "no tid": (lambda ev: ev[4].pop("tid"), "no tid"),
    "X overlaps without nesting": (
        lambda ev: ev[5].update(dur=80),
        "overlaps event 3 on pid/tid (1, 1) without nesting",
    ),
    "E without B": (lambda ev: ev.append({"ph": "E", "pid": 1, "tid": 9, "ts": 1}), "E without"),
    "B never closed": (lambda ev: ev.pop(10), "never closed"),
    "E closes the wrong B": (lambda ev: ev[10].update(name="push"), "E 'push' closes B 'pull'"),
    "B/E time goes back": (lambda ev: ev[9].update(ts=1), "goes back in time"),
    "counter without values": (lambda ev: ev[11].update(args={}), "a counter needs args"),
    "counter value not a number": (
        lambda ev: ev[11].update(args={"push": "5"}),
        "counter values must be finite numbers",
    ),
    "unknown metadata": (lambda ev: ev[0].update(name="proc_name"), "unknown metadata name"),
    "process_name without a name": (
        lambda ev: ev[0].update(args={"label": "x"}),
        "process_name needs args.name",
    ),
    "sort index not an int": (
        lambda ev: ev[1].update(args={"sort_index": "1"}),
        "needs args.sort_index",
    ),
    "args not an object": (lambda ev: ev[3].update(args=[1]), "args must be an object"),
    "instant scope": (lambda ev: ev[12].update(s="x"), "instant scope"),
    "event not an object": (lambda ev: ev.append(3), "not an object"),
}


def test_checker_accepts_a_well_formed_trace():
    validate_trace(_ok_trace())
    validate_trace(_ok_trace()["traceEvents"])  # the JSON Array Format


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_checker_rejects_broken_traces(case):
    change, message = BROKEN[case]
    with pytest.raises(TraceFormatError) as e:
        validate_trace(_broken(change))
    assert any(message in p for p in e.value.problems), e.value.problems


@pytest.mark.parametrize(
    "obj,message",
    [
        ({"events": []}, "no traceEvents"),
        ({"traceEvents": {}}, "traceEvents is not a list"),
        ("[]", "a trace is a JSON object or array"),
        ({"traceEvents": [], "displayTimeUnit": "s"}, "displayTimeUnit must be"),
    ],
)
def test_checker_rejects_broken_containers(obj, message):
    with pytest.raises(TraceFormatError) as e:
        validate_trace(obj)
    assert message in e.value.problems[0]


# -- the trace of a run ------------------------------------------------------------------------
def _write_run(d: Path, with_spans: bool = True) -> dict:
    """Two workers, 4 rounds each, known spans and traffic; returns what was written."""
    w = RunWriter(d, run_meta("sync", "mlp", 2, 1, 32, started_at=START))
    written = {"records": {}, "traffic": {}}
    for rank in (0, 1):
        tr = TrafficRecorder(START, 0.01, path=w.run_dir / f"traffic-worker{rank}.jsonl")
        recs = []
        with IterationLog(w.run_dir, rank) as log:
            t = 0.0
            for it in range(4):
                # a round: 4 ms of bookkeeping, then compute, push, wait, pull
                comp, push, wait, pull, gap = 0.02 + 0.01 * rank, 0.003, 0.01, 0.002, 0.004
                t0, t = t, t + gap
                spans = [
                    ["compute", round(t, 6), comp],
                    ["push", round(t + comp, 6), push],
                    ["wait", round(t + comp + push, 6), wait],
                    ["pull", round(t + comp + push + wait, 6), pull],
                ]
                tr.record(START + t + comp + 0.001, "server0", "push", 1000 + it)
                tr.record(START + t + comp + push + wait + 0.001, "server0", "pull", 2000 + it)
                t += comp + push + wait + pull
                rec = {
                    "rank": rank, "iter": it, "epoch": 0, "t": t, "samples": 32,
                    "loss": 1.0 / (it + 1), "local_steps": 1, "compute_s": comp,
                    "push_s": push, "wait_s": wait, "pull_s": pull, "bytes_sent": 1000 + it,
                    "bytes_recv": 2000 + it, "srit_s": t - t0,
                }  # fmt: skip
                if with_spans:
                    rec["spans"] = spans
                log.write(rec)
                recs.append(rec)
        tr.close()
        written["records"][rank] = recs
        written["traffic"][rank] = tr.totals()
    return written


def _by(trace: dict, **match) -> list[dict]:
    return [e for e in trace["traceEvents"] if all(e.get(k) == v for k, v in match.items())]


def test_trace_of_a_run_has_a_process_per_worker_its_rounds_phases_and_bytes(tmp_path):
    written = _write_run(tmp_path / "run")
    trace = build_trace(tmp_path / "run")
    validate_trace(trace)
    procs = {e["pid"]: e["args"]["name"] for e in _by(trace, ph="M", name="process_name")}
    assert sorted(procs.values()) == ["worker 0: worker0", "worker 1: worker1"]
    for rank in (0, 1):
        pid = next(p for p, n in procs.items() if n.startswith(f"worker {rank}"))
        threads = {e["tid"]: e["args"]["name"] for e in _by(trace, ph="M", name="thread_name", pid=pid)}  # fmt: skip
        assert threads == {0: "rounds", 1: "compute", 2: "push", 3: "wait", 4: "pull"}
        rounds = _by(trace, ph="X", cat="round", pid=pid)
        assert [e["name"] for e in rounds] == [f"round {i}" for i in range(4)]
        for rec, ev in zip(written["records"][rank], rounds, strict=True):
            # the round starts srit_s before its end, 4 ms before its first phase
            assert ev["ts"] == pytest.approx((rec["spans"][0][1] - 0.004) * 1e6, abs=1)
            assert ev["ts"] + ev["dur"] == pytest.approx(rec["t"] * 1e6, abs=1)
            assert ev["args"]["loss"] == rec["loss"]
        phases = _by(trace, ph="X", cat="phase", pid=pid)
        want = [(n, s * 1e6, d * 1e6) for rec in written["records"][rank] for n, s, d in rec["spans"]]  # fmt: skip
        got = sorted(((e["name"], e["ts"], e["dur"]) for e in phases), key=lambda x: x[1])
        want.sort(key=lambda x: x[1])
        assert [g[0] for g in got] == [w[0] for w in want]
        assert [g[1:] for g in got] == [pytest.approx(w[1:], abs=1e-3) for w in want]
        for e in phases:
            assert e["tid"] == {v: k for k, v in threads.items()}[e["name"]]
    totals = counter_totals(trace)
    for rank in (0, 1):
        got = totals[f"bytes worker{rank}↔server0"]
        assert got == {
            "push_bytes": written["traffic"][rank]["push"],
            "pull_bytes": written["traffic"][rank]["pull"],
        }
    # one value per bucket that carried bytes, then back to 0 at the bucket's end (10 ms on)
    # unless the next bucket follows at once
    counters = _by(trace, ph="C", name="bytes worker0↔server0")
    assert sum(1 for e in counters if any(e["args"].values())) == 8
    assert not any(counters[-1]["args"].values())
    for prev, e in zip(counters, counters[1:], strict=False):
        if not any(e["args"].values()):
            assert e["ts"] - prev["ts"] == pytest.approx(10_000, abs=1e-3)
        else:
            assert e["ts"] - prev["ts"] >= 10_000 - 1e-3


def test_records_without_spans_get_their_phase_sums_end_to_end_marked_derived(tmp_path):
    written = _write_run(tmp_path / "run", with_spans=False)
    trace = build_trace(tmp_path / "run")
    validate_trace(trace)
    rec = written["records"][1][2]
    phases = [e for e in _by(trace, ph="X", cat="phase", pid=2) if e["args"]["iter"] == 2]
    assert [e["name"] for e in phases] == ["compute", "push", "wait", "pull"]
    assert all(e["args"]["derived"] for e in phases)
    assert phases[-1]["ts"] + phases[-1]["dur"] == pytest.approx(rec["t"] * 1e6, abs=1)
    for a, b in zip(phases, phases[1:], strict=False):  # end to end
        assert a["ts"] + a["dur"] == pytest.approx(b["ts"], abs=1e-3)
    assert phases[0]["dur"] == pytest.approx(rec["compute_s"] * 1e6, abs=1e-3)


def test_spans_are_on_the_run_clock():
    start = time.time() - 2.0
    sp = Spans(start)
    with sp.phase("compute"):
        time.sleep(0.01)
    t_now = time.time() - start
    end = time.perf_counter()
    sp.add("wait", end - 0.005, end)
    assert sp.totals()["compute"] >= 0.009
    (c_name, c_start, c_dur), (w_name, w_start, w_dur) = sp.take()
    assert (c_name, w_name) == ("compute", "wait")
    assert c_start == pytest.approx(t_now - c_dur, abs=0.003)
    assert w_start + w_dur == pytest.approx(t_now, abs=0.003) and w_dur == 0.005
    assert sp.take() == []
    at = sp.from_unix(start + 1.5)  # a message's timestamp lands at its run time
    sp.add("recv", at, at)
    assert sp.take()[0][1] == pytest.approx(1.5, abs=1e-6)


# -- the command -------------------------------------------------------------------------------
def test_cli_writes_a_valid_trace_and_says_how_to_open_it(tmp_path, capsys):
    _write_run(tmp_path / "run")
    assert main(["trace", str(tmp_path / "run"), "-o", str(tmp_path / "t.json")]) == 0
    out = capsys.readouterr().out
    assert f"wrote {tmp_path / 't.json'} (8 rounds)" in out and "ui.perfetto.dev" in out
    validate_trace(json.loads((tmp_path / "t.json").read_text()))
    assert main(["trace", str(tmp_path / "run")]) == 0  # default: RUN/trace.json
    assert (tmp_path / "run" / "trace.json").is_file()


def test_cli_on_a_logdir_names_a_run_in_it(tmp_path, capsys):
    _write_run(tmp_path / "logs" / "a")
    assert main(["trace", str(tmp_path / "logs")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "is not a run directory (no run.json)" in err
    assert f"hetps trace {tmp_path / 'logs' / 'a'}" in err


@pytest.mark.parametrize("what", ["missing", "empty dir"])
def test_cli_on_no_run_says_so_in_one_line(tmp_path, capsys, what):
    d = tmp_path / "x"
    if what == "empty dir":
        d.mkdir()
    assert main(["trace", str(d)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("hetps trace: ") and "fix:" in err


def test_cli_drops_a_torn_last_line_and_says_so(tmp_path, capsys):
    _write_run(tmp_path / "run")
    log = tmp_path / "run" / "worker-1.jsonl"
    log.write_text(log.read_text() + '{"rank": 1, "iter": 4, "ep')  # killed mid-write
    assert main(["trace", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "worker-1.jsonl ended in a torn line" in out and "(8 rounds)" in out


def test_cli_on_a_corrupt_log_names_the_file_and_line(tmp_path, capsys):
    _write_run(tmp_path / "run")
    log = tmp_path / "run" / "worker-0.jsonl"
    lines = log.read_text().splitlines()
    lines[1] = lines[1][:20]
    log.write_text("\n".join(lines) + "\n")
    assert main(["trace", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{log}:2: not JSON" in err


def test_cli_on_a_run_without_iterations(tmp_path, capsys):
    RunWriter(tmp_path / "run", run_meta("sync", "mlp", 2, 1, 32, started_at=START))
    assert main(["trace", str(tmp_path / "run")]) == 1
    assert "no iteration was logged" in capsys.readouterr().err


def test_plot_draws_the_phase_timeline_of_a_run(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    _write_run(tmp_path / "logs" / "run")
    RunWriter(tmp_path / "logs" / "empty", run_meta("sync", "mlp", 2, 1, 32, started_at=START))
    code = main(
        ["plot", str(tmp_path / "logs"), "--run", "run", "--figure", "phase_timeline",
         "--out", str(tmp_path / "figs")]
    )  # fmt: skip
    assert code == 0
    png = tmp_path / "figs" / "phase_timeline.png"
    assert f"wrote {png}" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code = main(["plot", str(tmp_path / "logs"), "--run", "empty", "--figure", "phase_timeline"])
    assert code == 1
    assert "phase_timeline.png: skipped, no run with iterations" in capsys.readouterr().out
