"""Exact for what transformers train with: padded token sequences under a mask, every
loss reduction, sample and class weights, several outputs, regularization, tokens that
a mini-batch or a whole window lacks; the window's update is the direct batch's.

A masked loss divides by the batch's valid tokens, "sum" by nothing,
"mean_with_sample_weight" by the summed weights: the window divides the sum of its
mini-batches' numerators by the sum of their divisors, as the direct batch of the same
samples does. Each case trains 4 epochs of 84 sequences (24 updates of 16: N=2 x B=8,
or a micro-batch of 7 that does not divide 16; each epoch's last window partial and
short) against the plain model fitted at 16; Keras's own gradient_accumulation_steps
is shown off by as much where the mask matters.
"""

import os
import runpy

import keras
import numpy as np
import pytest
import tensorflow as tf

from gradient_averaging import keras_fit
from gradient_averaging import tf2
from tests.helpers import ROOT
from tests.library import sequences as seq
from tests.library.toys import KERAS
from tests.library.toys import floatx

EPOCHS = 4  # 6 updates an epoch at 16 samples each: 24
WINDOWS = {"N": dict(average_gradients=seq.N), "micro_batch": dict(micro_batch_size=7)}
BATCH = {"N": seq.B, "micro_batch": seq.N * seq.B}
# make test runs each case on N; make test-slow on the micro-batch too.
WINDOW_PARAMS = [pytest.param("N"), pytest.param("micro_batch", marks=pytest.mark.slow)]


def compiled(model, loss=None, optimizer=None, **kwargs):
    model.compile(optimizer=optimizer or seq.sgd(), loss=loss or seq.token_loss(), **kwargs)
    return model



def momentum():
    """SGD with momentum: Keras's own Adam applies an Embedding's rows (IndexedSlices)
    otherwise than their dense sum (docs/tf2-engine.md), so the direct batch's
    Embedding would not be a reference for it; momentum, like Adam, moves on a zero
    gradient."""
    return keras.optimizers.SGD(0.2, momentum=0.9)


def data(case):
    """(x, y, fit's other arguments) for a case."""
    ids, labels, lengths = seq.sequences()
    kwargs = {}
    if case == "masking":
        return seq.features(ids), labels, kwargs
    if case == "temporal_weights":
        kwargs["sample_weight"] = np.random.default_rng(3).uniform(
            0.2, 2.0, size=ids.shape).astype(np.float32)
    if case == "sample_weights":
        kwargs["sample_weight"] = np.random.default_rng(3).uniform(
            0.2, 2.0, size=(len(ids), 1)).astype(np.float32)
    return ids, labels, kwargs


CASES = {
    "embedding_mask": dict(),
    "masking": dict(kind="masking"),
    "compute_mask": dict(kind="compute_mask"),
    "temporal_weights": dict(),
    "sample_weights": dict(),
    "sum": dict(loss=seq.token_loss("sum"), rate=0.002),
    "mean_with_sample_weight": dict(loss=seq.token_loss("mean_with_sample_weight")),
    "loss_subclass": dict(loss=seq.FocalTokens()),
    "kernel_regularizer": dict(regularized=True),
    "activity_regularizer": dict(activity=True),
}


def make(case, accumulate=None):
    spec = CASES[case]
    model = seq.tagger(spec.get("kind", "embedding"), spec.get("regularized", False),
                       spec.get("activity", False))
    if accumulate is not None:
        model = keras_fit.accumulate(model, **accumulate)
    return compiled(model, spec.get("loss"), seq.sgd(spec.get("rate", 0.2)),
                    metrics=["accuracy"])


def validation(x, y):
    """fit's validation arguments: the first 32 sequences, in batches of 16 (a batch's
    masked loss is its own token mean, so both fits evaluate the same batches)."""
    return dict(validation_data=(x[:32], y[:32]), validation_batch_size=seq.N * seq.B)


_REFERENCES = {}


def reference(case):
    """The direct batch: the plain model fitted on batches of N x B (memoized)."""
    if case not in _REFERENCES:
        x, y, kwargs = data(case)
        model = make(case)
        history = seq.fit(model, x, y, seq.N * seq.B, EPOCHS, **kwargs,
                          **validation(x, y)).history
        _REFERENCES[case] = model, history
    return _REFERENCES[case]


def assert_history(history, want):
    for key in want:
        np.testing.assert_allclose(history[key], want[key], rtol=1e-5, err_msg=key)


@pytest.mark.parametrize("window", WINDOW_PARAMS)
@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.slow) if case == "masking"
                                  else case for case in sorted(CASES)])  # the LSTM: slow
