"""gradient_averaging.tf2: the one-call window (WindowAccumulator.apply_window,
fit_accumulated's default) against its per-mini-batch path (MiniBatchAccumulator.accumulate
+ apply), on real MNIST, and each against the direct batch; XLA and mixed precision; two
mirrored replicas in a process of its own.

The model is a small ConvNet with seeded dropout (tests/library/toys.py; the library is
for your own Keras model): both paths must draw the same dropout masks in the same order,
so their weights are compared for equality, not closeness.
"""

import ctypes
import json
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import gradient_averaging
from gradient_averaging import micro_batch as micro_batch_lib
from gradient_averaging import tf2
from gradient_averaging import window as window_lib
from tests.helpers import CPU_ONLY
from tests.helpers import run_cli
from tests.library import sequences
from tests.library.toys import activity_regularized
from tests.library.toys import check_mirrored_fit
from tests.library.toys import cross_entropy
from tests.library.toys import data as toy_data
from tests.library.toys import max_difference
from tests.library.toys import mini_batches
from tests.library.toys import mixed_float16
from tests.library.toys import sgd as halving_sgd  # the rate halves at every update
from tests.library.toys import side_branch
from tests.library.toys import small_conv_net
from tests.library.toys import tiny_model as toy_model
from tests.library.toys import windows
from tools import common
from tools import memory


def accumulator(optimizer, model=None, **kwargs):
    """The one-call window's trainer."""
    return tf2.WindowAccumulator(model or small_conv_net(), optimizer,
                                             cross_entropy, **kwargs)


def per_mini_batch(optimizer, model=None, **kwargs):
    return tf2.MiniBatchAccumulator(model or small_conv_net(), optimizer,
                                               cross_entropy, **kwargs)


def assert_same_weights(a, b):
    for x, y in zip(a.model.get_weights(), b.model.get_weights()):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("make_optimizer", [lambda: keras.optimizers.Adam(1e-2),
                                            lambda: keras.optimizers.SGD(0.1)],
                         ids=["adam", "sgd"])
