"""Horovod's and BytePS's PyTorch API (``import hetps.torch as hvd``) in a real cluster: the
process's store, the collectives, Horovod's ``DistributedOptimizer`` options, AMP's
``synchronize``/``skip_synchronize``, ``SyncBatchNorm``; and no launched worker trains alone."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")


def _results(out: str) -> dict[int, dict]:
    """Each worker's ``RESULT {json}`` line, by rank."""
    found = {}
    for line in out.splitlines():
        if "RESULT " in line:
            rec = json.loads(line.split("RESULT ", 1)[1])
            found[rec["rank"]] = rec
    return found


API = """
import json, torch
import hetps.torch as hvd
torch.set_num_threads(1)
hvd.init()
hvd.init()  # once per process
r, W = hvd.rank(), hvd.size()
res = {"rank": r, "size": W, "local": [hvd.local_rank(), hvd.local_size()]}
x = torch.tensor([1.0, 2.0, 3.0]) * (r + 1)
res["avg"] = hvd.allreduce(x, name="x").tolist()
res["sum"] = hvd.allreduce(x, name="x", op=hvd.Sum).tolist()
res["int"] = hvd.allreduce(torch.tensor([7 + r]), op=hvd.Sum).tolist()  # unnamed, int64
res["fp16"] = hvd.allreduce(x, compression=hvd.Compression.fp16, op=hvd.Sum).dtype == x.dtype
res["pushpull"] = hvd.push_pull(x, average=False, name="pp").tolist()
y = torch.zeros(3)
hvd.push_pull_inplace(y + r, name="ppi")
res["gather"] = hvd.allgather(torch.full((r + 1, 2), float(r)), name="g").tolist()
b = torch.tensor([float(r), -0.0 if r else 5.0])
res["bcast"] = hvd.broadcast(b, root_rank=1, name="b").tolist()
res["obj"] = hvd.broadcast_object({"from": r, "list": [r] * 3}, root_rank=1)

# Horovod's optimizer: 2 passes accumulate, predivide 4, fp16 on the wire
torch.manual_seed(7)
model = torch.nn.Linear(4, 2).double()
start = {k: v.clone() for k, v in model.state_dict().items()}
opt = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.5),
    named_parameters=model.named_parameters(),
    compression=hvd.Compression.fp16,
    backward_passes_per_step=2,
    gradient_predivide_factor=4.0,
)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(opt, root_rank=0)
def data(rank, k):
    g = torch.Generator().manual_seed(100 * rank + k)
    return torch.randn(3, 4, generator=g, dtype=torch.float64)
opt.zero_grad()
for k in range(2):
    model(data(r, k)).square().sum().backward()
opt.step()
res["weights"] = [v.tolist() for v in model.state_dict().values()]
# the same step by hand: the mean over workers of the gradients summed over two passes
ref = torch.nn.Linear(4, 2).double()
ref.load_state_dict(start)
for w in range(W):
    for k in range(2):
        (ref(data(w, k)).square().sum() / W).backward()
with torch.no_grad():
    for p in ref.parameters():
        p -= 0.5 * p.grad
res["ref"] = [v.tolist() for v in ref.state_dict().values()]

# AMP: synchronize(), the scaler unscales the reduced gradients, then step without syncing
scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
model2 = torch.nn.Linear(4, 1)
model2.load_state_dict({"weight": torch.ones(1, 4), "bias": torch.zeros(1)})
opt2 = hvd.DistributedOptimizer(
    torch.optim.SGD(model2.parameters(), lr=0.1), named_parameters=model2.named_parameters(),
    prefix="amp.",
)
opt2.zero_grad()
scaler.scale(model2(torch.ones(2, 4) * (r + 1)).sum()).backward()
opt2.synchronize()
scaler.unscale_(opt2)
with opt2.skip_synchronize():
    scaler.step(opt2)
scaler.update()
res["amp"] = model2.weight.flatten().tolist() + model2.bias.tolist()

# SyncBatchNorm: the job's batch statistics, forward and backward
bn = hvd.SyncBatchNorm(3)
xs = [torch.randn(4, 3, 2, generator=torch.Generator().manual_seed(w)) for w in range(W)]
mine = xs[r].clone().requires_grad_(True)
out = bn(mine)
(out * torch.arange(out.numel()).view_as(out)).sum().backward()
full = torch.cat(xs).requires_grad_(True)
ref_bn = torch.nn.BatchNorm1d(3)
ref_out = ref_bn(full)
weights = torch.cat([torch.arange(out.numel()).view_as(out)] * W)
(ref_out * weights).sum().backward()
rows = slice(4 * r, 4 * (r + 1))
res["bn_out"] = (out - ref_out[rows]).abs().max().item()
res["bn_grad"] = (mine.grad - full.grad[rows]).abs().max().item()
res["bn_running"] = (bn.running_var - ref_bn.running_var).abs().max().item()
print("RESULT " + json.dumps(res), flush=True)
hvd.shutdown()
"""


