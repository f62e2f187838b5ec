"""keras_fit.accumulate: Keras's compile/fit with exact gradient averaging.

Against the direct batch (the same model fitted with batch_size=N*B, same data order):
the same weights and History, for SGD with a LearningRateSchedule and Adam, numpy and
tf.data, 270 samples (not a multiple of N*B: each epoch ends with a window of a whole
mini-batch and a short one) over two epochs; and Keras's own
`gradient_accumulation_steps` shown to miss on the same cases. Tiny models: a Dense
layer or two on synthetic data (tests/library/toys.py). The two-replica MirroredStrategy
check runs inside test_tf2's mirrored subprocess (logical devices must be set
before TensorFlow starts): toys.mirrored_fit is its half of that script.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from gradient_averaging import keras_fit
from tests.library.toys import CLASSES
from tests.library.toys import FEATURES
from tests.library.toys import OPTIMIZERS
from tests.library.toys import SAMPLES
from tests.library.toys import B
from tests.library.toys import N
from tests.library.toys import activity_regularized
from tests.library.toys import bn_model
from tests.library.toys import compiled
from tests.library.toys import data
from tests.library.toys import fit
from tests.library.toys import floatx
from tests.library.toys import max_difference
from tests.library.toys import mixed_float16
from tests.library.toys import nan_in_second_window
from tests.library.toys import sgd
from tests.library.toys import tiny_model


@pytest.fixture(scope="module")
def direct():
    """The reference per optimizer: the plain model fitted on batches of N*B."""
    x, y = data()
    out = {}
    for name, make in OPTIMIZERS.items():
        model = compiled(tiny_model(), make())
        out[name] = model, fit(model, x, y, N * B).history
    return out


@pytest.mark.parametrize("clip", [{"clipnorm": 0.05}, {"global_clipnorm": 0.05},
                                  {"clipvalue": 0.002}], ids=lambda clip: next(iter(clip)))
def test_a_clipping_optimizer_clips_the_windows_mean_as_the_direct_batch_s(clip):
    """Clipping sees the window's mean, as the direct batch's optimizer clips its
    gradient: the optimizer is handed the mean, never the sum."""
    x, y = data()
    reference = compiled(tiny_model(), keras.optimizers.Adam(0.05, **clip))
    fit(reference, x, y, N * B)
    model = compiled(keras_fit.accumulate(tiny_model(), average_gradients=N),
                     keras.optimizers.Adam(0.05, **clip))
    fit(model, x, y, B)
    assert max_difference(model, reference) < 1e-5
    unclipped = compiled(tiny_model(), keras.optimizers.Adam(0.05))
    fit(unclipped, x, y, N * B)
    assert max_difference(unclipped, reference) > 1e-3  # the clip bound


@pytest.mark.parametrize("source", ["numpy", "tf.data"])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_fit_equals_the_direct_batch_and_keras_accumulation_does_not(direct, optimizer,
                                                                     source):
    x, y = data()
    reference, reference_history = direct[optimizer]
    model = compiled(keras_fit.accumulate(tiny_model(), average_gradients=N),
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


@pytest.mark.parametrize("window", [{"average_gradients": N}, {"micro_batch_size": B}])
def test_steps_per_execution_trains_every_window_and_evaluates_every_batch(direct, window):
    """compile's steps_per_execution=3: a call of the train function trains three windows
    (the last call of an epoch fewer), so every window trains, as at 1; evaluate and
    test_on_batch, with a micro-batch size each batch cut into mini-batches of it, see
    every batch: the direct model's loss and accuracy."""
    x, y = data()
    reference, _ = direct["adam"]
    batch_size = B if "average_gradients" in window else N * B
    model = compiled(keras_fit.accumulate(tiny_model(), **window), OPTIMIZERS["adam"](),
                     steps_per_execution=3)
    fit(model, x, y, batch_size)
    assert int(model.optimizer.iterations) == int(reference.optimizer.iterations) == 8
    assert max_difference(model, reference) < 1e-5
    got = model.evaluate(x, y, batch_size=N * B, verbose=0, return_dict=True)
    want = reference.evaluate(x, y, batch_size=N * B, verbose=0, return_dict=True)
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5)
    # test_on_batch too (Keras hands it (x, y, None)).
    got = model.test_on_batch(x[:N * B], y[:N * B], return_dict=True)
    want = reference.test_on_batch(x[:N * B], y[:N * B], return_dict=True)
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5)


