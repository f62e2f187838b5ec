"""TF1 code written with tf.compat.v1.layers (conv2d, batch_normalization with a
`training` placeholder, dropout, dense, UPDATE_OPS under control_dependencies), trained
with AveragingOptimizer, and checked against the direct batch of N*B:

1. Batch norm frozen (training=False: BN uses its moving statistics, dropout is off):
   the weights are the direct batch's.
2. Batch norm training: the layers' UPDATE_OPS run once per mini-batch, so their moving
   statistics take N steps per update on mini-batch statistics and differ from the
   direct batch's, at the layer's momentum m and, less, at m ** (1 / N). The weights
   differ too: each mini-batch is normalized by its own statistics (and dropout draws
   other masks), which no accumulation can change.
3. Per-update statistics through `after_update=` (WindowBatchNorm below): the moments of
   each BN layer's input summed over the window, one moving-average step per update. A
   BN layer on the inputs then has the direct batch's statistics; a BN layer after
   another BN in training mode, or after weights once they have been updated, does not:
   its inputs are not the direct batch's.

Keras 3 has no tf.compat.v1.layers. The tf-keras package (pinned in requirements.txt)
brings them back when TF_USE_LEGACY_KERAS=1 is set before TensorFlow is imported: hence
the first lines, and a process of its own in the tests (the variable would turn tf.keras
into Keras 2 for whatever runs after it in the same process).

    .venv/bin/python -m examples.tf1_legacy_layers
(docs/tf1-code.md, "Legacy layers and batch norm per update")
"""

import os

# tf.compat.v1.layers and tf.keras then come from tf-keras (Keras 2). TensorFlow reads it
# when each is first used and keeps the answer, so it goes before any import of TensorFlow.
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import sys

import numpy as np
import tensorflow as tf

from gradient_averaging import AveragingOptimizer

v1 = tf.compat.v1
N, B, MINIBATCHES = 4, 20, 10      # windows of 4, 4 and a flushed 2
IMAGE_SHAPE, CLASSES = (16, 16, 3), 10
MOMENTUM = 0.9                     # batch norm's decay per step of its moving averages
TOLERANCE = 1e-5


class WindowBatchNorm:
    """Batch norm whose moving statistics step once per update, on the whole window.

    batch_normalization() stands in for v1.layers.batch_normalization: the layer
    normalizes each mini-batch as usual, but in UPDATE_OPS its moving-average updates are
    replaced by ops that add the mini-batch's moments (count, sum, sum of squares, in
    float64) to the window's. step(), passed as after_update, takes one moving-average
    step per layer with the window's mean and variance, as the layer would on one batch
    of N*B; restarting_after(op, optimizer) restarts the sums once a run leaves the
    optimizer's window empty (applied, flushed or skipped: after_update does not run on
    a skipped window). One thread runs the train op.
    """

    def __init__(self):
        self._layers = []  # (layer, [count, sum, sum of squares] variables)

    def batch_normalization(self, inputs, training, **kwargs):
        if any(kwargs.get(arg) for arg in ("renorm", "virtual_batch_size", "adjustment")):
            raise ValueError("WindowBatchNorm: renorm, virtual_batch_size and adjustment "
                             "need more than one batch's moments")
        updates = list(v1.get_collection(v1.GraphKeys.UPDATE_OPS))
        layer = v1.layers.BatchNormalization(**kwargs)
        outputs = layer(inputs, training=training)
        axes = [i for i in range(inputs.shape.rank) if i not in layer.axis]
        x = tf.cast(inputs, tf.float64)
        batch = [tf.reduce_sum(tf.ones_like(x), axes), tf.reduce_sum(x, axes),
                 tf.reduce_sum(tf.square(x), axes)]
        sums = [v1.Variable(tf.zeros_like(layer.moving_mean, tf.float64), trainable=False,
                            name=f"{layer.name}/window_{what}")
                for what in ("count", "sum", "sum_of_squares")]
        add = tf.cond(tf.cast(training, tf.bool),
                      lambda: tf.group([s.assign_add(b) for s, b in zip(sums, batch)]),
                      tf.no_op)
        v1.get_collection_ref(v1.GraphKeys.UPDATE_OPS)[:] = updates + [add]
        self._layers.append((layer, sums))
        return outputs

    def step(self):
        """One moving-average step per layer: the after_update of AveragingOptimizer."""
        ops = []
        for layer, (count, total, squares) in self._layers:
            mean = total / count
            variance = squares / count - tf.square(mean)
            if layer.fused:  # the fused kernel's moving variance is Bessel-corrected
                variance *= count / tf.maximum(count - 1, 1)
            for moving, value in ((layer.moving_mean, mean), (layer.moving_variance, variance)):
                delta = (moving - tf.cast(value, moving.dtype)) * (1 - layer.momentum)
                ops.append(moving.assign_sub(tf.where(count > 0, delta, tf.zeros_like(delta))))
        return ops

    def restarting_after(self, op, optimizer):
        """`op`, then the window's sums zeroed if `op` left the optimizer's window empty."""
        with tf.control_dependencies([op]):
            closed = tf.equal(optimizer.window_count, 0)
            return tf.group(tf.cond(closed, lambda: tf.group(
                [s.assign(tf.zeros_like(s)) for _, sums in self._layers for s in sums]),
                tf.no_op))


