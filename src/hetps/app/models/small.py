"""The small models, for fast runs (an MLP, LeNet-5), and AlexNet (Gluon's "one weird trick"
AlexNet, strides adapted to 28x28: :mod:`hetps.app.models` says how)."""

from __future__ import annotations

import torch
from torch import nn


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