def test_whole_windows_keras_accumulation_still_counts_the_schedule_in_mini_batches():
    """240 samples, whole windows only: Keras's own accumulation is exact with a constant
    rate, not with a schedule (it steps at mini-batch N-1, 2N-1...); accumulate is."""
    x, y = data(240)

    def constant(**kw):
        return keras.optimizers.SGD(0.1, **kw)

    for make, keras_exact in ((constant, True), (sgd, False)):
        reference = compiled(tiny_model(), make())
        fit(reference, x, y, N * B)
        ours = compiled(keras_fit.accumulate(tiny_model(), N), make())
        fit(ours, x, y, B)
        keras_own = compiled(tiny_model(), make(gradient_accumulation_steps=N))
        fit(keras_own, x, y, B)
        assert max_difference(ours, reference) < 1e-5
        assert (max_difference(keras_own, reference) < 1e-5) == keras_exact


def test_count_params_and_summary_answer_for_a_wrapped_model_as_for_the_model():
    """Before fit: a built model wrapped answers at once; an unbuilt one once fit built it
    (as the model itself would)."""
    built = tiny_model()
    wrapped = compiled(keras_fit.accumulate(built, average_gradients=N), sgd())
    assert wrapped.count_params() == built.count_params() > 0
    lines = []
    wrapped.summary(print_fn=lines.append)
    assert f"Total params: {built.count_params()} " in "\n".join(lines)
    unbuilt = keras.Sequential([keras.layers.Dense(CLASSES)])
    wrapped = compiled(keras_fit.accumulate(unbuilt, average_gradients=N), sgd())
    assert not wrapped.built
    x, y = data()
    fit(wrapped, x, y, B)
    assert wrapped.count_params() == unbuilt.count_params() == (FEATURES + 1) * CLASSES


def test_fit_passes_on_the_keras_arguments_it_does_not_read(monkeypatch):
    """Keras's fit is called with every argument AccumulatingModel.fit does not read as
    given, so that a parameter Keras adds reaches it (here one Keras does not have, taken
    off before Keras's own fit trains); its own arguments are Keras's by keyword."""
    seen = {}
    keras_fit_ = keras.Model.fit

    def recording(self, *args, new_in_keras=None, **kwargs):
        seen.update(new_in_keras=new_in_keras, initial_epoch=kwargs.get("initial_epoch"))
        return keras_fit_(self, *args, **kwargs)

    monkeypatch.setattr(keras.Model, "fit", recording)
    x, y = data()
    model = compiled(keras_fit.accumulate(tiny_model(), N), sgd())
    history = model.fit(x, y, batch_size=B, epochs=2, verbose=0, new_in_keras="passed",
                        initial_epoch=1, shuffle=False)
    assert seen == {"new_in_keras": "passed", "initial_epoch": 1}
    # One epoch of 14 mini-batches: 3 windows of N and a partial one.
    assert history.epoch == [1] and int(model.optimizer.iterations) == 4
    with pytest.raises(TypeError):
        model.fit(x, y, B, 1, 0, None, 0.1)  # validation_split: by keyword, as Keras's


