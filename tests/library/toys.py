"""Small Keras models, data and checks that the library's tests share.

Tiny models: a Dense layer or two on synthetic data (Keras fit), a small ConvNet with
seeded dropout and an L2 regularizer on real MNIST (the TF2 accumulators).
"""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

from gradient_averaging import keras_fit

KERAS = tuple(int(part) for part in keras.__version__.split(".")[:2])  # (major, minor)


def new_in_keras(release, feature):
    """Skips a test of `feature`, which Keras has from `release` (major, minor) on."""
    return pytest.mark.skipif(KERAS < release,
                              reason=f"{feature} is new in Keras {release[0]}.{release[1]}")

# Ops that communicate between replicas.
ALL_REDUCE_OPS = ("CollectiveReduce", "CollectiveReduceV2", "CollectiveReduceV3",
                  "CollectiveGather", "CollectiveGatherV2", "NcclAllReduce")


def count_all_reduces(concrete_function):
    """Number of cross-replica reduction ops in a traced function and its library."""
    graph_def = concrete_function.graph.as_graph_def()
    nodes = list(graph_def.node)
    for function in graph_def.library.function:
        nodes.extend(function.node_def)
    return sum(node.op in ALL_REDUCE_OPS for node in nodes)


# ---------------------------------------------------------------- Keras fit: tiny models

N, B = 4, 20  # an update per 80 samples
# 270 = 3 x 80 + 30: each epoch ends with a partial window of a whole mini-batch and a
# short one, (20, 10), which must weigh 2:1.
SAMPLES, FEATURES, CLASSES = 270, 8, 3


def data(n=SAMPLES, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype(np.float32)
    y = (x[:, :CLASSES].argmax(axis=1) + (rng.random(n) < 0.2)) % CLASSES
    return x, y.astype(np.int64)


def tiny_model(seed=1, dropout=0.0):
    init = keras.initializers.GlorotUniform
    layers = [keras.Input((FEATURES,)),
              keras.layers.Dense(16, activation="relu", kernel_initializer=init(seed),
                                 kernel_regularizer=keras.regularizers.L2(1e-3))]
    if dropout:
        layers.append(keras.layers.Dropout(dropout, seed=seed))
    return keras.Sequential(layers + [keras.layers.Dense(CLASSES,
                                                         kernel_initializer=init(seed + 1))])


def activity_regularized(l2=0.05):
    """tiny_model's layers with an activity regularizer between them: a loss the forward
    pass adds (add_loss), per sample from Keras 3.14, summed over the batch before."""
    init = keras.initializers.GlorotUniform
    return keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(16, activation="relu", kernel_initializer=init(1)),
        keras.layers.ActivityRegularization(l2=l2),
        keras.layers.Dense(CLASSES, kernel_initializer=init(2))])


class SideBranch(keras.Model):
    """A hidden layer, the logits, and a side layer on the hidden one whose output only
    its activity regularizer sees: before Keras 3.14, which sums that regularizer's loss
    apart, the loss itself gives the side layer's weights no gradient."""

    def __init__(self, l2=0.05):
        super().__init__()
        init = keras.initializers.GlorotUniform
        self.hidden = keras.layers.Dense(16, activation="relu", kernel_initializer=init(1))
        self.side = keras.layers.Dense(4, kernel_initializer=init(3),
                                       activity_regularizer=keras.regularizers.L2(l2))
        self.logits = keras.layers.Dense(CLASSES, kernel_initializer=init(2))

    def call(self, x, training=False):
        hidden = self.hidden(x)
        self.side(hidden)
        return self.logits(hidden)


def side_branch():
    model = SideBranch()
    model(np.zeros((1, FEATURES), np.float32))  # built, as a Sequential with an Input is
    return model

def sgd(**kwargs):
    """SGD on a schedule that halves the rate at every optimizer step."""
    return keras.optimizers.SGD(
        keras.optimizers.schedules.ExponentialDecay(0.2, decay_steps=1, decay_rate=0.5),
        **kwargs)


