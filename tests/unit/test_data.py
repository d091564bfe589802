"""Fashion-MNIST reader (real files and broken copies), partitions and mini-batches."""

from __future__ import annotations

import gzip
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from hetps.app.data import (  # noqa: E402
    DEFAULT_DATA_DIR,
    FASHION_MNIST_MEAN,
    FASHION_MNIST_STD,
    batches,
    load_fashion_mnist,
    normalize,
    partition,
)

pytestmark = pytest.mark.torch

REAL = Path(DEFAULT_DATA_DIR)
needs_real = pytest.mark.skipif(
    not (REAL / "t10k-images-idx3-ubyte.gz").is_file(),
    reason=f"real Fashion-MNIST not installed at {REAL} (apt-get install dataset-fashion-mnist)",
)
FILES = {
    "img": "t10k-images-idx3-ubyte",
    "lbl": "t10k-labels-idx1-ubyte",
}


def write_idx(
    directory: Path,
    images: np.ndarray,
    labels: np.ndarray,
    *,
    prefix: str = "t10k",
    compress: bool = True,
) -> tuple[Path, Path]:
    """Write a well-formed idx pair (images uint8 [N, 28, 28], labels uint8 [N])."""
    n, rows, cols = images.shape
    img = struct.pack(">4I", 0x803, n, rows, cols) + images.astype(np.uint8).tobytes()
    lbl = struct.pack(">2I", 0x801, len(labels)) + labels.astype(np.uint8).tobytes()
    paths = []
    for stem, data in ((f"{prefix}-images-idx3-ubyte", img), (f"{prefix}-labels-idx1-ubyte", lbl)):
        path = directory / (stem + (".gz" if compress else ""))
        path.write_bytes(gzip.compress(data) if compress else data)
        paths.append(path)
    return paths[0], paths[1]


def small_set(n: int = 12, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 28, 28), dtype=np.uint8), rng.integers(0, 10, n, np.uint8)


# ---------------------------------------------------------------------------------------------
# The real files


@pytest.fixture(scope="module")
def real_test():
    if not (REAL / "t10k-images-idx3-ubyte.gz").is_file():
        pytest.skip(f"real Fashion-MNIST not installed at {REAL}")
    return load_fashion_mnist(train=False)


@needs_real
def test_real_train_split():
    images, labels = load_fashion_mnist(REAL, train=True)
    assert images.shape == (60000, 28, 28) and images.dtype == np.uint8
    assert labels.shape == (60000,) and labels.dtype == np.int64
    assert labels[:10].tolist() == [9, 0, 0, 3, 0, 2, 7, 2, 5, 5]
    assert np.bincount(labels).tolist() == [6000] * 10
    x = images.astype(np.float64) / 255.0
    assert x.mean() == pytest.approx(FASHION_MNIST_MEAN, abs=1e-9)
    assert x.std() == pytest.approx(FASHION_MNIST_STD, abs=1e-9)
    # class split on the real labels: 2 workers get 0-4 and 5-9, exactly
    assert set(labels[partition(labels, 2, 0, split_by_class=True)]) == {0, 1, 2, 3, 4}
    assert set(labels[partition(labels, 2, 1, split_by_class=True)]) == {5, 6, 7, 8, 9}
    three = [labels[partition(labels, 3, r, split_by_class=True)] for r in range(3)]
    assert [np.bincount(t, minlength=10).tolist() for t in three] == [
        [6000, 6000, 6000, 2000, 0, 0, 0, 0, 0, 0],
        [0, 0, 0, 4000, 6000, 6000, 4000, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 2000, 6000, 6000, 6000],
    ]


@needs_real
def test_real_test_split(real_test):
    images, labels = real_test
    assert images.shape == (10000, 28, 28) and labels.shape == (10000,)
    assert np.bincount(labels).tolist() == [1000] * 10
    assert images.flags.writeable
    head_images, head_labels = load_fashion_mnist(train=False, limit=50)
    np.testing.assert_array_equal(head_images, images[:50])
    np.testing.assert_array_equal(head_labels, labels[:50])


@needs_real
def test_uncompressed_copy_reads_the_same(tmp_path, real_test):
    for stem in FILES.values():
        with gzip.open(REAL / f"{stem}.gz") as src:
            (tmp_path / stem).write_bytes(src.read())
    images, labels = load_fashion_mnist(tmp_path, train=False)
    np.testing.assert_array_equal(images, real_test[0])
    np.testing.assert_array_equal(labels, real_test[1])


@needs_real
def test_truncated_real_gzip(tmp_path):
    shutil.copy(REAL / "t10k-labels-idx1-ubyte.gz", tmp_path)
    data = (REAL / "t10k-images-idx3-ubyte.gz").read_bytes()
    (tmp_path / "t10k-images-idx3-ubyte.gz").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"t10k-images-idx3-ubyte\.gz.*(truncated|corrupt)"):
        load_fashion_mnist(tmp_path, train=False)


# ---------------------------------------------------------------------------------------------
# Broken and synthetic files


