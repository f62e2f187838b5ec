"""Padded token sequences, the models that tag them and the losses they train with:
what transformers accumulate gradients on, shared by test_sequences and the mirrored
and multi-worker scripts.

Every sequence is padded to T tokens with id 0; lengths are very unequal (1 to T, and
runs of empty ones where a case asks), so a mini-batch's valid tokens, which a masked
loss divides by, are far from proportional to its samples.
"""

import keras
import numpy as np
import tensorflow as tf

V, T, FEATURES = 20, 12, 4  # vocabulary, tokens per sequence, a sample's features
SAMPLES = 84  # 10.5 mini-batches of 8: a short last one, a partial window at N=2
N, B = 2, 8  # 16 samples an update: 5.25 a pass over the 84


def sequences(samples=SAMPLES, seed=0, empty=()):
    """(ids [samples, T] int32, labels [samples, T] int32, lengths): `empty`, ranges of
    sample indices whose sequences hold no token."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, T + 1, size=samples)
    lengths[rng.random(samples) < 0.3] = 1  # very unequal
    for rows in empty:
        lengths[rows] = 0
    ids = np.zeros((samples, T), np.int32)
    labels = np.zeros((samples, T), np.int32)
    for i, n in enumerate(lengths):
        ids[i, :n] = rng.integers(1, V, size=n)
        labels[i, :n] = rng.integers(0, V, size=n)
    return ids, labels, lengths


def tagger(kind="embedding", regularized=False, activity=False):
    """A per-token classifier whose mask Keras propagates to its per-step logits:
    "embedding": Embedding(mask_zero=True); "masking": float features, a Masking layer
    and an LSTM; "compute_mask": a layer of its own that makes the mask."""
    init = keras.initializers.GlorotUniform
    regularizer = keras.regularizers.L2(1e-2) if regularized else None
    if kind == "masking":
        layers = [keras.Input((T, FEATURES)), keras.layers.Masking(0.0),
                  keras.layers.LSTM(8, return_sequences=True, kernel_initializer=init(1),
                                    recurrent_initializer=keras.initializers.Orthogonal(seed=2))]
    else:
        embedding = (keras.layers.Embedding(V, 8, mask_zero=True, embeddings_initializer=init(1))
                     if kind == "embedding" else MaskedLookup(init(1)))
        layers = [keras.Input((T,), dtype="int32"), embedding]
    layers.append(keras.layers.Dense(16, activation="tanh", kernel_initializer=init(3),
                                     kernel_regularizer=regularizer))
    if activity:
        layers.append(keras.layers.ActivityRegularization(l2=0.01))
    layers.append(keras.layers.Dense(V, kernel_initializer=init(4)))
    return keras.Sequential(layers)


@keras.saving.register_keras_serializable(package="tests")
class MaskedLookup(keras.layers.Layer):
    """An embedding whose mask (id != 0) comes from its own compute_mask."""

    def __init__(self, initializer="glorot_uniform", **kwargs):
        super().__init__(**kwargs)
        self.initializer = initializer
        self.supports_masking = True

    def build(self, input_shape):
        self.table = self.add_weight(shape=(V, 8), initializer=self.initializer)

    def call(self, ids):
        return keras.ops.take(self.table, ids, axis=0)

    def compute_mask(self, ids, mask=None):
        return keras.ops.not_equal(ids, 0)


def features(ids):
    """Float features for the Masking tagger: zero rows where a sequence is padded."""
    rng = np.random.default_rng(7)
    table = rng.normal(size=(V, FEATURES)).astype(np.float32)
    table[0] = 0.0
    return table[ids]


def two_outputs():
    """Tokens (per step, masked) and a label per sequence, each with its own loss."""
    init = keras.initializers.GlorotUniform
    ids = keras.Input((T,), dtype="int32")
    hidden = keras.layers.Embedding(V, 8, mask_zero=True, embeddings_initializer=init(1))(ids)
    hidden = keras.layers.Dense(16, activation="tanh", kernel_initializer=init(3))(hidden)
    tokens = keras.layers.Dense(V, kernel_initializer=init(4), name="tokens")(hidden)
    pooled = keras.layers.GlobalAveragePooling1D()(hidden)
    label = keras.layers.Dense(3, kernel_initializer=init(5), name="label")(pooled)
    return keras.Model(ids, {"tokens": tokens, "label": label})


class FocalTokens(keras.losses.Loss):
    """A Loss subclass with its own call: per-token focal cross-entropy on logits."""

    def call(self, y_true, y_pred):
        log_p = tf.nn.log_softmax(y_pred)
        picked = tf.gather(log_p, tf.cast(y_true, tf.int32), batch_dims=2)
        return -((1.0 - tf.exp(picked)) ** 2) * picked


def token_loss(reduction="sum_over_batch_size"):
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)


def sgd(rate=0.2):
    return keras.optimizers.SGD(rate)


def max_difference(a, b):
    return max(float(np.abs(u - v).max()) for u, v in zip(a.get_weights(), b.get_weights()))


def fit(model, x, y, batch_size, epochs=2, **kwargs):
    return model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0,
                     **kwargs)


def mirrored_fit(strategy):
    """Run by test_tf2's mirrored script: a masked tagger under `strategy` (its
    replicas sum the window's valid tokens in the one scalar exchange), by accumulate
    with N and with a micro-batch size, and by fit_accumulated on per-token weights,
    each against the one-device direct batch."""
    from gradient_averaging import keras_fit
    from gradient_averaging import tf2

    ids, labels, _ = sequences(empty=(slice(8, 16),))
    direct = compile_tagger(tagger())
    fit(direct, ids, labels, N * B)
    out = {}
    for name, window, batch in (("n", dict(average_gradients=N), B),
                                ("micro", dict(micro_batch_size=3), N * B)):
        with strategy.scope():
            model = compile_tagger(keras_fit.accumulate(tagger(), **window))
        fit(model, ids, labels, batch)
        out[f"sequences_{name}_difference"] = max_difference(model, direct)
    weights = (ids > 0).astype(np.float32)
    with strategy.scope():
        model, optimizer = tagger(), sgd()
    dataset = tf.data.Dataset.from_tensor_slices((ids, (labels, weights))).batch(B)
    for _ in range(2):
        tf2.fit_accumulated(model, dataset, optimizer, weighted_token_losses,
                            average_gradients=N, strategy=strategy)
    out["sequences_fit_accumulated_difference"] = max_difference(model, direct)
    return out


def compile_tagger(model, loss=None, optimizer=None):
    model.compile(optimizer=optimizer or sgd(), loss=loss or token_loss())
    return model


def weighted_token_losses(y, logits):
    """fit_accumulated's loss_fn: per-token losses and their weights, y = (labels,
    weights): the window divides by the weights' sum."""
    labels, weights = y
    losses = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
    return losses, weights


def check_mirrored_fit(result):
    """test_tf2's assertions on mirrored_fit's result."""
    for name in ("n", "micro", "fit_accumulated"):
        assert result[f"sequences_{name}_difference"] < 1e-5, name
