"""A GradScaler given a DistributedOptimizer whose updates run on the servers (or as the
summation update) is refused by name: the servers would step on scaled gradients."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("update_on", ["server", "sum"])
def test_grad_scaler_with_server_updates_is_refused_by_name(update_on):
    from hetps import optim
    from hetps.torch.optimizer import DistributedOptimizer

    net = torch.nn.Linear(3, 2)
    opt = DistributedOptimizer(
        None,
        net.named_parameters(),
        kvstore="local",
        update_on=update_on,
        server_optimizer=optim.SGD(learning_rate=0.1),
    )
    try:
        scaler = torch.amp.GradScaler("cpu")
        scaler.scale(net(torch.ones(4, 3)).sum()).backward()
        with pytest.raises(RuntimeError, match=f"GradScaler with update_on='{update_on}'"):
            scaler.step(opt)
        assert opt.param_groups == []  # (read by anything else: as before)
    finally:
        opt.close()


def test_grad_scaler_with_server_held_tables_is_refused_by_name():
    """A sparse embedding held by the servers would take still-scaled rows at once."""
    from hetps.torch.optimizer import DistributedOptimizer

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(10, 3, sparse=True)
            self.out = torch.nn.Linear(3, 1)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.out(self.emb(ids))

    net = Net()
    dense = [(n, p) for n, p in net.named_parameters() if not n.startswith("emb")]
    opt = DistributedOptimizer(
        torch.optim.SGD([p for _, p in dense], lr=0.1), dense, kvstore="local", model=net
    )
    try:
        scaler = torch.amp.GradScaler("cpu")
        scaler.scale(net(torch.tensor([1, 2, 3])).sum()).backward()
        with pytest.raises(RuntimeError, match="GradScaler with server-held embedding tables"):
            scaler.step(opt)
    finally:
        opt.close()