OPTIMIZERS = {"sgd_schedule": sgd, "adam": lambda **kw: keras.optimizers.Adam(0.05, **kw)}


def compiled(model, optimizer, **kwargs):
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], **kwargs)
    return model


@contextlib.contextmanager
def mixed_float16():
    """Keras's global policy mixed_float16 for the models built in the block."""
    before = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy(before)


@contextlib.contextmanager
def floatx(dtype):
    """Keras's floatx for the models and losses built in the block, and its dtype policy
    (a policy set before, by mixed_float16's block, outlives a change of floatx)."""
    before = keras.config.floatx(), keras.mixed_precision.global_policy()
    keras.config.set_floatx(dtype)
    keras.mixed_precision.set_global_policy(dtype)
    try:
        yield
    finally:
        keras.config.set_floatx(before[0])
        keras.mixed_precision.set_global_policy(before[1])


def nan_in_second_window(x):
    """x with a NaN in each epoch's second window of N x B, and the rows that leave
    that window out: (bad x, kept rows)."""
    bad = x.copy()
    bad[N * B + 5, 2] = np.nan
    return bad, np.r_[0:N * B, 2 * N * B:len(x)]


def fit(model, x, y, batch_size, source="numpy", epochs=2, **kwargs):
    if source == "tf.data":
        return model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size),
                         epochs=epochs, verbose=0, **kwargs)
    return model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0,
                     **kwargs)


def max_difference(a, b):
    return max(float(np.abs(u - v).max()) for u, v in zip(a.get_weights(), b.get_weights()))



# ---------------------------------------------------------------- the TF2 accumulators: MNIST

# Three windows at N=3: equal mini-batches, unequal ones (a short slice), and a partial
# window of two (the run's trailing one).
WINDOWS = ((8, 8, 8), (8, 3, 5), (8, 2))


def small_conv_net(dropout=0.5, seed=0):
    """A ConvNet with dropout and an L2 regularizer: every kind of model state is used."""
    init = keras.initializers.GlorotUniform
    return keras.Sequential([
        keras.Input((28, 28, 1)), keras.layers.Dropout(min(0.2, dropout), seed=seed + 10),
        keras.layers.Conv2D(4, 5, activation="relu", kernel_initializer=init(seed)),
        keras.layers.MaxPool2D(4), keras.layers.Flatten(),
        keras.layers.Dropout(dropout, seed=seed + 11),
        keras.layers.Dense(16, activation="relu", kernel_initializer=init(seed + 1),
                           kernel_regularizer=keras.regularizers.L2(1e-3)),
        keras.layers.Dense(10, kernel_initializer=init(seed + 2))])


def cross_entropy(labels, logits):
    return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)


def mini_batches(split, sizes, start=0):
    """Consecutive (images, labels) slices of `split`, of the given sizes."""
    out = []
    for size in sizes:
        out.append((split.images[start:start + size], split.labels[start:start + size]))
        start += size
    return out


def windows(split, shape=WINDOWS):
    batches = mini_batches(split, [size for window in shape for size in window])
    out = []
    for window in shape:
        out.append(batches[:len(window)])
        batches = batches[len(window):]
    return out



# ---------------------------------------------------------------- two mirrored replicas


def bn_model(seed=1, nested=False, momentum=0.99):
    """BatchNormalization on the inputs (its statistics depend on no weight), then the
    tiny model; `nested`: inside a Sequential block of its own."""
    init = keras.initializers.GlorotUniform
    norm = keras.layers.BatchNormalization(momentum=momentum)
    if nested:
        norm = keras.Sequential([keras.Input((FEATURES,)), norm], name="block")
    return keras.Sequential([
        keras.Input((FEATURES,)), norm,
        keras.layers.Dense(16, activation="relu", kernel_initializer=init(seed)),
        keras.layers.Dense(CLASSES, kernel_initializer=init(seed + 1))])


