"""Elastic workers (HETPS_ELASTIC): a worker killed with SIGKILL mid-round is let go, the
rounds it left unfinished complete with the others, and the job goes on with nothing
restarted. Below the minimum the job fails with a clear error."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from conftest import PRELUDE, TEST_ENV
from hetps.launch.contract import LaunchSpec
from hetps.launch.local import Launcher

# Three workers, one server, keys "a" (small) and "b" (3 chunks of HETPS_CHUNK_BYTES), no
# optimizer: each round's value is the sum of what the workers pushed, (rank + 1) * (r + 1)
# everywhere. At round DIE_AT worker 2 pushes "a" only, makes sure the server has it (a
# pull of "probe" behind it on the same connection), and kills itself: its "b" of that round
# never comes. The survivors print what every round gave them, and the ranges the store
# says hold fewer workers (short_rounds).
SCRIPT = """
import json
rounds, die_at = int(os.environ["ROUNDS"]), int(os.environ["DIE_AT"])
kv = hetps.kv.create("dist_sync")
kv.init(["a", "b", "probe"], [np.zeros(5, np.float32), np.zeros(3000, np.float32),
                              np.zeros(1, np.float32)])
if os.environ.get("SGD"):
    kv.set_optimizer(optim.SGD(learning_rate=1.0))
outs = [np.zeros(5, np.float32), np.zeros(3000, np.float32)]
seen = []
for r in range(rounds):
    mine = [np.full(5, (kv.rank + 1) * (r + 1), np.float32),
            np.full(3000, (kv.rank + 1) * (r + 1), np.float32)]
    if r == die_at and kv.rank == 2:
        kv.push("a", mine[0])
        kv.pull("probe")
        os.kill(os.getpid(), signal.SIGKILL)
    kv.pushpull(["a", "b"], mine, out=outs)
    seen.append({"r": r, "a": sorted(set(outs[0].tolist())), "b": sorted(set(outs[1].tolist())),
                 "sa": kv.short_rounds("a"), "sb": kv.short_rounds("b"),
                 "live": kv.live_workers})
