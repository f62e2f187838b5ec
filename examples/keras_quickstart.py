"""README's Keras snippet: `accumulate` wraps your model; compile, fit and callbacks stay
Keras's. Each batch of 256 is one update, trained as mini-batches of 64.

    .venv/bin/python -m examples.keras_quickstart
"""

import keras
import numpy as np

import gradient_averaging

rng = np.random.default_rng(0)
x = rng.normal(size=(1024, 20)).astype("float32")                   # your data here
y = (x[:, 0] > 0).astype("int32")

model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(64, activation="relu"),
                          keras.layers.Dense(2)])                   # your model here
model = gradient_averaging.accumulate(model, micro_batch_size=64)   # or "auto": it is found
model.compile(optimizer="adam", metrics=["accuracy"],
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.fit(x, y, batch_size=256, epochs=2, verbose=0)                # 256 per update
print("updates:", int(model.optimizer.iterations))                  # 1,024 / 256 x 2: 8
