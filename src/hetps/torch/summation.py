"""Servers that only sum (BytePS's Summation Service): the workers run the update.
(docs/MODULES.md, "hetps.torch.summation")"""

from __future__ import annotations

from typing import Any

import torch

from hetps import optim as ps_optim


class WorkerUpdate:
    """A hetps optimizer run on a worker's parameters, one state per parameter name."""

    def __init__(self, optimizer: ps_optim.Optimizer, named: list[tuple[str, torch.Tensor]]):
        if not isinstance(optimizer, ps_optim.Optimizer):
            raise TypeError(
                "update_on='sum' runs server_optimizer on the workers: give a "
                f"hetps.optim.Optimizer, not {type(optimizer).__name__}"
            )
        if isinstance(optimizer, ps_optim.DCASGD):
            raise ValueError(
                "update_on='sum' is synchronous: DC-ASGD compensates asynchronous delays; use "
                "update_on='server' with dist_async for it"
            )
        for name, p in named:
            if p.device.type != "cpu":
                raise ValueError(
                    f"update_on='sum' updates with NumPy on the host; parameter {name!r} is on "
                    f"{p.device}: use update_on='worker' with a torch optimizer on the device"
                )
        self.optimizer = optimizer
        self.states: dict[str, Any] = {}

    def step(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Apply each parameter's gradient (the servers' sum) to it, in place."""
        for name, p in named:
            if p.grad is not None:
                self.apply(name, p, p.grad)

    def apply(self, name: str, p: torch.Tensor, grad: torch.Tensor) -> None:
        """Apply one parameter's gradient ``grad`` (the servers' sum) to it, in place."""
        w = p.data.numpy()
        state = self.states.get(name)
        if name not in self.states:
            state = self.states[name] = self.optimizer.create_state(name, w)
        self.optimizer.apply_update(name, w, grad.detach().numpy(), state, sender=0)

    def state_bytes(self) -> bytes:
        return ps_optim.dump_states(self.states)

    def load_state_bytes(self, data: bytes) -> None:
        self.states = ps_optim.load_states(data)