print("SEEN", kv.rank, kv.live_rank, json.dumps(seen), flush=True)
"""

ENV = {
    **TEST_ENV,
    "HETPS_CHUNK_BYTES": "4096",
    "ROUNDS": "8",
    "DIE_AT": "4",
}


def _run(tmp_path, elastic: int, extra: dict | None = None) -> tuple[int, str]:
    script = tmp_path / "elastic_script.py"
    script.write_text(PRELUDE + textwrap.dedent(SCRIPT))
    out = io.StringIO()
    spec = LaunchSpec(
        num_workers=3,
        num_servers=1,
        command=[sys.executable, str(script)],
        env={**ENV, **(extra or {})},
        start_timeout=30.0,
        failure_grace=5.0,
        elastic_min=elastic,
    )
    launcher = Launcher(spec, out=out)
    try:
        code = launcher.run()
    finally:
        launcher.stop_all(kill=True)
    return code, out.getvalue()


def _seen(out: str) -> dict[int, tuple[int, list[dict]]]:
    import json

    return {
        int(rank): (int(live_rank), json.loads(seen))
        for rank, live_rank, seen in re.findall(r"SEEN (\d) (\d) (\[.*\])", out)
    }


def test_a_dead_worker_is_let_go_and_the_others_finish_its_rounds(tmp_path):
    code, out = _run(tmp_path, elastic=2)
    assert code == 0, out
    assert re.search(r"elastic: worker 2 .*was killed by signal 9.*with 2 workers", out), out
    seen = _seen(out)
    assert sorted(seen) == [0, 1], out  # worker 2 never got that far
    assert seen[0][0] == 0 and seen[1][0] == 1  # their places among the live workers
    die = int(ENV["DIE_AT"])
    for _rank, (_, rounds) in seen.items():
        assert [s["r"] for s in rounds] == list(range(int(ENV["ROUNDS"])))
        for s in rounds:
            r, full, two = s["r"], 6.0 * (s["r"] + 1), 3.0 * (s["r"] + 1)
            if r < die:
                assert s["a"] == [full] and s["b"] == [full] and s["sa"] == s["sb"] == []
                continue
            # "b" of the round it died in never had its push: the two others' sum, and the
            # store says so for the whole key
            assert s["b"] == [two] and s["sb"] == [[0, 3000, 2]], s
            if r == die and s["a"] == [full]:
                # its "a" came before the others' (the round completed with it): kept
                assert s["sa"] == [], s
            else:
                assert s["a"] == [two] and s["sa"] == [[0, 5, 2]], s
            if r > die:
                assert s["live"] == 2
    # each survivor read the same values every round
    assert seen[0][1] == seen[1][1], out


def test_with_a_server_optimizer_the_step_is_the_survivors_mean_at_the_jobs_scale(tmp_path):
    """SGD with learning rate 1 and rescale_grad 1: each round subtracts the sum of the
    pushes; after the leave, the survivors' sum scaled by 3/2 (the job's mean times 3)."""
    code, out = _run(tmp_path, elastic=2, extra={"SGD": "1"})
    assert code == 0, out
    seen = _seen(out)
    die = int(ENV["DIE_AT"])
    for _rank, (_, rounds) in seen.items():
        value = 0.0
        for s in rounds:
            r = s["r"]
            value -= 6.0 * (r + 1) if r < die else 3.0 * (r + 1) * 3 / 2
            assert s["b"] == [value], (r, s, out)
            assert s["sb"] == []  # weights, not a sum: nothing to divide


def test_below_the_minimum_the_job_fails_naming_the_worker(tmp_path):
    code, out = _run(tmp_path, elastic=3)
    assert code == 137, out
    assert "fewer than --elastic 3: the job fails" in out, out
    assert "SEEN" not in out
    # the survivors are told which worker died and how, not "uneven rounds"
    assert re.search(
        r"\[worker [01]\].*NodeFailure: worker rank 2 .*was killed by signal 9.*fewer than "
        r"HETPS_ELASTIC=3",
        out,
    ), out


# Worker DIE_RANK dies at round DIE_AT as above; the launcher starts it again, it joins, and
# the others let it in at the round boundary where all of them saw it waiting: a summed flag.
# The first live worker gives the joiner the round to go on from and the round to stop after
# (10 rounds on; the others go on as long as it takes the joiner to start). Every worker
# prints each round's sums; the joiner's first round is the one after the boundary. With
# JOINER_DIES the worker started again asks to join, gets its answer (the others wait at
# their boundary) and dies before it is in.
JOIN_SCRIPT = """
import json, pickle
from hetps.transport.codec import Message
die_at, die_rank = int(os.environ["DIE_AT"]), int(os.environ["DIE_RANK"])
kv = hetps.kv.create("dist_sync")
kv.init(["a", "probe", "flag"], [np.zeros(5, np.float32), np.zeros(1, np.float32),
                                 np.zeros(1, np.float32)])
first, stop_at = 0, 100000  # (a bound: the test fails long before)
if kv.rejoining:
    if os.environ.get("JOINER_DIES"):
        kv.node.request(1, Message("join")).wait(60)
        os.kill(os.getpid(), signal.SIGKILL)
    state = pickle.loads(kv.join())
    first, stop_at = state["next"], state["stop_at"]
    print("JOINED", kv.rank, first, kv.live_workers, flush=True)
seen = []
out, flag = np.zeros(5, np.float32), np.zeros(1, np.float32)
r = first - 1
while r + 1 < stop_at:
    r += 1
    mine = np.full(5, (kv.rank + 1) * (r + 1), np.float32)
    if r == die_at and kv.rank == die_rank and not kv.node.recovery:
        kv.push("a", mine)
        kv.pull("probe")
        os.kill(os.getpid(), signal.SIGKILL)
    kv.pushpull(["a", "flag"], [mine, np.array([float(kv.joining)], np.float32)],
                out=[out, flag])
    seen.append([r, float(out[0]), kv.short_rounds("a"), kv.live_workers])
    if flag[0] > 0.5:
        stop_at = r + 11
        kv.admit(pickle.dumps({"next": r + 1, "stop_at": stop_at}))
        seen[-1].append("admitted")