def test_horovod_api_through_the_servers(cluster):
    rc, out = cluster(
        API,
        workers=2,
        # (as a launcher sets them: hvd.local_rank() and local_size() read them)
        node_env={
            ("worker", 0): {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"},
            ("worker", 1): {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
        },
    )
    assert rc == 0, out
    res = _results(out)
    assert sorted(res) == [0, 1], out
    for r, got in res.items():
        assert got["size"] == 2
        assert got["local"] == [r, 2]
        assert got["avg"] == [1.5, 3.0, 4.5]
        assert got["sum"] == [3.0, 6.0, 9.0]
        assert got["int"] == [15]
        assert got["fp16"] is True
        assert got["pushpull"] == [3.0, 6.0, 9.0]
        assert got["gather"] == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
        assert got["bcast"] == [1.0, -0.0]
        assert got["obj"] == {"from": 1, "list": [1, 1, 1]}
        # fp16 on the wire: within float16's rounding of the exact step
        for w, ref in zip(got["weights"], got["ref"], strict=True):
            assert torch.allclose(torch.tensor(w), torch.tensor(ref), rtol=2e-3, atol=2e-3)
        # the gradient of the sum of w.x + b over two rows of x = r + 1 is 2 (r + 1) per
        # weight and 2 for b: the mean over the workers, unscaled, is 3 and 2
        assert got["amp"] == pytest.approx([0.7] * 4 + [-0.2])
        assert got["bn_out"] < 1e-5 and got["bn_grad"] < 1e-5 and got["bn_running"] < 1e-6
    # every worker ends with the same weights
    assert res[0]["weights"] == res[1]["weights"]


TRAP = """
import json, hashlib, torch
import hetps.torch as hps
torch.set_num_threads(1)
MODE = os.environ["MODE"]
if MODE == "found":
    kv = hetps.kv.create("dist_sync")  # made, and not passed below
torch.manual_seed(int(os.environ.get("DMLC_WORKER_ID", "0")) + 11)  # each starts elsewhere
model = torch.nn.Linear(5, 3)
opt = hps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               model.named_parameters())  # Horovod's habit: no store
for step in range(3):
    opt.zero_grad()
    model(torch.randn(4, 5)).square().sum().backward()
    opt.step()
h = hashlib.sha256(b"".join(v.numpy().tobytes() for v in model.state_dict().values()))
res = {"rank": opt.kv.rank, "store": opt.kv.type, "sum": h.hexdigest()[:16]}
if MODE == "found":
    res["found"] = opt.kv is kv
print("RESULT " + json.dumps(res), flush=True)
"""


@pytest.mark.parametrize("mode", ["made", "found"])
def test_a_launched_worker_never_trains_alone(cluster, mode):
    # without a store the optimizer makes the job's (it used to make a local one: every
    # worker trained alone, and the scheduler waited for workers that never registered)
    rc, out = cluster(TRAP, workers=2, env={"MODE": mode})
    assert rc == 0, out
    res = _results(out)
    assert sorted(res) == [0, 1], out
    assert {r["store"] for r in res.values()} == {"dist_sync"}
    assert res[0]["sum"] == res[1]["sum"], out
    if mode == "found":
        assert res[0]["found"] and res[1]["found"]


def test_two_open_stores_are_refused_with_the_fix(monkeypatch):
    import hetps.kvstore
    from hetps.torch import process

    class Open:
        closed = False

    monkeypatch.setattr(hetps.kvstore, "_live", [Open(), Open()])
    monkeypatch.setattr(process, "_state", process._Process())
    with pytest.raises(ValueError, match=r"2 hetps KVStores are open.*init\(kvstore=kv\)"):
        process.store_for(None)


ALONE = """
import torch, hetps.torch as hvd
hvd.init()
x = hvd.allreduce(torch.tensor([2.0, 4.0]), name="x")
print(hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), x.tolist(),
      type(hvd.DistributedOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=1))
           .kv).__name__)
"""


def test_a_script_alone_is_one_worker(tmp_path):
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("DMLC_")}
    res = subprocess.run(
        [sys.executable, "-c", ALONE], capture_output=True, text=True, timeout=60, env=env
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["0", "1", "0", "1", "[2.0,", "4.0]", "LocalKVStore"]


def test_a_sparse_embedding_without_model_is_explained():
    from hetps.torch.horovod import DistributedOptimizer

    emb = torch.nn.Embedding(10, 3, sparse=True)
    opt = DistributedOptimizer(
        torch.optim.SGD(emb.parameters(), lr=0.1), emb.named_parameters(), kvstore="local"
    )
    try:
        with pytest.raises(TypeError, match=r"'weight' has a sparse gradient.*model=model"):
            emb(torch.tensor([1, 2])).sum().backward()
    finally:
        opt.close()
