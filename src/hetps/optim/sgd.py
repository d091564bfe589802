"""Stochastic gradient descent, with optional momentum and weight decay (MXNet's ``sgd``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from hetps.optim.base import Key, Optimizer, _check_number, compute_dtype

__all__ = ["SGD"]


class SGD(Optimizer):
    """SGD with momentum and weight decay, exactly as MXNet's ``sgd_update``/``sgd_mom_update``.

    With ``g = clip(rescale_grad * grad) + wd * weight`` (clipping *before* weight decay is
    added, as MXNet does)::

        momentum == 0:  weight -= learning_rate * g
        momentum > 0:   mom = momentum * mom - learning_rate * g;  weight += mom

    Float16 weights are computed in float32 and stored back as float16; the momentum buffer of
    a float16 weight is kept in float32.

    Args:
        momentum: momentum coefficient in ``[0, 1)``; 0 disables the momentum buffer.
        **kwargs: the common :class:`Optimizer` arguments (``learning_rate``, ``rescale_grad``,
            ``wd``, ``clip_gradient``).
    """

    def __init__(self, momentum: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.momentum = _check_number("momentum", momentum, minimum=0.0)

    def create_state(self, key: Key, weight: np.ndarray) -> dict[str, np.ndarray] | None:
        """``None`` without momentum, else ``{'mom': zeros}`` in the compute dtype."""
        dtype = compute_dtype(weight)
        if self.momentum == 0.0:
            return None
        return {"mom": np.zeros(weight.shape, dtype=dtype)}

    def update(
        self, key: Key, weight: np.ndarray, grad: np.ndarray, state: dict[str, np.ndarray] | None
    ) -> None:
        """Apply one SGD step to ``weight`` in place."""
        dtype = compute_dtype(weight)
        grad = self._check_grad(weight, grad)
        g = self._preprocess_grad(grad, dtype)
        if self.wd != 0.0:
            # g += wd * weight, computed in the compute dtype (float32 for float16 weights)
            g += np.multiply(weight, self.wd, dtype=dtype)
        if self.momentum == 0.0:
            g *= -self.learning_rate
            np.add(weight, g, out=weight, casting="same_kind")
            return
        if state is None:
            raise ValueError(
                f"SGD(momentum={self.momentum}) needs the state from create_state(); got None"
            )
        mom = state["mom"]
        mom *= self.momentum
        g *= self.learning_rate
        mom -= g
        np.add(weight, mom, out=weight, casting="same_kind")