def test_a_window_with_a_nan_is_skipped_whole_and_counted():
    x, y = data()
    bad, keep = nan_in_second_window(x)
    model = compiled(keras_fit.accumulate(tiny_model(), N), sgd())
    history = fit(model, bad, y, B).history
    assert model.skipped_windows == 2 and int(model.optimizer.iterations) == 6
    assert np.isfinite(history["loss"]).all()  # the NaN mini-batch is left out of the logs
    # The same as never seeing that window's samples (and the schedule did not step).
    reference = compiled(keras_fit.accumulate(tiny_model(), N), sgd())
    fit(reference, x[keep], y[keep], B)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_callbacks_validation_and_a_keras_round_trip(tmp_path):
    x, y = data()
    model = compiled(keras_fit.accumulate(tiny_model(dropout=0.2), N),
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
        assert isinstance(loaded, keras_fit.AccumulatingModel)
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
    uninterrupted = compiled(keras_fit.accumulate(tiny_model(), N), sgd())
    fit(uninterrupted, x, y, B)
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    first = compiled(keras_fit.accumulate(tiny_model(), N), sgd())
    with pytest.raises(RuntimeError, match="interrupted"):
        fit(first, x, y, B, callbacks=[backup, Interrupt()])
    resumed = compiled(keras_fit.accumulate(tiny_model(), N), sgd())  # a new process
    history = fit(resumed, x, y, B, callbacks=[backup])
    assert len(history.history["loss"]) == 1  # epoch 2 only
    assert int(resumed.optimizer.iterations) == 8
    for a, b in zip(resumed.get_weights(), uninterrupted.get_weights()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("jit_compile", [False, True], ids=["eager", "xla"])
def test_mixed_float16_with_keras_loss_scale_optimizer(jit_compile):
    """The direct batch without XLA in both cases."""
    x, y = data()
    with mixed_float16():
        model = compiled(keras_fit.accumulate(tiny_model(), N), sgd(),
                         jit_compile=jit_compile)
        reference = compiled(tiny_model(), sgd())
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    fit(model, x, y, B)
    fit(reference, x, y, N * B)
    assert model.jit_compile is jit_compile
    # The loss scale starts high: the first windows overflow in float16, and are
    # skipped by the LossScaleOptimizer (which lowers its scale), as the direct batch's.
    assert int(model.optimizer.iterations) == int(reference.optimizer.iterations) > 0
    assert model.skipped_windows == 8 - int(model.optimizer.iterations)
    # float16 activations: as close as the direct batch's own rounding allows.
    assert max_difference(model, reference) < 1e-2
    assert max_difference(model, tiny_model()) > 1e-2


class ScaleLog(keras.callbacks.Callback):
    """The LossScaleOptimizer's scale after each update (Keras's batch: the window)."""

    def __init__(self):
        super().__init__()
        self.scales = []

    def on_train_batch_end(self, batch, logs=None):
        self.scales.append(float(self.model.optimizer.dynamic_scale.numpy()))


@pytest.mark.parametrize("initial_scale", [2.0 ** 19,
                                           pytest.param(2.0 ** 26, marks=pytest.mark.slow)])
def test_the_loss_scale_moves_as_the_direct_batch_s(initial_scale):
    """Each mini-batch's pass differentiates its share of the window's mean, so its
    float16 backward pass holds the direct batch's magnitudes: at 2^19 neither
    overflows (a mini-batch's own mean did, in its fourth); from 2^26 both halve the
    scale on the same updates, skipped once each, and then apply the same."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 20)).astype(np.float32)
    y = rng.integers(0, 10, size=128).astype(np.int64)

    def model(**accumulate):
        init = keras.initializers.GlorotUniform
        with mixed_float16():
            net = keras.Sequential([
                keras.Input((20,)),
                keras.layers.Dense(32, activation="relu", kernel_initializer=init(1)),
                keras.layers.Dense(10, kernel_initializer=init(2))])
            net = keras_fit.accumulate(net, **accumulate) if accumulate else net
            return compiled(net, keras.optimizers.LossScaleOptimizer(
                keras.optimizers.SGD(0.1), initial_scale=initial_scale))

    logs = {}
    for name, accumulate, batch in (("direct", {}, 128), ("window", {"average_gradients": 4}, 32),
                                    ("micro", {"micro_batch_size": 32}, 128)):
        net, log = model(**accumulate), ScaleLog()
        fit(net, x, y, batch, epochs=12, callbacks=[log])
        logs[name] = log.scales, int(net.optimizer.iterations), net
    direct, window, micro = (logs[name][0] for name in ("direct", "window", "micro"))
    assert window == micro
    if initial_scale == 2.0 ** 19:  # nothing skipped, nothing halved, as the direct batch
        assert window == direct == [2.0 ** 19] * 12
        assert logs["window"][1] == logs["direct"][1] == 12
    else:
        # Halved on the same updates while a sample's own values overflow; the direct
        # batch's float16 sums over 128 samples may overflow where four over 32 do not.
        assert window[:5] == direct[:5] == [initial_scale / 2 ** (k + 1) for k in range(5)]
        assert all(w >= d for w, d in zip(window, direct))
    assert max_difference(logs["window"][2], logs["direct"][2]) < 1e-2


@pytest.mark.slow
def test_float8_scales_and_histories_are_the_direct_batch_s():
    """float8 layers keep scales and amax histories that the optimizer overwrites with
    their "gradient" (overwrite_with_gradient): the window gives it their elementwise
    maximum over its mini-batches, as Keras's own accumulation does, not a mean."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 20)).astype(np.float32)
    y = rng.integers(0, 10, size=128).astype(np.int64)

    def model(optimizer=None, **accumulate):
        init = keras.initializers.GlorotUniform
        net = keras.Sequential([keras.Input((20,)),
                                keras.layers.Dense(32, activation="relu",
                                                   kernel_initializer=init(1)),
                                keras.layers.Dense(10, kernel_initializer=init(2))])
        net.quantize("float8")
        net = keras_fit.accumulate(net, **accumulate) if accumulate else net
        return compiled(net, optimizer or keras.optimizers.SGD(0.1))

    def histories(net):  # by layer and name, in order
        return {f"{i}/{v.name}": v.numpy() for i, v in enumerate(net.weights)
                if "amax_history" in v.name or v.name.endswith("scale")}

    direct = model()
    fit(direct, x, y, 128, epochs=1)
    ours = model(average_gradients=4)
    fit(ours, x, y, 32, epochs=1)
    keras_own = model(keras.optimizers.SGD(0.1, gradient_accumulation_steps=4))
    fit(keras_own, x, y, 32, epochs=1)
    want, got, own = histories(direct), histories(ours), histories(keras_own)
    assert want and set(got) == set(want)
    for path in want:  # one update: the direct batch's histories and scales
        np.testing.assert_allclose(got[path], want[path], rtol=1e-2, err_msg=path)
        # Keras's own: its inputs' and kernels' too, but each pass's output gradient is
        # its mini-batch's mean's, N times the direct batch's, and so is that history.
        if "outputs_grad_amax_history" in path:
            np.testing.assert_allclose(own[path][0], 4 * want[path][0], rtol=1e-2)
        else:
            np.testing.assert_allclose(own[path], want[path], rtol=1e-2, err_msg=path)
    fit(direct, x, y, 128, epochs=20)
    fit(ours, x, y, 32, epochs=20)
    assert max_difference(ours, direct) < 5e-3  # float8's rounding


def test_a_float64_model_trains_as_its_direct_batch():
    """The loss sum is made in the loss's own type (a float64 model's loss is float64)."""
    x, y = data()
    with floatx("float64"):
        model = compiled(keras_fit.accumulate(tiny_model(), N), OPTIMIZERS["adam"]())
        reference = compiled(tiny_model(), OPTIMIZERS["adam"]())
    fit(model, x, y, B)
    fit(reference, x, y, N * B)
    assert model.weights[0].dtype == "float64"
    assert int(model.optimizer.iterations) == 8
    assert max_difference(model, reference) < 1e-10
    assert max_difference(model, tiny_model()) > 1e-2


# ---------------------------------------------------------------- XLA (jit_compile)
# Keras compiles fit's step with XLA by default on a GPU (jit_compile="auto"); XLA on the
# CPU stands in for it here. Under XLA every mini-batch runs at its window's padded width.


@pytest.mark.parametrize("optimizer, source", [("adam", "numpy"), ("sgd_schedule", "tf.data")])
def test_fit_under_xla_equals_the_direct_batch(direct, optimizer, source):
    x, y = data()
    reference, reference_history = direct[optimizer]
    model = compiled(keras_fit.accumulate(tiny_model(), N), OPTIMIZERS[optimizer](),
                     jit_compile=True)
    history = fit(model, x, y, B, source).history
    assert model.jit_compile is True  # XLA stayed on: nothing turned it off
    assert max_difference(model, reference) < 1e-5
    assert int(model.optimizer.iterations) == 8
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(history[key], reference_history[key], rtol=1e-5)


def test_a_nan_window_is_skipped_under_xla():
    """(mixed_float16 under XLA: test_mixed_float16_with_keras_loss_scale_optimizer.)"""
    x, y = data()
    bad, keep = nan_in_second_window(x)
    model = compiled(keras_fit.accumulate(tiny_model(), N), sgd(), jit_compile=True)
    fit(model, bad, y, B)
    reference = compiled(keras_fit.accumulate(tiny_model(), N), sgd(), jit_compile=True)
    fit(reference, x[keep], y[keep], B)
    assert model.skipped_windows == 2 and int(model.optimizer.iterations) == 6
    assert max_difference(model, reference) == 0.0  # as if never seen


# ------------------------------------------------------------- what accumulate refuses, embeddings


class OwnStep(keras.Sequential):
    """A model with a train_step of its own (a GAN's, a VAE's)."""

    def train_step(self, data):
        return super().train_step(data)


class OwnLoss(keras.Sequential):
    """A model that computes its loss its own way."""

    def compute_loss(self, *args, **kwargs):
        return 2.0 * super().compute_loss(*args, **kwargs)


@pytest.mark.parametrize("cls, step", [(OwnStep, "train_step"), (OwnLoss, "compute_loss")])
def test_a_model_with_its_own_step_is_refused_in_one_clear_error(cls, step):
    model = cls([keras.Input((FEATURES,)), keras.layers.Dense(CLASSES)])
    with pytest.raises(TypeError, match=f"overrides {step}.*MiniBatchAccumulator"):
        keras_fit.accumulate(model, N)


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_add_loss_in_the_forward_pass_counts_as_in_the_direct_batch(jit_compile):
    """An activity regularizer adds its loss during call (add_loss): per sample from Keras
    3.14, each mini-batch's weighted by its samples makes the direct batch's; before 3.14
    a raw sum over the batch, which the window step sums apart and adds unweighted. The
    logged loss is the direct batch's on either."""
    x, y = data()
    reference = compiled(activity_regularized(), sgd())
    reference_history = fit(reference, x, y, N * B).history
    model = compiled(keras_fit.accumulate(activity_regularized(), N), sgd(),
                     jit_compile=jit_compile)
    history = fit(model, x, y, B).history
    assert max_difference(model, reference) < 1e-5
    np.testing.assert_allclose(history["loss"], reference_history["loss"], rtol=1e-5)
    without = compiled(activity_regularized(l2=0.0), sgd())  # the loss is not a no-op here
    fit(without, x, y, N * B)
    assert max_difference(without, reference) > 1e-3


class OneHotLookup(keras.layers.Layer):
    """An embedding lookup as a one-hot matmul: its gradient is dense."""

    def __init__(self, table):
        super().__init__()
        self.table = self.add_weight(shape=table.shape, initializer=keras.initializers.Constant(
            table))

    def call(self, ids):
        return tf.matmul(tf.one_hot(ids, self.table.shape[0]), self.table)


def embedding_model(table, dense=False):
    lookup = OneHotLookup(table) if dense else keras.layers.Embedding(
        *table.shape, embeddings_initializer=keras.initializers.Constant(table))
    return keras.Sequential([keras.Input((3,), dtype="int32"), lookup, keras.layers.Flatten(),
                             keras.layers.Dense(CLASSES, kernel_initializer=keras.initializers.
                                                GlorotUniform(5))])


def test_an_embedding_under_adam_gets_the_dense_mean_of_the_direct_batch():
    """Ids repeat within windows: accumulate applies the window's mean gradient as one
    dense tensor, the direct batch's update when its lookup's gradient is dense; Keras's
    own Adam on the Embedding's sparse gradient (repeated rows) differs."""
    rng = np.random.default_rng(3)
    table = rng.normal(size=(6, 4)).astype(np.float32)
    ids = rng.integers(0, 6, size=(SAMPLES, 3)).astype(np.int32)
    labels = rng.integers(0, CLASSES, size=SAMPLES)
    ours = compiled(keras_fit.accumulate(embedding_model(table), N), keras.optimizers.Adam(0.05))
    fit(ours, ids, labels, B)
    dense_direct = compiled(embedding_model(table, dense=True), keras.optimizers.Adam(0.05))
    fit(dense_direct, ids, labels, N * B)
    sparse_direct = compiled(embedding_model(table), keras.optimizers.Adam(0.05))
    fit(sparse_direct, ids, labels, N * B)
    assert max_difference(ours, dense_direct) < 1e-5
    assert max_difference(sparse_direct, dense_direct) > 1e-3  # Keras's sparse Adam


@pytest.mark.parametrize("parallel, jit_compile", [
    pytest.param(2, False, id="2"), pytest.param(3, False, id="3"),
    pytest.param(2, True, id="2-xla", marks=pytest.mark.slow)])
def test_parallel_mini_batches_train_the_bits_of_one_at_a_time(parallel, jit_compile):
    """P passes at once, each on the state the one before left as values (dropout's seed
    generators, batch norm's statistics stepped per mini-batch, the metrics): the weights,
    statistics and History of P=1, in windows of N with a partial one shorter than P, and
    in effective batches cut where B does not divide them."""
    x, y = data()

    def trained(model, batch_size, **kwargs):
        accumulating = compiled(keras_fit.accumulate(model, **kwargs),
                                keras.optimizers.Adam(0.05), jit_compile=jit_compile)
        return accumulating, fit(accumulating, x, y, batch_size).history

    cases = [(lambda: tiny_model(dropout=0.2), B, dict(average_gradients=N)),
             (bn_model, B, dict(average_gradients=N, bn_statistics="mini_batch")),
             (lambda: tiny_model(dropout=0.2), 53, dict(micro_batch_size=7))]
    for make, batch_size, kwargs in cases:
        one, one_history = trained(make(), batch_size, **kwargs)
        group, group_history = trained(make(), batch_size, parallel_mini_batches=parallel,
                                       **kwargs)
        assert group.parallel_mini_batches == parallel
        for a, b in zip(one.get_weights(), group.get_weights()):
            np.testing.assert_array_equal(a, b)
        assert group_history == one_history


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2", None])
def test_a_bad_parallel_mini_batches_is_one_clear_error(value):
    with pytest.raises(ValueError, match="parallel_mini_batches must be an int >= 1"):
        keras_fit.accumulate(tiny_model(), N, parallel_mini_batches=value)
