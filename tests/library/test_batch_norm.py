"""Batch normalization under accumulation: one moving-average step per update, on the
window's statistics, as the direct batch takes it (bn_statistics="update", the default).

On data of unit scale the tolerances are absolute. BatchNormalization on the inputs has
statistics that depend on no weight, so they must equal the direct batch's whatever the
per-mini-batch normalization did to the weights; a layer deeper in gets its input from
weights that are the same only before the first update.
"""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

from gradient_averaging import keras_fit
from gradient_averaging import tf2
from tests.library.toys import CLASSES
from tests.library.toys import FEATURES
from tests.library.toys import B
from tests.library.toys import N
from tests.library.toys import bn_model
from tests.library.toys import compiled
from tests.library.toys import data
from tests.library.toys import fit
from tests.library.toys import max_difference
from tests.library.toys import mixed_float16
from tests.library.toys import moving_statistics
from tests.library.toys import nan_in_second_window
from tests.library.toys import new_in_keras
from tests.library.toys import sgd
from tests.library.toys import statistics_difference

BN = keras.layers.BatchNormalization
RENORM = new_in_keras((3, 14), "BatchNormalization(renorm=True)")


@pytest.fixture(scope="module")
def direct():
    """The plain model with BN on its inputs, fitted on batches of N*B (two epochs)."""
    x, y = data()
    reference = compiled(bn_model(), sgd())
    fit(reference, x, y, N * B)
    return reference


def accumulating(nested=False, jit_compile=False, **kwargs):
    model = keras_fit.accumulate(bn_model(nested=nested), N, **kwargs)
    model.compile(optimizer=sgd(), jit_compile=jit_compile,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("variant", ["plain", "nested", "xla"])
def test_fit_gives_the_direct_batchs_moving_statistics(direct, variant):
    """Three whole windows and a partial one (20 + 10 samples) per epoch; nested: the BN
    inside a Sequential block; xla: padded mini-batches, whose padding must not count."""
    x, y = data()
    model = accumulating(nested=variant == "nested", jit_compile=variant == "xla")
    fit(model, x, y, B)
    assert statistics_difference(model.model, direct) < 1e-5


def test_keras_own_step_per_mini_batch_is_far_off_the_direct_batchs(direct):
    x, y = data()
    per_mini_batch = accumulating(bn_statistics="mini_batch")
    fit(per_mini_batch, x, y, B)
    assert statistics_difference(per_mini_batch.model, direct) > 1e-2


@pytest.mark.parametrize("one_call", [True, False], ids=["window", "per_mini_batch"])
def test_fit_accumulated_gives_the_direct_batchs_moving_statistics(direct, one_call):
    x, y = data()
    model = bn_model()
    optimizer = sgd()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(B)
    for _ in range(2):  # two epochs, as the direct batch's
        tf2.fit_accumulated(model, dataset, optimizer, loss_fn, N, one_call=one_call)
    assert int(optimizer.iterations) == 8
    assert statistics_difference(model, direct) < 1e-5


def test_windows_a_loss_scale_optimizer_skips_still_move_the_statistics():
    """mixed_float16: the first windows overflow in float16 and the LossScaleOptimizer
    skips their steps (the direct batch's skips too, a step more: its float16 gradients
    sum N times the samples); the statistics move at every window all the same, as the
    direct batch's do."""
    x, y = data()

    def scaled():  # a scale so high that the first steps overflow
        return keras.optimizers.LossScaleOptimizer(sgd(), initial_scale=2.0 ** 24)

    with mixed_float16():
        model = compiled(keras_fit.accumulate(bn_model(), N), scaled())
        reference = compiled(bn_model(), scaled())
    fit(model, x, y, B)
    fit(reference, x, y, N * B)
    assert 0 < int(model.optimizer.iterations) == 8 - model.skipped_windows < 8
    assert int(reference.optimizer.iterations) < 8
    assert statistics_difference(model.model, reference) < 1e-5


def test_a_nan_window_leaves_the_statistics_as_they_were():
    x, y = data()
    bad, keep = nan_in_second_window(x)
    model = accumulating()
    fit(model, bad, y, B)
    reference = accumulating()  # the same, never seeing that window
    fit(reference, x[keep], y[keep], B)
    assert model.skipped_windows == 2
    for a, b in zip(moving_statistics(model.model), moving_statistics(reference.model)):
        np.testing.assert_array_equal(a, b)


def conv_net(seed=0):
    init = keras.initializers.GlorotUniform
    return keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(4, 5, kernel_initializer=init(seed)), BN(), keras.layers.ReLU(),
        keras.layers.MaxPool2D(4),
        keras.layers.Conv2D(4, 3, kernel_initializer=init(seed + 1)), BN(),
        keras.layers.ReLU(), keras.layers.Flatten(),
        keras.layers.Dense(10, kernel_initializer=init(seed + 2))])


