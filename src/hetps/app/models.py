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

Cost on a 2-core CPU (torch 2.13, 2 threads), forward + backward of a batch of 32: lenet
2 ms, mobilenet-v1/v2 and resnet18-v1 under 0.1 s, resnet50-v1/v2 about 0.2 s, alexnet about
0.25 s, inception-v3 about 0.5 s.

Initialisation follows ESync (``init.Xavier()``: Glorot-uniform weights, zero biases,
BatchNorm weight 1 and bias 0); seed with ``torch.manual_seed`` for identical replicas.
BatchNorm uses PyTorch's momentum 0.1 (Gluon's momentum 0.9 is the same average);
Inception's BatchNorm uses eps 1e-3 as Gluon's.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

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
# Small models for fast runs


class MLP(nn.Module):
    """Two hidden layers of 256 units with ReLU: 784-256-256-classes."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(28 * 28, 256),
            nn.ReLU(inplace=True),
            nn.Linear(256, 256),
            nn.ReLU(inplace=True),
            nn.Linear(256, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [B, classes] for images [B, 1, 28, 28]."""
        return self.net(x)


class LeNet(nn.Module):
    """LeNet-5 with ReLU and max-pooling: conv 6@5x5 (pad 2), conv 16@5x5, 120-84-classes."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 6, kernel_size=5, padding=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(6, 16, kernel_size=5),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Flatten(),
        )
        self.classifier = nn.Sequential(
            nn.Linear(16 * 5 * 5, 120),
            nn.ReLU(inplace=True),
            nn.Linear(120, 84),
            nn.ReLU(inplace=True),
            nn.Linear(84, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [B, classes] for images [B, 1, 28, 28]."""
        return self.classifier(self.features(x))


# ---------------------------------------------------------------------------------------------
# AlexNet (Gluon's "one weird trick" AlexNet, strides adapted to 28x28)


class AlexNet(nn.Module):
    """AlexNet with Gluon's layer shapes; conv1 stride 1 and no last pool for 28x28 inputs."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 64, kernel_size=11, stride=1, padding=5),  # 28
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),  # 13
            nn.Conv2d(64, 192, kernel_size=5, padding=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),  # 6
            nn.Conv2d(192, 384, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(384, 256, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(256, 256, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Flatten(),
        )
        self.classifier = nn.Sequential(
            nn.Dropout(0.5),
            nn.Linear(256 * 6 * 6, 4096),
            nn.ReLU(inplace=True),
            nn.Dropout(0.5),
            nn.Linear(4096, 4096),
            nn.ReLU(inplace=True),
            nn.Linear(4096, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [B, classes] for images [B, 1, 28, 28]."""
        return self.classifier(self.features(x))


# ---------------------------------------------------------------------------------------------
# ResNet v1 / v2 (Gluon model zoo, as in ESync's symbols/resnet.py)


def _conv3x3(in_ch: int, out_ch: int, stride: int) -> nn.Conv2d:
    return nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)


def _conv1x1(in_ch: int, out_ch: int, stride: int = 1, bias: bool = False) -> nn.Conv2d:
    return nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=bias)