def test_synthetic_roundtrip_gz_and_plain(tmp_path):
    images, labels = small_set()
    for compress in (True, False):
        d = tmp_path / str(compress)
        d.mkdir()
        write_idx(d, images, labels, compress=compress)
        got_images, got_labels = load_fashion_mnist(d, train=False)
        np.testing.assert_array_equal(got_images, images)
        np.testing.assert_array_equal(got_labels, labels.astype(np.int64))
    write_idx(tmp_path, images, labels, prefix="train")
    assert load_fashion_mnist(tmp_path, train=True)[0].shape == (12, 28, 28)


def test_missing_file_names_it_and_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        load_fashion_mnist(tmp_path, train=True)
    msg = str(err.value)
    assert "train-images-idx3-ubyte.gz" in msg
    assert "apt-get install dataset-fashion-mnist" in msg and "--data-dir" in msg
    images, labels = small_set()
    img, lbl = write_idx(tmp_path, images, labels)
    lbl.unlink()
    with pytest.raises(FileNotFoundError, match="t10k-labels-idx1-ubyte"):
        load_fashion_mnist(tmp_path, train=False)


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_fashion_mnist(tmp_path / "nowhere")


@pytest.mark.parametrize("compress", [True, False])
def test_truncated_data(tmp_path, compress):
    images, labels = small_set()
    img, _ = write_idx(tmp_path, images, labels, compress=False)
    raw = img.read_bytes()[:-100]
    if compress:
        img.unlink()
        img = img.with_name(img.name + ".gz")
        img.write_bytes(gzip.compress(raw))
    else:
        img.write_bytes(raw)
    with pytest.raises(ValueError, match=rf"{img.name}: truncated: header announces 12 images"):
        load_fashion_mnist(tmp_path, train=False)


def test_truncated_header(tmp_path):
    images, labels = small_set()
    _, lbl = write_idx(tmp_path, images, labels)
    lbl.write_bytes(gzip.compress(b"\x00\x00\x08\x01\x00"))
    with pytest.raises(ValueError, match=r"t10k-labels-idx1-ubyte\.gz: truncated: header"):
        load_fashion_mnist(tmp_path, train=False)


def test_trailing_bytes(tmp_path):
    images, labels = small_set()
    _, lbl = write_idx(tmp_path, images, labels, compress=False)
    lbl.write_bytes(lbl.read_bytes() + b"\x00\x01")
    with pytest.raises(ValueError, match="2 unexpected bytes"):
        load_fashion_mnist(tmp_path, train=False)


def test_corrupt_gzip(tmp_path):
    images, labels = small_set()
    img, _ = write_idx(tmp_path, images, labels)
    data = bytearray(img.read_bytes())
    data[-8] ^= 0xFF  # CRC of the uncompressed data
    img.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"t10k-images-idx3-ubyte\.gz: corrupt"):
        load_fashion_mnist(tmp_path, train=False)


def test_wrong_magic(tmp_path):
    images, labels = small_set()
    img, lbl = write_idx(tmp_path, images, labels)
    shutil.copy(lbl, img)  # a labels file where the images should be
    with pytest.raises(ValueError, match=r"bad magic number 0x00000801, expected 0x00000803"):
        load_fashion_mnist(tmp_path, train=False)


def test_wrong_dimensions(tmp_path):
    rng = np.random.default_rng(0)
    write_idx(tmp_path, rng.integers(0, 255, (3, 32, 32), np.uint8), np.zeros(3, np.uint8))
    with pytest.raises(ValueError, match="images are 32x32, expected 28x28"):
        load_fashion_mnist(tmp_path, train=False)


def test_count_mismatch_and_bad_labels(tmp_path):
    images, labels = small_set()
    write_idx(tmp_path, images, labels[:-1])
    with pytest.raises(ValueError, match="12 images but .* 11 labels"):
        load_fashion_mnist(tmp_path, train=False)
    labels = labels.copy()
    labels[5] = 10
    write_idx(tmp_path, images, labels)
    with pytest.raises(ValueError, match="label 10 at index 5"):
        load_fashion_mnist(tmp_path, train=False)


def test_limit(tmp_path):
    images, labels = small_set()
    write_idx(tmp_path, images, labels)
    got_images, got_labels = load_fashion_mnist(tmp_path, train=False, limit=5)
    np.testing.assert_array_equal(got_images, images[:5])
    assert got_labels.tolist() == labels[:5].tolist()
    assert load_fashion_mnist(tmp_path, train=False, limit=100)[0].shape[0] == 12
    with pytest.raises(ValueError, match="limit"):
        load_fashion_mnist(tmp_path, train=False, limit=-1)


# ---------------------------------------------------------------------------------------------
# Partitions


