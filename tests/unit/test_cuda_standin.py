"""The CUDA branch without a GPU: :class:`hetps.device.staging.CudaBackend`, the CUDA probe,
the stream order of a pull's copy, a failed multi-key call's buffers, and the refusals of
CUDA-graph capture and torch.compile, on a stand-in of torch.cuda whose copies run as late
as a GPU's may and whose misuse raises (tests/cuda_standin.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cuda_standin import Misuse, StandInCuda  # noqa: E402
from hetps.device import staging as devices  # noqa: E402
from hetps.kvstore.base import settle, staged_call  # noqa: E402
from hetps.kvstore.local import LocalKVStore  # noqa: E402


@pytest.fixture
def cuda():
    """A CudaBackend on the stand-in, for the tensors the test places on it."""
    driver = StandInCuda(claim_all=False)
    backend = devices.CudaBackend(driver)
    devices.register_backend(backend)
    try:
        yield driver, backend
    finally:
        devices.unregister_backend(backend)


def test_the_standin_raises_on_what_a_gpu_would_not_forgive():
    d = StandInCuda()
    side, cur = d.new_stream(0), d.current_stream(0)
    x, pinned = torch.arange(4.0), d.pinned((4,), torch.float32)
    with pytest.raises(Misuse, match="page-locked staging buffer"):
        d.copy(torch.empty(4), x, side)  # pageable to device: not asynchronous
    with pytest.raises(Misuse, match="never recorded"):
        d.synchronize(devices_event_never_recorded())
    d.copy(pinned, x, side)  # a side-stream read of x, x not kept for the stream
    with pytest.raises(Misuse, match="record_stream"):
        d.synchronize(d.event(side))
    d.copy(pinned, x, side)
    d.keep(x, side)
    ev = d.event(side)
    assert np.isnan(pinned.numpy()).all()  # not landed before anything waited for it
    pinned[0] = 7.0  # the host writes the buffer the pending copy writes
    with pytest.raises(Misuse, match="host wrote a page-locked buffer"):
        d.synchronize(ev)
    with d.capture(), pytest.raises(Misuse, match="capturing"):
        d.synchronize(d.event(cur))


def devices_event_never_recorded():
    from cuda_standin import Event

    return Event()


def test_cuda_backend_push_and_pull_are_exact_over_two_devices(cuda):
    d, _ = cuda
    kv = LocalKVStore()
    kv.init("w", d.place(torch.zeros(6), 0))
    a = d.place(torch.arange(6.0), 0)
    b = d.place(torch.full((6,), 10.0), 1)
    kv.push("w", [a, b])
    a.fill_(-1.0)  # a kernel after the push: the push sent what was there before it
    outs = [d.place(torch.zeros(6), 0), d.place(torch.zeros(6), 1)]
    kv.pull("w", out=outs)
    for o in outs:  # the caller's stream waited for each copy: its kernels see the value
        assert torch.equal(o, torch.arange(6.0) + 10.0)
    assert d.copies == {"to_host": 2, "to_device": 2}


def test_a_pulls_copy_waits_for_the_work_before_the_pull_not_after(cuda):
    """The copy into an out waits for what the caller's stream queued before the pull (a
    forward still reading the old weight), not for what it queued after (the next layers'
    work, which it could not overlap with otherwise)."""
    d, backend = cuda
    out = d.place(torch.zeros(4), 0)
    cur = d.current_stream(0)
    before, after = d.pinned((4,), torch.float32), d.pinned((4,), torch.float32)
    d.copy(before, d.place(torch.full((4,), 1.0), 0), cur)  # queued before the pull
    mark = backend.mark(out)
    d.copy(after, d.place(torch.full((4,), 2.0), 0), cur)  # queued after the pull
    host = backend.host_buffer(0, (4,), np.dtype("float32"))
    host[...] = 5.0
    ev = backend.to_device(host, out, mark)
    backend.stream_wait(out, ev)
    assert torch.equal(out, torch.full((4,), 5.0))
    assert before.tolist() == [1.0] * 4  # ran: the copy waited for it
    assert np.isnan(after.numpy()).all()  # still queued: the copy did not wait for it


class FakeCudaTensor(torch.Tensor):
    """A tensor that says it is on cuda:0 (the probe looks at that alone)."""

    @property
    def device(self):
        return torch.device("cuda", 0)


def test_a_cpu_tensor_first_does_not_turn_the_cuda_probe_off(monkeypatch):
    monkeypatch.setattr(devices, "_probed_cuda", False)
    monkeypatch.setattr(devices, "_BACKENDS", [])
    kv = LocalKVStore()
    kv.init("c", torch.zeros(3))  # broadcast_parameters stages on the CPU first
    kv.push("c", torch.ones(3))
    assert devices._BACKENDS == [] and not devices._probed_cuda
    t = torch.Tensor._make_subclass(FakeCudaTensor, torch.zeros(3))
    assert isinstance(devices.backend_for(t), devices.CudaBackend)
    assert devices._probed_cuda and len(devices._BACKENDS) == 1
    devices.backend_for(t)
    assert len(devices._BACKENDS) == 1  # probed once


class Pending:
    """A request in flight (its answer has not come)."""

    def __init__(self) -> None:
        self.answered = False

    def done(self) -> bool:
        return self.answered


def test_a_failed_multi_key_call_keeps_the_buffers_its_sent_requests_read(cuda):
    """Key a's request was sent, then key b raised: a's staging buffer is not lent again
    (and overwritten) before a's request is answered; then it is."""
    d, _ = cuda
    x = d.place(torch.arange(5.0), 0)
    futs: list = []
    with pytest.raises(ValueError, match="key b"), staged_call(futs):
        sent = devices.STAGING.push_value(x, "push of key 'a'")
        futs.append(Pending())  # a's request, sent with the buffer above
        raise ValueError("push of key b: shape (3,) does not match")
    assert sent.tolist() == list(range(5))
    with staged_call():
        other = devices.STAGING.push_value(d.place(torch.full((5,), 9.0), 0), "push")
    settle([])
    assert not np.shares_memory(other, sent)  # a fresh buffer: a's is still being sent
    assert sent.tolist() == list(range(5))
    futs[0].answered = True
    with staged_call():
        again = devices.STAGING.push_value(d.place(torch.full((5,), 3.0), 0), "push")
    settle([])
    assert np.shares_memory(again, sent) or np.shares_memory(again, other)  # reused