def test_one_call_window_equals_the_per_mini_batch_path(mnist, make_optimizer):
    per_mini, one_call = per_mini_batch(make_optimizer()), accumulator(make_optimizer())
    start = [w.copy() for w in one_call.model.get_weights()]
    for window in windows(mnist.train):
        for x, y in window:
            per_mini.accumulate(x, y)
        assert per_mini.apply() is True
        assert one_call.apply_window(window) is True
    assert_same_weights(per_mini, one_call)
    assert not np.array_equal(start[0], one_call.model.get_weights()[0])  # it trained
    assert one_call.updates == int(one_call.optimizer.iterations.numpy()) == 3
    assert one_call.loss_totals() == pytest.approx(per_mini.loss_totals(), rel=1e-12)
    # dropout's seed generators advanced alike: the next masks are the same too
    for a, b in zip(per_mini.model.non_trainable_variables,
                    one_call.model.non_trainable_variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_padding_of_short_mini_batches_is_left_out(mnist):
    """The same window stacked wider (more zero padding) trains to the same weights."""
    window = mini_batches(mnist.train, (6, 2, 5))
    xs, ys, sizes = tf2.stack_window(window)
    assert xs.shape == (3, 6, 28, 28, 1) and sizes.tolist() == [6, 2, 5]
    assert not np.any(xs[1, 2:]) and np.array_equal(xs[2, :5], window[2][0])
    padded = [np.pad(a, [(0, 0), (0, 4)] + [(0, 0)] * (a.ndim - 2)) for a in (xs, ys)]
    narrow, wide = accumulator(keras.optimizers.SGD(0.1)), accumulator(keras.optimizers.SGD(0.1))
    narrow.apply_stacked(xs, ys, sizes)
    wide.apply_stacked(*padded, sizes)
    assert_same_weights(narrow, wide)
    # Padding counted as samples would be another gradient: this test would see it.
    equal = accumulator(keras.optimizers.SGD(0.1))
    equal.apply_stacked(xs, ys, np.array([6, 6, 6], np.int32))
    assert any(not np.array_equal(a, b) for a, b in zip(narrow.model.get_weights(),
                                                        equal.model.get_weights()))


@pytest.mark.parametrize("source", ["tf.data", "list"])
def test_fit_in_one_call_per_window_equals_fit_per_mini_batch(mnist, source):
    """10 mini-batches at N=4 (a short last one): windows of 4, 4 and a partial 2."""
    images, labels = mnist.train.images[:75], mnist.train.labels[:75]
    if source == "tf.data":
        dataset = tf.data.Dataset.from_tensor_slices((images, labels)).batch(8)
    else:
        dataset = mini_batches(mnist.train, [8] * 9 + [3])
    summaries, models, calls = [], [], []
    for one_call in (False, True):
        model = small_conv_net()
        seen = []
        summaries.append(tf2.fit_accumulated(
            model, dataset, keras.optimizers.Adam(1e-2), cross_entropy, average_gradients=4,
            callback=seen.append, one_call=one_call))
        models.append(model)
        calls.append(seen)
    assert summaries[0] == summaries[1] == tf2.FitSummary(
        mini_batches=10, updates=3, partial_window=2)
    assert calls[0] == calls[1] == list(range(1, 11))
    for a, b in zip(models[0].get_weights(), models[1].get_weights()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("one_call", [True, False], ids=["window", "per_mini_batch"])
def test_fit_accumulated_under_xla_equals_the_direct_batch(mnist, one_call):
    """jit_compile=True: 75 samples in mini-batches of 8, N=4: windows of 32, 32 and a
    partial one of 8 + 3, the one-call window at its padded width, an LR schedule that
    steps per update, dropout off; against plain Keras's batches of 32, 32 and 11. A
    window holding a NaN is skipped under XLA too, as if never seen."""
    images, labels = mnist.train.images[:75], mnist.train.labels[:75]
    direct = small_conv_net(dropout=0.0)
    direct.compile(optimizer=halving_sgd(),
                   loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    direct.fit(images, labels, batch_size=32, epochs=1, shuffle=False, verbose=0)
    model = small_conv_net(dropout=0.0)
    optimizer = halving_sgd()
    summary = tf2.fit_accumulated(
        model, tf.data.Dataset.from_tensor_slices((images, labels)).batch(8), optimizer,
        cross_entropy, average_gradients=4, one_call=one_call, jit_compile=True)
    assert summary == tf2.FitSummary(mini_batches=10, updates=3, partial_window=2)
    assert int(optimizer.iterations) == 3
    for a, b in zip(model.get_weights(), direct.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)
    poisoned = images[:64].copy()
    poisoned[40, 3] = np.nan  # window 2
    skipped, clean = small_conv_net(dropout=0.0), small_conv_net(dropout=0.0)
    summary = tf2.fit_accumulated(skipped, mini_batches_of(poisoned, labels[:64]),
                                  halving_sgd(), cross_entropy, 4, one_call=one_call,
                                  jit_compile=True)
    assert summary.skipped_windows == 1 and summary.updates == 1
    tf2.fit_accumulated(clean, mini_batches_of(images[:32], labels[:32]), halving_sgd(),
                        cross_entropy, 4, one_call=one_call, jit_compile=True)
    for a, b in zip(skipped.get_weights(), clean.get_weights()):
        np.testing.assert_array_equal(a, b)


def mini_batches_of(x, y, size=8):
    return [(x[i:i + size], y[i:i + size]) for i in range(0, len(y), size)]


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_fit_accumulated_under_mixed_float16_scales_its_loss(jit_compile):
    """mixed_float16 with Keras's LossScaleOptimizer: the loss is scaled and the applied
    mean unscaled, for both paths, as the direct batch of plain Keras (within float16
    rounding); an overflowed window goes to the optimizer, which skips it."""
    x, y = toy_data()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    with mixed_float16():
        direct = toy_model()
        models = [toy_model() for _ in range(2)]
    direct.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.2)),
                   loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    direct.fit(x, y, batch_size=80, epochs=1, shuffle=False, verbose=0)
    for model, one_call in zip(models, (True, False)):
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.2))
        summary = tf2.fit_accumulated(
            model, tf.data.Dataset.from_tensor_slices((x, y)).batch(20), optimizer, loss_fn,
            4, one_call=one_call, jit_compile=jit_compile)
        assert summary.updates + summary.skipped_windows == 4
        assert int(optimizer.iterations) == summary.updates > 0
        assert max_difference(model, direct) < 1e-2
        assert max_difference(model, toy_model()) > 1e-2


