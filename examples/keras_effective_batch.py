"""Say the batch you want; `fit` finds the micro-batch that fits and trains each batch as
one update of it (docs/effective-batch.md).

`accumulate(model, micro_batch_size="auto")`: on its first batch, fit measures the peak
device memory of trial mini-batches and takes the largest size B whose peak fits in the
budget; each batch of E samples is then N = ceil(E / B) mini-batches, the last one
shorter, and one update that equals the direct batch of E's. The device's memory is the
budget by default; here a budget of 16 MiB stands for a small device, so that B is well
under E. The peak is read from the device's allocator: a GPU's, or on a CPU the BFC
allocator TensorFlow uses when TF_CPU_ALLOCATOR_USE_BFC=true is set before it starts.

Checks what it claims: B < E, the effective batch cut as said, and the weights of the
direct batch of E (a plain fit at batch_size=E, with no budget). Exits non-zero if not.

    .venv/bin/python -m examples.keras_effective_batch
"""

import os

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")  # before TensorFlow starts

import keras
import numpy as np

from gradient_averaging import accumulate

E, SAMPLES, BUDGET = 1000, 1800, 16 << 20  # an epoch: one batch of 1,000 and one of 800
rng = np.random.default_rng(0)
x = rng.normal(size=(SAMPLES, 256)).astype(np.float32)
y = (x[:, :10] @ rng.normal(size=(10,))).astype(np.float32) > 0


def make_model():
    init = keras.initializers.GlorotUniform
    return keras.Sequential([
        keras.Input((256,)),
        keras.layers.Dense(1024, activation="relu", kernel_initializer=init(1)),
        keras.layers.Dense(1, kernel_initializer=init(2))])


def compiled(model):
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True))
    return model


def main():
    model = compiled(accumulate(make_model(), micro_batch_size="auto", budget=BUDGET))
    model.fit(x, y, batch_size=E, epochs=1, shuffle=False, verbose=0)
    found = model.micro_batch
    print(found)
    assert 1 < found.micro_batch_size < E, found
    assert found.average_gradients == -(-E // found.micro_batch_size), found
    assert model.optimizer.iterations.numpy() == 2  # one update per batch of E (or less)

    direct = compiled(make_model())
    direct.fit(x, y, batch_size=E, epochs=1, shuffle=False, verbose=0)
    for got, want in zip(model.get_weights(), direct.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    print(f"2 updates of {E} samples in mini-batches of {found.micro_batch_size}: "
          "the direct batch's weights")


if __name__ == "__main__":
    main()
