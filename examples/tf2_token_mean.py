"""fit_accumulated on padded token sequences: loss_fn returns the per-token losses and
their weights (the mask), so each update is the token mean over the window's sequences,
as the direct batch of them has it, however unequal their lengths.

    .venv/bin/python -m examples.tf2_token_mean
"""

import keras
import numpy as np
import tensorflow as tf

from gradient_averaging import fit_accumulated

V, T, SAMPLES = 20, 12, 84
rng = np.random.default_rng(0)
lengths = rng.integers(1, T + 1, size=SAMPLES)
lengths[rng.random(SAMPLES) < 0.3] = 1                        # very unequal lengths
ids = (rng.integers(1, V, size=(SAMPLES, T)) * (np.arange(T) < lengths[:, None])).astype(
    np.int32)
labels = rng.integers(0, V, size=(SAMPLES, T)).astype(np.int32)
weights = (ids > 0).astype(np.float32)                        # the mask: 1 per valid token


def tagger():
    init = keras.initializers.GlorotUniform
    return keras.Sequential([keras.Input((T,), dtype="int32"),
                             keras.layers.Embedding(V, 8, embeddings_initializer=init(1)),
                             keras.layers.Dense(V, kernel_initializer=init(2))])


def token_losses(y, logits):                                  # y: (labels, weights)
    labels, weights = y
    losses = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
    return losses, weights                                    # divided by the weights' sum


model, optimizer = tagger(), keras.optimizers.SGD(0.5)
dataset = tf.data.Dataset.from_tensor_slices((ids, (labels, weights))).batch(8)
for _ in range(3):                                            # epochs
    fit_accumulated(model, dataset, optimizer, token_losses, average_gradients=4)

direct = tagger()                                             # the direct batch: 32 at once
direct.compile(optimizer=keras.optimizers.SGD(0.5),          # the token mean of each batch
               loss=keras.losses.SparseCategoricalCrossentropy(
                   from_logits=True, reduction="mean_with_sample_weight"))
direct.fit(ids, labels, sample_weight=weights, batch_size=32, epochs=3, shuffle=False, verbose=0)
difference = max(float(np.abs(a - b).max()) for a, b in zip(model.get_weights(),
                                                            direct.get_weights()))
print(f"{int(optimizer.iterations)} updates; max weight difference from the direct "
      f"batch: {difference:.1e}")                             # 9 updates; ~1e-7
