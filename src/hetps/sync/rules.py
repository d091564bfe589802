"""The training algorithms' update rules as pure NumPy functions (numbers in, numbers out).

These are the reference definitions the worker loops and server optimizers are tested
against; none of them mutates its inputs.

* SSGD (synchronous SGD): the servers wait for every worker's gradient and apply their mean:
  ``w <- w - lr * (mean_k g_k + wd * w)`` (:func:`average`, :func:`ssgd_step`).
* ASGD (asynchronous SGD): the servers apply each gradient as it arrives:
  ``w <- w - lr * (g + wd * w)`` (:func:`sgd_step`).
* DC-ASGD (Zheng et al., "Asynchronous SGD with Delay Compensation"): the stale gradient is
  compensated with the change of the weight since it was computed,
  ``g + lamda * g * g * (w - w_bak)`` (:func:`dcasgd_compensate`), then applied as SGD with
  optional momentum exactly as MXNet's ``DCASGD`` optimizer does (:func:`dcasgd_step`).
* ESync: each worker pushes its model difference from the round's start,
  ``delta_k = w_k - w_round`` (:func:`model_delta`); the servers sum, and every worker sets
  ``w <- w_round + global_lr * mean_k delta_k`` (:func:`esync_global_update`, or
  :func:`esync_update_from_sum` from the servers' sum). BatchNorm running statistics are
  averaged with :func:`average`.

Results have the floating dtype of the inputs (``numpy.result_type``); sums run in the order
the arrays are given, so results are bit-for-bit reproducible.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike

__all__ = [
    "average",
    "dcasgd_compensate",
    "dcasgd_step",
    "esync_global_update",
    "esync_update_from_sum",
    "model_delta",
    "sgd_step",
    "ssgd_step",
    "sum_arrays",
]


def _float(*arrays: ArrayLike) -> tuple[np.ndarray, ...]:
    out = tuple(np.asarray(a) for a in arrays)
    dtype = np.result_type(*out, np.float32) if out else np.float64
    if not np.issubdtype(dtype, np.floating):
        dtype = np.float64
    return tuple(a.astype(dtype, copy=False) for a in out)


def _same_shape(names: Sequence[str], arrays: Sequence[np.ndarray]) -> None:
    shape = arrays[0].shape
    for name, a in zip(names, arrays, strict=True):
        if a.shape != shape:
            raise ValueError(f"shape mismatch: {name} has shape {a.shape}, expected {shape}")


def sum_arrays(arrays: Sequence[ArrayLike]) -> np.ndarray:
    """Element-wise sum of equally shaped arrays, added in the given order."""
    if len(arrays) == 0:
        raise ValueError("need at least one array")
    arrs = _float(*arrays)
    _same_shape([f"arrays[{i}]" for i in range(len(arrs))], arrs)
    total = arrs[0].copy()
    for a in arrs[1:]:
        total += a
    return total


def average(arrays: Sequence[ArrayLike]) -> np.ndarray:
    """Element-wise mean of equally shaped arrays (SSGD's gradient average, BN statistics)."""
    total = sum_arrays(arrays)
    total /= len(arrays)
    return total


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
    """DC-ASGD's delay-compensated gradient ``g + lamda * g * g * (w - w_bak)``.

    ``weight`` is the current weight, ``weight_backup`` the weight the gradient was computed
    against (MXNet's ``DCASGD`` keeps one backup per key: the weight before its previous
    update); ``lamda`` is the variance-control factor (MXNet's default 0.04).
    """
    g, w, b = _float(grad, weight, weight_backup)
    _same_shape(["grad", "weight", "weight_backup"], [g, w, b])
    return g + lamda * g * g * (w - b)


def dcasgd_step(
    weight: ArrayLike,
    grad: ArrayLike,
    weight_backup: ArrayLike,
    lr: float,
    lamda: float = 0.04,
    wd: float = 0.0,
    momentum: float = 0.0,
    mom: ArrayLike | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """One DC-ASGD update as MXNet's ``DCASGD.update``; returns ``(weight, backup, mom)``.

    ``step = -lr * (g + wd*w + lamda*g*g*(w - w_bak))``; with ``momentum`` > 0,
    ``mom = momentum*mom + step`` (``mom`` starts at zeros when None) and the weight moves by
    ``mom``, else by ``step`` and the returned ``mom`` is None. The new backup is the weight
    before this update.
    """
    w, g, b = _float(weight, grad, weight_backup)
    _same_shape(["weight", "grad", "weight_backup"], [w, g, b])
    step = -lr * (g + wd * w + lamda * g * g * (w - b))
    new_mom: np.ndarray | None = None
    if momentum:
        prev = np.zeros_like(w) if mom is None else _float(mom)[0]
        _same_shape(["weight", "mom"], [w, prev])
        new_mom = momentum * prev + step
        step = new_mom
    return w + step, w.copy(), new_mom


def model_delta(weight: ArrayLike, weight_round: ArrayLike) -> np.ndarray:
    """ESync's push: the model difference ``w - w_round`` since the round's start."""
    w, r = _float(weight, weight_round)
    _same_shape(["weight", "weight_round"], [w, r])
    return w - r


def esync_global_update(
    weight_round: ArrayLike, deltas: Sequence[ArrayLike], global_lr: float = 1.0
) -> np.ndarray:
    """ESync's aggregation: ``w_round + global_lr * mean_k(delta_k)``."""
    return esync_update_from_sum(weight_round, sum_arrays(deltas), len(deltas), global_lr)


def esync_update_from_sum(
    weight_round: ArrayLike, delta_sum: ArrayLike, num_workers: int, global_lr: float = 1.0
) -> np.ndarray:
    """ESync's aggregation from the servers' sum of deltas (what a worker pulls):
    ``w_round + global_lr * delta_sum / num_workers``."""
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    r, s = _float(weight_round, delta_sum)
    _same_shape(["weight_round", "delta_sum"], [r, s])
    return r + global_lr * (s / num_workers)
