"""Stochastic gradient descent, with optional momentum and weight decay (MXNet's ``sgd``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from hetps.optim import kernels
from hetps.optim.base import Key, Optimizer, check_number, compute_dtype
from hetps.optim.registry import optimizer

__all__ = ["SGD"]


@optimizer("sgd")
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
        self.momentum = check_number("momentum", momentum, minimum=0.0)

    def create_state(self, key: Key, weight: np.ndarray) -> dict[str, np.ndarray] | None:
        """``None`` without momentum, else ``{'mom': zeros}`` in the compute dtype."""
        dtype = compute_dtype(weight)
        if self.momentum == 0.0:
            return None
        return {"mom": np.zeros(weight.shape, dtype=dtype)}

    def scratch_buffers(self) -> int:
        """One scratch buffer, a second for weight decay."""
        return 2 if self.wd != 0.0 else 1

    def _momentum(self, state: Any) -> Any:
        """The momentum buffer of ``state`` (None without momentum)."""
        if self.momentum == 0.0:
            return None
        if state is None:
            raise ValueError(
                f"SGD(momentum={self.momentum}) needs the state from create_state(); got None"
            )
        return state["mom"]

    def update(
        self, key: Key, weight: np.ndarray, grad: np.ndarray, state: dict[str, np.ndarray] | None
    ) -> None:
        """Apply one SGD step to ``weight`` in place (chunk by chunk, on the kernel threads:
        see :mod:`hetps.optim.kernels`; the same arithmetic as on whole arrays)."""
        ops = kernels.NumpyOps(compute_dtype(weight))
        grad = self._check_grad(weight, grad)
        mom = self._momentum(state)

        def body(views: list, scratch: list) -> None:
            self.rule(ops, *views, scratch)

        kernels.run(body, [weight, grad, mom], scratch=self.scratch_buffers(), dtype=ops.dtype)

    def device_step(self, torch: Any, w: Any, grad: Any, state: Any, scratch: list) -> None:
        """:meth:`update` on torch tensors, on a server's device: the same step, so the
        weights equal the host step's bit for bit."""
        self.rule(kernels.TorchOps(torch, w), w, grad, self._momentum(state), scratch)

    def rule(self, ops: kernels.NumpyOps, w: Any, gr: Any, mom: Any, scratch: list) -> None:
        """The step, written once for the host's arrays and a device's tensors (``ops``)."""
        clip = self.clip_gradient
        clip = clip if clip is not None and clip > 0 else None
        g = scratch[0]
        # g = clip(rescale_grad * grad) + wd * weight, in the compute dtype
        src = ops.rescaled(gr, self.rescale_grad, clip, g)
        if self.wd != 0.0:
            src = ops.add(src, ops.scale(w, self.wd, scratch[1]), g)
        if mom is None:
            ops.add(w, ops.scale(src, -self.learning_rate, g), w)
            return
        ops.scale(mom, self.momentum, mom)  # mom = momentum * mom - learning_rate * g
        ops.add(mom, ops.scale(src, -self.learning_rate, g), mom)
        ops.add(w, mom, w)