@pytest.mark.parametrize("accumulator", [tf2.WindowAccumulator, tf2.MiniBatchAccumulator])
def test_an_activity_regularizer_counts_as_in_the_direct_batch(accumulator):
    """An activity regularizer's loss, against plain Keras's batches of 80, on every
    supported Keras: before 3.14 Keras adds its raw sum over the batch (so a mini-batch's
    weighs as much as the whole window's samples, learnt only at the window's end), from
    3.14 its mean per sample. 270 samples in mini-batches of 20, N=4: three windows and a
    partial one of 20 + 10. The logged loss is the direct batch's too."""
    x, y = toy_data()
    direct = activity_regularized()
    direct.compile(optimizer=halving_sgd(),
                   loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = direct.fit(x, y, batch_size=80, epochs=1, shuffle=False, verbose=0).history
    model = activity_regularized()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    trainer = accumulator(model, halving_sgd(), loss_fn, average_gradients=4)
    summary = trainer.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(20))
    assert summary == tf2.FitSummary(mini_batches=14, updates=4, partial_window=2)
    assert max_difference(model, direct) < 1e-5
    loss_sum, samples = trainer.loss_totals()
    assert samples == len(x)
    np.testing.assert_allclose(loss_sum / samples, history["loss"][0], rtol=1e-5)


@pytest.mark.parametrize("accumulator", [tf2.WindowAccumulator, tf2.MiniBatchAccumulator])
def test_a_weight_that_only_an_activity_regularizer_reaches_is_trained(accumulator):
    """A side layer whose output only its activity regularizer sees trains as in the
    direct batch. Before Keras 3.14, where that regularizer's loss is summed apart
    (`make test-low`), the loss itself gives the layer's weights no gradient."""
    x, y = toy_data()
    direct = side_branch()
    direct.compile(optimizer=halving_sgd(),
                   loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    direct.fit(x, y, batch_size=80, epochs=1, shuffle=False, verbose=0)
    model = side_branch()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    trainer = accumulator(model, halving_sgd(), loss_fn, average_gradients=4)
    trainer.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(20))
    assert max_difference(model, direct) < 1e-5
    assert np.abs(model.side.kernel.numpy() - side_branch().side.kernel.numpy()).max() > 1e-3


def test_an_activity_regularizer_under_mixed_float16_counts_as_in_float32():
    """A float16 layer's activity loss is float16: summed in float32 with the loss, scaled
    as the loss is by the LossScaleOptimizer and unscaled with the mean (before Keras 3.14
    its gradients are summed apart). Against float32's direct batch (Keras 3.12 cannot fit
    this model under mixed_float16 itself), within float16 rounding."""
    x, y = toy_data()
    direct = activity_regularized()
    direct.compile(optimizer=keras.optimizers.SGD(0.2),
                   loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    direct.fit(x, y, batch_size=80, epochs=1, shuffle=False, verbose=0)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    for accumulator in (tf2.WindowAccumulator, tf2.MiniBatchAccumulator):
        with mixed_float16():
            model = activity_regularized()
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.2))
        summary = accumulator(model, optimizer, loss_fn, average_gradients=4).fit(
            tf.data.Dataset.from_tensor_slices((x, y)).batch(20))
        assert summary.updates == 4 and summary.skipped_windows == 0
        assert max_difference(model, direct) < 1e-2


