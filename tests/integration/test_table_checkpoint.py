"""Embedding tables (row-sparse keys) in checkpoints, through real clusters: a job restored
from a checkpoint goes on exactly as the job that was not interrupted, with the tables' rows,
their lazy optimizer states (SGD momentum, Adam's moments and step count, AdaGrad's history)
and a growing table's id index; a damaged table file is found by name."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

CODE = """
import json
from hetps.kvstore import checkpoint
from hetps.tables.rowsparse import Table
ck_dir, phase, stop = {ck!r}, {phase!r}, {stop}
kv = hetps.kv.create('dist_sync')
r = kv.rank
def batch(step, key, n, high):
    g = np.random.default_rng(1000 * step + 10 * r + len(key))
    ids = g.integers(0, high, n) if high else g.integers(0, 1 << 40, n) // 7
    return ids, g.standard_normal((n, 4)).astype(np.float32)
keys = {{'mom': 500, 'adam': 0, 'ada': 60}}
def declare():
    kv.init('mom', Table(500, 4, scale=0.1, seed=1))                 # the servers' SGD momentum
    kv.init('adam', Table(None, 4, scale=0.2, seed=2, optimizer=optim.Adam(learning_rate=0.05)))
    kv.init('ada', Table(60, 4, optimizer=optim.AdaGrad(learning_rate=0.1)))
    kv.init('dense', np.linspace(0, 1, 10, dtype=np.float32))
opt = optim.SGD(learning_rate=0.1, momentum=0.9)
if phase == 'first':
    declare()
    kv.set_optimizer(opt)
    start = 0
else:
    ck = checkpoint.latest(ck_dir)
    if phase == 'declared':        # the job declares its tables itself, then restores
        declare()
    kv.set_optimizer(opt)
    ck.restore(kv)                 # (else: the tables come from the checkpoint's manifest)
    start = ck.step
for step in range(start + 1, 7):
    for key, high in keys.items():
        kv.push(key, batch(step, key, 30, high))
    kv.push('dense', np.full(10, step, np.float32))
    if phase == 'first' and step == stop:
        checkpoint.save(kv, ck_dir, step, state={{'step': step}})
out = {{}}
for key, high in keys.items():
    ids = np.unique(np.concatenate([batch(s, key, 30, high)[0] for s in range(1, 7)]))
    got = kv.row_sparse_pull(key, row_ids=ids)
    out[key] = [got.indices.tolist(), got.data.tolist()]
out['dense'] = kv.pull('dense').tolist()
kv.barrier()
if r == 0:
    print('RESULT ' + json.dumps(out), flush=True)
"""


def _result(out: str) -> dict:
    return json.loads(re.findall(r"RESULT (\{.*\})", out)[0])


def test_tables_restored_from_a_checkpoint_go_on_exactly(cluster, tmp_path):
    """Rounds 1-6 of three tables (momentum, Adam on a growing table, AdaGrad) on two servers,
    a checkpoint after round 3; a new cluster restores it (declaring the tables itself, or
    taking them from the checkpoint) and does rounds 4-6 again: every row equals the first
    run's bit for bit."""
    ck = str(tmp_path / "ck")
    rc, out = cluster(CODE.format(ck=ck, phase="first", stop=3), workers=2, servers=2)
    assert rc == 0, out
    first = _result(out)
    manifest = json.loads((tmp_path / "ck" / "ckpt-00000003" / "manifest.json").read_text())
    tables = {e["key"][1]: e for e in manifest["tables"]}
    assert sorted(tables) == ["ada", "adam", "mom"]
    assert tables["adam"]["numbers"] == [{"t": 3}, {"t": 3}]
    assert [m for m, _, _ in tables["adam"]["state"]] == ["mean", "var"]
    assert [m for m, _, _ in tables["mom"]["state"]] == ["mom"]
    assert tables["mom"]["rows_saved"] < 500  # only the rows used
    for phase in ("declared", "manifest"):
        rc, out = cluster(CODE.format(ck=ck, phase=phase, stop=3), workers=2, servers=2)
        assert rc == 0, out
        assert _result(out) == first, phase


