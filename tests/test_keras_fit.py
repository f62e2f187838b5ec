"""tf2_accumulator.accumulate: Keras's compile/fit with exact gradient averaging.

Against the direct batch (the same model fitted with batch_size=N*B, same data order):
the same weights and History, for SGD with a LearningRateSchedule and Adam, numpy and
tf.data, 250 samples (not a multiple of N*B) over two epochs; and Keras's own
`gradient_accumulation_steps` shown to miss on the same cases. Tiny models: a Dense
layer or two on synthetic data. The two-replica MirroredStrategy check runs inside
test_tf2_accumulator's mirrored subprocess (logical devices must be set before TensorFlow
starts): `mirrored_fit` below is its half of that script.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf2_accumulator

N, B = 4, 20  # an update per 80 samples: 250 = 3 x 80 + 10, a partial window per epoch
SAMPLES, FEATURES, CLASSES = 250, 8, 3


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


def sgd(**kwargs):
    """SGD on a schedule that halves the rate at every optimizer step."""
    return keras.optimizers.SGD(
        keras.optimizers.schedules.ExponentialDecay(0.2, decay_steps=1, decay_rate=0.5),
        **kwargs)


OPTIMIZERS = {"sgd_schedule": sgd, "adam": lambda **kw: keras.optimizers.Adam(0.05, **kw)}


def compiled(model, optimizer):
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def fit(model, x, y, batch_size, source="numpy", epochs=2, **kwargs):
    if source == "tf.data":
        return model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size),
                         epochs=epochs, verbose=0, **kwargs)
    return model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0,
                     **kwargs)


def max_difference(a, b):
    return max(float(np.abs(u - v).max()) for u, v in zip(a.get_weights(), b.get_weights()))


@pytest.fixture(scope="module")
def direct():
    """The reference per optimizer: the plain model fitted on batches of N*B."""
    x, y = data()
    out = {}
    for name, make in OPTIMIZERS.items():
        model = compiled(tiny_model(), make())
        out[name] = model, fit(model, x, y, N * B).history
    return out


@pytest.mark.parametrize("source", ["numpy", "tf.data"])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_fit_equals_the_direct_batch_and_keras_accumulation_does_not(direct, optimizer,
                                                                     source):
    x, y = data()
    reference, reference_history = direct[optimizer]
    model = compiled(tf2_accumulator.accumulate(tiny_model(), average_gradients=N),
                     OPTIMIZERS[optimizer]())
    history = fit(model, x, y, B, source).history
    assert max_difference(model, reference) < 1e-5
    assert max_difference(model, tiny_model()) > 1e-2  # it trained
    # One update per window: 3 full and a partial one per epoch; the schedule agrees.
    assert int(model.optimizer.iterations) == int(reference.optimizer.iterations) == 8
    # History: the samples' mean loss and accuracy per epoch, as the direct batch's.
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(history[key], reference_history[key], rtol=1e-5)
    if source == "numpy":  # Keras's own accumulation on the same case
        keras_own = compiled(tiny_model(), OPTIMIZERS[optimizer](gradient_accumulation_steps=N))
        fit(keras_own, x, y, B)
        assert max_difference(keras_own, reference) > 1e-2


def test_whole_windows_keras_accumulation_still_counts_the_schedule_in_micro_batches():
    """240 samples, whole windows only: Keras's own accumulation is exact with a constant
    rate, not with a schedule (it steps at micro-batch N-1, 2N-1...); accumulate is."""
    x, y = data(240)
    constant = lambda **kw: keras.optimizers.SGD(0.1, **kw)  # noqa: E731
    for make, keras_exact in ((constant, True), (sgd, False)):
        reference = compiled(tiny_model(), make())
        fit(reference, x, y, N * B)
        ours = compiled(tf2_accumulator.accumulate(tiny_model(), N), make())
        fit(ours, x, y, B)
        keras_own = compiled(tiny_model(), make(gradient_accumulation_steps=N))
        fit(keras_own, x, y, B)
        assert max_difference(ours, reference) < 1e-5
        assert (max_difference(keras_own, reference) < 1e-5) == keras_exact


def test_a_window_with_a_nan_is_discarded_whole_and_counted():
    x, y = data()
    bad = x.copy()
    bad[N * B + 5, 2] = np.nan  # window 2 of each epoch
    model = compiled(tf2_accumulator.accumulate(tiny_model(), N), sgd())
    history = fit(model, bad, y, B).history
    assert model.skipped_windows == 2 and int(model.optimizer.iterations) == 6
    assert np.isfinite(history["loss"]).all()  # the NaN micro-batch is left out of the logs
    # The same as never seeing that window's samples (and the schedule did not step).
    keep = np.r_[0:N * B, 2 * N * B:SAMPLES]
    reference = compiled(tf2_accumulator.accumulate(tiny_model(), N), sgd())
    fit(reference, x[keep], y[keep], B)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_callbacks_validation_and_a_keras_round_trip(tmp_path):
    x, y = data()
    model = compiled(tf2_accumulator.accumulate(tiny_model(dropout=0.2), N),
                     keras.optimizers.Adam(0.05))
    seen = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: seen.append(int(model.optimizer.iterations)))
    history = model.fit(
        x, y, batch_size=B, epochs=6, verbose=0, validation_data=data(60, seed=1),
        callbacks=[record,
                   keras.callbacks.ModelCheckpoint(str(tmp_path / "best.keras"),
                                                   save_best_only=True),
                   keras.callbacks.ReduceLROnPlateau(monitor="loss", min_delta=10, patience=0,
                                                     factor=0.5),
                   keras.callbacks.EarlyStopping(monitor="loss", min_delta=10, patience=2),
                   keras.callbacks.TensorBoard(str(tmp_path / "tb"))])
    assert seen[:5] == [1, 2, 3, 4, 5]  # a batch callback per update
    assert len(history.history["val_loss"]) == 3  # stopped by EarlyStopping
    # TensorBoard logged each epoch's loss, as History has it.
    assert tensorboard_scalars(tmp_path / "tb" / "train", "epoch_loss") == pytest.approx(
        history.history["loss"])
    # Reduced at the end of epochs 2 and 3 (the first set the best loss); logged before.
    assert history.history["learning_rate"] == pytest.approx([0.05, 0.05, 0.025])
    assert float(model.optimizer.learning_rate) == pytest.approx(0.0125)
    model.save(tmp_path / "model.keras")
    for path in ("best.keras", "model.keras"):  # ModelCheckpoint's, then this one
        loaded = keras.models.load_model(tmp_path / path)
        assert isinstance(loaded, tf2_accumulator.AccumulatingModel)
        assert loaded.average_gradients == N
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    evaluated = [m.evaluate(x, y, verbose=0, return_dict=True)["loss"] for m in (model, loaded)]
    assert evaluated[0] == pytest.approx(evaluated[1])


def tensorboard_scalars(logdir, tag):
    """The values of `tag` in the event files under `logdir`, in step order."""
    values = []
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            values += [(event.step, float(tf.make_ndarray(v.tensor)))
                       for v in event.summary.value if v.tag == tag]
    return [value for _, value in sorted(values)]


class Interrupt(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 1:
            raise RuntimeError("interrupted")


def test_backup_and_restore_resumes_an_interrupted_fit_to_the_same_weights(tmp_path):
    x, y = data()
    uninterrupted = compiled(tf2_accumulator.accumulate(tiny_model(), N), sgd())
    fit(uninterrupted, x, y, B)
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    first = compiled(tf2_accumulator.accumulate(tiny_model(), N), sgd())
    with pytest.raises(RuntimeError, match="interrupted"):
        fit(first, x, y, B, callbacks=[backup, Interrupt()])
    resumed = compiled(tf2_accumulator.accumulate(tiny_model(), N), sgd())  # a new process
    history = fit(resumed, x, y, B, callbacks=[backup])
    assert len(history.history["loss"]) == 1  # epoch 2 only
    assert int(resumed.optimizer.iterations) == 8
    for a, b in zip(resumed.get_weights(), uninterrupted.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_mixed_float16_with_keras_loss_scale_optimizer():
    x, y = data()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = compiled(tf2_accumulator.accumulate(tiny_model(), N), sgd())
        reference = compiled(tiny_model(), sgd())
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    fit(model, x, y, B)
    fit(reference, x, y, N * B)
    # The loss scale starts high: the first windows overflow in float16, and are
    # skipped by the LossScaleOptimizer (which lowers its scale), as the direct batch's.
    assert int(model.optimizer.iterations) == int(reference.optimizer.iterations) > 0
    assert model.skipped_windows == 8 - int(model.optimizer.iterations)
    # float16 activations: as close as the direct batch's own rounding allows.
    assert max_difference(model, reference) < 1e-2
    assert max_difference(model, tiny_model()) > 1e-2


def mirrored_fit(strategy):
    """Run by test_tf2_accumulator's mirrored script: accumulate under 2 replicas
    against one device, and the all-reduces traced into one train_step."""
    x, y = data()
    one_device = compiled(tf2_accumulator.accumulate(tiny_model(), N), sgd())
    fit(one_device, x, y, B)
    with strategy.scope():
        model = compiled(tf2_accumulator.accumulate(tiny_model(), N), sgd())
    fit(model, x, y, B)
    specs = ((tf.TensorSpec([None, None, FEATURES]), tf.TensorSpec([None, None], tf.int64)),
             tf.TensorSpec([None], tf.int32))
    specs = tf.nest.map_structure(lambda s: tf.TensorSpec([2] + s.shape.as_list(), s.dtype),
                                  specs)
    # The step as Keras runs it, per replica (each gets the window on a leading axis).
    step = tf.function(lambda data: strategy.run(model.train_step, args=(data,)))
    return {"fit_difference": max_difference(model, one_device),
            "fit_updates": int(model.optimizer.iterations.numpy()),
            "fit_all_reduces": tf2_accumulator.count_all_reduces(
                step.get_concrete_function(specs)),
            "fit_variables": len(model.trainable_variables)}


def check_mirrored_fit(result):
    """test_tf2_accumulator's assertions on mirrored_fit's result."""
    assert result["fit_difference"] < 1e-5 and result["fit_updates"] == 8
    # The optimizer's all-reduce of the applied mean, once per window; nothing per
    # micro-batch (their N is not even known when traced).
    assert 1 <= result["fit_all_reduces"] <= 2 * result["fit_variables"] + 1