@pytest.mark.parametrize("trainer", [tf2.WindowAccumulator,
                                     tf2.MiniBatchAccumulator])
def test_each_fits_summary_counts_its_own_updates_and_skipped_windows(mnist, trainer):
    """Two fits on one trainer: each FitSummary counts that fit's windows only, a
    window holding a NaN as skipped; the trainer's counters hold both fits'."""
    batches = mini_batches(mnist.train, [5] * 6)  # 3 windows of 2
    nan = (batches[2][0].copy(), batches[2][1])
    nan[0][1] = np.nan
    fitted = trainer(small_conv_net(dropout=0.0), keras.optimizers.Adam(1e-2), cross_entropy,
                     average_gradients=2)
    first = fitted.fit(batches[:2] + [nan] + batches[3:])
    assert first == tf2.FitSummary(mini_batches=6, updates=2, partial_window=0,
                                               skipped_windows=1)
    second = fitted.fit(batches[:5], warn_partial=False)
    assert second == tf2.FitSummary(mini_batches=5, updates=3, partial_window=1,
                                                skipped_windows=0)
    assert (fitted.updates, fitted.skipped_windows) == (5, 1)


def test_a_nonfinite_window_is_skipped_whole_in_one_call(mnist):
    good, bad, after = windows(mnist.train, ((5, 5), (5, 5), (5, 5)))
    bad[1] = (bad[1][0].copy(), bad[1][1])  # windows() returns views of MNIST
    bad[1][0][3] = np.nan
    one_call = accumulator(keras.optimizers.Adam(1e-2), small_conv_net(dropout=0.0))
    assert one_call.apply_window(good) is True
    before = [w.copy() for w in one_call.model.get_weights()]
    assert one_call.apply_window(bad) is False
    assert (one_call.updates, one_call.skipped_windows) == (1, 1)
    assert int(one_call.optimizer.iterations.numpy()) == 1  # LR schedules stay put
    for a, b in zip(before, one_call.model.get_weights()):
        np.testing.assert_array_equal(a, b)
    # The next window applies as if the skipped one had never been.
    reference = accumulator(keras.optimizers.Adam(1e-2), small_conv_net(dropout=0.0))
    reference.apply_window(good)
    assert one_call.apply_window(after) and reference.apply_window(after)
    assert_same_weights(one_call, reference)


def trained_on(path, batches):
    """The weights after `path` trains on `batches` (mini-batches of 5, windows of 2)."""
    model, optimizer = small_conv_net(dropout=0.0), keras.optimizers.Adam(1e-2)
    if path == "accumulate":
        model = gradient_averaging.accumulate(model, 2)
        model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(np.concatenate([x for x, _ in batches]),
                  np.concatenate([y for _, y in batches]), batch_size=5, shuffle=False,
                  verbose=0)
    else:
        trainer = {"window": tf2.WindowAccumulator, "mini_batch": tf2.MiniBatchAccumulator}
        trainer[path](model, optimizer, cross_entropy, average_gradients=2).fit(batches)
    return model.get_weights()


@pytest.mark.parametrize("value, position", [(np.nan, 0), (np.inf, 1), (-np.inf, 0)])
@pytest.mark.parametrize("path", ["window", "mini_batch", "accumulate"])
def test_every_path_skips_a_window_with_a_nonfinite_mini_batch_whole(mnist, path, value,
                                                                     position):
    """Its first mini-batch's or its last's: the weights are those of never seeing the
    window, and the next window holds nothing of it (its sums zeroed)."""
    batches = mini_batches(mnist.train, [5] * 6)  # 3 windows of 2
    bad = 2 + position
    images = batches[bad][0].copy()
    images[1, 3] = value
    with_bad = batches[:bad] + [(images, batches[bad][1])] + batches[bad + 1:]
    for got, want in zip(trained_on(path, with_bad),
                         trained_on(path, batches[:2] + batches[4:])):
        np.testing.assert_array_equal(got, want)