def test_tables_with_copies_checkpoint_and_restore_exactly(cluster, tmp_path):
    """HETPS_REPLICAS=2: the same rounds, a checkpoint (read from each part's primary) and a
    restore (each load copied to the part's replica) give every row, bit for bit, what the
    run without copies gives."""
    rc, out = cluster(CODE.format(ck=str(tmp_path / "a"), phase="first", stop=3), servers=2)
    assert rc == 0, out
    first = _result(out)
    ck, env = str(tmp_path / "b"), {"HETPS_REPLICAS": "2"}
    for phase in ("first", "declared"):
        rc, out = cluster(CODE.format(ck=ck, phase=phase, stop=3), servers=2, env=env)
        assert rc == 0, out
        assert _result(out) == first, phase


def test_a_table_checkpoint_loads_into_another_number_of_servers(cluster, tmp_path):
    """Taken on two servers, restored on one: the rows go to the server holding their id."""
    ck = str(tmp_path / "ck")
    rc, out = cluster(CODE.format(ck=ck, phase="first", stop=2), workers=2, servers=2)
    assert rc == 0, out
    first = _result(out)
    rc, out = cluster(CODE.format(ck=ck, phase="declared", stop=2), workers=2, servers=1)
    assert rc == 0, out
    assert _result(out) == first


def test_a_damaged_table_file_is_named_and_the_checkpoint_before_is_used(cluster, tmp_path):
    """Checkpoints after rounds 2 and 4; a byte of round 4's Adam moments changed: the
    manifest's checksum finds it by name, and the job goes on from round 2, exactly."""
    ck = tmp_path / "ck"
    code = CODE.replace("step == stop", "step in (2, 4)")
    rc, out = cluster(code.format(ck=str(ck), phase="first", stop=0), workers=2, servers=2)
    assert rc == 0, out
    first = _result(out)
    manifest = json.loads((ck / "ckpt-00000004" / "manifest.json").read_text())
    name = next(e for e in manifest["tables"] if e["key"][1] == "adam")["files"]["mean"]
    f = ck / "ckpt-00000004" / name
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x40
    f.write_bytes(bytes(data))
    rc, out = cluster(code.format(ck=str(ck), phase="declared", stop=0), workers=2, servers=2)
    assert rc == 0, out
    assert f"{name}: its SHA-256 differs" in out, out
    assert _result(out) == first


@pytest.mark.slow
def test_the_click_example_goes_on_from_its_checkpoint_exactly(tmp_path):
    """examples/dlrm_clicks.py through ``hetps launch`` (a DistributedOptimizer with 4
    server-held tables under AdaGrad, MLPs under Adam): stopped after step 5 with its
    checkpoint and started again with the same folder, it ends with the held-out scores of
    the run that was not interrupted, bit for bit."""
    root = Path(__file__).resolve().parents[2]
    args = ["--rows", "1000", "--fields", "4", "--steps", "6", "--epochs", "2",
            "--test-size", "512", "--batch-size", "64", "--checkpoint-every", "4"]  # fmt: skip
    ck = ["--checkpoint-dir", str(tmp_path / "ck")]

    def launch(*extra: str) -> str:
        cmd = [sys.executable, "-m", "hetps.cli", "launch", "-n", "2", "-s", "2", "--",
               sys.executable, "examples/dlrm_clicks.py", *args, *extra]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        res = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=240, env=env)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        return res.stdout

    whole = re.findall(r"scores digest (\w+)", launch())
    stopped = launch(*ck, "--stop-at", "5")
    assert "scores digest" not in stopped and (tmp_path / "ck" / "ckpt-00000005").is_dir()
    again = launch(*ck)
    assert "after step 5" in again, again
    assert whole and re.findall(r"scores digest (\w+)", again) == whole, again