class BasicBlockV1(nn.Module):
    """Post-activation basic block (two 3x3 convolutions), ResNet-18/34 v1."""

    def __init__(self, in_ch: int, channels: int, stride: int, downsample: bool) -> None:
        super().__init__()
        self.body = nn.Sequential(
            _conv3x3(in_ch, channels, stride),
            nn.BatchNorm2d(channels),
            nn.ReLU(inplace=True),
            _conv3x3(channels, channels, 1),
            nn.BatchNorm2d(channels),
        )
        self.downsample = (
            nn.Sequential(_conv1x1(in_ch, channels, stride), nn.BatchNorm2d(channels))
            if downsample
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Residual block output."""
        residual = x if self.downsample is None else self.downsample(x)
        return F.relu(self.body(x) + residual)


class BottleneckV1(nn.Module):
    """Post-activation bottleneck (1x1, 3x3, 1x1), ResNet-50+ v1; stride on the first 1x1."""

    def __init__(self, in_ch: int, channels: int, stride: int, downsample: bool) -> None:
        super().__init__()
        mid = channels // 4
        self.body = nn.Sequential(
            _conv1x1(in_ch, mid, stride, bias=True),  # Gluon's default use_bias=True
            nn.BatchNorm2d(mid),
            nn.ReLU(inplace=True),
            _conv3x3(mid, mid, 1),
            nn.BatchNorm2d(mid),
            nn.ReLU(inplace=True),
            _conv1x1(mid, channels, 1, bias=True),
            nn.BatchNorm2d(channels),
        )
        self.downsample = (
            nn.Sequential(_conv1x1(in_ch, channels, stride), nn.BatchNorm2d(channels))
            if downsample
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Residual block output."""
        residual = x if self.downsample is None else self.downsample(x)
        return F.relu(self.body(x) + residual)


class BasicBlockV2(nn.Module):
    """Pre-activation basic block, ResNet-18/34 v2."""

    def __init__(self, in_ch: int, channels: int, stride: int, downsample: bool) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_ch)
        self.conv1 = _conv3x3(in_ch, channels, stride)
        self.bn2 = nn.BatchNorm2d(channels)
        self.conv2 = _conv3x3(channels, channels, 1)
        self.downsample = _conv1x1(in_ch, channels, stride) if downsample else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Residual block output."""
        residual = x
        x = F.relu(self.bn1(x))
        if self.downsample is not None:
            residual = self.downsample(x)
        x = self.conv1(x)
        x = self.conv2(F.relu(self.bn2(x)))
        return x + residual


class BottleneckV2(nn.Module):
    """Pre-activation bottleneck, ResNet-50+ v2; stride on the 3x3 convolution."""

    def __init__(self, in_ch: int, channels: int, stride: int, downsample: bool) -> None:
        super().__init__()
        mid = channels // 4
        self.bn1 = nn.BatchNorm2d(in_ch)
        self.conv1 = _conv1x1(in_ch, mid)
        self.bn2 = nn.BatchNorm2d(mid)
        self.conv2 = _conv3x3(mid, mid, stride)
        self.bn3 = nn.BatchNorm2d(mid)
        self.conv3 = _conv1x1(mid, channels)
        self.downsample = _conv1x1(in_ch, channels, stride) if downsample else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Residual block output."""
        residual = x
        x = F.relu(self.bn1(x))
        if self.downsample is not None:
            residual = self.downsample(x)
        x = self.conv1(x)
        x = self.conv2(F.relu(self.bn2(x)))
        x = self.conv3(F.relu(self.bn3(x)))
        return x + residual


_RESNET_SPEC: dict[int, tuple[str, list[int], list[int]]] = {
    18: ("basic", [2, 2, 2, 2], [64, 64, 128, 256, 512]),
    50: ("bottleneck", [3, 4, 6, 3], [64, 256, 512, 1024, 2048]),
}


def _make_stages(block: type[nn.Module], layers: list[int], channels: list[int]) -> list[nn.Module]:
    stages: list[nn.Module] = []
    in_ch = channels[0]
    for i, num in enumerate(layers):
        out_ch = channels[i + 1]
        stride = 1 if i == 0 else 2
        blocks = [block(in_ch, out_ch, stride, out_ch != in_ch)]
        blocks += [block(out_ch, out_ch, 1, False) for _ in range(num - 1)]
        stages.append(nn.Sequential(*blocks))
        in_ch = out_ch
    return stages