def buffer_address(variable):
    """Where a variable's value lies in memory (a read shares its buffer)."""
    capsule = tf.experimental.dlpack.to_dlpack(variable.read_value())
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    return ctypes.c_void_p.from_address(get(capsule, b"dltensor")).value  # DLTensor.data


def test_the_sums_keep_their_buffers_through_a_windows_additions(mnist):
    # An assign takes its value's buffer: a window whose first mini-batch assigned its
    # gradients kept buffers made amid that pass's activations (window.zero_sums).
    per_mini = per_mini_batch(keras.optimizers.Adam(1e-2))
    good, after = windows(mnist.train, ((5, 5), (5, 5)))
    for x, y in good:
        per_mini.accumulate(x, y)
    assert per_mini.apply() is True  # its sums zeroed, for the next window
    assert not any(np.any(s.numpy()) for s in per_mini.sums)
    before = [buffer_address(s) for s in per_mini.sums]
    for x, y in after:
        per_mini.accumulate(x, y)
        assert [buffer_address(s) for s in per_mini.sums] == before
    assert all(np.any(s.numpy()) for s in per_mini.sums)  # and they were added to


IN_PLACE = """
import json
import numpy as np
import tensorflow as tf
from gradient_averaging import window
rng = np.random.default_rng(0)
values = [rng.standard_normal(shape).astype(np.float32) for shape in ((4096, 1024), (1024,))]
values[0][0, 0] = np.nan
sums = [tf.Variable(v) for v in values]
divide = tf.function(lambda: window.divide_in_place([sums], [tf.constant(3.0, tf.float64)])[1])


@tf.function
def zero():
    window.zero_sums(sums)


def growth(run):  # MiB the peak rose over what was held as `run` ran
    held = tf.config.experimental.get_memory_info("CPU:0")["current"]
    tf.config.experimental.reset_memory_stats("CPU:0")
    result = run()
    return (tf.config.experimental.get_memory_info("CPU:0")["peak"] - held) / 2**20, result

divided, finite = growth(divide)
same = all(np.array_equal(s.numpy(), v / np.float32(3), equal_nan=True)
           for s, v in zip(sums, values))
zeroed = growth(zero)[0]
print(json.dumps(dict(divided=divided, finite=bool(finite), same=same, zeroed=zeroed,
                      zeros=all(not np.any(s.numpy()) for s in sums))))
"""


def test_the_sums_are_divided_and_zeroed_in_their_own_buffers_with_no_temporary():
    """The window's close makes no sum-sized temporary (16 MiB here): the mean is divided in
    place, bit for bit a division, a NaN seen; the next window's zeros are written in place."""
    done = subprocess.run([sys.executable, "-c", IN_PLACE], cwd=common.ROOT,
                          env=memory.probe_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.splitlines()[-1])
    assert got["same"] and not got["finite"] and got["zeros"], got
    assert got["divided"] < 1 and got["zeroed"] < 1, got


def test_lr_schedule_counts_updates_in_one_call(mnist):
    rates = {}
    for n in (1, 4):
        optimizer = keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(
            0.1, decay_steps=2, decay_rate=0.5))
        one_call = accumulator(optimizer, small_conv_net(dropout=0.0))
        for window in windows(mnist.train, [(2,) * n] * 3):  # three updates
            one_call.apply_window(window)
        assert int(optimizer.iterations.numpy()) == 3
        rates[n] = float(optimizer.learning_rate.numpy())
    assert rates[1] == rates[4] == pytest.approx(0.1 * 0.5 ** 1.5)


