"""Delay-compensated asynchronous SGD (DC-ASGD; Zheng et al., ICML 2017).

In asynchronous training a worker computes its gradient on the weight ``w_bak`` it pulled,
while the server's weight has meanwhile moved on to ``w``. DC-ASGD compensates the stale
gradient with a cheap approximation of the Hessian (``lamda * g * g``, the diagonal of the
outer product of the gradient)::

    g_comp = g + lamda * g * g * (w - w_bak)

MXNet's ``DCASGD`` optimizer keeps a single ``previous_weight`` per key. As in the paper, this
implementation keeps one backup **per worker**: the server tells the optimizer which worker
pulled (:meth:`DCASGD.on_pull`) and which one pushed (:meth:`DCASGD.apply_update`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hetps.optim.base import Key, Optimizer, _check_number, compute_dtype

__all__ = ["DCASGD"]


class DCASGD(Optimizer):
    """DC-ASGD with a weight backup per worker.

    When worker ``s`` pushes gradient ``grad`` for a key with current weight ``w``::

        g     = clip(rescale_grad * grad)
        w_bak = backup[s] if worker s has one, else w      (no compensation)
        d     = g + wd * w + lamda * g * g * (w - w_bak)
        momentum == 0:  step = -learning_rate * d
        momentum > 0:   mom = momentum * mom - learning_rate * d;  step = mom
        w += step;  backup[s] = copy of the new w

    and when worker ``s`` pulls the key, ``backup[s]`` becomes a copy of the weight it
    receives. :meth:`update` (no sender known) acts as worker 0.

    The state of a key is ``{'mom': array or None, 'backup': {sender: array}}``; the backups
    cost one copy of the key's weight per worker that has touched it.

    Args:
        momentum: momentum coefficient in ``[0, 1)``; 0 disables the momentum buffer.
        lamda: strength of the delay compensation (``lamda`` as spelt by MXNet), ``>= 0``.
        **kwargs: the common :class:`Optimizer` arguments.
    """

    def __init__(self, momentum: float = 0.0, lamda: float = 0.04, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.momentum = _check_number("momentum", momentum, minimum=0.0)
        self.lamda = _check_number("lamda", lamda, minimum=0.0)

    def create_state(self, key: Key, weight: np.ndarray) -> dict[str, Any]:
        """``{'mom': zeros or None, 'backup': {}}`` (momentum buffer in the compute dtype)."""
        dtype = compute_dtype(weight)
        mom = np.zeros(weight.shape, dtype=dtype) if self.momentum != 0.0 else None
        return {"mom": mom, "backup": {}}

    def update(self, key: Key, weight: np.ndarray, grad: np.ndarray, state: dict[str, Any]) -> None:
        """Apply a gradient whose sender is unknown: the same as worker 0 pushing it."""
        self.apply_update(key, weight, grad, state, sender=0)

    def apply_update(
        self, key: Key, weight: np.ndarray, grad: np.ndarray, state: dict[str, Any], sender: int
    ) -> None:
        """Apply worker ``sender``'s gradient, compensated against that worker's backup."""
        dtype = compute_dtype(weight)
        grad = self._check_grad(weight, grad)
        g = self._preprocess_grad(grad, dtype)
        w = weight.astype(dtype, copy=False)
        backup = state["backup"]
        w_bak = backup.get(sender)

        # d = g + wd * w + lamda * g * g * (w - w_bak)
        if w_bak is not None and self.lamda != 0.0:
            comp = np.subtract(w, w_bak, dtype=dtype)
            comp *= g
            comp *= g
            comp *= self.lamda
        else:
            comp = None
        d = g
        if self.wd != 0.0:
            d += np.multiply(w, self.wd, dtype=dtype)
        if comp is not None:
            d += comp

        if self.momentum == 0.0:
            d *= -self.learning_rate
            step = d
        else:
            mom = state["mom"]
            if mom is None:
                raise ValueError(
                    f"DCASGD(momentum={self.momentum}) has no momentum buffer in this state; "
                    "it was created with momentum=0"
                )
            mom *= self.momentum
            d *= self.learning_rate
            mom -= d
            step = mom
        np.add(weight, step, out=weight, casting="same_kind")
        self._store_backup(backup, sender, weight)

    def on_pull(self, key: Key, weight: np.ndarray, state: dict[str, Any], sender: int) -> None:
        """Remember the weight worker ``sender`` now holds, for compensating its next push."""
        self._store_backup(state["backup"], sender, weight)

    @staticmethod
    def _store_backup(backup: dict[int, np.ndarray], sender: int, weight: np.ndarray) -> None:
        """Copy ``weight`` into ``backup[sender]``, reusing the old buffer when it fits."""
        old = backup.get(sender)
        if old is not None and old.shape == weight.shape and old.dtype == weight.dtype:
            np.copyto(old, weight)
        else:
            backup[sender] = weight.copy()