def moving_statistics(model):
    """Every BatchNormalization layer's moving mean and variance, in layer order."""
    layers = [layer for layer in model._flatten_layers()  # noqa: SLF001 (no public API)
              if isinstance(layer, keras.layers.BatchNormalization)]
    return [v.numpy() for layer in layers for v in (layer.moving_mean, layer.moving_variance)]


def statistics_difference(a, b):
    return max(float(np.abs(u - v).max()) for u, v in zip(moving_statistics(a),
                                                          moving_statistics(b)))


def mirrored_fit(strategy):
    """Run by test_tf2's mirrored script: Keras fit through accumulate under
    2 replicas, as Keras's distributed guide writes it (model and compile in the scope,
    fit, evaluate and predict outside), against one device."""
    x, y = data()
    one_device = compiled(keras_fit.accumulate(tiny_model(), N), sgd())
    fit(one_device, x, y, B)
    with strategy.scope():
        model = compiled(keras_fit.accumulate(tiny_model(), N), sgd())
        grouped = compiled(keras_fit.accumulate(tiny_model(), N, parallel_mini_batches=2), sgd())
    fit(model, x, y, B)
    fit(grouped, x, y, B)
    # What Keras distributes: each mini-batch as the replicas' shares.
    windows = model._windows(x, y, None, B, False, None)  # noqa: SLF001 (fit's own data)
    mini_batches = strategy.experimental_distribute_dataset(windows.get_tf_dataset())
    shares = strategy.experimental_local_results(next(iter(mini_batches))[0])
    # Batch norm on the inputs, pooled across the replicas; a last mini-batch of one
    # sample (81 = 4 x 20 + 1): one replica's share is empty.
    bn_reference = compiled(bn_model(), sgd())
    fit(bn_reference, x, y, N * B)
    with strategy.scope():
        bn = compiled(keras_fit.accumulate(bn_model(), N), sgd())
        tiny_last = compiled(keras_fit.accumulate(bn_model(), N), sgd())
    fit(bn, x, y, B)
    fit(tiny_last, x[:81], y[:81], B, epochs=1)
    # An activity regularizer (before Keras 3.14 summed apart on each replica): the direct
    # batch's weights and logged loss.
    activity_reference = compiled(activity_regularized(), sgd())
    activity_reference_loss = fit(activity_reference, x, y, N * B).history["loss"]
    with strategy.scope():
        activity = compiled(keras_fit.accumulate(activity_regularized(), N), sgd())
    activity_loss = fit(activity, x, y, B).history["loss"]

    # An Embedding's gradient, rows, added as rows into each replica's sum.
    table = np.random.default_rng(3).normal(size=(11, 4)).astype(np.float32)
    ids = np.random.default_rng(4).integers(0, 11, size=(len(y), 3)).astype(np.int32)
    rows_one_device = compiled(keras_fit.accumulate(embedding_model(table), N), sgd())
    fit(rows_one_device, ids, y, B)
    with strategy.scope():
        rows = compiled(keras_fit.accumulate(embedding_model(table), N), sgd())
    fit(rows, ids, y, B)
    rows_ops = []
    for concrete in rows._window_function._list_all_concrete_functions():  # noqa: SLF001 (fit's traces)
        graph_def = concrete.graph.as_graph_def()
        rows_ops += [node.op for node in graph_def.node]
        rows_ops += [node.op for f in graph_def.library.function for node in f.node_def]

    def all_reduces(accumulating):  # in the window function that fit traced
        function = accumulating._window_function  # noqa: SLF001 (the one fit traced)
        return count_all_reduces(function.get_concrete_function(iter(mini_batches)))

    return {"fit_difference": max_difference(model, one_device),
            "grouped_difference": max_difference(grouped, one_device),
            "fit_updates": int(model.optimizer.iterations.numpy()),
            "fit_all_reduces": all_reduces(model),
            "fit_variables": len(model.trainable_variables),
            "evaluate_difference": abs(model.evaluate(x, y, verbose=0)[0]
                                       - one_device.evaluate(x, y, verbose=0)[0]),
            "predict_difference": float(np.abs(model.predict(x, verbose=0)
                                               - one_device.predict(x, verbose=0)).max()),
            "share_shapes": [list(share.shape) for share in shares],
            "bn_difference": statistics_difference(bn.model, bn_reference),
            "bn_all_reduces": all_reduces(bn),
            "tiny_last_skipped": tiny_last.skipped_windows,
            "tiny_last_updates": int(tiny_last.optimizer.iterations.numpy()),
            "tiny_last_finite": all(np.isfinite(w).all() for w in tiny_last.get_weights()),
            "rows_difference": max_difference(rows, rows_one_device),
            "rows_scattered": "ResourceScatterAdd" in rows_ops,
            "activity_difference": max_difference(activity, activity_reference),
            "activity_loss_difference": float(np.max(np.abs(
                np.subtract(activity_loss, activity_reference_loss))
                / np.abs(activity_reference_loss)))}


