"""``SumKeys``: a server optimizer that sums the pushes of some keys instead of applying them.
(docs/MODULES.md, "hetps.optim.sums")"""

from __future__ import annotations

from typing import Any

import numpy as np

from hetps.optim.base import Key, Optimizer

__all__ = ["SumKeys"]


class SumKeys(Optimizer):
    """``optimizer`` for every key but those named ``prefix...``, whose pushes are summed."""

    def __init__(self, optimizer: Optimizer, prefix: str = "hvd.") -> None:
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"SumKeys wraps a hetps.optim.Optimizer, not {type(optimizer)}")
        super().__init__()
        self.inner = optimizer
        self.prefix = prefix

    def _summed(self, key: Key) -> bool:
        name = key[0] if isinstance(key, tuple) else key
        return isinstance(name, str) and name.startswith(self.prefix)

    def create_state(self, key: Key, weight: np.ndarray) -> Any:
        """No state for a summed key; the wrapped optimizer's for the others."""
        return None if self._summed(key) else self.inner.create_state(key, weight)

    def update(self, key: Key, weight: np.ndarray, grad: np.ndarray, state: Any) -> None:
        """A summed key: ``weight += grad``; any other: the wrapped optimizer's update."""
        if self._summed(key):
            np.add(weight, grad, out=weight, casting="unsafe")
        else:
            self.inner.update(key, weight, grad, state)

    def apply_update(
        self, key: Key, weight: np.ndarray, grad: np.ndarray, state: Any, sender: int
    ) -> None:
        """As :meth:`update`, with the sender for the wrapped optimizer (DC-ASGD)."""
        if self._summed(key):
            self.update(key, weight, grad, state)
        else:
            self.inner.apply_update(key, weight, grad, state, sender)

    def on_pull(self, key: Key, weight: np.ndarray, state: Any, sender: int) -> None:
        """The wrapped optimizer's hook, for its own keys."""
        if not self._summed(key):
            self.inner.on_pull(key, weight, state, sender)
