"""Fashion-MNIST from local idx files, worker partitions, and normalised mini-batches
(docs/ESYNC.md, "The data: Fashion-MNIST from local files": the files, checks and constants)."""

from __future__ import annotations

import gzip
import operator
import os
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "DEFAULT_DATA_DIR",
    "FASHION_MNIST_MEAN",
    "FASHION_MNIST_STD",
    "batches",
    "load_fashion_mnist",
    "normalize",
    "partition",
]

#: Where Debian's ``dataset-fashion-mnist`` package installs the files.
DEFAULT_DATA_DIR = "/usr/share/datasets/fashion-mnist"

#: Mean and standard deviation of pixel/255 over the 60,000 training images.
FASHION_MNIST_MEAN = 0.2860405969887955
FASHION_MNIST_STD = 0.35302424451492254

_IMAGES_MAGIC = 0x00000803  # idx3, unsigned byte
_LABELS_MAGIC = 0x00000801  # idx1, unsigned byte
_ROWS = _COLS = 28
_NUM_CLASSES = 10
_FIX = (
    "install Debian's dataset-fashion-mnist (apt-get install dataset-fashion-mnist) "
    "or pass --data-dir DIR, a directory holding the four Fashion-MNIST idx files"
)


def _find(data_dir: Path, stem: str) -> Path:
    """The ``.gz`` file if present, else the uncompressed one, else FileNotFoundError."""
    for candidate in (data_dir / f"{stem}.gz", data_dir / stem):
        if candidate.is_file():
            return candidate
    where = "" if data_dir.is_dir() else f" (directory {data_dir} does not exist)"
    raise FileNotFoundError(
        f"Fashion-MNIST file not found: {data_dir / (stem + '.gz')} "
        f"(nor uncompressed {stem}){where}; {_FIX}"
    )


def _open(path: Path):
    with open(path, "rb") as f:
        compressed = f.read(2) == b"\x1f\x8b"
    return gzip.open(path, "rb") if compressed else open(path, "rb")


def _read_idx(path: Path, magic: int, dims: int, limit: int | None) -> tuple[int, np.ndarray]:
    """Read one idx file: returns (N in the header, first min(N, limit) records flat)."""
    kind = "images (idx3-ubyte)" if dims == 3 else "labels (idx1-ubyte)"
    header_len = 4 * (dims + 1)
    try:
        with _open(path) as f:
            header = f.read(header_len)
            if len(header) < header_len:
                raise ValueError(
                    f"{path}: truncated: header is {len(header)} bytes, an idx file of "
                    f"{kind} needs {header_len}"
                )
            fields = struct.unpack(f">{dims + 1}I", header)
            if fields[0] != magic:
                raise ValueError(
                    f"{path}: bad magic number 0x{fields[0]:08x}, expected 0x{magic:08x} for "
                    f"{kind}; the file is not a Fashion-MNIST {kind.split()[0]} file"
                )
            n = fields[1]
            if dims == 3 and (fields[2], fields[3]) != (_ROWS, _COLS):
                raise ValueError(
                    f"{path}: images are {fields[2]}x{fields[3]}, expected {_ROWS}x{_COLS}"
                )
            record = _ROWS * _COLS if dims == 3 else 1
            count = n if limit is None else min(n, limit)
            want = count * record
            data = f.read(want)
            if len(data) < want:
                raise ValueError(
                    f"{path}: truncated: header announces {n} {kind.split()[0]} "
                    f"({n * record} data bytes) but the data ends after {len(data)} bytes"
                )
            if limit is None:
                extra = len(f.read(1 << 20))
                if extra:
                    more = "at least " if extra == 1 << 20 else ""
                    raise ValueError(
                        f"{path}: {more}{extra} unexpected bytes after the {n} "
                        f"{kind.split()[0]} announced by the header"
                    )
    except EOFError as exc:
        raise ValueError(f"{path}: truncated: the gzip stream ends early ({exc})") from exc
    except (gzip.BadGzipFile, zlib.error) as exc:
        raise ValueError(f"{path}: corrupt gzip data ({exc})") from exc
    return n, np.frombuffer(bytearray(data), dtype=np.uint8)