@pytest.mark.parametrize("check_finite", [True, False])
def test_build_window_trains_nothing(mnist, check_finite):
    one_call = accumulator(keras.optimizers.Adam(1e-2), check_finite=check_finite)
    start = [w.copy() for w in one_call.model.get_weights()]
    window = mini_batches(mnist.train, (4, 4))
    one_call.build_window(*tf2.stack_window(window))
    assert one_call.window_step is not None
    for a, b in zip(start, one_call.model.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert int(one_call.optimizer.iterations.numpy()) == 0
    assert (one_call.updates, one_call.skipped_windows, one_call.loss_totals()) == (0, 0, (0, 0))
    # It trains afterwards as a fresh one would.
    fresh = accumulator(keras.optimizers.Adam(1e-2), check_finite=check_finite)
    assert one_call.apply_window(window) and fresh.apply_window(window)
    assert_same_weights(one_call, fresh)


def test_the_loop_takes_one_mini_batch_at_a_time_and_carries_no_gradient(mnist):
    """The window loop runs its mini-batches one after the other (parallel_iterations 1:
    one mini-batch's activations alive at a time) and adds their gradients into the
    sums in place: nothing the size of a variable rides along the loop."""
    one_call = accumulator(keras.optimizers.SGD(0.1))
    xs, ys, sizes = tf2.stack_window(mini_batches(mnist.train, (4, 4)))
    one_call.build_window(xs, ys, sizes)
    graph = one_call.window_step.get_concrete_function(xs, ys, sizes).graph
    loops = [op for op in graph.get_operations() if op.type.endswith("While")]
    assert len(loops) == 1
    assert loops[0].get_attr("parallel_iterations") == window_lib.PARALLEL_ITERATIONS == 1
    shapes = {tuple(v.shape) for v in one_call.variables}
    carried = [tuple(t.shape) for t in loops[0].outputs]
    assert not shapes & set(carried), carried


MIRRORED_SCRIPT = """
import json
import numpy as np, keras, tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
from experiment import data
from gradient_averaging import micro_batch as micro_batch_lib
from gradient_averaging import tf2
from tests.library import sequences, toys
from tests.library.toys import count_all_reduces, cross_entropy, small_conv_net, windows

def accumulator(trainer):
    with strategy.scope():
        model, optimizer = small_conv_net(), keras.optimizers.Adam(1e-2)
    return trainer(model, optimizer, cross_entropy, strategy)

per_mini = accumulator(tf2.MiniBatchAccumulator)
one_call = accumulator(tf2.WindowAccumulator)
grouped = accumulator(lambda *args: tf2.WindowAccumulator(*args, parallel_mini_batches=2))
split = data.load_mnist().train
for window in windows(split):  # 8 samples: 4 a replica; 3: 1 / 2; 5: 2 / 3
    for x, y in window:
        per_mini.accumulate(x, y)
    per_mini.apply()
    one_call.apply_window(window)
    grouped.apply_window(window)
same = all(np.array_equal(a, b) and np.array_equal(a, c) for a, b, c in zip(
    per_mini.model.get_weights(), one_call.model.get_weights(), grouped.model.get_weights()))
before = [w.copy() for w in one_call.model.get_weights()]
window = windows(split, [(6, 6)])[0]
poisoned = [window[0], (window[1][0].copy(), window[1][1])]
poisoned[1][0][5] = np.nan  # sample 5 of 6: in replica 1's slice only
xs, ys, sizes = tf2.stack_window(window)
print(json.dumps({
    "replicas": strategy.num_replicas_in_sync, "same": same,
    "window": count_all_reduces(
        one_call.window_step.get_concrete_function(xs, ys, sizes)),
    "apply": count_all_reduces(per_mini.apply_step.get_concrete_function()),
    "mini_batch": count_all_reduces(per_mini.mini_batch_step.get_concrete_function()),
    "variables": len(per_mini.variables),
    "skipped": not one_call.apply_window(poisoned),
    "unchanged": all(np.array_equal(a, b) for a, b in zip(before, one_call.model.get_weights())),
    "updates": int(one_call.optimizer.iterations.numpy()),
    **toys.mirrored_fit(strategy), **sequences.mirrored_fit(strategy),
    **toys.multi_worker_fit()}))
"""


@pytest.mark.slow
def test_two_mirrored_replicas_all_reduce_once_per_window(tmp_path):
    """Logical devices must be set before TensorFlow starts: a fresh process. Both paths,
    one call per window and a call per mini-batch: the same bits, one all-reduce per
    update, and a NaN on one replica skips the window for all; and Keras fit through
    `accumulate` as Keras's distributed guide writes it, under two mirrored replicas and
    one multi-worker worker (toys.mirrored_fit, toys.multi_worker_fit)."""
    path = tmp_path / "mirrored_window.py"
    path.write_text(MIRRORED_SCRIPT)
    proc = run_cli(script=str(path), timeout=600, env=CPU_ONLY)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["replicas"] == 2 and result["same"]
    # The optimizer's all-reduce of the applied mean (at most one per variable and replica)
    # and the non-finite vote (one scalar, summed locally by AddN here, one collective
    # across workers), the same in both paths' apply; nothing per mini-batch.
    assert result["mini_batch"] == 0
    assert 1 <= result["apply"] <= result["replicas"] * result["variables"] + 2
    assert result["window"] == result["apply"]
    assert result["skipped"] and result["unchanged"] and result["updates"] == 3
    # In the same process (one TensorFlow start less): Keras fit through accumulate.
    check_mirrored_fit(result)
    sequences.check_mirrored_fit(result)


def test_n_is_the_accumulators_and_fit_takes_no_other(mnist):
    """N is given where the accumulator is made: an accumulator without it is one clear
    error at fit, and fit refuses an N of its own (the old spelling, removed in 0.3) before
    it trains anything; the old class name is gone."""
    batches = mini_batches(mnist.train, [5] * 4)
    with pytest.raises(ValueError, match="has no average_gradients: make it with"):
        accumulator(keras.optimizers.SGD(0.1)).fit(batches)
    new = accumulator(keras.optimizers.SGD(0.1), average_gradients=2)
    before = new.model.get_weights()
    with pytest.raises(TypeError, match="positional argument"):
        new.fit(batches, 2)
    for weight, was in zip(new.model.get_weights(), before):
        np.testing.assert_array_equal(weight, was)
    assert not hasattr(tf2, "GradientAccumulator")
    assert "GradientAccumulator" not in gradient_averaging.__all__


@pytest.mark.parametrize("parallel", [2, 3])
def test_parallel_mini_batches_train_the_bits_of_one_at_a_time(mnist, parallel):
    """P passes at once, each on the state the one before left as values (dropout's seed
    generators): every window loop trains the bits of P=1: fit's iterator (windows of 4,
    a partial one shorter than P), a stacked window of unequal mini-batches, an effective
    batch cut where B does not divide it."""
    data = mnist.train
    dataset = tf.data.Dataset.from_tensor_slices((data.images[:70], data.labels[:70])).batch(5)
    stacked = tf2.stack_window(mini_batches(data, [6, 4, 5], start=100))
    effective = (data.images[200:223], data.labels[200:223])
    trained = []
    for p in (1, parallel):
        one_call = accumulator(keras.optimizers.Adam(1e-2), average_gradients=4,
                               parallel_mini_batches=p)
        summary = one_call.fit(dataset)
        assert one_call.apply_stacked(*stacked)
        applied, count, _ = one_call.apply_effective(effective, micro_batch_lib.plan(23, 4, 1))
        assert applied and count == 6
        trained.append((one_call, summary))
    (one, one_summary), (group, group_summary) = trained
    assert group_summary == one_summary and group.updates == one.updates == 6
    assert_same_weights(one, group)


def test_parallel_mini_batches_is_checked_before_any_training(mnist):
    for value in (0, 2.0, True):
        with pytest.raises(ValueError, match="parallel_mini_batches must be an int >= 1"):
            accumulator(keras.optimizers.SGD(0.1), parallel_mini_batches=value)
    with pytest.raises(ValueError, match="parallel_mini_batches needs one_call=True"):
        tf2.fit_accumulated(small_conv_net(), mini_batches(mnist.train, [5] * 2),
                            keras.optimizers.SGD(0.1), cross_entropy, average_gradients=2,
                            one_call=False, parallel_mini_batches=2)
