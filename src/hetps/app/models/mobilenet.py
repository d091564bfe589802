"""MobileNet v1 / v2 (the Gluon model zoo's, width multiplier 1.0)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


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
