"""The CUDA paths on a GPU (each skips where torch sees none; the same paths run on the
stand-in of torch.cuda in tests/unit/test_cuda_standin.py and
tests/integration/test_cuda_standin_cluster.py): a CPU tensor before the CUDA ones, a
failing multi-key push followed by exact pushes, gradient accumulation with fused groups,
AMP's GradScaler, CUDA-graph capture refused, and LOCAL_RANK choosing each server's and
worker's GPU."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

CUDA = torch.cuda.is_available()
GPUS = torch.cuda.device_count() if CUDA else 0
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (torch sees none)")
needs_two = pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA GPUs (torch sees {GPUS})")

CPU_FIRST = """
import torch
from hetps.device import staging as devices
from hetps.torch.optimizer import DistributedOptimizer
kv = hetps.kv.create('dist_sync')
kv.init('c', torch.zeros(4))                # a CPU tensor first (a broadcast stages on the CPU)
kv.push('c', torch.ones(4))
n = 1 << 20
kv.init('w', torch.zeros(n, device='cuda'))
g = torch.arange(n, dtype=torch.float32, device='cuda')
kv.push('w', g)
out = torch.empty(n, device='cuda')
kv.pull('w', out=out)
assert torch.equal(out, g)
assert isinstance(devices.backend_for(out), devices.CudaBackend)
model = torch.nn.Linear(16, 4).cuda()
opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                           kvstore=kv)
assert opt._staging and all(t.device.type == 'cuda' for t in opt._cpu.values())  # no .cpu()
opt.close()
print('CPU-FIRST-OK', flush=True)
"""


@needs_cuda
def test_a_cpu_tensor_first_leaves_cuda_tensors_staged(cluster):
    rc, out = cluster(CPU_FIRST, workers=1, servers=1)
    assert rc == 0 and "CPU-FIRST-OK" in out, out


MULTI_KEY = """
import torch
kv = hetps.kv.create('dist_sync')
kv.set_optimizer(optim.SGD(learning_rate=1.0))  # every round's sum changes the value
r, W = kv.rank, kv.num_workers
n = 1 << 22  # 16 MB: still being sent when the next push stages into a buffer
kv.init(['a', 'b'], [torch.zeros(n, device='cuda'), torch.zeros(8, device='cuda')])
total = 0.0
for rnd in range(1, 6):
    try:
        kv.push(['a', 'b'], [torch.full((n,), float(rnd * (r + 1)), device='cuda'),
                             torch.zeros(5, device='cuda')])
        raise SystemExit('a push of the wrong shape was taken')
    except ValueError as exc:
        assert "key 'b'" in str(exc), exc
    kv.push('a', torch.full((n,), -2.0 * rnd, device='cuda'))
    total += rnd * sum(range(1, W + 1)) - 2.0 * rnd * W
out = torch.empty(n, device='cuda')
kv.pull('a', out=out)
assert torch.equal(out, torch.full((n,), -total, device='cuda')), (out[:4], -total)
kv.barrier()
print('MULTI-KEY-OK', flush=True)
"""


@needs_cuda
def test_a_failed_multi_key_cuda_push_then_exact_pushes(cluster):
    rc, out = cluster(MULTI_KEY, workers=2, servers=1)
    assert rc == 0 and out.count("MULTI-KEY-OK") == 2, out


ACCUMULATE = """
import copy, torch
from hetps.torch.optimizer import DistributedOptimizer
torch.manual_seed(0)
kv = hetps.kv.create('dist_sync')
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                            torch.nn.ReLU(), torch.nn.Linear(256, 10)).cuda()
ref = copy.deepcopy(model)
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                           model.named_parameters(), kvstore=kv, fusion_bytes=8 << 10)
assert any(len(g.names) > 1 for g in opt.groups) and any(len(g.names) == 1 for g in opt.groups)
data = [[(torch.randn(32, 64, device='cuda'), torch.randint(0, 10, (32,), device='cuda'))
         for _ in range(3)] for _ in range(6)]
for batches in data:
    for m, o in ((ref, ref_opt), (model, opt)):
        o.zero_grad()
        for x, y in batches:  # three backward passes before each step
            torch.nn.functional.cross_entropy(m(x), y).backward()
        o.step()
