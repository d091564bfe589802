"""The server-side optimizer contract. (docs/MODULES.md, "hetps.optim.base")"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any

import numpy as np

__all__ = ["Key", "Optimizer", "compute_dtype"]

#: The type of a key as the server hands it to an optimizer (an int, a str, a tuple...).
Key = Hashable

#: Extra keyword arguments MXNet's ``Optimizer`` accepts that have no effect on a server-side
#: NumPy optimizer; accepted (and ignored) so that MXNet-style construction code keeps working.
_IGNORED_MXNET_KWARGS = frozenset(
    {"param_idx2name", "param_dict", "sym", "begin_num_update", "multi_precision"}
)

_FLOAT_DTYPES = (np.float16, np.float32, np.float64)


def check_number(name: str, value: Any, *, minimum: float | None = None) -> float:
    """Return ``value`` as a float, raising a ValueError/TypeError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return value


def compute_dtype(weight: np.ndarray) -> np.dtype:
    """The dtype optimizers compute in for ``weight``: float32 for float16 weights, else its own.

    Raises:
        TypeError: ``weight`` is not a float16/32/64 NumPy array.
    """
    if not isinstance(weight, np.ndarray):
        raise TypeError(
            f"optimizers update NumPy arrays in place; got a {type(weight).__name__} weight"
        )
    if weight.dtype.type not in _FLOAT_DTYPES:
        raise TypeError(
            f"optimizers update float16, float32 or float64 weights; got dtype {weight.dtype}"
        )
    return np.dtype(np.float32) if weight.dtype == np.float16 else weight.dtype


def device_step_of(optimizer: Any) -> Any:
    """``optimizer``'s device step, or None. A class may define
    ``device_step(torch, weight, grad, state, scratch)``: its update on torch tensors, which a
    server with ``HETPS_SERVER_DEVICE`` runs on its device (:mod:`hetps.device.aggregator`).
    Only the class's own counts: a subclass may change any method, so it steps on the host."""
    klass = optimizer if isinstance(optimizer, type) else type(optimizer)
    return getattr(optimizer, "device_step", None) if "device_step" in vars(klass) else None


class Optimizer:
    """Base class of every server-side optimizer.

    Subclasses implement :meth:`create_state` and :meth:`update`; ``update`` must change the
    ``weight`` NumPy array in place and keep its dtype. A subclass may be defined in the user's
    own training script: optimizers travel to the servers by value (see
    :func:`hetps.optim.dumps`).

    Args:
        learning_rate: step size.
        rescale_grad: every gradient is multiplied by this first (typically ``1/batch_size``);
            an attribute that may be changed after construction.
        wd: weight decay (L2 penalty coefficient).
        clip_gradient: if not ``None`` and ``> 0``, the rescaled gradient is clipped to
            ``[-clip_gradient, clip_gradient]``; otherwise no clipping (as in MXNet).
        lazy_update: on row-sparse keys (embedding tables), True (the default) runs the
            rule only on the rows a round touched; False runs it on every row of the table
            each round, the untouched ones with a zero gradient (their momentum, moments
            and weight decay move), as MXNet's ``lazy_update=False`` does. Dense keys are
            updated whole either way.
        **kwargs: MXNet ``Optimizer`` arguments that have no meaning here (``param_idx2name``,
            ``param_dict``, ``sym``, ``begin_num_update``, ``multi_precision``) are accepted
            and ignored; anything else is a TypeError, so a misspelt hyper-parameter never
            passes silently.
    """

    def __init__(
        self,
        learning_rate: float = 0.01,
        rescale_grad: float = 1.0,
        wd: float = 0.0,
        clip_gradient: float | None = None,
        lazy_update: bool = True,
        **kwargs: Any,
    ) -> None:
        if not isinstance(lazy_update, (bool, np.bool_)):
            raise TypeError(f"lazy_update must be True or False, got {lazy_update!r}")
        self.lazy_update = bool(lazy_update)
        unknown = sorted(set(kwargs) - _IGNORED_MXNET_KWARGS)
        if unknown:
            if "lr_scheduler" in unknown:
                raise TypeError(
                    f"{type(self).__name__}: lr_scheduler is not supported by hetps' "
                    "server-side optimizers; set the optimizer's learning_rate attribute instead"
                )
            raise TypeError(
                f"{type(self).__name__} got unexpected keyword argument(s) {unknown}; "
                "the common ones are learning_rate, rescale_grad, wd and clip_gradient"
            )
        self.learning_rate = check_number("learning_rate", learning_rate)
        self.rescale_grad = check_number("rescale_grad", rescale_grad)
        self.wd = check_number("wd", wd)
        self.clip_gradient = (
            None if clip_gradient is None else check_number("clip_gradient", clip_gradient)
        )

    # ----------------------------------------------------------------- the contract
    def create_state(self, key: Key, weight: np.ndarray) -> Any:
        """Create the optimizer state for ``key``, whose current weight is ``weight``.

        Called once per key by the server before the first update. The returned object is
        passed back to :meth:`update`; it must be picklable (dicts of NumPy arrays and
        numbers are ideal) so that servers can save and load optimizer states.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement create_state()")

    def update(self, key: Key, weight: np.ndarray, grad: np.ndarray, state: Any) -> None:
        """Apply ``grad`` to ``weight`` in place, using and updating ``state``."""
        raise NotImplementedError(f"{type(self).__name__} must implement update()")

    # ------------------------------------------------------------ server-facing hooks
    def apply_update(
        self, key: Key, weight: np.ndarray, grad: np.ndarray, state: Any, sender: int
    ) -> None:
        """Apply a gradient pushed by worker ``sender``; by default just :meth:`update`.

        Override it for rules that depend on which worker pushed (DC-ASGD).
        """
        self.update(key, weight, grad, state)

    def on_pull(self, key: Key, weight: np.ndarray, state: Any, sender: int) -> None:
        """Hook called when worker ``sender`` pulls ``key`` (after any pending update).

        ``weight`` is the value the worker receives. The default does nothing.
        """

    # ------------------------------------------------------------------- helpers
    def preprocess_grad(self, grad: np.ndarray, dtype: np.dtype | None = None) -> np.ndarray:
        """Return a new array ``clip(rescale_grad * grad)`` in ``dtype``.

        ``dtype`` defaults to the gradient's float dtype, with float16 (and non-float input)
        promoted to float32. Clipping to ``[-clip_gradient, clip_gradient]`` happens only when
        ``clip_gradient`` is not ``None`` and ``> 0``. The input is never modified.
        """
        grad = np.asarray(grad)
        if dtype is None:
            dtype = grad.dtype if grad.dtype.type in (np.float32, np.float64) else np.float32
        out = np.multiply(grad, self.rescale_grad, dtype=dtype)
        clip = self.clip_gradient
        if clip is not None and clip > 0:
            np.clip(out, -clip, clip, out=out)
        return out

    @staticmethod
    def _check_grad(weight: np.ndarray, grad: Any) -> np.ndarray:
        """Return ``grad`` as an array shaped like ``weight``; ValueError if sizes differ."""
        grad = np.asarray(grad)
        if grad.shape != weight.shape:
            if grad.size != weight.size:
                raise ValueError(
                    f"gradient of shape {grad.shape} does not match weight of shape {weight.shape}"
                )
            grad = grad.reshape(weight.shape)
        return grad

    def scratch_buffers(self) -> int:
        """Scratch buffers (of the compute dtype, as long as the weight) a step needs: the
        host step's kernels and a device step (``device_step``) get this many."""
        return 2

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({params})"