def test_a_masked_sequence_loss_trains_as_the_direct_batch(case, window):
    x, y, kwargs = data(case)
    direct, direct_history = reference(case)
    model = make(case, WINDOWS[window])
    history = seq.fit(model, x, y, BATCH[window], EPOCHS, **kwargs,
                      **validation(x, y)).history
    assert int(model.optimizer.iterations) == int(direct.optimizer.iterations) == 24
    assert seq.max_difference(model, direct) < 1e-5
    assert seq.max_difference(model, make(case)) > 1e-2  # it trained
    # The logged loss, the masked accuracy and the validation's: the direct batch's.
    assert sorted(history) == sorted(direct_history) == [
        "accuracy", "loss", "val_accuracy", "val_loss"]
    assert_history(history, direct_history)


def test_keras_own_accumulation_misses_the_masked_mean():
    x, y, _ = data("embedding_mask")
    own = compiled(seq.tagger(),
                   optimizer=keras.optimizers.SGD(0.2, gradient_accumulation_steps=seq.N))
    seq.fit(own, x[:80], y[:80], seq.B, EPOCHS)  # whole windows: only the mask differs
    whole = compiled(seq.tagger())
    seq.fit(whole, x[:80], y[:80], seq.N * seq.B, EPOCHS)
    assert seq.max_difference(own, whole) > 1e-3


@pytest.mark.parametrize("window", WINDOW_PARAMS)
def test_several_outputs_each_with_its_mask_reduction_and_weight(window):
    """Tokens under their mask, a label per sequence under mean_with_sample_weight with
    class weights folded into sample weights... each with its own divisor, summed
    apart: a term each."""
    ids, labels, lengths = seq.sequences()
    label = (lengths % 3).astype(np.int32)
    y = {"tokens": labels, "label": label}
    weights = {"tokens": np.ones(ids.shape, np.float32),
               "label": np.where(label == 1, 3.0, 0.5).astype(np.float32)}
    losses = {"tokens": seq.token_loss(),
              "label": keras.losses.SparseCategoricalCrossentropy(
                  from_logits=True, reduction="mean_with_sample_weight")}

    def model(**accumulate):
        net = seq.two_outputs()
        net = keras_fit.accumulate(net, **accumulate) if accumulate else net
        return compiled(net, losses, loss_weights={"tokens": 1.0, "label": 0.5})

    direct = model()
    want = seq.fit(direct, ids, y, seq.N * seq.B, EPOCHS, sample_weight=weights).history
    ours = model(**WINDOWS[window])
    got = seq.fit(ours, ids, y, BATCH[window], EPOCHS, sample_weight=weights).history
    assert seq.max_difference(ours, direct) < 1e-5
    assert_history(got, {"loss": want["loss"]})
    if KERAS > (3, 15):
        pytest.xfail("keras-nightly 3.16.0.dev2026102704 (make test-next) logs the direct "
                     "batch's per-output losses otherwise than 3.15 (tokens_loss, epoch 1: "
                     "3.011195, 3.15.1: 3.014386; the loss the same): the windows' weights "
                     "and loss are the direct batch's, their per-output logs 3.15's")
    assert_history(got, {k: want[k] for k in ("tokens_loss", "label_loss")})


def test_class_weight_under_mean_with_sample_weight():
    """class_weight, divided by the summed class weights."""
    ids, labels, lengths = seq.sequences()
    label = (lengths % 3).astype(np.int32)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                      reduction="mean_with_sample_weight")

    def model(**accumulate):
        init = keras.initializers.GlorotUniform
        net = keras.Sequential([keras.Input((seq.T,), dtype="int32"),
                                keras.layers.Embedding(seq.V, 8, embeddings_initializer=init(1)),
                                keras.layers.GlobalAveragePooling1D(),
                                keras.layers.Dense(3, kernel_initializer=init(2))])
        return compiled(keras_fit.accumulate(net, **accumulate) if accumulate else net, loss)

    class_weight = {0: 0.5, 1: 4.0, 2: 1.0}
    direct = model()
    want = seq.fit(direct, ids, label, seq.N * seq.B, EPOCHS, class_weight=class_weight)
    ours = model(average_gradients=seq.N)
    got = seq.fit(ours, ids, label, seq.B, EPOCHS, class_weight=class_weight)
    assert seq.max_difference(ours, direct) < 1e-5
    assert_history(got.history, want.history)


@pytest.mark.parametrize("window", WINDOW_PARAMS)
def test_a_mini_batch_or_a_whole_window_without_a_token_is_the_direct_batch(window):
    """Sequences 8-15 (a mini-batch) and 32-47 (a whole window, a direct batch) hold no
    token: the direct batch's loss there is 0 and its gradient zero, which SGD with
    momentum still applies (its momentum moves the weights on); so does the window, and
    nothing turns NaN."""
    ids, labels, _ = seq.sequences(empty=(slice(8, 16), slice(32, 48)))

    def model(**accumulate):
        net = keras_fit.accumulate(seq.tagger(), **accumulate) if accumulate else seq.tagger()
        return compiled(net, optimizer=momentum())

    direct = model()
    want = seq.fit(direct, ids, labels, seq.N * seq.B, EPOCHS).history
    ours = model(**WINDOWS[window])
    got = seq.fit(ours, ids, labels, BATCH[window], EPOCHS).history
    assert ours.skipped_windows == 0
    assert int(ours.optimizer.iterations) == int(direct.optimizer.iterations) == 24
    assert seq.max_difference(ours, direct) < 1e-5
    assert_history(got, want)