print("SEEN", kv.rank, kv.live_rank, json.dumps(seen), flush=True)
groups = sorted([n.rank, n.group] for n in kv.node.nodes.values() if n.role == "worker")
print("GROUPS", kv.rank, json.dumps(groups), flush=True)
"""


def _join_job(tmp_path, die_rank: int, servers: int = 1, extra: dict | None = None):
    script = tmp_path / "join_script.py"
    script.write_text(PRELUDE + textwrap.dedent(JOIN_SCRIPT))
    out = io.StringIO()
    spec = LaunchSpec(
        num_workers=3,
        num_servers=servers,
        command=[sys.executable, str(script)],
        env={**ENV, "DIE_RANK": str(die_rank), **(extra or {})},
        start_timeout=30.0,
        failure_grace=5.0,
        elastic_min=2,
        max_restarts=1,
        rejoin_workers=True,
        replicas=servers,
    )

    def host_group(role: str, rank: int, argv: list[str], env: dict[str, str]):
        # each worker a host of its own, numbered 10 + rank (a started-again one too)
        return argv, {**env, "HETPS_HOST_GROUP": str(10 + rank)} if role == "worker" else env

    spec.wrap = host_group
    launcher = Launcher(spec, out=out)
    try:
        code = launcher.run()
    finally:
        launcher.stop_all(kill=True)
    return code, out.getvalue()


@pytest.mark.parametrize(
    ("die_rank", "servers"),
    # worker 0, started again, must not act as the first worker before it is in: its init
    # would reset the keys (with copies, their round counts, and the job would hang)
    [(2, 1), (0, 2)],
)
def test_a_worker_started_again_joins_at_a_round_boundary(tmp_path, die_rank, servers):
    """--elastic 2 with restarts: a worker dies, the others go on with 2, it is started again
    and joins; from the round after the boundary every sum has its push again, and the job
    completes with nothing else restarted. Second case: 2 servers with --replicas 2."""
    code, out = _join_job(tmp_path, die_rank, servers)
    assert code == 0, out
    assert f"starting worker {die_rank} again (it joins the running job" in out, out
    assert re.search(rf"is_recovery=1 \(worker rank {die_rank} again", out), out
    joined = re.search(rf"JOINED {die_rank} (\d+) 3", out)
    assert joined is not None, out
    first = int(joined.group(1))
    seen = _seen(out)
    assert sorted(seen) == [0, 1, 2], out
    die = int(ENV["DIE_AT"])
    full, part = 6.0, 6.0 - (die_rank + 1)
    for rank, (live_rank, rounds) in seen.items():
        assert live_rank == rank
        for entry in rounds:
            r, value, short, live = entry[:4]
            if r < die or (r == die and value == full * (r + 1)):  # (its push came in time)
                assert value == full * (r + 1) and short == [], entry
            elif r < first:
                assert value == part * (r + 1) and short == [[0, 5, 2]], entry
                assert live == 2
            else:  # the joiner's push is in every round from the boundary on
                assert value == full * (r + 1) and short == [] and live == 3, (rank, entry)
        if rank != die_rank:
            assert [e[0] for e in rounds] == list(range(first + 10)), out
            admitted = [e[0] for e in rounds if e[-1] == "admitted"]
            assert admitted == [first - 1], out
        else:
            assert [e[0] for e in rounds] == list(range(first, first + 10)), out
    assert die < first
    # every worker's node table, the joiner's and the others', keeps each worker's host group
    groups = re.findall(r"GROUPS (\d) (.*)", out)
    assert sorted(int(rank) for rank, _ in groups) == [0, 1, 2], out
    for rank, listed in groups:
        assert json.loads(listed) == [[0, 10], [1, 11], [2, 12]], (rank, listed)


def test_a_worker_that_dies_while_it_joins_is_let_go_again(tmp_path):
    """The worker started again dies after the others reached their boundary and before it
    is in: they go on without it (no admit waits forever), and the job completes."""
    code, out = _join_job(tmp_path, 2, extra={"JOINER_DIES": "1"})
    assert code == 0, out
    assert "before it joined; the job goes on without it" in out, out
    seen = _seen(out)
    assert sorted(seen) == [0, 1], out
    die = int(ENV["DIE_AT"])
    for _rank, (_, rounds) in seen.items():
        admitted = [e[0] for e in rounds if e[-1] == "admitted"]
        assert len(admitted) == 1, out
        assert [e[0] for e in rounds] == list(range(admitted[0] + 11)), out
        for r, value, short, live, *_ in rounds:
            if r > die:
                assert value == 3.0 * (r + 1) and short == [[0, 5, 2]] and live == 2


# Worker 0 (the one that makes a checkpoint's folder and writes its shared part) dies at
# the moment the three would checkpoint; the others checkpoint that round without it.
CKPT_SCRIPT = """
import json
from hetps.kvstore import checkpoint
kv = hetps.kv.create("dist_sync")
kv.init("a", np.zeros(5, np.float32))
out = np.zeros(5, np.float32)
for r in range(4):
    kv.pushpull("a", np.full(5, kv.rank + 1.0, np.float32), out=out)
