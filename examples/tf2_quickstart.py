"""README's TF2-loop snippet: fit_accumulated trains your model on your dataset, N
mini-batches per update, under any tf.distribute strategy.

    .venv/bin/python -m examples.tf2_quickstart
"""

import keras
import numpy as np
import tensorflow as tf

from gradient_averaging import fit_accumulated

rng = np.random.default_rng(0)
x = rng.normal(size=(1000, 20)).astype("float32")                   # your data here
y = x.sum(axis=1, keepdims=True)

strategy = tf.distribute.MirroredStrategy()          # optional; leave out for one device
with strategy.scope():
    model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(1)])
    optimizer = keras.optimizers.Adam(
        keras.optimizers.schedules.ExponentialDecay(1e-3, 100, 0.9))  # steps = updates
loss_fn = keras.losses.MeanSquaredError(reduction=None)             # per-sample losses
dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)      # global mini-batches
summary = fit_accumulated(model, dataset, optimizer, loss_fn, average_gradients=8,
                          strategy=strategy)
print(summary.updates, "updates of", 8 * 32, "samples")  # 32 mini-batches at N=8: 4