class ResNetV1(nn.Module):
    """ResNet v1 ("Deep Residual Learning"), Gluon layout, ImageNet stem, 1 input channel."""

    def __init__(self, depth: int, num_classes: int = 10) -> None:
        super().__init__()
        kind, layers, channels = _RESNET_SPEC[depth]
        block = BasicBlockV1 if kind == "basic" else BottleneckV1
        self.features = nn.Sequential(
            nn.Conv2d(1, channels[0], 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(channels[0]),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2, padding=1),
            *_make_stages(block, layers, channels),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.output = nn.Linear(channels[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [B, classes] for images [B, 1, 28, 28]."""
        return self.output(self.features(x))


class ResNetV2(nn.Module):
    """ResNet v2 ("Identity Mappings"), Gluon layout: input BatchNorm without affine terms."""

    def __init__(self, depth: int, num_classes: int = 10) -> None:
        super().__init__()
        kind, layers, channels = _RESNET_SPEC[depth]
        block = BasicBlockV2 if kind == "basic" else BottleneckV2
        self.features = nn.Sequential(
            nn.BatchNorm2d(1, affine=False),
            nn.Conv2d(1, channels[0], 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(channels[0]),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2, padding=1),
            *_make_stages(block, layers, channels),
            nn.BatchNorm2d(channels[-1]),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.output = nn.Linear(channels[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [B, classes] for images [B, 1, 28, 28]."""
        return self.output(self.features(x))


# ---------------------------------------------------------------------------------------------
# MobileNet v1 / v2 (Gluon model zoo, width multiplier 1.0)


def _conv_bn(
    in_ch: int,
    out_ch: int,
    kernel: int = 1,
    stride: int = 1,
    padding: int = 0,
    groups: int = 1,
    act: Callable[[], nn.Module] | None = nn.ReLU,
) -> list[nn.Module]:
    layers: list[nn.Module] = [
        nn.Conv2d(in_ch, out_ch, kernel, stride, padding, groups=groups, bias=False),
        nn.BatchNorm2d(out_ch),
    ]
    if act is not None:
        layers.append(act())
    return layers


class MobileNetV1(nn.Module):
    """MobileNet v1 (depthwise-separable convolutions), width 1.0."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        dw_channels = [32, 64] + [128] * 2 + [256] * 2 + [512] * 6 + [1024]
        channels = [64] + [128] * 2 + [256] * 2 + [512] * 6 + [1024] * 2
        strides = [1, 2] * 3 + [1] * 5 + [2, 1]
        layers = _conv_bn(1, 32, 3, 2, 1)
        for dwc, c, s in zip(dw_channels, channels, strides, strict=True):
            layers += _conv_bn(dwc, dwc, 3, s, 1, groups=dwc)
            layers += _conv_bn(dwc, c)
        self.features = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.output = nn.Linear(1024, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [B, classes] for images [B, 1, 28, 28]."""
        return self.output(self.features(x))


class InvertedResidual(nn.Module):
    """MobileNet-v2 linear bottleneck: 1x1 expand, 3x3 depthwise, 1x1 project (+ shortcut)."""

    def __init__(self, in_ch: int, channels: int, t: int, stride: int) -> None:
        super().__init__()
        self.use_shortcut = stride == 1 and in_ch == channels
        mid = in_ch * t
        self.out = nn.Sequential(
            *_conv_bn(in_ch, mid, act=nn.ReLU6),
            *_conv_bn(mid, mid, 3, stride, 1, groups=mid, act=nn.ReLU6),
            *_conv_bn(mid, channels, act=None),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Block output."""
        out = self.out(x)
        return out + x if self.use_shortcut else out


class MobileNetV2(nn.Module):
    """MobileNet v2, width 1.0; the classifier is a bias-free 1x1 convolution as in Gluon."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        in_group = [32, 16, 24, 24, 32, 32, 32, 64, 64, 64, 64, 96, 96, 96, 160, 160, 160]
        out_group = [16, 24, 24, 32, 32, 32, 64, 64, 64, 64, 96, 96, 96, 160, 160, 160, 320]
        ts = [1] + [6] * 16
        strides = [1, 2] * 2 + [1] * 2 + [2] + [1] * 3 + [1] * 3 + [2] + [1] * 3
        blocks = [
            InvertedResidual(i, c, t, s)
            for i, c, t, s in zip(in_group, out_group, ts, strides, strict=True)
        ]
        self.features = nn.Sequential(
            *_conv_bn(1, 32, 3, 2, 1, act=nn.ReLU6),
            *blocks,
            *_conv_bn(320, 1280, act=nn.ReLU6),
            nn.AdaptiveAvgPool2d(1),
        )
        self.output = nn.Sequential(nn.Conv2d(1280, num_classes, 1, bias=False), nn.Flatten())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [B, classes] for images [B, 1, 28, 28]."""
        return self.output(self.features(x))


# ---------------------------------------------------------------------------------------------
# Inception v3 (Gluon's Inception3 without aux logits; stem adapted to 28x28)


class BasicConv(nn.Sequential):
    """Convolution without bias, BatchNorm (eps 1e-3), ReLU."""

    def __init__(
        self,
        in_ch: int,
        out_ch: int,
        kernel: int | tuple[int, int],
        stride: int = 1,
        padding: int | tuple[int, int] = 0,
    ) -> None:
        super().__init__(
            nn.Conv2d(in_ch, out_ch, kernel, stride=stride, padding=padding, bias=False),
            nn.BatchNorm2d(out_ch, eps=1e-3),
            nn.ReLU(inplace=True),
        )


class Concat(nn.Module):
    """Runs each branch on the same input and concatenates the outputs on channels."""

    def __init__(self, *branches: nn.Module) -> None:
        super().__init__()
        self.branches = nn.ModuleList(branches)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Channel-wise concatenation of the branches' outputs."""
        return torch.cat([b(x) for b in self.branches], dim=1)


def _avg_pool_branch(in_ch: int, out_ch: int) -> nn.Sequential:
    return nn.Sequential(nn.AvgPool2d(3, stride=1, padding=1), BasicConv(in_ch, out_ch, 1))


def _inception_a(in_ch: int, pool_features: int) -> Concat:  # out 224 + pool_features
    return Concat(
        BasicConv(in_ch, 64, 1),
        nn.Sequential(BasicConv(in_ch, 48, 1), BasicConv(48, 64, 5, padding=2)),
        nn.Sequential(
            BasicConv(in_ch, 64, 1),
            BasicConv(64, 96, 3, padding=1),
            BasicConv(96, 96, 3, padding=1),
        ),
        _avg_pool_branch(in_ch, pool_features),
    )


def _inception_b(in_ch: int) -> Concat:  # out 384 + 96 + in_ch
    return Concat(
        BasicConv(in_ch, 384, 3, stride=2),
        nn.Sequential(
            BasicConv(in_ch, 64, 1), BasicConv(64, 96, 3, padding=1), BasicConv(96, 96, 3, stride=2)
        ),
        nn.MaxPool2d(3, stride=2),
    )


def _inception_c(in_ch: int, c7: int) -> Concat:  # out 768
    return Concat(
        BasicConv(in_ch, 192, 1),
        nn.Sequential(
            BasicConv(in_ch, c7, 1),
            BasicConv(c7, c7, (1, 7), padding=(0, 3)),
            BasicConv(c7, 192, (7, 1), padding=(3, 0)),
        ),
        nn.Sequential(
            BasicConv(in_ch, c7, 1),
            BasicConv(c7, c7, (7, 1), padding=(3, 0)),
            BasicConv(c7, c7, (1, 7), padding=(0, 3)),
            BasicConv(c7, c7, (7, 1), padding=(3, 0)),
            BasicConv(c7, 192, (1, 7), padding=(0, 3)),
        ),
        _avg_pool_branch(in_ch, 192),
    )


def _inception_d(in_ch: int) -> Concat:  # out 320 + 192 + in_ch
    return Concat(
        nn.Sequential(BasicConv(in_ch, 192, 1), BasicConv(192, 320, 3, stride=2)),
        nn.Sequential(
            BasicConv(in_ch, 192, 1),
            BasicConv(192, 192, (1, 7), padding=(0, 3)),
            BasicConv(192, 192, (7, 1), padding=(3, 0)),
            BasicConv(192, 192, 3, stride=2),
        ),
        nn.MaxPool2d(3, stride=2),
    )


def _inception_e(in_ch: int) -> Concat:  # out 320 + 768 + 768 + 192 = 2048
    return Concat(
        BasicConv(in_ch, 320, 1),
        nn.Sequential(
            BasicConv(in_ch, 384, 1),
            Concat(
                BasicConv(384, 384, (1, 3), padding=(0, 1)),
                BasicConv(384, 384, (3, 1), padding=(1, 0)),
            ),
        ),
        nn.Sequential(
            BasicConv(in_ch, 448, 1),
            BasicConv(448, 384, 3, padding=1),
            Concat(
                BasicConv(384, 384, (1, 3), padding=(0, 1)),
                BasicConv(384, 384, (3, 1), padding=(1, 0)),
            ),
        ),
        _avg_pool_branch(in_ch, 192),
    )


class InceptionV3(nn.Module):
    """Inception v3 with Gluon's layer shapes; stem adapted so 28x28 ends at 2x2 (8x8 orig.)."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            BasicConv(1, 32, 3, stride=1),  # 26   (stride 2 in the original)
            BasicConv(32, 32, 3),  # 24
            BasicConv(32, 64, 3, padding=1),  # 24
            nn.MaxPool2d(3, stride=2),  # 11
            BasicConv(64, 80, 1),  # 11
            BasicConv(80, 192, 3, padding=1),  # 11   (unpadded + 3x3/2 max-pool in the original)
            _inception_a(192, 32),  # 256 @ 11x11
            _inception_a(256, 64),  # 288
            _inception_a(288, 64),  # 288
            _inception_b(288),  # 768 @ 5x5
            _inception_c(768, 128),
            _inception_c(768, 160),
            _inception_c(768, 160),
            _inception_c(768, 192),
            _inception_d(768),  # 1280 @ 2x2
            _inception_e(1280),  # 2048
            _inception_e(2048),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Dropout(0.5),
        )
        self.output = nn.Linear(2048, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [B, classes] for images [B, 1, 28, 28]."""
        return self.output(self.features(x))


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
