"""Say the batch you want; `fit` finds the micro-batch that fits and trains each batch as
one update of it (docs/effective-batch.md).

`accumulate(model, micro_batch_size="auto")`: before it trains, fit measures the peak
device memory of trial steps on its first batch, each of a size the search asks for (the
model put back after), and takes the largest size B whose peak fits in the budget; each
batch of E samples is then N = ceil(E / B) mini-batches, the last one shorter, and every
update equals the direct batch of E's.
The device's memory is the budget by default; here a budget of 16 MiB stands for a small
device, so that B is well under E. The peak is read from the device's allocator: a
GPU's, or on a CPU the BFC allocator TensorFlow uses when TF_CPU_ALLOCATOR_USE_BFC=true is
set before it starts.

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
EPOCHS = 10
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
    # SGD: its step is linear in the gradient, so the direct batch's weights are met to
    # float32 rounding after 20 updates. Adam divides by the gradient's root mean square,
    # which over 20 updates lifts the rounding of a sum over mini-batches against one
    # mean to 5e-5 on weights whose gradient is near zero (in float64 they agree).
    model.compile(optimizer=keras.optimizers.SGD(0.05),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True))
    return model


def main():
    model = compiled(accumulate(make_model(), micro_batch_size="auto", budget=BUDGET))
    model.fit(x, y, batch_size=E, epochs=EPOCHS, shuffle=False, verbose=0)
    found = model.micro_batch
    print(found)
    assert 1 < found.micro_batch_size < E, found
    assert found.average_gradients == -(-E // found.micro_batch_size), found
    # One update per batch of E (or less).
    assert model.optimizer.iterations.numpy() == 2 * EPOCHS

    direct = compiled(make_model())
    direct.fit(x, y, batch_size=E, epochs=EPOCHS, shuffle=False, verbose=0)
    for got, want in zip(model.get_weights(), direct.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    print(f"{2 * EPOCHS} updates of up to {E} samples in mini-batches of "
          f"{found.micro_batch_size}: the direct batch's weights")


if __name__ == "__main__":
    main()