def test_iid_partition_properties():
    labels = np.arange(103) % 10
    shards = [partition(labels, 4, r, seed=3) for r in range(4)]
    assert all(len(s) == 25 for s in shards)
    assert all(s.dtype == np.int64 and np.all(np.diff(s) > 0) for s in shards)
    union = np.concatenate(shards)
    assert len(np.unique(union)) == 100  # disjoint; the 3 left over are dropped
    for r in range(4):
        np.testing.assert_array_equal(partition(labels, 4, r, seed=3), shards[r])
    assert not np.array_equal(partition(labels, 4, 0, seed=4), shards[0])
    np.testing.assert_array_equal(partition(labels, 1, 0), np.arange(103))
    # torch labels are accepted
    np.testing.assert_array_equal(partition(torch.as_tensor(labels), 4, 1, seed=3), shards[1])


def test_class_partition_two_and_five_workers():
    labels = np.repeat(np.arange(10), 7)[np.random.default_rng(0).permutation(70)]
    assert set(labels[partition(labels, 2, 0, split_by_class=True)]) == {0, 1, 2, 3, 4}
    assert set(labels[partition(labels, 2, 1, split_by_class=True)]) == {5, 6, 7, 8, 9}
    for r in range(5):
        assert set(labels[partition(labels, 5, r, split_by_class=True)]) == {2 * r, 2 * r + 1}


def test_partition_errors():
    labels = np.zeros(10, np.int64)
    with pytest.raises(ValueError, match="num_workers"):
        partition(labels, 0, 0)
    with pytest.raises(ValueError, match="rank"):
        partition(labels, 2, 2)
    with pytest.raises(ValueError, match="cannot split"):
        partition(labels[:1], 2, 0)
    with pytest.raises(ValueError, match="one-dimensional"):
        partition(np.zeros((2, 2)), 1, 0)
    with pytest.raises(ValueError, match="rank must be an integer"):
        partition(labels, 2, 0.5)
    np.testing.assert_array_equal(
        partition(labels, np.int64(2), np.int64(1)), partition(labels, 2, 1)
    )


@settings(max_examples=50, deadline=None)
@given(
    labels=st.lists(st.integers(0, 9), min_size=1, max_size=200),
    workers=st.integers(1, 12),
    by_class=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_partition_invariants(labels, workers, by_class, seed):
    y = np.array(labels)
    if len(y) < workers:
        return
    shards = [partition(y, workers, r, split_by_class=by_class, seed=seed) for r in range(workers)]
    union = np.concatenate(shards)
    assert all(len(s) == len(y) // workers for s in shards)
    assert len(np.unique(union)) == len(union) == workers * (len(y) // workers)
    if by_class:  # contiguous class ranges: rank r's labels all <= rank r+1's
        for a, b in zip(shards, shards[1:], strict=False):
            if len(a):
                assert y[a].max() <= y[b].min()


# ---------------------------------------------------------------------------------------------
# Batches


def test_batches_shapes_normalisation_and_coverage():
    images, labels = small_set(n=10)
    idx = np.array([0, 2, 3, 5, 7, 8, 9])
    got = list(batches(images, labels, idx, batch_size=3, seed=1, epoch=0))
    assert [len(y) for _, y in got] == [3, 3, 1]
    x0, y0 = got[0]
    assert x0.shape == (3, 1, 28, 28) and x0.dtype == torch.float32 and y0.dtype == torch.int64
    seen = []
    for x, y in got:
        for xi, yi in zip(x, y, strict=True):
            j = int(np.flatnonzero((normalize(images)[:, 0] == xi[0]).all(dim=(1, 2)))[0])
            assert labels[j] == yi
            seen.append(j)
    assert sorted(seen) == idx.tolist()  # each index exactly once
    expected = (images[3].astype(np.float32) / 255 - FASHION_MNIST_MEAN) / FASHION_MNIST_STD
    np.testing.assert_allclose(normalize(images[3:4])[0, 0].numpy(), expected, rtol=1e-5, atol=1e-5)


def test_batches_determinism_epochs_and_options():
    images, labels = small_set(n=20)

    def order(**kw):
        return [y.tolist() for _, y in batches(images, labels, batch_size=4, **kw)]

    assert order(seed=0, epoch=0) == order(seed=0, epoch=0)
    assert order(seed=0, epoch=0) != order(seed=0, epoch=1)
    assert sum(order(seed=0, epoch=0), []) != labels.tolist()
    assert sum(order(shuffle=False), []) == labels.tolist()
    assert len(order(limit=2)) == 2
    small = [len(y) for _, y in batches(images[:10], labels[:10], batch_size=4, drop_last=True)]
    assert small == [4, 4]
    with pytest.raises(ValueError, match="batch_size"):
        next(batches(images, labels, batch_size=0))


@needs_real
def test_batches_on_real_data_are_standardised(real_test):
    images, labels = real_test
    idx = partition(labels, 2, 1, seed=0)
    x, y = next(batches(images, labels, idx, batch_size=2000, seed=0, epoch=0))
    assert abs(float(x.mean())) < 0.05 and abs(float(x.std()) - 1.0) < 0.05
    x, y = next(batches(images, labels, idx, batch_size=64, shuffle=False))
    torch.testing.assert_close(x, normalize(images[idx[:64]]))
    assert y.tolist() == labels[idx[:64]].tolist()
