"""``DistributedOptimizer(..., overlap_forward=True)``: ``step()`` leaves the pulls in flight
and each module's forward waits for its own parameters' new weights only.

The store here is a local KVStore whose answers land as late as a real one's may: only when
their handle is waited for. A module that ran without waiting would see its old weight; a
``step()`` that waited for everything would land every answer before the first module ran.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import hetps.kvstore  # noqa: E402
from hetps import optim  # noqa: E402
from hetps.torch.optimizer import DistributedOptimizer  # noqa: E402


class _LateHandle:
    def __init__(self, store: LateStore, key: str, answer: torch.Tensor, out: torch.Tensor):
        self.store, self.key, self.answer, self.out = store, key, answer, out

    def wait(self) -> None:
        if self.key in self.store.fail:
            raise RuntimeError(f"the server refused {self.key}")
        if self.answer is not None:
            self.out.copy_(self.answer)
            self.answer = None
            self.store.events.append(("land", self.key))

    def done(self) -> bool:
        return self.answer is None


class LateStore:
    """A local store (SGD on the "server") whose pushpull answers land in ``out`` only when
    the handle is waited for; ``events`` records each landing, ``answers`` the latest answer
    of each key, ``fail`` keys whose wait raises."""

    def __init__(self) -> None:
        self.inner = hetps.kvstore.create("local")
        self.events: list[tuple[str, str]] = []
        self.answers: dict[str, torch.Tensor] = {}
        self.fail: set[str] = set()

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def pushpull(self, key, value, out=None, priority=0, block=True):
        answer = torch.empty_like(out)
        self.inner.pushpull(key, value, out=answer)
        self.answers[key] = answer.clone()
        return _LateHandle(self, key, answer, out)


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(),
        torch.nn.Linear(8, 2),
    )  # fmt: skip


def setup(overlap: bool = True, update_on: str = "server", fusion_bytes: int | None = 0):
    store = LateStore()
    model = net()
    opt = DistributedOptimizer(
        None,
        model.named_parameters(),
        kvstore=store,
        update_on=update_on,
        server_optimizer=optim.SGD(learning_rate=0.1, momentum=0.9),
        model=model,
        overlap_forward=overlap,
        background_launch=False,
        fusion_bytes=fusion_bytes,
    )
    seen: list[tuple[str, int, bool]] = []  # ("fwd", layer, weights were the new ones)

    def recorder(i: int):
        def hook(m, args):  # registered after the optimizer's: runs after its wait
            fresh = all(
                torch.equal(p, store.answers.get(f"weight:{i}.{n}", p))
                for n, p in m.named_parameters()
            )
            store.events.append(("fwd", str(i)))
            seen.append(("fwd", i, fresh))

        return hook

    for i in (0, 2, 4):
        model[i].register_forward_pre_hook(recorder(i))
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    return store, model, opt, seen, x


def train_step(model, opt, x) -> None:
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("update_on", ["server", "sum"])
def test_each_module_waits_for_its_own_weights_and_no_others(update_on):
    store, model, opt, seen, x = setup(update_on=update_on)
    k = "weight" if update_on == "server" else "grad"  # (sum: the update runs at the wait)
    train_step(model, opt, x)
    assert not [e for e in store.events if e[0] == "land"]  # step() left every pull in flight
    store.events.clear()
    train_step(model, opt, x)
    fwd = store.events.index(("fwd", "0"))
    # the second forward: layer 0 ran before the later layers' answers landed (the overlap),
    # and each layer only once its own answers were in
    assert store.events[: fwd + 1] == [
        ("land", f"{k}:0.weight"),
        ("land", f"{k}:0.bias"),
        ("fwd", "0"),
    ], store.events
    assert store.events[fwd + 1 : fwd + 6] == [
        ("land", f"{k}:2.weight"),
        ("land", f"{k}:2.bias"),
        ("fwd", "2"),
        ("land", f"{k}:4.weight"),
        ("land", f"{k}:4.bias"),
    ], store.events
    assert seen and all(fresh for _, _, fresh in seen), seen  # no layer ran on an old weight
    opt.close()


@pytest.mark.parametrize(
    "update_on,fusion_bytes", [("server", 0), ("sum", 0), ("sum", 1 << 20)]
)  # (fusion: one group of every parameter)
def test_weights_equal_training_without_overlap(update_on, fusion_bytes):
    runs = []
    for overlap in (True, False):
        _, model, opt, _, x = setup(overlap, update_on, fusion_bytes)
        for _ in range(4):
            train_step(model, opt, x)
        opt.synchronize()  # (reading p by hand: wait first)
        runs.append([p.detach().clone() for p in model.parameters()])
        opt.close()
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


def test_state_dict_close_and_the_next_step_wait_for_everything():
    store, model, opt, _, x = setup()
    train_step(model, opt, x)
    store.events.clear()
    state = model.state_dict()
    assert [e for e in store.events if e[0] == "land"] == [
        ("land", f"weight:{i}.{n}") for i in (0, 2, 4) for n in ("weight", "bias")
    ]
    for i in (0, 2, 4):
        assert torch.equal(state[f"{i}.weight"], store.answers[f"weight:{i}.weight"])
    train_step(model, opt, x)
    store.events.clear()
    opt.close()  # lands what is in flight
    assert len([e for e in store.events if e[0] == "land"]) == 6


def test_a_failed_pull_raises_in_the_forward_and_at_every_later_wait():
    store, model, opt, seen, x = setup()
    train_step(model, opt, x)
    model(x).sum().backward()
    store.fail.add("weight:2.bias")
    opt.step()  # does not wait: the failure shows at the wait for layer 2's parameters
    store.events.clear()
    with pytest.raises(RuntimeError, match="refused weight:2.bias"):
        model(x)
    assert ("fwd", "0") in store.events and ("fwd", "2") not in store.events
    with pytest.raises(RuntimeError, match="refused weight:2.bias"):
        opt.synchronize()
    with pytest.raises(RuntimeError, match="refused weight:2.bias"):
        opt.close()


class _ReadsChildWeight(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)

    def forward(self, x):
        return x @ self.a.weight.t()  # self.a itself never runs: its pre-hook does not wait


def test_a_weight_read_outside_its_module_raises_in_backward():
    model = _ReadsChildWeight()
    opt = DistributedOptimizer(
        None,
        model.named_parameters(),
        kvstore=LateStore(),
        update_on="server",
        server_optimizer=optim.SGD(learning_rate=0.1),
        model=model,
        overlap_forward=True,
    )
    x = torch.ones(2, 4)
    model(x).sum().backward()
    opt.step()
    with pytest.raises(RuntimeError, match="'a.weight' got a gradient, but no forward"):
        model(x).sum().backward()
    opt.synchronize()
    opt.close()


def test_bad_arguments_name_the_fix():
    model = net()
    kw = dict(kvstore=LateStore(), server_optimizer=optim.SGD(learning_rate=0.1))
    with pytest.raises(ValueError, match="needs update_on='server' or 'sum'"):
        DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
            overlap_forward=True, model=model, **kw,
        )  # fmt: skip
    with pytest.raises(ValueError, match="and model="):
        DistributedOptimizer(
            None, model.named_parameters(), update_on="server", overlap_forward=True, **kw
        )
    other = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="not parameters of any module of model"):
        DistributedOptimizer(
            None, [*model.named_parameters(), ("x.weight", other.weight)], update_on="server",
            overlap_forward=True, model=model, **kw,
        )  # fmt: skip
