"""Models for 1x28x28 inputs (Fashion-MNIST) and 10 classes, without torchvision."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch
from torch import nn

from hetps.app.models.inception import InceptionV3
from hetps.app.models.mobilenet import MobileNetV1, MobileNetV2
from hetps.app.models.resnet import ResNetV1, ResNetV2
from hetps.app.models.small import MLP, AlexNet, LeNet

__all__ = [
    "count_parameters",
    "get_model",
    "model_names",
    "param_shapes",
]

# ---------------------------------------------------------------------------------------------
# Registry and helpers

_BUILDERS: dict[str, Callable[[int], nn.Module]] = {
    "mlp": MLP,
    "lenet": LeNet,
    "alexnet": AlexNet,
    "resnet18-v1": lambda n: ResNetV1(18, n),
    "resnet50-v1": lambda n: ResNetV1(50, n),
    "resnet50-v2": lambda n: ResNetV2(50, n),
    "mobilenet-v1": MobileNetV1,
    "mobilenet-v2": MobileNetV2,
    "inception-v3": InceptionV3,
}


def model_names() -> list[str]:
    """Names accepted by :func:`get_model`, fast models first."""
    return list(_BUILDERS)


def _canonical(name: str) -> str:
    key = name.strip().lower().replace("_", "-")
    if key not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(_BUILDERS)}")
    return key


def _init_weights(model: nn.Module) -> None:
    """ESync's ``init.Xavier()``: Glorot-uniform weights, zero biases, BatchNorm 1/0."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d | nn.Linear):
            nn.init.xavier_uniform_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.BatchNorm2d) and m.affine:
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


def get_model(name: str, num_classes: int = 10) -> nn.Module:
    """Build the model called ``name`` for [B, 1, 28, 28] inputs and ``num_classes`` outputs.

    Names are case-insensitive and ``_`` may stand for ``-``. Weights are drawn from torch's
    global generator, so ``torch.manual_seed(s)`` before the call gives identical replicas.
    Raises ``ValueError`` listing the valid names for an unknown one.
    """
    key = _canonical(name)
    if not isinstance(num_classes, int) or num_classes < 1:
        raise ValueError(f"num_classes must be a positive integer, got {num_classes!r}")
    model = _BUILDERS[key](num_classes)
    _init_weights(model)
    return model


def count_parameters(model: nn.Module, trainable_only: bool = True) -> int:
    """Number of scalar parameters (trainable ones only by default; buffers never count)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


@cache
def _param_shapes(key: str, num_classes: int) -> tuple[tuple[int, ...], ...]:
    with torch.device("meta"):  # shapes only: no memory, no initialisation cost
        model = _BUILDERS[key](num_classes)
    return tuple(tuple(p.shape) for p in model.parameters() if p.requires_grad)


def param_shapes(name: str, num_classes: int = 10) -> list[tuple[int, ...]]:
    """Shapes of the trainable parameters of ``name``, in ``model.parameters()`` order.

    The order is the model's registration order, identical on every process, so it can key
    the parameters on a parameter server. Computed on the meta device (no weights allocated).
    """
    return list(_param_shapes(_canonical(name), num_classes))
