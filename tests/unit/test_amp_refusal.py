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