def inference(images, training, momentum, batch_normalization):
    """A TF1 convnet: BN on the inputs, conv - BN - ReLU twice, dropout, dense. Seeded
    initializers: the same initial weights in every graph (the layers' defaults ignore
    the graph's seed)."""
    def init(seed):
        return v1.glorot_uniform_initializer(seed=seed)

    net = batch_normalization(images, training=training, momentum=momentum, name="bn_input")
    net = v1.layers.conv2d(net, 8, 5, strides=2, padding="same", use_bias=False,
                           kernel_initializer=init(1), name="conv1")
    net = batch_normalization(net, training=training, momentum=momentum, name="bn_conv1")
    net = v1.layers.conv2d(tf.nn.relu(net), 16, 3, strides=2, padding="same",
                           use_bias=False, kernel_initializer=init(2), name="conv2")
    net = batch_normalization(net, training=training, momentum=momentum, name="bn_conv2")
    net = v1.layers.flatten(tf.nn.relu(net))
    net = v1.layers.dropout(net, rate=0.25, training=training, seed=3)
    return v1.layers.dense(net, CLASSES, kernel_initializer=init(4), name="logits")


def train(runs, accumulate=True, momentum=MOMENTUM, per_update=False):
    """Builds the model, trained with AveragingOptimizer at N (accumulate=False: the plain
    optimizer, for the direct batch), and for each (batches, training) in `runs` trains
    it from its initial weights.

    Returns:
      Each run's {variable name: value} of the weights and the moving statistics.
    """
    with tf.Graph().as_default() as graph:
        images = v1.placeholder(tf.float32, [None, *IMAGE_SHAPE], name="images")
        labels = v1.placeholder(tf.int64, [None], name="labels")
        is_training = v1.placeholder(tf.bool, [], name="training")
        if per_update:  # moving statistics once per update, on the window's moments
            window_bn = WindowBatchNorm()
            batch_normalization, after_update = window_bn.batch_normalization, window_bn.step
        else:           # the layers' own moving-average updates, in UPDATE_OPS
            batch_normalization, after_update = v1.layers.batch_normalization, None
        logits = inference(images, is_training, momentum, batch_normalization)
        loss = v1.losses.sparse_softmax_cross_entropy(labels, logits)
        optimizer = v1.train.MomentumOptimizer(0.05, 0.9)
        if accumulate:
            optimizer = AveragingOptimizer(optimizer, N, after_update=after_update)
        with tf.control_dependencies(v1.get_collection(v1.GraphKeys.UPDATE_OPS)):
            train_op = optimizer.minimize(loss)
        flush_op = optimizer.flush_op() if accumulate else tf.no_op()
        if per_update:  # the window's sums restart whenever a run closes the window
            train_op = window_bn.restarting_after(train_op, optimizer)
            flush_op = window_bn.restarting_after(flush_op, optimizer)
        kept = [v for v in v1.global_variables()
                if v in v1.trainable_variables() or "/moving_" in v.op.name]
        init = v1.global_variables_initializer()
        graph.finalize()
        results = []
        with v1.Session() as sess:
            for batches, training in runs:
                sess.run(init)
                for xb, yb in batches:
                    sess.run(train_op, {images: xb, labels: yb, is_training: training})
                sess.run(flush_op)
                results.append(dict(zip([v.op.name for v in kept], sess.run(kept))))
        return results


def input_statistics(batches, momentum=MOMENTUM):
    """BN on the inputs' moving mean and variance after `batches`, in float64: what the
    layer computes, without its float32 rounding (the fused kernel's moving variance is
    Bessel-corrected)."""
    mean, variance = 0.0, 1.0
    for images, _ in batches:
        x = images.astype(np.float64)
        axes = tuple(range(x.ndim - 1))
        mean -= (mean - x.mean(axes)) * (1 - momentum)
        variance -= (variance - x.var(axes, ddof=1)) * (1 - momentum)
    return {"bn_input/moving_mean": mean, "bn_input/moving_variance": variance}


def largest_difference(a, b, which=lambda name: True):
    return max(float(np.abs(a[k] - b[k]).max()) for k in b if which(k))


LAYERS = ("bn_input", "bn_conv1", "bn_conv2")