def test_a_float64_model_is_exact_to_1e_10():
    x, y, _ = data("embedding_mask")
    with floatx("float64"):
        direct = compiled(seq.tagger())
        seq.fit(direct, x, y, seq.N * seq.B, EPOCHS)
        ours = compiled(keras_fit.accumulate(seq.tagger(), seq.N))
        seq.fit(ours, x, y, seq.B, EPOCHS)
    assert ours.get_weights()[0].dtype == np.float64
    # Keras 3.12's mask adds 1e-7 to a batch's valid tokens (from 3.13 it divides by
    # them): once per direct batch, which the window's sum of divisors cannot hold.
    assert seq.max_difference(ours, direct) < (1e-10 if KERAS >= (3, 13) else 1e-9)


def test_under_xla_a_masked_loss_is_the_direct_batch():
    x, y, _ = data("embedding_mask")
    direct, _ = reference("embedding_mask")
    ours = compiled(keras_fit.accumulate(seq.tagger(), seq.N), jit_compile=True)
    seq.fit(ours, x, y, seq.B, EPOCHS)
    assert seq.max_difference(ours, direct) < 1e-5


# ---------------------------------------------------------------- the TF2 loop


@pytest.mark.parametrize("how", ["one_call", pytest.param("per_mini_batch", marks=pytest.mark.slow),
                                 pytest.param("micro_batch", marks=pytest.mark.slow)])
def test_fit_accumulated_divides_by_the_summed_weights(how):
    ids, labels, _ = seq.sequences(empty=(slice(8, 16),))
    token_weights = np.random.default_rng(3).uniform(0.2, 2.0, size=ids.shape)
    weights = ((ids > 0) * token_weights).astype(np.float32)
    direct = compiled(seq.tagger(), seq.token_loss("mean_with_sample_weight"), momentum())
    seq.fit(direct, ids, labels, seq.N * seq.B, EPOCHS, sample_weight=weights)
    model, optimizer = seq.tagger(), momentum()
    kwargs = ({"micro_batch_size": 7} if how == "micro_batch"
              else {"average_gradients": seq.N, "one_call": how == "one_call"})
    batch = seq.N * seq.B if how == "micro_batch" else seq.B
    for _ in range(EPOCHS):
        dataset = tf.data.Dataset.from_tensor_slices((ids, (labels, weights))).batch(batch)
        summary = tf2.fit_accumulated(model, dataset, optimizer, seq.weighted_token_losses,
                                         **kwargs)
    assert summary.updates == 6 and int(optimizer.iterations) == 24
    assert seq.max_difference(model, direct) < 1e-5


def test_the_token_mean_example_is_the_direct_batch():
    """examples/tf2_token_mean.py, docs/tf2-engine.md's runnable example."""
    example = runpy.run_path(os.path.join(ROOT, "examples", "tf2_token_mean.py"))
    assert example["difference"] < 1e-5 and int(example["optimizer"].iterations) == 9


def exactness_table():
    """docs/tf2-engine.md's table: per case, the max weight difference from the direct
    batch of Keras's own gradient_accumulation_steps=N and of accumulate(model, N), on
    the whole windows of the first 80 sequences (Keras's own has no partial window)."""
    rows = []
    for case in CASES:
        x, y, kwargs = data(case)
        kwargs = {k: v[:80] for k, v in kwargs.items()}
        spec = CASES[case]
        rate = spec.get("rate", 0.2)

        def plain(optimizer, case=case, spec=spec):
            model = seq.tagger(spec.get("kind", "embedding"), spec.get("regularized", False),
                               spec.get("activity", False))
            return compiled(model, spec.get("loss"), optimizer)

        direct = plain(seq.sgd(rate))
        seq.fit(direct, x[:80], y[:80], seq.N * seq.B, EPOCHS, **kwargs)
        own = plain(keras.optimizers.SGD(rate, gradient_accumulation_steps=seq.N))
        seq.fit(own, x[:80], y[:80], seq.B, EPOCHS, **kwargs)
        ours = make(case, {"average_gradients": seq.N})
        seq.fit(ours, x[:80], y[:80], seq.B, EPOCHS, **kwargs)
        rows.append((case, seq.max_difference(own, direct), seq.max_difference(ours, direct)))
    return rows


if __name__ == "__main__":  # python -m tests.library.test_sequences
    for case, own, ours in exactness_table():
        print(f"| {case} | {own:.1e} | {ours:.1e} |")
