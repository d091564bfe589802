"""Adam (Kingma & Ba, 2014) as MXNet implements it (``adam_update`` plus bias-corrected lr)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from hetps.optim import kernels
from hetps.optim.base import Key, Optimizer, _check_number, compute_dtype
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
        self.beta1 = _check_number("beta1", beta1, minimum=0.0)
        self.beta2 = _check_number("beta2", beta2, minimum=0.0)
        for name, beta in (("beta1", self.beta1), ("beta2", self.beta2)):
            if beta >= 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {beta!r}")
        self.epsilon = _check_number("epsilon", epsilon)
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
        """Apply one Adam step to ``weight`` in place and advance the key's step count."""
        dtype = compute_dtype(weight)
        grad = self._check_grad(weight, grad)
        state["t"] += 1
        t = state["t"]
        lr_t = self.learning_rate * math.sqrt(1.0 - self.beta2**t) / (1.0 - self.beta1**t)

        rescale, clip, wd = self.rescale_grad, self.clip_gradient, self.wd
        clip = clip if clip is not None and clip > 0 else None
        beta1, beta2, eps = self.beta1, self.beta2, self.epsilon

        def body(views: list, scratch: list) -> None:
            w, gr, mean, var = views
            g, t = scratch
            # g = clip(rescale_grad * grad + wd * weight): MXNet adds wd before clipping
            src = kernels.rescaled(gr, rescale, None, dtype, g)
            if wd != 0.0:
                np.multiply(w, wd, dtype=dtype, out=t)
                np.add(src, t, out=g)
                src = g
            if clip is not None:
                np.clip(src, -clip, clip, out=g)
                src = g
            mean *= beta1
            np.multiply(src, 1.0 - beta1, out=t)
            mean += t
            np.multiply(src, src, out=g)
            var *= beta2
            np.multiply(g, 1.0 - beta2, out=t)
            var += t
            # step = -lr_t * mean / (sqrt(var) + eps), reusing g as the buffer
            np.sqrt(var, out=g)
            g += eps
            np.divide(mean, g, out=g)
            g *= -lr_t
            np.add(w, g, out=w, casting="same_kind")

        # chunk by chunk on the kernel threads (hetps.optim.kernels): the same arithmetic
        kernels.run(body, [weight, grad, state["mean"], state["var"]], scratch=2, dtype=dtype)

    def device_step(self, torch: Any, w: Any, grad: Any, state: dict, scratch: list) -> None:
        """:meth:`update` on torch tensors, on a server's device: the same operations in the
        same order and dtypes (weights within float rounding of the host step's: torch's
        square root is not correctly rounded in every kernel)."""
        c = kernels.torch_scalar(torch, kernels.torch_compute_dtype(torch, w))
        state["t"] += 1
        t_ = state["t"]
        lr_t = self.learning_rate * math.sqrt(1.0 - self.beta2**t_) / (1.0 - self.beta1**t_)
        clip = (
            self.clip_gradient
            if self.clip_gradient is not None and self.clip_gradient > 0
            else None
        )
        mean, var = state["mean"], state["var"]
        g, t = scratch
        src = kernels.torch_rescaled(grad, self.rescale_grad, None, g, c)
        if self.wd != 0.0:
            t.copy_(w)
            t.mul_(c(self.wd))
            torch.add(src, t, out=g)
            src = g
        if clip is not None:
            torch.clamp(src, c(-clip), c(clip), out=g)
            src = g
        mean.mul_(c(self.beta1))
        torch.mul(src, c(1.0 - self.beta1), out=t)
        mean.add_(t)
        torch.mul(src, src, out=g)
        var.mul_(c(self.beta2))
        torch.mul(g, c(1.0 - self.beta2), out=t)
        var.add_(t)
        torch.sqrt(var, out=g)
        g.add_(c(self.epsilon))
        torch.div(mean, g, out=g)
        g.mul_(c(-lr_t))
        w.add_(g)