for a, b in zip(ref.parameters(), model.parameters()):
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max()
opt.close()
print('ACCUMULATE-OK', flush=True)
"""


@needs_cuda
def test_gradient_accumulation_with_fused_groups_on_cuda(cluster):
    rc, out = cluster(ACCUMULATE, workers=1, servers=1)
    assert rc == 0 and "ACCUMULATE-OK" in out, out


SCALER = """
import copy, torch
from hetps.torch.optimizer import DistributedOptimizer
torch.manual_seed(0)
kv = hetps.kv.create('dist_sync')
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                            torch.nn.Linear(64, 10)).cuda()
ref = copy.deepcopy(model)
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                           kvstore=kv, fusion_bytes=4096)
scalers = [torch.amp.GradScaler('cuda', init_scale=2.0 ** 12, growth_interval=2) for _ in range(2)]
for step in range(6):
    x = torch.randn(16, 32, device='cuda')
    y = torch.randint(0, 10, (16,), device='cuda')
    for m, o, s in ((ref, ref_opt, scalers[0]), (model, opt, scalers[1])):
        o.zero_grad()
        with torch.autocast('cuda', dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(m(x), y)
        if step == 3:
            loss = loss * float('inf')  # an overflow: the step is skipped, the scale halved
        s.scale(loss).backward()
        s.step(o)
        s.update()
assert scalers[0].get_scale() == scalers[1].get_scale() == 2.0 ** 13
for a, b in zip(ref.parameters(), model.parameters()):
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), (a - b).abs().max()
opt.close()
print('SCALER-OK', flush=True)
"""


@needs_cuda
def test_grad_scaler_on_cuda_matches_local_training(cluster):
    rc, out = cluster(SCALER, workers=1, servers=1)
    assert rc == 0 and "SCALER-OK" in out, out


@needs_cuda
def test_cuda_graph_capture_is_refused_by_name():
    from hetps import optim
    from hetps.torch.optimizer import DistributedOptimizer

    model = torch.nn.Linear(16, 4).cuda()
    opt = DistributedOptimizer(
        None,
        model.named_parameters(),
        kvstore="local",
        model=model,
        update_on="server",
        server_optimizer=optim.SGD(learning_rate=0.1),
        overlap_forward=True,
    )
    try:
        x = torch.randn(8, 16, device="cuda")
        model(x).sum().backward()
        opt.step()
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError) as info:
            with torch.cuda.graph(graph):
                model(x)
        # (ending the capture may raise too: then ours is the error it happened during)
        said = f"{info.value} {info.value.__context__}"
        assert "CUDA graph is being captured" in said, said
    finally:
        opt.close()


SERVER_GPU = """
kv = hetps.kv.create('dist_sync')
n = 1 << 21  # above the big-array bound: a part on each server, so each one sums a round
kv.init('w', np.zeros(n, np.float32))
kv.set_optimizer(optim.SGD(learning_rate=1.0))
kv.push('w', np.ones(n, np.float32))
assert np.array_equal(kv.pull('w'), -np.ones(n, np.float32))
print('SERVER-GPU-OK', flush=True)
"""


@needs_cuda
def test_a_plain_cuda_server_takes_the_gpu_of_its_local_rank(cluster):
    """HETPS_SERVER_DEVICE=cuda: server 1 (LOCAL_RANK 1) on cuda:1, around the host's GPUs."""
    rc, out = cluster(
        SERVER_GPU,
        workers=1,
        servers=2,
        env={"HETPS_SERVER_DEVICE": "cuda"},
        node_env={("server", 0): {"LOCAL_RANK": "0"}, ("server", 1): {"LOCAL_RANK": "1"}},
    )
    assert rc == 0 and "SERVER-GPU-OK" in out, out
    assert "summing on cuda:0 (HETPS_SERVER_DEVICE=cuda)" in out, out
    assert f"summing on cuda:{1 % GPUS} (HETPS_SERVER_DEVICE=cuda)" in out, out


WORKER_GPU = """
import torch
from hetps.app.train import local_gpu
from hetps.config import env_value
kv = hetps.kv.create('dist_sync')
dev = local_gpu('cuda:0', env_value('LOCAL_RANK'), torch.cuda.device_count(), per_host=True)
t = torch.full((4,), float(kv.rank + 1), device=dev)
kv.init('w', torch.zeros(4, device=dev))
kv.push('w', t)
kv.pull('w', out=t)
assert torch.equal(t.cpu(), torch.full((4,), 3.0))
print('WORKER-GPU', kv.rank, dev, flush=True)
"""


@needs_two
def test_workers_of_a_host_spread_over_its_gpus_by_local_rank(cluster):
    rc, out = cluster(
        WORKER_GPU,
        workers=2,
        servers=1,
        node_env={("worker", 0): {"LOCAL_RANK": "0"}, ("worker", 1): {"LOCAL_RANK": "1"}},
    )
    assert rc == 0, out
    assert sorted(ln.split()[-1] for ln in out.splitlines() if "WORKER-GPU" in ln) == [
        "cuda:0",
        "cuda:1",
    ], out
