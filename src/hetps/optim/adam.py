"""Adam (Kingma & Ba, 2014) as MXNet implements it (``adam_update`` plus bias-corrected lr)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from hetps.optim import kernels
from hetps.optim.base import Key, Optimizer, check_number, compute_dtype
from hetps.optim.registry import optimizer

__all__ = ["Adam"]


@optimizer("adam")
class Adam(Optimizer):
    """Adam with MXNet's exact order of operations.

    For the ``t``-th update of a key (``t`` counted per key, starting at 1)::

        lr_t = learning_rate * sqrt(1 - beta2**t) / (1 - beta1**t)
        g    = clip(rescale_grad * grad + wd * weight)      # MXNet adds wd *before* clipping
        mean = beta1 * mean + (1 - beta1) * g
        var  = beta2 * var  + (1 - beta2) * g**2
        weight -= lr_t * mean / (sqrt(var) + epsilon)

    Note the difference from :class:`~hetps.optim.SGD`, where MXNet clips the rescaled gradient
    and only then adds ``wd * weight``: MXNet's ``AdamUpdateKernel`` clips the sum.

    The state of a key is ``{'mean': array, 'var': array, 't': int}``; the step count lives in
    the state (not on the optimizer) so it is saved and loaded with the optimizer states.

    Args:
        beta1: decay rate of the first-moment estimate, in ``[0, 1)``.
        beta2: decay rate of the second-moment estimate, in ``[0, 1)``.
        epsilon: small constant added to the denominator, ``> 0``.
        **kwargs: the common :class:`Optimizer` arguments (default ``learning_rate=0.001``).
    """

    def __init__(
        self,
        learning_rate: float = 0.001,
        beta1: float = 0.9,
        beta2: float = 0.999,
        epsilon: float = 1e-8,
        **kwargs: Any,
    ) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.beta1 = check_number("beta1", beta1, minimum=0.0)
        self.beta2 = check_number("beta2", beta2, minimum=0.0)
        for name, beta in (("beta1", self.beta1), ("beta2", self.beta2)):
            if beta >= 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {beta!r}")
        self.epsilon = check_number("epsilon", epsilon)
        if self.epsilon <= 0.0:
            raise ValueError(f"epsilon must be > 0, got {self.epsilon!r}")

    def create_state(self, key: Key, weight: np.ndarray) -> dict[str, Any]:
        """``{'mean': zeros, 'var': zeros, 't': 0}``, arrays in the compute dtype."""
        dtype = compute_dtype(weight)
        return {
            "mean": np.zeros(weight.shape, dtype=dtype),
            "var": np.zeros(weight.shape, dtype=dtype),
            "t": 0,
        }

    def update(self, key: Key, weight: np.ndarray, grad: np.ndarray, state: dict[str, Any]) -> None:
        """Apply one Adam step to ``weight`` in place and advance the key's step count
        (chunk by chunk on the kernel threads, :mod:`hetps.optim.kernels`: the same
        arithmetic)."""
        ops = kernels.NumpyOps(compute_dtype(weight))
        grad = self._check_grad(weight, grad)
        lr_t = self._advance(state)

        def body(views: list, scratch: list) -> None:
            self.rule(ops, lr_t, *views, scratch)

        arrays = [weight, grad, state["mean"], state["var"]]
        kernels.run(body, arrays, scratch=2, dtype=ops.dtype)

    def device_step(self, torch: Any, w: Any, grad: Any, state: dict, scratch: list) -> None:
        """:meth:`update` on torch tensors, on a server's device: the same step (weights
        within float rounding of the host's: torch's square root is not correctly rounded
        in every kernel)."""
        lr_t = self._advance(state)
        self.rule(kernels.TorchOps(torch, w), lr_t, w, grad, state["mean"], state["var"], scratch)

    def _advance(self, state: dict[str, Any]) -> float:
        """Count the key's step in ``state``; returns the bias-corrected learning rate."""
        state["t"] += 1
        t = state["t"]
        return self.learning_rate * math.sqrt(1.0 - self.beta2**t) / (1.0 - self.beta1**t)

    def rule(self, ops: kernels.NumpyOps, lr_t: float, w, gr, mean, var, scratch: list) -> None:
        """The step, written once for the host's arrays and a device's tensors (``ops``)."""
        clip = self.clip_gradient
        clip = clip if clip is not None and clip > 0 else None
        g, t = scratch
        # g = clip(rescale_grad * grad + wd * weight): MXNet adds wd before clipping
        src = ops.rescaled(gr, self.rescale_grad, None, g)
        if self.wd != 0.0:
            src = ops.add(src, ops.scale(w, self.wd, t), g)
        if clip is not None:
            src = ops.clip(src, clip, g)
        ops.scale(mean, self.beta1, mean)
        ops.add(mean, ops.scale(src, 1.0 - self.beta1, t), mean)
        ops.mul(src, src, g)
        ops.scale(var, self.beta2, var)
        ops.add(var, ops.scale(g, 1.0 - self.beta2, t), var)
        # step = -lr_t * mean / (sqrt(var) + eps), reusing g as the buffer
        ops.shift(ops.sqrt(var, g), self.epsilon)
        ops.scale(ops.div(mean, g, g), -lr_t, g)
        ops.add(w, g, w)
