"""`hetps train` in every mode through real processes on a small slice of the real data."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from roles import read_port

DATA = Path("/usr/share/datasets/fashion-mnist")
pytestmark = pytest.mark.skipif(
    not DATA.exists(),
    reason="Fashion-MNIST not installed (scripts/setup.sh --tests installs it as root)",
)
SMALL = [
    "--train-limit",
    "2400",
    "--test-limit",
    "500",
    "-b",
    "32",
    "-e",
    "5",
    "--progress",
    "lines",
]


def _train(
    tmp_path: Path, *args: str, timeout: float = 180, env: dict | None = None
) -> subprocess.CompletedProcess:
    res = subprocess.run(
        [sys.executable, "-m", "hetps.cli", "train", "-ld", str(tmp_path), *SMALL, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})),
    )
    assert res.returncode == 0, res.stdout + res.stderr
    return res


def _records(run: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (run / f"worker-{rank}.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "mode,extra,name",
    [
        ("sync", [], "sync-mlp-w2"),
        ("async", [], "async-mlp-w2"),
        pytest.param("async", ["-dcasgd", "1"], "dcasgd-mlp-w2", marks=pytest.mark.slow),
        # step() leaves the pulls in flight; each layer's forward (evaluation's too) waits
        ("async", ["--overlap-forward"], "async-mlp-w2"),
    ],
)
def test_modes_train_and_log(tmp_path, mode, extra, name):
    """DC-ASGD is slow here: the async case takes the app's path, and DC-ASGD on the servers
    runs by default in integration/test_kvstore_modes.py
    (test_dcasgd_on_servers_knows_the_worker) and integration/test_dcasgd_backup.py."""
    _train(
        tmp_path,
        "-m",
        mode,
        *extra,
        "-n",
        "mlp",
        "--workers",
        "2",
        "--max-rounds",
        "30",
        "-l",
        "0.05",
    )
    run = tmp_path / name
    meta = json.loads((run / "run.json").read_text())
    assert meta["mode"] == name.split("-")[0] and meta["workers"] == 2
    for rank in (0, 1):
        recs = _records(run, rank)
        assert len(recs) == 30
        for r in recs:
            # (--overlap-forward: a round's answers may arrive in the next round)
            late = "--overlap-forward" in extra
            assert r["bytes_sent"] > 0 and (r["bytes_recv"] > 0 or late) and r["samples"] == 32
            assert r["compute_s"] > 0 and r["local_steps"] == 1
        assert sum(r["bytes_recv"] for r in recs) > 0
        assert (run / f"traffic-worker{rank}.jsonl").exists()
    accs = [r["accuracy"] for r in _records(run, 0) if r.get("accuracy") is not None]
    assert len(accs) == 6 and accs[-1] > 0.5, accs  # learned something on 4800 images


def test_esync_fast_workers_take_more_local_steps(tmp_path):
    _train(
        tmp_path,
        "-m",
        "esync",
        "-n",
        "lenet",
        "--workers",
        "3",
        "--slowdown",
        "1,1,6",
        "--max-rounds",
        "8",
        "-ll",
        "0.05",
    )
    run = tmp_path / "esync-lenet-w3"
    meta = json.loads((run / "run.json").read_text())
    assert meta["slowdown"] == [1, 1, 6] and meta["emulated_heterogeneity"] is True
    steps = {r: sum(x["local_steps"] for x in _records(run, r)[1:]) for r in range(3)}
    # the slowest does one step per round; emulated 6x slower means the fast ones do several
    assert steps[2] == 7, steps
    assert steps[0] > 2 * steps[2] and steps[1] > 2 * steps[2], steps
    # round 1 is lockstep (no step times known yet)
    assert [_records(run, r)[0]["local_steps"] for r in range(3)] == [1, 1, 1]

    # the recorded run summarised and plotted as a user would
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "hetps.cli",
            "summary",
            str(tmp_path),
            "--json",
            str(tmp_path / "s.json"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    summary = json.loads((tmp_path / "s.json").read_text())
    (only,) = summary["runs"]
    assert only["mode"] == "esync" and only["workers"] == 3 and only["network"] == "lenet"
    assert set(only["time_to_accuracy"]) == {"0.7", "0.8", "0.85"}
    assert only["throughput_samples_per_s"] > 0 and only["traffic_mb_per_s"]["push"] > 0
    assert len(only["computing_time_ratio"]) == 3 and only["asrit_s"] > 0
    res = subprocess.run(
        [sys.executable, "-m", "hetps.cli", "plot", str(tmp_path), "--out", str(tmp_path / "figs")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    for png in (
        "accuracy_vs_time_iid.png",
        "throughput.png",
        "traffic.png",
        "computing_time_ratio.png",
        "traffic_timeline.png",
    ):
        data = (tmp_path / "figs" / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, png


def test_local_mode_and_split_by_class(tmp_path):
    _train(tmp_path, "-m", "local", "-n", "mlp", "--max-rounds", "20", "-s")
    meta = json.loads((tmp_path / "local-mlp-w1" / "run.json").read_text())
    assert meta["split_by_class"] is True and meta["workers"] == 1


def test_epochs_end_after_exactly_their_steps(tmp_path):
    # 288 examples in batches of 96: 3 steps an epoch, so 2 epochs are 6 rounds (a float sum
    # of 1/3 stays below 2 after 6 steps: one round too many, as 1/1000 does after 4,000)
    _train(
        tmp_path, "-m", "local", "-n", "mlp", "--train-limit", "288", "-b", "96",
        "--epochs", "2", "-e", "100",
    )  # fmt: skip
    recs = _records(tmp_path / "local-mlp-w1", 0)
    assert [r["iter"] for r in recs] == list(range(1, 7))


def test_esync_with_standalone_state_server(tmp_path):
    # a state server of its own shares the job's cluster secret: one file for both
    secret = {"HETPS_SECRET_FILE": str(tmp_path / "job.secret")}
    subprocess.run(
        [sys.executable, "-m", "hetps.cli", "secret", secret["HETPS_SECRET_FILE"]], check=True
    )
    srv = subprocess.Popen(
        [sys.executable, "-m", "hetps.cli", "state-server", "-w", "2", "--host", "127.0.0.1"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=dict(os.environ, **secret),
    )
    try:
        port = srv.stdout.readline().split()[-1]
        _train(
            tmp_path,
            "-m",
            "esync",
            "-n",
            "mlp",
            "--workers",
            "2",
            "--max-rounds",
            "5",
            "-ip",
            "127.0.0.1",
            "-port",
            port,
            "--slowdown",
            "1,3",
            env=secret,
        )
        recs = _records(tmp_path / "esync-mlp-w2", 0)
        assert len(recs) == 5
    finally:
        os.killpg(srv.pid, signal.SIGTERM)
        srv.wait(timeout=10)


def test_overlap_forward_outside_async_is_refused(tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "hetps.cli", "train", "-ld", str(tmp_path), "-m", "sync",
         "--overlap-forward", "--workers", "1", *SMALL, "--max-rounds", "2"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert res.returncode != 0
    assert "--overlap-forward applies to -m async" in res.stderr, res.stderr


def test_missing_data_dir_is_explained(tmp_path):
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "hetps.cli",
            "train",
            "-m",
            "local",
            "-dd",
            str(tmp_path / "nope"),
            "-ld",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode != 0
    assert "dataset-fashion-mnist" in res.stderr and "--data-dir" in res.stderr


def test_devices_per_worker_are_used_logged_and_checked(tmp_path):
    _train(tmp_path, "-m", "sync", "--workers", "2", "--devices", "cpu,CPU", "--max-rounds", "3")
    meta = json.loads((tmp_path / "sync-mlp-w2" / "run.json").read_text())
    assert meta["devices"] == {"0": "worker0 (cpu)", "1": "worker1 (cpu)"}

    def fails(*args: str) -> str:
        res = subprocess.run(
            [sys.executable, "-m", "hetps.cli", "train", "-ld", str(tmp_path), *SMALL, *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode != 0, res.stdout
        return res.stderr

    # a wrong list is refused before any process starts, naming the fix
    err = fails("-m", "sync", "--workers", "2", "--devices", "cpu,tpu:0")
    assert "'tpu:0' is not a device" in err and "gpu:N" in err
    err = fails("-m", "sync", "--workers", "3", "--devices", "cpu,cpu")
    assert "needs 3 entries" in err
    err = fails("-m", "sync", "--workers", "2", "--devices", "cpu,cpu", "-g", "0")
    assert "drop -g/-c" in err
    # a GPU the machine does not have: the worker says which and what to do instead
    err = fails("-m", "local", "--devices", "gpu:99", "--max-rounds", "2")
    assert "worker 0 wants cuda:99" in err and "train on the CPU" in err


def test_slowdown_parses_one_factor_per_worker_or_this_workers_own():
    from hetps.app.train import parse_slowdown

    assert parse_slowdown(None, 3) == [1.0, 1.0, 1.0]
    assert parse_slowdown("1,2,4", 3) == [1.0, 2.0, 4.0]
    assert parse_slowdown("4", 3) == [4.0, 4.0, 4.0]  # every worker that gets the flag
    for bad in ("1,2", "0.5", "1,0.5,1"):
        with pytest.raises(SystemExit, match="one \\(this worker's\\) or 3"):
            parse_slowdown(bad, 3)


@pytest.fixture
def by_hand():
    """Start roles by hand, MXNet's way (1 server and 2 workers on loopback): ``start(argv,
    role, port, **env)``; every process started is killed at the end, whatever happened."""
    base = dict(
        os.environ,
        DMLC_PS_ROOT_URI="127.0.0.1",
        DMLC_NUM_SERVER="1",
        DMLC_NUM_WORKER="2",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    procs: list[subprocess.Popen] = []

    def start(argv: list[str], role: str, port: str, **env: str) -> subprocess.Popen:
        procs.append(
            subprocess.Popen(
                argv,
                env={**base, **env, "DMLC_ROLE": role, "DMLC_PS_ROOT_PORT": port},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
        return procs[-1]

    yield start
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def test_workers_started_by_hand_each_take_their_own_slowdown(tmp_path, by_hand):
    """The MXNet way, as ESync's README starts a cluster: a scheduler, a server and two
    workers by hand, each `hetps train` with its own flags; the one given `--slowdown 8` is
    the slow device of the ESync rounds (one local step while the other takes several)."""
    train = [sys.executable, "-m", "hetps.cli", "train", "-ld", str(tmp_path), *SMALL]
    train += ["-m", "esync", "-n", "lenet", "--max-rounds", "6", "--run-name", "byhand"]
    sched = by_hand([sys.executable, "-m", "hetps.cli", "scheduler"], "scheduler", "0")
    port = str(read_port(sched.stdout))  # after the scheduler's plain-mode warning
    server = by_hand(train, "server", port)
    slow = by_hand([*train, "--slowdown", "8"], "worker", port)
    fast = by_hand(train, "worker", port)
    outs = {p.pid: p.communicate(timeout=240)[0] for p in (server, slow, fast)}
    assert sched.wait(timeout=60) == 0
    for p in (server, slow, fast):
        assert p.returncode == 0, outs.get(p.pid)

    def rank_of(p: subprocess.Popen) -> int:
        (line,) = [x for x in outs[p.pid].splitlines() if " finished " in x]
        return int(line.split()[1])  # "worker R finished N rounds ..."

    run = tmp_path / "byhand"
    steps = {
        who: [r["local_steps"] for r in _records(run, rank_of(p))]
        for who, p in (("slow", slow), ("fast", fast))
    }
    assert len(steps["slow"]) == len(steps["fast"]) == 6
    assert sum(steps["fast"][1:]) > sum(steps["slow"][1:]), steps  # round 1 is lockstep


def test_a_crashed_worker_is_reported_as_crashed_to_everyone(tmp_path, by_hand):
    """Roles by hand; one worker's training images are truncated, so it crashes after joining.
    The other worker, the server and the scheduler stop with its cause (not with "uneven
    rounds" as if it had finished), and every one of them exits non-zero."""
    bad_data = tmp_path / "truncated"
    bad_data.mkdir()
    for f in DATA.iterdir():  # the same files, the training images cut short
        blob = f.read_bytes()
        (bad_data / f.name).write_bytes(blob[:4096] if f.name.startswith("train-images") else blob)
    train = [sys.executable, "-m", "hetps.cli", "train", "-ld", str(tmp_path), *SMALL]
    train += ["-m", "sync", "-n", "mlp", "--run-name", "crash"]
    slow_hb = {"PS_HEARTBEAT_TIMEOUT": "60"}  # the cause must come from the crash, not a timeout
    sched = by_hand([sys.executable, "-m", "hetps.cli", "scheduler"], "scheduler", "0", **slow_hb)
    port = str(read_port(sched.stdout))
    server = by_hand(train, "server", port, **slow_hb)
    # the good worker is rank 0, so it writes run.json, which must record how the run ended
    good = by_hand(train, "worker", port, HETPS_LAUNCH_RANK="0", **slow_hb)
    bad = by_hand([*train, "-dd", str(bad_data)], "worker", port, HETPS_LAUNCH_RANK="1", **slow_hb)
    outs = {p.pid: p.communicate(timeout=120)[0] for p in (server, good, bad)}
    sched_out = sched.communicate(timeout=60)[0]
    assert bad.returncode != 0 and "ValueError" in outs[bad.pid], outs[bad.pid]
    for who, p, out in (
        ("good worker", good, outs[good.pid]),
        ("server", server, outs[server.pid]),
        ("scheduler", sched, sched_out),
    ):
        assert p.returncode != 0, (who, out)
        assert "exited with an error: ValueError" in out, (who, out)
        assert "uneven" not in out, (who, out)
    ended = json.loads((tmp_path / "crash" / "run.json").read_text())["ended"]
    assert ended["status"] == "failed" and "worker rank 1" in ended["cause"], ended
    assert "ValueError" in ended["cause"], ended


def test_a_rerun_keeps_the_earlier_runs_logs(tmp_path):
    """Re-running with the same log directory and run name moves the earlier run to
    LOGDIR/.previous/ (summaries leave it out); --overwrite-logs deletes it instead. run.json
    records that each run completed."""
    args = ["-m", "local", "--max-rounds", "3", "--run-name", "again"]
    run = tmp_path / "again"
    _train(tmp_path, *args)
    first = json.loads((run / "run.json").read_text())
    first_log = (run / "worker-0.jsonl").read_text()
    assert first["ended"]["status"] == "completed"
    res = _train(tmp_path, *args)
    (kept,) = (tmp_path / ".previous").iterdir()
    assert f"moved to {kept}" in res.stdout
    assert json.loads((kept / "run.json").read_text())["started_at"] == first["started_at"]
    assert (kept / "worker-0.jsonl").read_text() == first_log
    second = json.loads((run / "run.json").read_text())
    assert second["started_at"] != first["started_at"] and second["ended"]["status"] == "completed"
    assert len((run / "worker-0.jsonl").read_text().splitlines()) == 3  # only the new run's
    summary = subprocess.run(
        [
            sys.executable,
            "-m",
            "hetps.cli",
            "summary",
            str(tmp_path),
            "--json",
            str(tmp_path / "s.json"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert summary.returncode == 0, summary.stderr
    runs = json.loads((tmp_path / "s.json").read_text())["runs"]
    assert [r["run_dir"] for r in runs] == [str(run)] and runs[0]["ended"] == "completed"
    _train(tmp_path, *args, "--overwrite-logs")
    assert [p.name for p in (tmp_path / ".previous").iterdir()] == [kept.name]
    assert json.loads((run / "run.json").read_text())["started_at"] != second["started_at"]


def test_g_takes_the_gpu_of_the_workers_local_rank(tmp_path):
    """-g N names a host's first GPU: a worker whose launcher set LOCAL_RANK=2 takes N + 2
    (here, with no GPU, it says which one it wanted)."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("checks the error of a machine without a GPU")
    res = subprocess.run(
        [sys.executable, "-m", "hetps.cli", "train", "-ld", str(tmp_path), *SMALL,
         "-m", "local", "-g", "1", "--max-rounds", "2"],
        capture_output=True, text=True, timeout=60, env={**os.environ, "LOCAL_RANK": "2"},
    )  # fmt: skip
    assert res.returncode != 0, res.stdout
    assert "-g: worker 0 wants cuda:3" in res.stderr, res.stderr
