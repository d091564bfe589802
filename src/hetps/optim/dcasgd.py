"""Delay-compensated asynchronous SGD (DC-ASGD; Zheng et al., ICML 2017).
(docs/MODULES.md, "hetps.optim.dcasgd")"""

from __future__ import annotations

from typing import Any

import numpy as np

from hetps.optim import kernels
from hetps.optim.base import Key, Optimizer, check_number, compute_dtype
from hetps.optim.registry import optimizer

__all__ = ["DCASGD", "dcasgd_delta", "dcasgd_gradient"]


def dcasgd_gradient(
    weight: np.ndarray,
    grad: np.ndarray,
    weight_backup: np.ndarray | None,
    lamda: float,
    wd: float = 0.0,
) -> np.ndarray:
    """The delay-compensated gradient ``d = g + wd*w + (w - w_bak)*g*g*lamda``, a new array.

    The one definition of DC-ASGD's arithmetic (``hetps.sync.rules`` builds on it): the
    products run left to right as written, and a term whose factor is 0 (``wd``,
    ``lamda``) or that has no backup (``weight_backup`` None) is left out rather than added
    as zeros. Arrays are taken as they are (one floating dtype, equal shapes); inputs are
    not modified.
    """
    if weight_backup is not None and lamda != 0.0:
        comp = np.subtract(weight, weight_backup)
        comp *= grad
        comp *= grad
        comp *= lamda
    else:
        comp = None
    if wd != 0.0:
        d = grad + np.multiply(weight, wd)
        if comp is not None:
            d += comp
    elif comp is not None:
        d = grad + comp
    else:
        d = grad.copy()
    return d


def dcasgd_delta(
    weight: np.ndarray,
    grad: np.ndarray,
    weight_backup: np.ndarray | None,
    lr: float,
    lamda: float = 0.04,
    wd: float = 0.0,
    momentum: float = 0.0,
    mom: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """One DC-ASGD update's change of the weight and the new momentum buffer: with
    ``d = dcasgd_gradient(...)``, ``(-lr*d, None)`` without momentum, else
    ``(m, m)`` with ``m = momentum*mom - lr*d`` (``mom`` is required then). New arrays; the
    inputs are not modified."""
    d = dcasgd_gradient(weight, grad, weight_backup, lamda, wd)
    if momentum == 0.0:
        d *= -lr
        return d, None
    if mom is None:
        raise ValueError(f"DC-ASGD with momentum {momentum} needs the momentum buffer")
    new_mom = np.multiply(mom, momentum)
    d *= lr
    new_mom -= d
    return new_mom, new_mom


@optimizer("dcasgd")
class DCASGD(Optimizer):
    """DC-ASGD with a weight backup per worker.

    When worker ``s`` pushes gradient ``grad`` for a key with current weight ``w``::

        g     = clip(rescale_grad * grad)
        w_bak = backup[s] if worker s has one, else w      (no compensation)
        d     = g + wd * w + (w - w_bak) * g * g * lamda      (dcasgd_gradient)
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
        self.momentum = check_number("momentum", momentum, minimum=0.0)
        self.lamda = check_number("lamda", lamda, minimum=0.0)

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
        backup = state["backup"]
        mom = state["mom"]
        if self.momentum != 0.0 and mom is None:
            raise ValueError(
                f"DCASGD(momentum={self.momentum}) has no momentum buffer in this state; "
                "it was created with momentum=0"
            )
        old = backup.get(sender)
        # the new backup is written chunk by chunk right after each chunk's update: into
        # the sender's old backup (each chunk is read before it is overwritten) or a new one
        new = self._backup_buffer(backup, sender, weight)
        rescale, clip, wd = self.rescale_grad, self.clip_gradient, self.wd
        clip = clip if clip is not None and clip > 0 else None
        lr, lamda, momentum = self.learning_rate, self.lamda, self.momentum
        compensate = old is not None and lamda != 0.0
        ops = kernels.NumpyOps(dtype)

        def body(views: list, scratch: list) -> None:
            # dcasgd_gradient and dcasgd_delta on one chunk, operation for operation
            w, gr, bak, m, out = views
            g, c, d = scratch
            src = ops.rescaled(gr, rescale, clip, g)
            if compensate:
                np.subtract(w, bak, dtype=dtype, out=c)
                c *= src
                c *= src
                c *= lamda
            if wd != 0.0:
                np.multiply(w, wd, dtype=dtype, out=d)
                np.add(src, d, out=d)
                if compensate:
                    d += c
                src = d
            elif compensate:
                np.add(src, c, out=d)
                src = d
            if m is None:
                np.multiply(src, -lr, out=d)
                np.add(w, d, out=w, casting="same_kind")
            else:
                m *= momentum
                np.multiply(src, lr, out=d)
                m -= d
                np.add(w, m, out=w, casting="same_kind")
            np.copyto(out, w)

        kernels.run(
            body,
            [weight, grad, old if compensate else None, mom if momentum != 0.0 else None, new],
            scratch=3,
            dtype=dtype,
        )

    def on_pull(self, key: Key, weight: np.ndarray, state: dict[str, Any], sender: int) -> None:
        """Remember the weight worker ``sender`` now holds, for compensating its next push."""
        np.copyto(self._backup_buffer(state["backup"], sender, weight), weight)

    @staticmethod
    def _backup_buffer(backup: dict[int, np.ndarray], sender: int, weight: np.ndarray):
        """``backup[sender]`` when it fits ``weight`` (reused), else a new one in its place."""
        old = backup.get(sender)
        if old is None or old.shape != weight.shape or old.dtype != weight.dtype:
            old = backup[sender] = np.empty_like(weight)
        return old
