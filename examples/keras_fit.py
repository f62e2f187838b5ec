"""Keras `compile`/`fit` with exact gradient averaging: one line, `accumulate(model, N)`.

Fits 250 samples for 2 epochs in mini-batches of B=20, one update per N=4 of them, with
an SGD learning-rate schedule, and checks what it claims: the weights and History equal
those of the plain model fitted with batch_size=N*B=80 (the short last batch and each
epoch's partial window weighted by their samples, the schedule stepping once per update),
Keras's own `gradient_accumulation_steps` does not get there, and the model saves to
.keras and loads back. Exits non-zero if any of it does not hold.

    .venv/bin/python -m examples.keras_fit         (README, "Use it with Keras fit")
"""

import os
import tempfile

import keras
import numpy as np

from gradient_averaging import accumulate

N, B = 4, 20
rng = np.random.default_rng(0)
x = rng.normal(size=(250, 8)).astype(np.float32)
y = x[:, :3].argmax(axis=1)


def make_model():
    init = keras.initializers.GlorotUniform
    return keras.Sequential([keras.Input((8,)),
                             keras.layers.Dense(16, activation="relu", kernel_initializer=init(1)),
                             keras.layers.Dense(3, kernel_initializer=init(2))])


def schedule():
    """The learning rate halves at every optimizer step: it shows when the steps happen."""
    return keras.optimizers.schedules.ExponentialDecay(0.2, decay_steps=1, decay_rate=0.5)


def compiled(model, **optimizer_options):
    model.compile(optimizer=keras.optimizers.SGD(schedule(), **optimizer_options),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def fit(model, batch_size):
    return model.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0).history


def max_difference(a, b):
    return max(float(np.abs(u - v).max()) for u, v in zip(a.get_weights(), b.get_weights()))


model = accumulate(make_model(), average_gradients=N)   # the one line
model.compile(optimizer=keras.optimizers.SGD(schedule()), metrics=["accuracy"],
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
history = model.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0).history
direct = compiled(make_model())
direct_history = fit(direct, N * B)
keras_own = compiled(make_model(), gradient_accumulation_steps=N)
fit(keras_own, B)

print(f"accumulate(N={N}) x B={B} against one batch of {N * B}: max |weight difference| "
      f"{max_difference(model, direct):.1e}; Keras's gradient_accumulation_steps: "
      f"{max_difference(keras_own, direct):.1e}")
print(f"updates: {int(model.optimizer.iterations)} (direct: {int(direct.optimizer.iterations)})"
      f"; loss per epoch {np.round(history['loss'], 4).tolist()} "
      f"(direct: {np.round(direct_history['loss'], 4).tolist()})")

with tempfile.TemporaryDirectory() as directory:
    path = os.path.join(directory, "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)  # gradient_averaging imported: the class is known
    same_predictions = np.array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))

failures = [claim for claim, holds in [
    ("the weights equal the direct batch's", max_difference(model, direct) < 1e-5),
    ("one optimizer step per update", int(model.optimizer.iterations) == 8
     == int(direct.optimizer.iterations)),
    ("History reports the direct batch's loss", np.allclose(history["loss"],
                                                            direct_history["loss"], rtol=1e-5)),
    ("Keras's own accumulation differs", max_difference(keras_own, direct) > 1e-2),
    ("the .keras file loads and predicts the same", same_predictions)] if not holds]
if failures:
    raise SystemExit("does not hold: " + "; ".join(failures))
print("all claims hold")
