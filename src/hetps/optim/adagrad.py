"""AdaGrad (Duchi et al., 2011) as MXNet's ``AdaGrad`` optimizer writes it."""

from __future__ import annotations

from typing import Any

import numpy as np

from hetps.optim.base import Key, Optimizer, check_number, compute_dtype
from hetps.optim.registry import optimizer

__all__ = ["AdaGrad"]


@optimizer("adagrad")
class AdaGrad(Optimizer):
    """AdaGrad with MXNet's order of operations::

        g        = clip(rescale_grad * grad)
        history += g * g
        weight  += (g / sqrt(history + eps) + wd * weight) * -learning_rate

    The state of a key is ``{'history': array}`` in the compute dtype.

    Args:
        eps: added to the history under the square root (MXNet's ``float_stable_eps``).
        **kwargs: the common :class:`Optimizer` arguments.
    """

    def __init__(self, eps: float = 1e-7, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.eps = check_number("eps", eps, minimum=0.0)

    def create_state(self, key: Key, weight: np.ndarray) -> dict[str, np.ndarray]:
        """``{'history': zeros}``."""
        return {"history": np.zeros(weight.shape, dtype=compute_dtype(weight))}

    def update(
        self, key: Key, weight: np.ndarray, grad: np.ndarray, state: dict[str, np.ndarray]
    ) -> None:
        """Apply one AdaGrad step to ``weight`` in place."""
        dtype = compute_dtype(weight)
        grad = self._check_grad(weight, grad)
        g = self.preprocess_grad(grad, dtype)
        history = state["history"]
        history += g * g
        g /= np.sqrt(history + self.eps)
        if self.wd != 0.0:
            g += np.multiply(weight, self.wd, dtype=dtype)
        g *= -self.learning_rate
        np.add(weight, g, out=weight, casting="same_kind")