def embedding_model(table):
    """ids (3 a sample) -> an Embedding of `table` -> Dense logits: its gradient rows."""
    return keras.Sequential([
        keras.Input((3,), dtype="int32"),
        keras.layers.Embedding(*table.shape,
                               embeddings_initializer=keras.initializers.Constant(table)),
        keras.layers.Flatten(),
        keras.layers.Dense(CLASSES, kernel_initializer=keras.initializers.GlorotUniform(5))])


def multi_worker_fit():
    """Run by the same script, after mirrored_fit: one local MultiWorkerMirroredStrategy
    worker, model and compile in its scope, fit, evaluate and predict outside."""
    x, y = data()
    one_device = compiled(keras_fit.accumulate(tiny_model(), N), sgd())
    fit(one_device, x, y, B)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = compiled(keras_fit.accumulate(tiny_model(), N), sgd())
    fit(model, x, y, B)
    return {"multi_worker_difference": max(
        max_difference(model, one_device),
        abs(model.evaluate(x, y, verbose=0)[0] - one_device.evaluate(x, y, verbose=0)[0]),
        float(np.abs(model.predict(x, verbose=0) - one_device.predict(x, verbose=0)).max()))}


def check_mirrored_fit(result):
    """test_tf2's assertions on mirrored_fit's result."""
    assert result["fit_difference"] < 1e-5 and result["fit_updates"] == 8
    assert result["grouped_difference"] < 1e-5  # parallel_mini_batches=2
    assert result["rows_difference"] < 1e-5 and result["rows_scattered"]  # window.add_rows
    assert result["evaluate_difference"] < 1e-5 and result["predict_difference"] < 1e-5
    # The optimizer's all-reduce of the applied mean and the window's sample count, once
    # per window; nothing per mini-batch.
    assert 1 <= result["fit_all_reduces"] <= 2 * result["fit_variables"] + 2
    # Each replica receives its share only: 20 samples a mini-batch, 10 a replica.
    assert result["share_shapes"] == [[B // 2, FEATURES]] * 2
    # Batch norm: the one-device (direct batch's) statistics, for at most one reduction
    # more per update (the window's sums, read across the replicas).
    assert result["bn_difference"] < 1e-5
    assert result["fit_all_reduces"] <= result["bn_all_reduces"] <= result["fit_all_reduces"] + 1
    # An empty share: the window is applied, nothing turns NaN.
    assert result["tiny_last_skipped"] == 0 and result["tiny_last_updates"] == 2
    assert result["tiny_last_finite"]
    assert result["activity_difference"] < 1e-5
    assert result["activity_loss_difference"] < 1e-5
    assert result["multi_worker_difference"] < 1e-5
