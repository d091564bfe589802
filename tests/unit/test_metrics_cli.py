"""``hetps summary`` / ``hetps plot`` through hetps.metrics.cli.main, on a recorded log dir."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from hetps.metrics import IterationLog, RunWriter, TrafficRecorder, run_meta, summarize
from hetps.metrics.cli import add_parser, cmd_plot, cmd_summary, main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(
    d: Path,
    mode: str,
    network: str = "lenet",
    slowdown: tuple[float, ...] = (1, 1, 4),
    split: bool = False,
    speed: float = 1.0,
    extra_meta: dict | None = None,
    extra_rec: dict | None = None,
    rounds: int = 12,
) -> None:
    """A small but plausible run: 3 workers, 2 servers (ids 8, 10), traffic in 50 ms buckets."""
    start = 5000.0
    w = RunWriter(
        d,
        run_meta(
            mode,
            network,
            len(slowdown),
            2,
            32,
            slowdown=list(slowdown),
            split_by_class=split,
            started_at=start,
            **(extra_meta or {}),
        ),
    )
    period = 0.2 * max(slowdown) if mode in ("sync", "esync") else None
    for rank, sd in enumerate(slowdown):
        tr = TrafficRecorder(start, 0.05, path=w.run_dir / f"traffic-worker{rank}.jsonl")
        with IterationLog(w.run_dir, rank) as log:
            t = 0.0
            for it in range(rounds):
                step = period or 0.2 * sd
                comp = 0.2 * sd if mode != "esync" else step * 0.9
                for peer in (8, 10):
                    tr.record(start + t + comp + 0.01, peer, "push", 20_000)
                    tr.record(start + t + comp + 0.06, peer, "pull", 20_000)
                t += step
                r = {
                    "rank": rank,
                    "iter": it,
                    "epoch": 0,
                    "t": t,
                    "samples": 32 * (int(max(slowdown) / sd) if mode == "esync" else 1),
                    "loss": 1.0 / (it + 1),
                    "local_steps": 1,
                    "compute_s": comp,
                    "push_s": 0.01,
                    "pull_s": 0.01,
                    "wait_s": step - comp - 0.02 if step > comp + 0.02 else 0.0,
                    "bytes_sent": 40_000,
                    "bytes_recv": 40_000,
                }
                if rank == 0 and it % 3 == 2:
                    r["accuracy"] = min(0.95, 0.5 + 0.05 * speed * it)
                r.update(extra_rec or {})
                log.write(r)
        tr.close()


@pytest.fixture
def logdir(tmp_path: Path) -> Path:
    root = tmp_path / "logs"
    for mode, sp in (("esync", 2.0), ("sync", 0.7), ("async", 1.0), ("dcasgd", 1.1)):
        write_run(root / "iid" / mode, mode, speed=sp)
    write_run(root / "noniid" / "esync", "esync", split=True, speed=1.5)
    write_run(root / "noniid" / "sync", "sync", split=True, speed=0.5)
    write_run(root / "local", "local", slowdown=(1,), speed=1.2)
    return root


def assert_png(path: Path, min_bytes: int = 5000) -> None:
    assert path.is_file(), path
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > min_bytes, (path, len(data))


def test_summary_cli_prints_and_writes_json(logdir, tmp_path, capsys):
    out = tmp_path / "summary.json"
    assert main(["summary", str(logdir), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for word in ("esync", "dcasgd", "local", "t@0.8", "computing-time ratio", "non-iid"):
        assert word in text
    assert "emulated heterogeneity: --slowdown 1,1,4" in text
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(summarize(logdir)))
    assert len(data["runs"]) == 7
    esync = next(r for r in data["runs"] if r["run_dir"].endswith("iid/esync"))
    assert esync["time_to_accuracy"]["0.7"] is not None


def test_summary_cli_errors(tmp_path, capsys):
    assert main(["summary", str(tmp_path / "missing")]) == 2
    assert "no such log directory" in capsys.readouterr().err
    assert main(["summary", str(tmp_path)]) == 1
    assert "no runs under" in capsys.readouterr().err


def test_plot_cli_writes_every_figure(logdir, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "fig"
    assert main(["plot", str(logdir), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    for name in (
        "accuracy_vs_time_iid",
        "accuracy_vs_time_noniid",
        "throughput",
        "traffic",
        "computing_time_ratio",
    ):
        assert_png(out / f"{name}.png")
    timelines = sorted(p.name for p in out.glob("traffic_timeline_*.png"))
    assert len(timelines) == 7 and "traffic_timeline_iid_esync.png" in timelines
    for name in timelines:
        assert_png(out / name)
    # no load-balance keys in these logs: those figures are skipped with a note
    assert "note: speed_per_scheme.png: skipped" in printed
    assert not (out / "speed_per_scheme.png").exists()


def test_plot_one_run_timeline_window_and_missing_kind(logdir, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "one"
    argv = ["plot", str(logdir / "iid"), "--out", str(out), "--run", "sync", "--window", "0.5,2"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert_png(out / "traffic_timeline.png")
    assert not list(out.glob("traffic_timeline_*.png"))
    assert "accuracy_vs_time_noniid.png: skipped, no non-i.i.d. runs" in printed
    assert not (out / "accuracy_vs_time_noniid.png").exists()
    # --run must name one run
    assert main(["plot", str(logdir), "--out", str(out), "--run", "nope"]) == 1
    assert "no such run" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plot", str(logdir), "--window", "3,1"])


def test_plot_default_out_and_figure_filter(logdir, capsys):
    pytest.importorskip("matplotlib")
    assert main(["plot", str(logdir / "local"), "--figure", "throughput"]) == 0
    assert [p.name for p in (logdir / "local" / "figures").iterdir()] == ["throughput.png"]
    assert main(["plot", str(logdir), "--figure", "nonsense"]) == 1
    assert "unknown figure" in capsys.readouterr().err


def test_plot_load_balance_figures(tmp_path):
    pytest.importorskip("matplotlib")
    root = tmp_path / "lb"
    for scheme, srit in (("average", 0.5), ("aware", 0.3), ("optimal", 0.28)):
        write_run(
            root / scheme,
            "sync",
            network="resnet50-v1",
            slowdown=(1, 1, 1),
            extra_meta={"scheme": scheme, "scenario": "dynamic"},
            extra_rec={"srit_s": srit, "comm_s": srit / 2, "overhead_s": 0.004},
        )
    for x in (10_000, 100_000, 1_000_000):
        write_run(
            root / f"slice{x}",
            "sync",
            network="resnet50-v1",
            slowdown=(1, 1, 1),
            extra_meta={"scheme": "aware", "slice_size": x},
        )
    out = tmp_path / "fig"
    names = ("speed_per_scheme", "srit_over_iterations", "asrit_vs_slice_size", "overhead")
    argv = ["plot", str(root), "--out", str(out)]
    for name in names:
        argv += ["--figure", name]
    assert main(argv) == 0
    for name in names:
        assert_png(out / f"{name}.png")
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{n}.png" for n in names)
    runs = summarize(root)["runs"]
    assert {r["scheme"] for r in runs} == {"average", "aware", "optimal"}
    assert sorted(r["slice_size"] for r in runs if r["slice_size"]) == [10_000, 100_000, 1_000_000]


def test_srit_panels_follow_the_runs_by_mode_then_directory(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from hetps.metrics.plot_balance import fig_srit
    from hetps.metrics.plot_helpers import PlotContext
    from hetps.metrics.runs import load_run

    # directory a's run is resnet's, b's lenet's: the panels come in the directories' order
    for d, mode, net in (("a", "sync", "resnet"), ("b", "sync", "lenet"), ("c", "esync", "alex")):
        write_run(tmp_path / d, mode, network=net, slowdown=(1,), extra_rec={"srit_s": 0.2})
    runs = [load_run(tmp_path / d) for d in ("c", "b", "a")]
    ctx = PlotContext(runs, [{} for _ in runs], tmp_path / "out", [])
    drawn = []
    monkeypatch.setattr(PlotContext, "save", lambda self, fig, name: drawn.append(fig) or name)
    assert fig_srit(ctx) == ["srit_over_iterations.png"]
    (fig,) = drawn
    labels = [ax.get_ylabel() for ax in fig.axes]
    assert labels == ["resnet\nSRIT (s)", "lenet\nSRIT (s)", "alex\nSRIT (s)"]


def test_add_parser_follows_the_top_level_convention():
    p = argparse.ArgumentParser(prog="hetps")
    sub = p.add_subparsers(dest="cmd", required=True)
    add_parser(sub)
    args = p.parse_args(["summary", "LOG", "--json", "x.json"])
    assert args.func is cmd_summary and args.logdir == "LOG" and args.json == "x.json"
    args = p.parse_args(["plot", "LOG", "--out", "D", "--run", "r1", "--window", "1,2"])
    assert args.func is cmd_plot and args.out == "D" and args.window == (1.0, 2.0)
