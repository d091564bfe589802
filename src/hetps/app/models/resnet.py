"""ResNet v1 / v2 (the Gluon model zoo's, as in ESync's symbols/resnet.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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
