"""Host-local aggregation of device tensors: two hosts of two workers push, pull and
pushpull tensors of a simulated device whose copies run as late as a real one's may
(tests/deferred_device.py), and train with DistributedOptimizer on the stand-in of
torch.cuda (tests/cuda_standin.py), with the host's sum pushed once and with every worker
pushing its own: every value is the same bit for bit, each host's workers together send one
push per round, and no staging buffer is left taken. The same on CUDA where a GPU is present."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_cluster
from roles import HOSTS

TESTS = Path(__file__).resolve().parents[1]

#: a key of 30,000 elements is split over both servers: each local rank sends a part
SPLIT = {"MXNET_KVSTORE_BIGARRAY_BOUND": "1000"}

COMMON = """
import hashlib, json
from hetps.device import staging as devices
kv = hetps.kv.create('dist_sync')
g, lr = kv.cfg.host_group, kv.cfg.local_rank
me = 2 * g + lr
def sent():
    return sum(s for s, _ in kv.link_bytes().values())
def digest(a):
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()
def grad(rnd, who, n, part=0):  # every worker's gradients, known to every worker
    return np.random.default_rng([rnd, who, part]).standard_normal(n).astype(np.float32)
def host_order(rnd, n, each):
    # the documented order: each host's workers in local-rank order, then the hosts in order
    hosts = []
    for h in (0, 1):
        s = each(rnd, 2 * h, n).copy()
        s += each(rnd, 2 * h + 1, n)
        hosts.append(s)
    return hosts[0] + hosts[1]
"""

DEFERRED = f"""
sys.path.insert(0, {str(TESTS)!r})
from deferred_device import DeferredBackend
dev = DeferredBackend()
devices.register_backend(dev)
n = 30_000
kv.init('w', dev.array(np.zeros(n, np.float32)))
out = dev.array(np.zeros(n, np.float32), device=1)
def listed(rnd, who, n):  # a push of a list over two devices: summed on the first one
    return grad(rnd, who, n) + grad(rnd, who, n, 1)
sent0, digests = sent(), []
for rnd in range(3):
    a, b = dev.array(grad(rnd, me, n), device=0), dev.array(grad(rnd, me, n, 1), device=1)
    kv.push('w', [a, b])
    a.write(-1.0)  # a kernel after the push: the push sent what was there before it
    kv.pull('w', out=out)
    got = out.read()
    assert np.array_equal(got, host_order(rnd, n, listed)), ('pull', rnd)
    digests.append(digest(got))
    # a value staged ahead (as DistributedOptimizer's hook stages), pushpull into a device out
    st = devices.stage(dev.array(grad(rnd + 10, me, n), device=0))
    out2 = dev.array(np.zeros(n, np.float32), device=1)
    kv.pushpull('w', st, out=out2)
    got = out2.read()
    assert np.array_equal(got, host_order(rnd + 10, n, grad)), ('pushpull', rnd)
    digests.append(digest(got))
dsent = sent() - sent0
kv.barrier()
deferred = {{'sent': dsent, 'model': 4 * n, 'digests': digests,
             'taken': devices.STAGING.buffers(taken=True), 'buffers': devices.STAGING.buffers(),
             'copies': dev.to_host_copies}}
devices.unregister_backend(dev)
"""

#: the stand-in of torch.cuda: every float tensor of this process is on its device
STANDIN = f"""
import torch
sys.path.insert(0, {str(TESTS)!r})
from cuda_standin import StandInCuda
torch.set_num_threads(1)
d = StandInCuda()
devices.register_backend(devices.CudaBackend(d))
DEV, copies = 'cpu', lambda: d.copies['to_host']
"""

#: DistributedOptimizer on device DEV, and the same model trained here on the whole batch
OPTIMIZER = """
import copy, torch
from hetps.torch.optimizer import DistributedOptimizer
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(),
                            torch.nn.Linear(256, 10)).to(DEV)
opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                           model.named_parameters(), kvstore=kv, op='average')
ref = copy.deepcopy(model)  # what the job's mean of the workers' gradients gives
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
gen = torch.Generator().manual_seed(1)
X = torch.randn(3, 32, 64, generator=gen).to(DEV)   # 3 steps, global batch 32
Y = torch.randint(0, 10, (3, 32), generator=gen).to(DEV)
sent0 = sent()
for step in range(3):
    x, y = X[step, me * 8:(me + 1) * 8], Y[step, me * 8:(me + 1) * 8]
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    ref_opt.zero_grad()
    torch.nn.functional.cross_entropy(ref(X[step]), Y[step]).backward()
    ref_opt.step()
osent = sent() - sent0
kv.barrier()
weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu().numpy()
diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
optimizer = {'diff': diff, 'sent': osent, 'model': 4 * weights.size, 'weights': digest(weights),
             'taken': devices.STAGING.buffers(taken=True), 'copies': copies()}
opt.close()
"""

REPORT = """
print('HOSTDEV', json.dumps({'me': me, 'on': kv.hostagg is not None, 'W': kv.num_workers,
      'deferred': deferred, 'optimizer': globals().get('optimizer')}), flush=True)
