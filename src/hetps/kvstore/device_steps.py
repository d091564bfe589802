"""The built-in SGD and Adam steps on torch tensors, for a server that updates on a device
(``HETPS_SERVER_DEVICE``, :mod:`hetps.kvstore.ondevice`).

Each step is :mod:`hetps.optim`'s chain of element-wise operations, one torch operation for
each NumPy one, in the same order and the same dtypes (float16 weights computed in float32),
and every scalar rounded to the compute dtype before torch sees it, as NumPy rounds it. Adds,
multiplies and clips are correctly rounded in IEEE arithmetic on the CPU and on CUDA, so SGD
gives the NumPy optimizer's weights bit for bit. Adam's agree within float rounding: its
square root is not correctly rounded in every torch kernel (torch's vectorised CPU one differs
from NumPy's in the last bit for some values).

Only the exact classes :class:`~hetps.optim.SGD` and :class:`~hetps.optim.Adam` run here: a
subclass may change any method, so it runs on the host like every other optimizer.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from hetps.optim import SGD, Adam

#: NumPy dtype -> torch dtype name, for the values a device server holds on the device
FLOATS = {np.dtype("<f2"): "float16", np.dtype("<f4"): "float32", np.dtype("<f8"): "float64"}


def supported(optimizer: Any) -> bool:
    """Whether ``optimizer`` has a device step here (the exact SGD and Adam classes)."""
    return type(optimizer) in (SGD, Adam)


def compute_dtype(torch: Any, weight: Any) -> Any:
    """float32 for a float16 weight, else the weight's dtype (as optim.base.compute_dtype)."""
    return torch.float32 if weight.dtype == torch.float16 else weight.dtype


def scratch_count(optimizer: Any) -> int:
    """Scratch buffers (of the compute dtype, as long as the weight) a step needs."""
    if type(optimizer) is SGD and optimizer.wd == 0.0:
        return 1
    return 2


def step(torch: Any, optimizer: Any, w: Any, grad: Any, state: Any, scratch: list) -> None:
    """One step of ``optimizer`` (SGD or Adam) on the device tensor ``w`` in place, with the
    device tensor ``grad`` and the device state ``state`` (as :func:`state_to_device` made)."""
    if type(optimizer) is SGD:
        _sgd(torch, optimizer, w, grad, state, scratch)
    else:
        _adam(torch, optimizer, w, grad, state, scratch)


def _rounder(torch: Any, dtype: Any):
    """A scalar as NumPy rounds it to the compute dtype (a Python float torch casts exactly)."""
    np_type = {torch.float32: np.float32, torch.float64: np.float64}[dtype]
    return lambda x: float(np_type(x))


def _rescaled(grad: Any, rescale: float, clip: float | None, dtype: Any, out: Any, c) -> Any:
    """kernels.rescaled: ``clip(rescale * grad)`` in ``dtype`` into ``out``, or ``grad``."""
    if rescale == 1.0 and grad.dtype == dtype and clip is None:
        return grad
    out.copy_(grad)  # (a float16 gradient widened exactly, as NumPy's dtype= casts it)
    out.mul_(c(rescale))
    if clip is not None:
        out.clamp_(c(-clip), c(clip))
    return out


def _sgd(torch: Any, opt: SGD, w: Any, gr: Any, state: Any, scratch: list) -> None:
    dtype = compute_dtype(torch, w)
    c = _rounder(torch, dtype)
    mom = None
    if opt.momentum != 0.0:
        if state is None:
            raise ValueError(
                f"SGD(momentum={opt.momentum}) needs the state from create_state(); got None"
            )
        mom = state["mom"]
    clip = opt.clip_gradient if opt.clip_gradient is not None and opt.clip_gradient > 0 else None
    g = scratch[0]
    src = _rescaled(gr, opt.rescale_grad, clip, dtype, g, c)
    if opt.wd != 0.0:
        t = scratch[1]
        t.copy_(w)
        t.mul_(c(opt.wd))
        torch.add(src, t, out=g)
        src = g
    if mom is None:
        torch.mul(src, c(-opt.learning_rate), out=g)
        w.add_(g)
        return
    mom.mul_(c(opt.momentum))
    torch.mul(src, c(opt.learning_rate), out=g)
    mom.sub_(g)
    w.add_(mom)


def _adam(torch: Any, opt: Adam, w: Any, gr: Any, state: dict, scratch: list) -> None:
    dtype = compute_dtype(torch, w)
    c = _rounder(torch, dtype)
    state["t"] += 1
    t_ = state["t"]
    lr_t = opt.learning_rate * math.sqrt(1.0 - opt.beta2**t_) / (1.0 - opt.beta1**t_)
    clip = opt.clip_gradient if opt.clip_gradient is not None and opt.clip_gradient > 0 else None
    mean, var = state["mean"], state["var"]
    g, t = scratch
    src = _rescaled(gr, opt.rescale_grad, None, dtype, g, c)
    if opt.wd != 0.0:
        t.copy_(w)
        t.mul_(c(opt.wd))
        torch.add(src, t, out=g)
        src = g
    if clip is not None:
        torch.clamp(src, c(-clip), c(clip), out=g)
        src = g
    mean.mul_(c(opt.beta1))
    torch.mul(src, c(1.0 - opt.beta1), out=t)
    mean.add_(t)
    torch.mul(src, src, out=g)
    var.mul_(c(opt.beta2))
    torch.mul(g, c(1.0 - opt.beta2), out=t)
    var.add_(t)
    torch.sqrt(var, out=g)
    g.add_(c(opt.epsilon))
    torch.div(mean, g, out=g)
    g.mul_(c(-lr_t))
    w.add_(g)


def state_to_device(state: Any, upload) -> Any:
    """A host optimizer state (None, or a dict of arrays and numbers) with each array made a
    device tensor by ``upload(array)``; numbers (Adam's ``t``) kept."""
    if state is None:
        return None
    if not isinstance(state, dict):
        raise TypeError(f"a device step takes a dict state, got {type(state).__name__}")
    return {k: upload(v) if isinstance(v, np.ndarray) else v for k, v in state.items()}


def state_to_host(state: Any) -> Any:
    """The device state as the host optimizer keeps it: NumPy arrays, numbers kept (what
    get_states pickles, so a checkpoint reads the same from a CPU or a device server)."""
    if state is None:
        return None
    return {
        k: v.to("cpu", copy=True).numpy() if hasattr(v, "numpy") else v for k, v in state.items()
    }
