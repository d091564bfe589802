"""Models for 1x28x28 inputs (Fashion-MNIST) and 10 classes, without torchvision.

The names are the ones ESync (github Lizonghang/ESync, ``main.py -n``) uses -- ``alexnet``,
``resnet18-v1``, ``resnet50-v1``, ``resnet50-v2``, ``mobilenet-v1``, ``mobilenet-v2``,
``inception-v3`` -- plus ``mlp`` and ``lenet`` for fast runs. ``get_model(name)`` builds one,
``model_names()`` lists them, ``param_shapes(name)`` gives the shapes of the trainable
parameters (in the model's stable registration order) without allocating any weights, so a
benchmark can emulate a model's push/pull traffic without running it.

How the models are adapted to 28x28
-----------------------------------
ESync trains MXNet Gluon model-zoo networks on Fashion-MNIST. It feeds the ResNets and the
MobileNets the native 28x28 images and resizes the images to 224x224 for AlexNet and to
299x299 for Inception-v3. Here:

* ``resnet*`` and ``mobilenet*`` are the Gluon model-zoo architectures unchanged (ImageNet stem:
  7x7/2 convolution + 3x3/2 max-pool for ResNet, 3x3/2 convolution for MobileNet) with one input
  channel, run at 28x28 exactly as ESync runs them; the feature maps shrink to 1x1 before the
  global average pool. Layer shapes follow Gluon, including the biases of the 1x1 convolutions in
  Gluon's ``BottleneckV1`` and the bias-free 1x1 convolution that is MobileNet-v2's classifier.
* ``alexnet`` and ``inception-v3`` are **not** resized (224x224 / 299x299 would make a step tens
  of times slower on a CPU); instead their early strides and pools are adapted so that the same
  layers run on 28x28 inputs. Every parameter tensor keeps the shape it has in the Gluon model
  (1 input channel, 10 classes), so the parameter count and the push/pull traffic per step are
  those of ESync's runs; only the compute per sample is smaller.

  - AlexNet: conv1 11x11 with stride 1 and padding 5 instead of stride 4 and padding 2, and no
    max-pool after conv5, so 28 -> 28 -> pool 13 -> 13 -> pool 6 -> 6: the classifier still
    sees 256x6x6 = 9216 features (4096-4096-10, dropout 0.5, as Gluon's).
  - Inception-v3: stem convolution 1 has stride 1 instead of 2, the 3x3 convolution to 192
    channels is padded and the max-pool after it is dropped: 28 -> 26 -> 24 -> 24 -> pool 11
    -> 11 -> 11, so the Inception-A blocks run at 11x11 (35x35 in the original), B reduces to
    5x5 (17x17) for the Inception-C blocks, D reduces to 2x2 (8x8) for the Inception-E blocks,
    and the final 8x8 average pool becomes a global average pool. No auxiliary classifier (as
    Gluon's ``Inception3``).

Initialisation follows ESync (``init.Xavier()``: Glorot-uniform weights, zero biases,
BatchNorm weight 1 and bias 0); seed with ``torch.manual_seed`` for identical replicas.
BatchNorm uses PyTorch's momentum 0.1 (Gluon's momentum 0.9 is the same average);
Inception's BatchNorm uses eps 1e-3 as Gluon's.
"""

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
    "INPUT_SHAPE",
    "count_parameters",
    "get_model",
    "model_names",
    "param_shapes",
]

#: The input every model expects, per sample: one channel, 28x28 pixels.
INPUT_SHAPE: tuple[int, int, int] = (1, 28, 28)


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
