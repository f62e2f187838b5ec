"""An embedding's gradient, which arrives as rows (tf.IndexedSlices), is added into its
window's sum as rows on every TF2 path (window.add_rows): never made dense per
mini-batch, and the sum is read without a copy afterwards.

Each path is checked against the direct batch whose lookup has a dense gradient (a
one-hot matmul: Keras's Adam applies the rows of a plain Embedding otherwise), and its
traced step is checked for the scatter and for the absence of the op that makes rows
dense (UnsortedSegmentSum, tf.convert_to_tensor of an IndexedSlices). The memory this
saves is measured in tools/memory.py's language model and guarded under a limit in
test_memory.py.
"""

import ctypes

import keras
import numpy as np
import pytest
import tensorflow as tf

from gradient_averaging import keras_fit
from gradient_averaging import tf2
from tests.library.toys import CLASSES
from tests.library.toys import SAMPLES
from tests.library.toys import B
from tests.library.toys import N
from tests.library.toys import compiled
from tests.library.toys import fit
from tests.library.toys import max_difference
from tests.library.toys import mixed_float16

VOCABULARY, WIDTH, IDS = 11, 4, 3
DENSIFY = "UnsortedSegmentSum"  # what tf.convert_to_tensor makes of an IndexedSlices


class OneHotLookup(keras.layers.Layer):
    """An embedding lookup as a one-hot matmul: its gradient is dense."""

    def __init__(self, table, **kwargs):
        super().__init__(**kwargs)
        self.table = self.add_weight(shape=table.shape,
                                     initializer=keras.initializers.Constant(table))

    def call(self, ids):
        return tf.matmul(tf.one_hot(ids, self.table.shape[0], dtype=self.compute_dtype),
                         self.table)


class TiedLookup(keras.layers.Layer):
    """One table, looked up (rows) and used as the output projection (dense): one
    variable with a sparse and a dense gradient."""

    def __init__(self, table, dense=False, **kwargs):
        super().__init__(**kwargs)
        self.dense = dense
        self.table = self.add_weight(shape=table.shape,
                                     initializer=keras.initializers.Constant(table))

    def call(self, ids):
        if self.dense:
            looked_up = tf.matmul(tf.one_hot(ids, self.table.shape[0]), self.table)
        else:
            looked_up = tf.gather(self.table, ids)
        pooled = tf.reduce_mean(looked_up, axis=1)
        return tf.matmul(pooled, self.table, transpose_b=True)[:, :CLASSES]


def table_and_data():
    rng = np.random.default_rng(3)
    table = rng.normal(size=(VOCABULARY, WIDTH)).astype(np.float32)
    ids = rng.integers(0, VOCABULARY, size=(SAMPLES, IDS)).astype(np.int32)
    return table, ids, rng.integers(0, CLASSES, size=SAMPLES).astype(np.int32)


def model(table, dense=False, tied=False):
    """ids -> an embedding lookup (rows; dense=True: a one-hot matmul) -> logits."""
    ids = keras.Input((IDS,), dtype="int32")
    if tied:
        return keras.Model(ids, TiedLookup(table, dense)(ids))
    lookup = OneHotLookup(table) if dense else keras.layers.Embedding(
        *table.shape, embeddings_initializer=keras.initializers.Constant(table))
    h = keras.layers.Flatten()(lookup(ids))
    return keras.Model(ids, keras.layers.Dense(
        CLASSES, kernel_initializer=keras.initializers.GlorotUniform(5))(h))


def ops_in(function):
    """The op types of a tf.function's traces and of every function in their library."""
    types = []
    for concrete in function._list_all_concrete_functions():  # noqa: SLF001 (its traces)
        graph_def = concrete.graph.as_graph_def()
        types += [node.op for node in graph_def.node]
        for library_function in graph_def.library.function:
            types += [node.op for node in library_function.node_def]
    return types


def check_rows_added(function):
    """The traced step adds rows by a scatter and makes none dense."""
    types = ops_in(function)
    assert "ResourceScatterAdd" in types
    assert DENSIFY not in types


def tensor_address(tensor):
    """Where a tensor's data lies in memory."""
    capsule = tf.experimental.dlpack.to_dlpack(tensor)
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    return ctypes.c_void_p.from_address(get(capsule, b"dltensor")).value  # DLTensor.data


def loss_fn(labels, logits):
    return keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_accumulate_adds_an_embeddings_rows_and_trains_to_the_direct_batch(jit_compile, tied):
    table, ids, labels = table_and_data()
    ours = compiled(keras_fit.accumulate(model(table, tied=tied), N),
                    keras.optimizers.Adam(0.05), jit_compile=jit_compile)
    fit(ours, ids, labels, B)
    direct = compiled(model(table, dense=True, tied=tied), keras.optimizers.Adam(0.05))
    fit(direct, ids, labels, N * B)
    assert max_difference(ours, direct) < 1e-5
    assert max_difference(ours, model(table, tied=tied)) > 1e-2  # it trained
    if not tied:  # the tape sums a tied table's two gradients dense: one dense add
        check_rows_added(ours._window_function)  # noqa: SLF001 (the one fit traced)


@pytest.mark.parametrize("trainer", [tf2.WindowAccumulator, tf2.MiniBatchAccumulator])
@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_the_tf2_accumulators_add_an_embeddings_rows(trainer, jit_compile):
    table, ids, labels = table_and_data()
    net = model(table)
    accumulator = trainer(net, keras.optimizers.Adam(0.05), loss_fn, jit_compile=jit_compile,
                          average_gradients=N)
    dataset = tf.data.Dataset.from_tensor_slices((ids, labels)).batch(B)
    for _ in range(2):
        accumulator.fit(dataset)
    direct = compiled(model(table, dense=True), keras.optimizers.Adam(0.05))
    fit(direct, ids, labels, N * B)
    assert max_difference(net, direct) < 1e-5
    if trainer is tf2.MiniBatchAccumulator:
        check_rows_added(accumulator.mini_batch_step)
        # Read without a copy after the scatter: two reads alive at once share the
        # sum's buffer (a variable left copying on read hands each its own copy).
        accumulator.accumulate(ids[:B], labels[:B])
        embedding_sum = accumulator.sums[0]
        assert tuple(embedding_sum.shape) == table.shape
        first = embedding_sum.read_value()
        assert tensor_address(first) == tensor_address(embedding_sum.read_value())
    else:
        check_rows_added(accumulator._iterator_steps[N])  # noqa: SLF001 (the one fit traced)


def test_a_loss_scale_optimizer_unscales_rows_as_rows():
    """mixed_float16: the LossScaleOptimizer's unscaling keeps the rows (within float16
    rounding of the direct batch, as the dense models' test)."""
    table, ids, labels = table_and_data()
    with mixed_float16():
        ours = model(table)
        direct = model(table, dense=True)
    accumulating = compiled(keras_fit.accumulate(ours, N),
                            keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.2)))
    fit(accumulating, ids, labels, B)
    direct = compiled(direct, keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.2)))
    fit(direct, ids, labels, N * B)
    assert max_difference(ours, direct) < 1e-2
    assert max_difference(ours, model(table)) > 1e-2
    check_rows_added(accumulating._window_function)  # noqa: SLF001 (the one fit traced)
