"""The training algorithms' update rules as pure functions (numbers in, numbers out).
(docs/MODULES.md, "hetps.sync.rules")"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from hetps.optim.dcasgd import dcasgd_delta, dcasgd_gradient

__all__ = [
    "average",
    "average_from_sum",
    "dcasgd_compensate",
    "dcasgd_step",
    "esync_global_update",
    "esync_update_from_sum",
    "model_delta",
    "sgd_step",
    "ssgd_step",
    "sum_arrays",
]


def _is_tensor(a: Any) -> bool:
    """A torch tensor (or Parameter), told apart without importing torch."""
    return type(a).__module__.startswith("torch")


def _float(*arrays: Any) -> tuple[Any, ...]:
    """NumPy inputs as arrays of one floating dtype; torch tensors as they are (checked)."""
    tensors = [_is_tensor(a) for a in arrays]
    if any(tensors):
        if not all(tensors):
            raise TypeError("give all arrays as NumPy arrays or all as torch tensors, not a mix")
        for a in arrays:
            if not a.is_floating_point():
                raise TypeError(f"torch tensors must be floating point, got {a.dtype}")
        return arrays
    out = tuple(np.asarray(a) for a in arrays)
    dtype = np.result_type(*out, np.float32) if out else np.float64
    if not np.issubdtype(dtype, np.floating):
        dtype = np.float64
    return tuple(a.astype(dtype, copy=False) for a in out)


def _same_shape(names: Sequence[str], arrays: Sequence[Any]) -> None:
    shape = tuple(arrays[0].shape)
    for name, a in zip(names, arrays, strict=True):
        if tuple(a.shape) != shape:
            raise ValueError(f"shape mismatch: {name} has shape {tuple(a.shape)}, expected {shape}")


def _check_workers(num_workers: int) -> None:
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")


def sum_arrays(arrays: Sequence[ArrayLike]) -> np.ndarray:
    """Element-wise sum of equally shaped arrays, added in the given order."""
    if len(arrays) == 0:
        raise ValueError("need at least one array")
    arrs = _float(*arrays)
    _same_shape([f"arrays[{i}]" for i in range(len(arrs))], arrs)
    total = arrs[0].clone() if _is_tensor(arrs[0]) else arrs[0].copy()
    for a in arrs[1:]:
        total += a
    return total


def average_from_sum(total: Any, num_workers: int, out: Any = None) -> Any:
    """The mean from a sum over ``num_workers`` workers (what a worker pulls from the servers):
    ``total / num_workers``; into ``out`` when given (``out=total`` divides in place)."""
    _check_workers(num_workers)
    (t,) = _float(total)
    if out is None:
        return t / num_workers
    _same_shape(["total", "out"], [t, out])
    if _is_tensor(t):
        import torch  # loaded already: t is a tensor

        return torch.div(t, num_workers, out=out)
    return np.divide(t, num_workers, out=out)


def average(arrays: Sequence[ArrayLike]) -> np.ndarray:
    """Element-wise mean of equally shaped arrays (SSGD's gradient average, BN statistics)."""
    return average_from_sum(sum_arrays(arrays), len(arrays))


def sgd_step(weight: ArrayLike, grad: ArrayLike, lr: float, wd: float = 0.0) -> np.ndarray:
    """One SGD step, as ASGD's servers apply each pushed gradient: ``w - lr*(g + wd*w)``."""
    w, g = _float(weight, grad)
    _same_shape(["weight", "grad"], [w, g])
    return w - lr * (g + wd * w)


def ssgd_step(
    weight: ArrayLike, grads: Sequence[ArrayLike], lr: float, wd: float = 0.0
) -> np.ndarray:
    """Synchronous SGD: one step with the mean of all workers' gradients."""
    return sgd_step(weight, average(grads), lr, wd)


def dcasgd_compensate(
    grad: ArrayLike, weight: ArrayLike, weight_backup: ArrayLike, lamda: float
) -> np.ndarray:
    """DC-ASGD's delay-compensated gradient ``g + (w - w_bak) * g * g * lamda``.

    ``weight`` is the current weight, ``weight_backup`` the weight the gradient was computed
    against (the weight the pushing worker last received); ``lamda`` is the
    variance-control factor (MXNet's default 0.04). :func:`dcasgd_step`'s ``d`` without
    weight decay (:func:`hetps.optim.dcasgd.dcasgd_gradient`).
    """
    g, w, b = _float(grad, weight, weight_backup)
    _same_shape(["grad", "weight", "weight_backup"], [g, w, b])
    return dcasgd_gradient(w, g, b, lamda)


def dcasgd_step(
    weight: ArrayLike,
    grad: ArrayLike,
    weight_backup: ArrayLike | None,
    lr: float,
    lamda: float = 0.04,
    wd: float = 0.0,
    momentum: float = 0.0,
    mom: ArrayLike | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """One DC-ASGD update, as the servers' :class:`hetps.optim.DCASGD` applies a worker's
    gradient; returns ``(weight, backup, mom)``.

    ``d = g + wd*w + (w - w_bak)*g*g*lamda`` (terms whose factor is 0, or without a backup,
    are left out); with ``momentum`` > 0, ``mom = momentum*mom - lr*d`` (``mom`` starts at
    zeros when None) and the weight moves by ``mom``, else by ``-lr*d`` and the returned
    ``mom`` is None. ``weight_backup`` is the weight the pushing worker last received (None:
    it never pulled, no compensation); its new backup is the new weight, which it receives
    in the push's answer. The arithmetic is :func:`hetps.optim.dcasgd.dcasgd_delta`'s.
    """
    arrays = [weight, grad] if weight_backup is None else [weight, grad, weight_backup]
    conv = _float(*arrays)
    w, g = conv[0], conv[1]
    b = None if weight_backup is None else conv[2]
    _same_shape(["weight", "grad", "weight_backup"][: len(conv)], conv)
    prev = None
    if momentum:
        prev = np.zeros_like(w) if mom is None else np.asarray(mom).astype(w.dtype, copy=False)
        _same_shape(["weight", "mom"], [w, prev])
    step, new_mom = dcasgd_delta(w, g, b, lr, lamda, wd, momentum, prev)
    new_w = w + step
    return new_w, new_w.copy(), new_mom


def model_delta(weight: Any, weight_round: Any) -> Any:
    """ESync's push: the model difference ``w - w_round`` since the round's start."""
    w, r = _float(weight, weight_round)
    _same_shape(["weight", "weight_round"], [w, r])
    return w - r


def esync_global_update(
    weight_round: ArrayLike, deltas: Sequence[ArrayLike], global_lr: float = 1.0
) -> np.ndarray:
    """ESync's aggregation: ``w_round + global_lr * sum_k(delta_k) / K``."""
    return esync_update_from_sum(weight_round, sum_arrays(deltas), len(deltas), global_lr)


def esync_update_from_sum(
    weight_round: Any, delta_sum: Any, num_workers: int, global_lr: float = 1.0
) -> Any:
    """ESync's aggregation from the servers' sum of deltas (what a worker pulls):
    ``w_round + global_lr * delta_sum / num_workers``, evaluated left to right."""
    _check_workers(num_workers)
    r, s = _float(weight_round, delta_sum)
    _same_shape(["weight_round", "delta_sum"], [r, s])
    return r + global_lr * s / num_workers