def weights(name):
    return "/moving_" not in name


def statistics(layer):
    return lambda name: name.startswith(layer + "/moving_")


def data():
    """The mini-batches (images of unit scale, each channel its own mean) and the direct
    batches of their windows: 80, 80 and 40 samples."""
    rng = np.random.RandomState(0)
    minibatches = [((rng.normal(size=(B, *IMAGE_SHAPE)) * [1.0, 0.5, 2.0] + [0.5, -1.0, 0.0])
                    .astype(np.float32), rng.randint(CLASSES, size=B))
                   for _ in range(MINIBATCHES)]
    direct = [tuple(np.concatenate(part) for part in zip(*minibatches[k:k + N]))
              for k in range(0, MINIBATCHES, N)]
    return minibatches, direct


def print_statistics(reference, runs):
    print(f"training=True, momentum m = {MOMENTUM}: largest difference of the moving "
          "statistics from the direct batch's")
    print(f"  {'':50}" + "".join(f"{layer:>10}" for layer in LAYERS))
    for name, run in runs:
        print(f"  {name:50}" + "".join(
            f"{largest_difference(run, reference, statistics(layer)):10.1e}"
            for layer in LAYERS))


def main():
    if not hasattr(v1.layers, "conv2d"):  # Keras 3's tf.compat.v1 has no layers
        sys.exit("tf.compat.v1.layers needs the tf-keras package and TF_USE_LEGACY_KERAS=1 "
                 "set before TensorFlow is first imported")
    minibatches, direct = data()
    nan_window = [(np.full_like(xb, np.nan), yb) for xb, yb in minibatches[:N]]
    failures = []

    def check(claim, holds):
        print(("" if holds else "FAILED: ") + claim)
        if not holds:
            failures.append(claim)

    direct_frozen, reference = train([(direct, False), (direct, True)], accumulate=False)
    frozen, per_batch = train([(minibatches, False), (minibatches, True)])
    decayed, decayed_whole = train([(minibatches, True), (minibatches[:2 * N], True)],
                                   momentum=MOMENTUM ** (1 / N))
    per_update, after_nan = train([(minibatches, True), (nan_window + minibatches, True)],
                                  per_update=True)

    # 1. Frozen batch norm, no dropout: exact.
    off = largest_difference(frozen, direct_frozen)
    check(f"training=False (BN frozen, dropout off): weights {off:.1e} from the direct "
          f"batch's after {len(direct)} updates (N={N} x B={B}, the last window flushed)",
          off < TOLERANCE)

    # 2. and 3. Batch norm training: UPDATE_OPS per mini-batch, or per update.
    print_statistics(reference, (("UPDATE_OPS per mini-batch, momentum m", per_batch),
                                 ("UPDATE_OPS per mini-batch, momentum m ** (1 / N)", decayed),
                                 ("per update (after_update=)", per_update)))
    exact, exact_whole = input_statistics(direct), input_statistics(direct[:2])
    off = largest_difference(per_batch, exact)
    check(f"per mini-batch at m, BN on the inputs: {off:.1e} off the direct batch's "
          "statistics (N steps per update)", off > 1e-2)
    whole, partial = (largest_difference(decayed_whole, exact_whole),
                      largest_difference(decayed, exact))
    check(f"per mini-batch at m ** (1 / N): {whole:.1e} off after 2 whole windows, close "
          "but not exact (a window's mini-batches weigh unequally, each variance is one "
          f"mini-batch's); {partial:.1e} once the flushed window of {MINIBATCHES % N} has "
          f"taken {MINIBATCHES % N} steps where the direct batch takes one at m",
          TOLERANCE / 10 < whole < 1e-3 < partial)
    off = largest_difference(per_update, exact)
    check("per update, BN on the inputs has the direct batch's statistics: "
          f"{off:.1e} from them in float64 (the direct batch's float32 kernel: "
          f"{largest_difference(reference, exact):.1e})", off < TOLERANCE / 10
          and largest_difference(per_update, reference, statistics("bn_input")) < TOLERANCE)
    off = largest_difference(after_nan, exact)
    check("per update, a window skipped for a NaN leaves them as they were: "
          f"{off:.1e} from the direct batch's without it", off < TOLERANCE / 10)
    check("per update, BN after the convolutions is not the direct batch's (its inputs "
          "differ: the layers before normalize each mini-batch by its own statistics)",
          all(largest_difference(per_update, reference, statistics(layer)) > TOLERANCE
              for layer in LAYERS[1:]))
    off = largest_difference(per_update, reference, weights)
    check(f"training=True: weights {off:.1e} from the direct batch's (BN normalizes each "
          "mini-batch by its own statistics; dropout draws other masks)", off > TOLERANCE)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
