"""ResNet v1 / v2 (the Gluon model zoo's, as in ESync's symbols/resnet.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _conv3x3(in_ch: int, out_ch: int, stride: int) -> nn.Conv2d:
    return nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)


def _conv1x1(in_ch: int, out_ch: int, stride: int = 1, bias: bool = False) -> nn.Conv2d:
    return nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=bias)


class BlockV1(nn.Module):
    """Post-activation block, ResNet v1: basic (two 3x3 convolutions, ResNet-18/34) or
    bottleneck (1x1, 3x3, 1x1 with Gluon's default bias on the 1x1s and the stride on the
    first, ResNet-50+)."""

    def __init__(
        self, in_ch: int, channels: int, stride: int, downsample: bool, bottleneck: bool
    ) -> None:
        super().__init__()
        mid = channels // 4
        relu = nn.ReLU(inplace=True)
        if bottleneck:
            convs = [_conv1x1(in_ch, mid, stride, True), nn.BatchNorm2d(mid), relu]
            convs += [_conv3x3(mid, mid, 1), nn.BatchNorm2d(mid), relu]
            convs += [_conv1x1(mid, channels, 1, True)]
        else:
            convs = [_conv3x3(in_ch, channels, stride), nn.BatchNorm2d(channels), relu]
            convs += [_conv3x3(channels, channels, 1)]
        self.body = nn.Sequential(*convs, nn.BatchNorm2d(channels))
        self.downsample = (
            nn.Sequential(_conv1x1(in_ch, channels, stride), nn.BatchNorm2d(channels))
            if downsample
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Residual block output."""
        residual = x if self.downsample is None else self.downsample(x)
        return F.relu(self.body(x) + residual)


class BlockV2(nn.Module):
    """Pre-activation block, ResNet v2: basic (ResNet-18/34) or bottleneck (ResNet-50+, the
    stride on the 3x3 convolution)."""

    def __init__(
        self, in_ch: int, channels: int, stride: int, downsample: bool, bottleneck: bool
    ) -> None:
        super().__init__()
        mid = channels // 4 if bottleneck else channels
        self.bn1 = nn.BatchNorm2d(in_ch)
        if bottleneck:
            self.conv1 = _conv1x1(in_ch, mid)
            self.bn2 = nn.BatchNorm2d(mid)
            self.conv2 = _conv3x3(mid, mid, stride)
            self.bn3 = nn.BatchNorm2d(mid)
            self.conv3 = _conv1x1(mid, channels)
        else:
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
        x = self.conv2(F.relu(self.bn2(self.conv1(x))))
        if hasattr(self, "conv3"):
            x = self.conv3(F.relu(self.bn3(x)))
        return x + residual


_RESNET_SPEC: dict[int, tuple[bool, list[int], list[int]]] = {
    18: (False, [2, 2, 2, 2], [64, 64, 128, 256, 512]),
    50: (True, [3, 4, 6, 3], [64, 256, 512, 1024, 2048]),
}


def _stages(block: type[nn.Module], depth: int) -> list[nn.Module]:
    bottleneck, layers, channels = _RESNET_SPEC[depth]
    stages: list[nn.Module] = []
    in_ch = channels[0]
    for i, num in enumerate(layers):
        out_ch = channels[i + 1]
        blocks = [block(in_ch, out_ch, 1 if i == 0 else 2, out_ch != in_ch, bottleneck)]
        blocks += [block(out_ch, out_ch, 1, False, bottleneck) for _ in range(num - 1)]
        stages.append(nn.Sequential(*blocks))
        in_ch = out_ch
    return stages


def _stem(out_ch: int) -> list[nn.Module]:
    """The ImageNet stem on 1 input channel: 7x7/2 convolution, BatchNorm, ReLU, 3x3/2 pool."""
    return [
        nn.Conv2d(1, out_ch, 7, stride=2, padding=3, bias=False),
        nn.BatchNorm2d(out_ch),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, stride=2, padding=1),
    ]


class ResNetV1(nn.Module):
    """ResNet v1 ("Deep Residual Learning"), Gluon layout, ImageNet stem, 1 input channel."""

    def __init__(self, depth: int, num_classes: int = 10) -> None:
        super().__init__()
        channels = _RESNET_SPEC[depth][2]
        self.features = nn.Sequential(
            *_stem(channels[0]),
            *_stages(BlockV1, depth),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.output = nn.Linear(channels[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [B, classes] for images [B, 1, 28, 28]."""
        return self.output(self.features(x))


class ResNetV2(ResNetV1):
    """ResNet v2 ("Identity Mappings"), Gluon layout: input BatchNorm without affine terms."""

    def __init__(self, depth: int, num_classes: int = 10) -> None:
        nn.Module.__init__(self)
        channels = _RESNET_SPEC[depth][2]
        self.features = nn.Sequential(
            nn.BatchNorm2d(1, affine=False),
            *_stem(channels[0]),
            *_stages(BlockV2, depth),
            nn.BatchNorm2d(channels[-1]),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.output = nn.Linear(channels[-1], num_classes)