if kv.rank == 0:
    os.kill(os.getpid(), signal.SIGKILL)
path = checkpoint.save(kv, os.environ["CK"], 4, {"rank": kv.rank})
print("SAVED", kv.rank, path, flush=True)
"""


def test_a_checkpoint_the_first_worker_dies_in_is_taken_by_the_others(tmp_path):
    script = tmp_path / "ckpt_script.py"
    script.write_text(PRELUDE + textwrap.dedent(CKPT_SCRIPT))
    out = io.StringIO()
    ck = tmp_path / "ck"
    spec = LaunchSpec(
        num_workers=3,
        num_servers=1,
        command=[sys.executable, str(script)],
        env={**ENV, "CK": str(ck)},
        start_timeout=30.0,
        failure_grace=5.0,
        elastic_min=2,
    )
    launcher = Launcher(spec, out=out)
    try:
        code = launcher.run()
    finally:
        launcher.stop_all(kill=True)
    out = out.getvalue()
    assert code == 0, out
    assert sorted(re.findall(r"SAVED (\d)", out)) == ["1", "2"], out
    final = ck / "ckpt-00000004"
    manifest = json.loads((final / "manifest.json").read_text())
    assert manifest["workers"] == 2, manifest
    assert sorted(p.name for p in final.glob("*.pkl")) == ["worker-0.pkl", "worker-1.pkl"]
    import pickle

    ranks = [pickle.loads((final / f"worker-{i}.pkl").read_bytes())["rank"] for i in (0, 1)]
    assert ranks == [1, 2]
    assert (final / "values.npz").exists()
    # the survivors' sums went into the manifest under their new names, none left beside
    assert sorted(manifest["files"]) == [
        "optimizer.states",
        "values.npz",
        "worker-0.pkl",
        "worker-1.pkl",
    ]
    assert not list(final.glob("rank-*"))
    from hetps.kvstore import checkpoint

    checkpoint.Checkpoint(final, manifest).verify()


def test_hetps_launch_rejoin_starts_a_let_go_worker_again(tmp_path):
    """``hetps launch --elastic 2 --max-restarts 1 --rejoin``: the script's worker 2 dies,
    the launcher starts it again, and it joins the running job (the script calls
    ``kv.join()``)."""
    script = tmp_path / "join_script.py"
    script.write_text(PRELUDE + textwrap.dedent(JOIN_SCRIPT))
    launch = [sys.executable, "-m", "hetps.cli", "launch", "-n", "3", "-s", "1"]
    res = subprocess.run(
        [*launch, "--elastic", "2", "--max-restarts", "1", "--rejoin", "--start-timeout", "30",
         "--", sys.executable, str(script)],
        env={**os.environ, **ENV, "DIE_RANK": "2"},
        capture_output=True,
        text=True,
        timeout=240,
    )  # fmt: skip
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "starting worker 2 again (it joins the running job" in out, out
    assert re.search(r"JOINED 2 \d+ 3", out), out
    assert sorted(_seen(out)) == [0, 1, 2], out
    # without the flags it depends on, one line
    res = subprocess.run(
        [*launch, "--rejoin", "--", sys.executable, "-c", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        res.returncode != 0
        and "--rejoin starts a worker that was let go again, so it "
        "needs --elastic MIN and --max-restarts N"
        in res.stderr
    ), res.stderr
    assert "Traceback" not in res.stderr
    res = subprocess.run(
        [*launch, "--elastic", "2", "--max-restarts", "1", "--rejoin", "--balance", "aware",
         "--", sys.executable, "-c", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert res.returncode != 0 and "--rejoin with --balance" in res.stderr, res.stderr
