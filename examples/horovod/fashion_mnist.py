"""Fashion-MNIST as a torch Dataset, from Debian's files (no torchvision, no download).

The Horovod examples here read it in place of torchvision's MNIST: the same 28x28 grey
images and ten classes. ``apt-get install dataset-fashion-mnist`` (scripts/setup.sh) puts the
files in /usr/share/datasets/fashion-mnist.
"""

from __future__ import annotations

import torch

from hetps.app.data import DEFAULT_DATA_DIR, load_fashion_mnist, normalize


class FashionMNIST(torch.utils.data.Dataset):
    """The training (``train=True``) or test split: (image [1, 28, 28] standardised, label)."""

    def __init__(self, data_dir: str | None = None, train: bool = True, limit: int | None = None):
        images, labels = load_fashion_mnist(data_dir or DEFAULT_DATA_DIR, train, limit)
        self.images = normalize(images)
        self.labels = torch.from_numpy(labels)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[i], self.labels[i]