def test_a_conv_nets_first_bn_layer_after_one_update(mnist):
    """N=5 x B=8 against one batch of 40: the first BN layer's input came from the initial
    weights, so its statistics (per channel, over samples and positions) are the batch's."""
    x, y = mnist.train.images[:40], mnist.train.labels[:40]
    reference = compiled(conv_net(), keras.optimizers.SGD(0.1))
    reference.fit(x, y, batch_size=40, epochs=1, shuffle=False, verbose=0)
    model = compiled(keras_fit.accumulate(conv_net(), 5), keras.optimizers.SGD(0.1))
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    first, deeper = moving_statistics(model.model), moving_statistics(reference)
    for a, b in zip(first[:2], deeper[:2]):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_a_layer_called_twice_steps_twice():
    """One BN layer on the inputs and on twice the inputs: the direct batch steps it
    twice per update, each on its call's statistics."""
    def twice():
        norm = BN()
        inputs = keras.Input((FEATURES,))
        both = keras.layers.Concatenate()([norm(inputs), norm(inputs * 2.0)])
        out = keras.layers.Dense(CLASSES, kernel_initializer=keras.initializers.GlorotUniform(
            1))(both)
        return keras.Model(inputs, out)

    x, y = data()
    reference = compiled(twice(), sgd())
    fit(reference, x, y, N * B)
    model = compiled(keras_fit.accumulate(twice(), N), sgd())
    fit(model, x, y, B)
    assert statistics_difference(model.model, reference) < 1e-5


def dead_bn_model():
    """BN after a Dense layer: at B=1 it normalizes one value per channel."""
    return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(4),
                             BN(name="dead_bn"), keras.layers.Dense(CLASSES)])


def test_one_value_per_channel_is_warned_once_naming_the_layer(caplog):
    """B=1 into BN after a Dense layer: each mini-batch's BN normalizes one value per
    channel, its output is its beta whatever the input."""
    x, y = data(16)
    model = compiled(keras_fit.accumulate(dead_bn_model(), 4), sgd())
    with caplog.at_level(logging.WARNING):
        model.fit(x, y, batch_size=1, epochs=2, verbose=0)
    warned = [r.getMessage() for r in caplog.records if "dead_bn" in r.getMessage()]
    assert len(warned) == 1 and "GroupNormalization" in warned[0]
    caplog.clear()
    fine = compiled(keras_fit.accumulate(bn_model(), N), sgd())
    with caplog.at_level(logging.WARNING):
        fine.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert not [r for r in caplog.records if "single value" in r.getMessage()]


def test_frozen_bn_is_exact_against_the_direct_batch():
    x, y = data()
    frozen = []
    for _ in range(2):
        model = bn_model()
        model.layers[0].trainable = False
        frozen.append(model)
    reference = compiled(frozen[0], sgd())
    fit(reference, x, y, N * B)
    model = compiled(keras_fit.accumulate(frozen[1], N), sgd())
    fit(model, x, y, B)
    assert max_difference(model.model, reference) < 1e-5
    assert statistics_difference(model.model, reference) == 0.0


@pytest.mark.parametrize("kwargs, bn_statistics, jit_compile, why, fix", [
    ({"synchronized": True}, "update", False, "synchronized=True", "synchronized=False"),
    ({"synchronized": True}, "mini_batch", False, "synchronized=True", "synchronized=False"),
    pytest.param({"renorm": True}, "update", False, "renorm=True", "bn_statistics='mini_batch'",
                 marks=RENORM),
])
def test_a_bn_layer_the_window_cannot_train_is_refused(kwargs, bn_statistics, jit_compile,
                                                      why, fix):
    """Each refusal names the layer, why, and the way out that really works."""
    x, y = data(40)
    inner = keras.Sequential([keras.Input((FEATURES,)), BN(name="odd_bn", **kwargs),
                              keras.layers.Dense(CLASSES)])
    model = keras_fit.accumulate(inner, N, bn_statistics=bn_statistics)
    model.compile(optimizer=sgd(), jit_compile=jit_compile,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(ValueError, match=f"'odd_bn' has {why}.*{fix}"):
        model.fit(x, y, batch_size=B, epochs=1, verbose=0)
    with pytest.raises(ValueError, match="bn_statistics must be one of"):
        keras_fit.accumulate(inner, N, bn_statistics="window")


def test_fit_accumulated_warns_of_one_value_per_channel_too(caplog):
    x, y = data(8)
    model = dead_bn_model()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    with caplog.at_level(logging.WARNING):
        tf2.fit_accumulated(model, tf.data.Dataset.from_tensor_slices((x, y)).batch(1),
                            sgd(), loss_fn, 4)
    assert len([r for r in caplog.records if "dead_bn" in r.getMessage()]) == 1