"""


def _records(out: str) -> dict[int, dict]:
    got = [json.loads(ln.split("HOSTDEV ", 1)[1]) for ln in out.splitlines() if "HOSTDEV " in ln]
    return {r["me"]: r for r in got}


def _run(tmp_path, code: str, agg: str) -> dict[int, dict]:
    env = {"HETPS_HOST_AGGREGATION": agg, **SPLIT}
    rc, out = run_cluster(tmp_path, code, workers=4, servers=2, env=env, node_env=HOSTS)
    assert rc == 0, out
    got = _records(out)
    assert sorted(got) == [0, 1, 2, 3], out
    for rec in got.values():
        assert rec["on"] == (agg == "1") and rec["W"] == 4, rec  # counts stay per process
    return got


def _one_push_per_host(run: dict, what: str, pushes: int, hosts: bool = True) -> None:
    """Each host's workers together sent one push of the model a round (each its own
    server's part) with ``hosts``; each worker one of its own without."""
    for host in (0, 1):
        sent = [run[2 * host + lr][what]["sent"] for lr in (0, 1)]
        model = pushes * run[2 * host][what]["model"]
        for got in [sum(sent)] if hosts else sent:
            assert model <= got <= 1.1 * model, (what, sent, model)


def _check_deferred(run: dict) -> None:
    for rec in run.values():
        assert rec["deferred"]["taken"] == 0, rec
        assert rec["deferred"]["copies"] == 3 * 2 + 1, rec  # each push's, and the init's
        assert rec["deferred"]["buffers"] <= 4, rec  # reused, not one per round
        assert rec["deferred"]["digests"] == run[0]["deferred"]["digests"]


def test_device_tensors_go_through_the_host_exactly(tmp_path):
    """Pushes of a list over two simulated devices, pulls into device tensors and pushpulls
    of staged values through the host: every worker's values are the documented order's
    sums (the flat job's), exactly; one push per host; no staging buffer left taken."""
    on = _run(tmp_path, COMMON + DEFERRED + REPORT, "1")
    _check_deferred(on)
    _one_push_per_host(on, "deferred", 6)


@pytest.mark.slow
def test_device_tensors_and_the_optimizer_equal_the_flat_job(tmp_path):
    """The same, and DistributedOptimizer on the stand-in of torch.cuda (gradients staged
    on a side stream), with the host's sum pushed once and with every worker pushing its
    own: the same values bit for bit on every worker of both jobs."""
    pytest.importorskip("torch")
    code = COMMON + DEFERRED + STANDIN + OPTIMIZER + REPORT
    on, off = _run(tmp_path, code, "1"), _run(tmp_path, code, "0")
    for run in (on, off):
        _check_deferred(run)
        for rec in run.values():
            assert rec["optimizer"]["taken"] == 0, rec
            assert rec["optimizer"]["copies"] > 0, rec  # the gradients were staged
            assert rec["optimizer"]["diff"] < 1e-5, rec  # local training's weights
            assert rec["optimizer"]["weights"] == on[0]["optimizer"]["weights"], rec
    assert on[0]["deferred"]["digests"] == off[0]["deferred"]["digests"]
    for what, pushes in (("deferred", 6), ("optimizer", 3)):
        _one_push_per_host(on, what, pushes)
        _one_push_per_host(off, what, pushes, hosts=False)


CUDA = """
import torch
n = 1 << 20
kv.init('w', torch.zeros(n, device='cuda'))
out = torch.empty(n, device='cuda')
def cuda_grad(rnd, who, n):
    return torch.from_numpy(grad(rnd, who, n)).cuda()
sent0, digests = sent(), []
for rnd in range(3):
    x = cuda_grad(rnd, me, n)
    kv.push('w', x)
    x.fill_(-1.0)  # queued after the push: must not reach the server
    kv.pull('w', out=out)
    got = out.cpu().numpy()  # on the caller's stream: after the copy of the pulled value
    assert np.array_equal(got, host_order(rnd, n, grad)), ('pull', rnd)
    st = devices.stage(cuda_grad(rnd + 10, me, n))
    kv.pushpull('w', st, out=out)
    got2 = out.cpu().numpy()
    assert np.array_equal(got2, host_order(rnd + 10, n, grad)), ('pushpull', rnd)
    digests += [digest(got), digest(got2)]
dsent = sent() - sent0
torch.cuda.synchronize()
kv.barrier()
deferred = {'sent': dsent, 'model': 4 * n, 'digests': digests,
            'taken': devices.STAGING.buffers(taken=True)}
DEV, copies = 'cuda', lambda: None
"""


def _cuda() -> bool:
    torch = pytest.importorskip("torch")
    return torch.cuda.is_available()


def test_cuda_tensors_go_through_the_host_exactly(tmp_path):
    """The same on a GPU: CUDA tensors pushed, pulled and pushpulled through the host, and
    DistributedOptimizer on CUDA, equal to the flat job bit for bit, one push per host."""
    if not _cuda():
        pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False here)")
    on, off = (
        _run(tmp_path, COMMON + CUDA + OPTIMIZER + REPORT, "1"),
        _run(tmp_path, COMMON + CUDA + OPTIMIZER + REPORT, "0"),
    )
    for run in (on, off):
        for rec in run.values():
            assert rec["deferred"]["taken"] == rec["optimizer"]["taken"] == 0, rec
            assert rec["deferred"]["digests"] == off[0]["deferred"]["digests"], rec
            assert rec["optimizer"]["weights"] == off[0]["optimizer"]["weights"], rec
            assert rec["optimizer"]["diff"] < 1e-5, rec  # local training's weights
    for what, pushes in (("deferred", 6), ("optimizer", 3)):
        _one_push_per_host(on, what, pushes)
        _one_push_per_host(off, what, pushes, hosts=False)
