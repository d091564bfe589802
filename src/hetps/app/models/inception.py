"""Inception v3 (Gluon's Inception3 without the auxiliary logits; its stem adapted to 28x28:
:mod:`hetps.app.models` says how)."""

from __future__ import annotations

import torch
from torch import nn


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