def _standin_optimizer(**kw):
    from hetps.torch.optimizer import DistributedOptimizer

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    return model, DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1) if "update_on" not in kw else None,
        model.named_parameters(),
        kvstore="local",
        model=model,
        **kw,
    )


@pytest.fixture
def cuda_all():
    """Every float CPU tensor on the stand-in's device (the optimizer's own buffers too)."""
    driver = StandInCuda(claim_all=True)
    backend = devices.CudaBackend(driver)
    devices.register_backend(backend)
    try:
        yield driver
    finally:
        devices.unregister_backend(backend)


def test_gradients_are_staged_and_a_graph_capture_is_refused(cuda_all):
    d = cuda_all
    model, opt = _standin_optimizer()
    try:
        x = torch.randn(3, 4)
        model(x).sum().backward()
        opt.step()  # staged through the stand-in's page-locked buffers
        assert d.copies["to_host"] > 0
        opt.zero_grad()
        with d.capture(), pytest.raises(RuntimeError, match="CUDA graph is being captured"):
            model(x).sum().backward()
    finally:
        opt.close()


def test_overlap_forward_refuses_graph_capture_and_a_compiled_model(cuda_all):
    from hetps import optim

    d = cuda_all
    model, opt = _standin_optimizer(
        update_on="server", server_optimizer=optim.SGD(learning_rate=0.1), overlap_forward=True
    )
    try:
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        with d.capture(), pytest.raises(RuntimeError, match="overlap_forward's forward pre-hook"):
            model(torch.randn(2, 4))
    finally:
        opt.close()
    from hetps.torch.optimizer import DistributedOptimizer

    net = torch.nn.Linear(3, 3)
    with pytest.raises(ValueError, match="cannot run under torch.compile"):
        DistributedOptimizer(
            None,
            net.named_parameters(),
            kvstore="local",
            update_on="server",
            server_optimizer=optim.SGD(learning_rate=0.1),
            model=torch.compile(net, backend="eager"),
            overlap_forward=True,
        )


def test_a_gpu_per_local_rank_for_workers_and_servers():
    from hetps.app.train import local_gpu
    from hetps.device.aggregator import cuda_index

    # hetps train -g N: the host's first GPU, each worker N + LOCAL_RANK around the host's GPUs
    assert [local_gpu("cuda:0", r, 4, True) for r in range(6)] == [
        "cuda:0", "cuda:1", "cuda:2", "cuda:3", "cuda:0", "cuda:1",
    ]  # fmt: skip
    assert local_gpu("cuda:2", 1, 4, True) == "cuda:3"
    assert local_gpu("cuda:1", -1, 4, True) == "cuda:1"  # no launcher said: as given
    assert local_gpu("cuda:1", 3, 4, False) == "cuda:1"  # --devices names it as it is
    assert local_gpu("cpu", 3, 4, True) == "cpu"
    # HETPS_SERVER_DEVICE=cuda: the server's LOCAL_RANK around the host's GPUs; cuda:N as named
    assert [cuda_index(None, r, 2) for r in (-1, 0, 1, 2, 3)] == [0, 0, 1, 0, 1]
    assert cuda_index(3, 1, 8) == 3