def load_fashion_mnist(
    data_dir: str | os.PathLike[str] = DEFAULT_DATA_DIR,
    train: bool = True,
    limit: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Read the Fashion-MNIST training (``train=True``) or test split from ``data_dir``.

    Returns ``(images, labels)``: ``images`` a writable uint8 array [N, 28, 28] of raw pixels,
    ``labels`` an int64 array [N] in 0..9. ``limit`` reads only the first ``limit`` examples
    (fast, for tests and small runs); the length check then only requires that many records.

    Raises ``FileNotFoundError`` naming the missing file and the fix, and ``ValueError``
    naming the file and the problem for a wrong magic number, wrong dimensions, a truncated
    or padded file, corrupt gzip data, labels out of range, or images and labels that
    disagree on the number of examples.
    """
    if limit is not None and (not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit must be a non-negative integer or None, got {limit!r}")
    root = Path(data_dir).expanduser()
    prefix = "train" if train else "t10k"
    images_path = _find(root, f"{prefix}-images-idx3-ubyte")
    labels_path = _find(root, f"{prefix}-labels-idx1-ubyte")
    n_images, pixels = _read_idx(images_path, _IMAGES_MAGIC, 3, limit)
    n_labels, raw_labels = _read_idx(labels_path, _LABELS_MAGIC, 1, limit)
    if n_images != n_labels:
        raise ValueError(
            f"{images_path} holds {n_images} images but {labels_path} holds {n_labels} "
            "labels; the two files do not belong together"
        )
    if raw_labels.size and int(raw_labels.max()) >= _NUM_CLASSES:
        bad = int(np.argmax(raw_labels >= _NUM_CLASSES))
        raise ValueError(
            f"{labels_path}: label {int(raw_labels[bad])} at index {bad} is out of range "
            f"0..{_NUM_CLASSES - 1}"
        )
    images = pixels.reshape(-1, _ROWS, _COLS)
    return images, raw_labels.astype(np.int64)


def _as_int(value: int, name: str) -> int:
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)  # ints and NumPy integers
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def partition(
    labels: np.ndarray | torch.Tensor | list[int],
    num_workers: int,
    rank: int,
    split_by_class: bool = False,
    seed: int = 0,
) -> np.ndarray:
    """Indices (sorted, int64) of the examples that worker ``rank`` of ``num_workers`` trains on.

    Every worker gets ``len(labels) // num_workers`` examples; the shards are disjoint and
    together cover all examples but the last ``len(labels) % num_workers`` of their order.
    The result depends only on the arguments, so every worker computes the same split.
    (docs/MODULES.md, "hetps.app.data")"""
    y = labels.cpu().numpy() if isinstance(labels, torch.Tensor) else np.asarray(labels)
    if y.ndim != 1:
        raise ValueError(f"labels must be one-dimensional, got shape {y.shape}")
    num_workers, rank = _as_int(num_workers, "num_workers"), _as_int(rank, "rank")
    if num_workers < 1:
        raise ValueError(f"num_workers must be a positive integer, got {num_workers!r}")
    if not 0 <= rank < num_workers:
        raise ValueError(f"rank must be in 0..{num_workers - 1}, got {rank!r}")
    if len(y) < num_workers:
        raise ValueError(f"cannot split {len(y)} examples among {num_workers} workers")
    if split_by_class:
        order = np.argsort(y, kind="stable")
    else:
        order = np.random.default_rng(seed).permutation(len(y))
    shard = len(y) // num_workers
    return np.sort(order[rank * shard : (rank + 1) * shard]).astype(np.int64)


def normalize(images: np.ndarray | torch.Tensor) -> torch.Tensor:
    """uint8 images [N, 28, 28] to float32 [N, 1, 28, 28] standardised as the module says."""
    x = torch.as_tensor(images)
    if x.dim() == 3:
        x = x.unsqueeze(1)
    return (x.to(torch.float32) - 255.0 * FASHION_MNIST_MEAN) / (255.0 * FASHION_MNIST_STD)


def batches(
    images: np.ndarray | torch.Tensor,
    labels: np.ndarray | torch.Tensor,
    indices: np.ndarray | None = None,
    batch_size: int = 64,
    seed: int = 0,
    epoch: int = 0,
    *,
    shuffle: bool = True,
    drop_last: bool = False,
    limit: int | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield ``(x, y)`` mini-batches over ``indices`` (all examples when None) for one epoch.

    ``x`` is float32 [B, 1, 28, 28] normalised by :func:`normalize`, ``y`` int64 [B]. With
    ``shuffle`` the order is a permutation of ``indices`` drawn from
    ``numpy.random.default_rng([seed, epoch])``: the same on every call with the same
    arguments, different from epoch to epoch. The last, smaller batch is yielded unless
    ``drop_last``. ``limit`` stops after that many batches (small slices for tests).
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be non-negative or None, got {limit!r}")
    imgs = torch.as_tensor(images)
    ys = torch.as_tensor(labels).to(torch.int64)
    if imgs.shape[0] != ys.shape[0]:
        raise ValueError(f"{imgs.shape[0]} images but {ys.shape[0]} labels")
    idx = np.arange(imgs.shape[0]) if indices is None else np.asarray(indices, dtype=np.int64)
    if shuffle:
        idx = np.random.default_rng([seed, epoch]).permutation(idx)
    end = len(idx) - len(idx) % batch_size if drop_last else len(idx)
    for start in range(0, end, batch_size)[:limit]:
        sel = torch.from_numpy(np.ascontiguousarray(idx[start : start + batch_size]))
        yield normalize(imgs[sel]), ys[sel]
