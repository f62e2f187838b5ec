"""The Keras-fit contender: `model.fit` through `gradient_averaging.accumulate` against Keras
3's own `gradient_accumulation_steps` with `steps_per_execution=N`, the fastest way Keras
offers (bench_contenders.KerasContender).

It runs in the speed section's interleaved rounds beside the other contenders, but its
times are kept apart (`split_times`), on the speed row under "keras_fit", with its ratio
paired per round against `keras`; the figure and the speed table stay as they were.
"""

import statistics

from tools import bench_contenders
from tools.bench_targets import _judged

LABEL = "keras_fit"
TARGET_CONFIG = (5, 20)  # no slower than Keras's own at N=5 x B=20


class KerasFitContender(bench_contenders.KerasContender):
    """The tf2 engine's ConvNet, `accumulate(model, N)`, compiled as KerasContender
    compiles it (Adam 1e-3, from-logits loss, no XLA) but with no accumulation of Keras's
    and no steps_per_execution: `fit` on the same pipeline of B-sized batches, each
    window of N one compiled call by default."""

    def __init__(self, n, b, datasets):
        import keras
        from gradient_averaging import keras_fit  # Keras loads only where a Keras contender runs
        super().__init__(LABEL, n, b, datasets, mode="fit")
        self.model = keras_fit.accumulate(self.model, average_gradients=n)
        self.model.compile(optimizer=keras.optimizers.Adam(1e-3),
                           loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                           jit_compile=False)


def split_times(times):
    """Takes the Keras-fit contender's times out of a speed round's `times`.

    Returns:
      {"times": its seconds per update, "vs_keras": paired_ratio against `keras`}.
    """
    own = times.pop(LABEL)
    return {"times": own,
            "vs_keras": bench_contenders.paired_ratio({**times, LABEL: own}, LABEL, "keras")}


def targets(speed):
    """The speed target, judged from the paired rounds."""
    rows = {(r["n"], r["b"]): r for r in speed if LABEL in r}
    n, b = TARGET_CONFIG
    name = (f"fit with accumulate <= Keras's gradient_accumulation_steps with "
            f"steps_per_execution=N at N={n}/B={b}")
    if TARGET_CONFIG not in rows:
        return [dict(target=name, measured="not measured", status="not measured")]
    r = rows[TARGET_CONFIG][LABEL]["vs_keras"]
    return [_judged(name, f"{r['ratio']:.2f}x", r["ratio"] <= 1.0,
                    f"fit with accumulate took {r['ratio']:.2f}x Keras's time (paired rounds, "
                    f"quartiles {r['q1']:.2f}-{r['q3']:.2f}).")]


def report(speed):
    """BENCHMARKS.md's lines on the contender."""
    rows = [r for r in speed if LABEL in r]
    if not rows:
        return []
    lines = ["", "### Keras `fit` with `gradient_averaging.accumulate`", "",
             "`keras_fit`: the same ConvNet wrapped by `accumulate(model, N)`, compiled with "
             "plain `Adam(1e-3)` and fitted on the same pipeline of B-sized batches, "
             "default `steps_per_execution` (one compiled call per window); against `keras` "
             "(Keras's `gradient_accumulation_steps=N`, `steps_per_execution=N`), ratio "
             "paired per round.", "",
             "| N x B | keras_fit | keras | keras_fit / keras |", "|---|---|---|---|"]
    for row in rows:
        r = row[LABEL]["vs_keras"]
        own = statistics.median(row[LABEL]["times"])
        lines.append(f"| {row['n']} x {row['b']} | {1e3 * own:.1f} ms | "
                     f"{row['median_ms']['keras']:.1f} ms | {r['ratio']:.2f}x "
                     f"({r['q1']:.2f}-{r['q3']:.2f}) |")
    return lines
