"""Benchmarks the accumulation strategies and writes BENCHMARKS.md.

    python bench.py            # the full benchmark, 7 to 10 minutes on 2 cores
    python bench.py --quick    # every section, scaled down: a smoke test (< 1 minute)

Accumulation exists to save memory, so it must not cost speed; this measures both, in
one run, on this machine:
  * speed: training seconds per update (no evaluation) of the direct batch N*B, of each
    strategy at N x B, of Keras 3's built-in `gradient_accumulation_steps` and of the tf2
    engine, for the post's four (N, B). The contenders take turns (round robin, rotating
    who goes first), so drift of a shared machine hits them alike; ratios are paired per
    round, and at N=1, where every strategy is the same graph, they show the noise.
  * a profile of each (tf.profiler, one block of updates), to say where the time goes,
    and fused against direct again on Eigen kernels (oneDNN off, a fresh process);
  * peak memory, each measurement in a fresh process (`--probe`): a large effective
    batch direct against accumulated, and the host memory of each strategy as N grows.
Each target of the issue is printed and written as met or missed, with its ratio.
"""

import collections
import datetime
import glob
import json
import os
import platform
import re
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import main  # imports TensorFlow quietly, first; its fail() and flag parsing serve here too

import numpy as np
import tensorflow as tf
from absl import app
from absl import flags

import data
import experiment
import results
import trainer

v1 = tf.compat.v1
FLAGS = flags.FLAGS

CONFIGS = ((1, 100), (5, 20), (10, 10), (20, 5))  # the post's (N, B)
SEED = 0
# Speed: a measurement is a block of UPDATES updates, after one untimed block.
FULL = dict(configs=CONFIGS, updates=20, repeats=7, keras_setup=True, mem_samples=16384,
            mem_batch=128, host_ns=(1, 2, 4, 8, 16, 32, 64), host_strategies=trainer.STRATEGIES,
            mem_strategies=trainer.STRATEGIES, probe_jobs=1)
QUICK = dict(configs=((5, 20),), updates=2, repeats=2, keras_setup=False, mem_samples=1024,
             mem_batch=128, host_ns=(2,), host_strategies=("stack",),
             mem_strategies=("fused",), probe_jobs=3)
HOST_MODEL, HOST_BATCH = "mlp", 16  # the host-memory sweep: gradients dominate memory
MB = 1 << 20
# The targets.
FUSED_LIMITS = {(5, 20): 1.15, (20, 5): 1.5}
KERAS_SPEEDUP = 2.0
ACCUMULATED_VS_SMALL, ACCUMULATED_VS_DIRECT = 1.25, 0.25
FLAT_GRADIENTS_PER_N = 0.1  # host memory "flat in N": what one more micro-batch may add
# Op classes for the profile: the first pattern that matches the op type names it.
OP_CLASSES = (("conv", r"Conv2D"), ("pool", r"MaxPool"), ("matmul", r"MatMul"),
              ("dropout RNG", r"Random"), ("finite check", r"^(IsFinite|All)$"),
              ("variable updates", r"ApplyAdam|AssignAddVariable|AssignVariable"))
CONTAINER_OPS = ("While", "If", "PartitionedCall", "Case")  # time of ops they hold

flags.DEFINE_bool("quick", False, "Every section, scaled down (a smoke test, < 1 minute).")
flags.DEFINE_string("output", "BENCHMARKS.md", "Markdown file to write.")
flags.DEFINE_string("probe", None, "Internal: one memory measurement, as JSON; prints JSON.")


# ---------------------------------------------------------------- contenders


class SessionContender:
    """One TF1 graph training through experiment.Training, as `main.py` trains it."""

    def __init__(self, label, config, datasets):
        self.label, self.config = label, config
        self.run = experiment.Run(config, SEED)
        self.sess = self.run.session()
        self.sess.run(self.run.init_op)
        self.training = experiment.Training(config, datasets, SEED, self.sess, self.run)

    def train(self, updates):
        for _ in range(updates * self.config.average_gradients):
            self.training.step()

    def close(self):
        self.sess.close()


def keras_conv_net(dropout=0.5):
    """The post's ConvNet as a Keras model (same layers, linear logits)."""
    import keras
    layers = keras.layers
    return keras.Sequential([
        keras.Input(data.IMAGE_SHAPE), layers.Dropout(min(0.2, dropout)),
        layers.Conv2D(6, 5, activation="relu"), layers.MaxPooling2D(2), layers.Dropout(dropout),
        layers.Conv2D(16, 5, activation="relu"), layers.MaxPooling2D(2), layers.Dropout(dropout),
        layers.Flatten(), layers.Dense(120, activation="relu"), layers.Dropout(dropout),
        layers.Dense(84, activation="relu"), layers.Dropout(dropout), layers.Dense(10)])


class KerasContender:
    """Keras 3's built-in accumulation: Adam(gradient_accumulation_steps=N) on B samples.

    mode "fit": model.fit over a tf.data pipeline of B-sized batches, `steps_per_execution`
    micro-batches per compiled call (Keras's own way to cut per-step overhead);
    mode "train_on_batch": one call per micro-batch. No XLA: under op determinism (on in
    main.py and here) Keras turns jit_compile off.
    """

    def __init__(self, label, n, b, datasets, mode="fit", steps_per_execution=1):
        import keras
        keras.utils.set_random_seed(SEED)
        self.label, self.n, self.b, self.mode = label, n, b, mode
        self.model = keras_conv_net()
        self.model.compile(
            optimizer=keras.optimizers.Adam(1e-3, gradient_accumulation_steps=n if n > 1 else None),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=False, steps_per_execution=steps_per_execution)
        self.train_split = datasets.train
        self.stream = data.SampleStream(len(datasets.train.labels), SEED)
        self.dataset = (tf.data.Dataset.from_tensor_slices(tuple(datasets.train))
                        .repeat().batch(b, drop_remainder=True).prefetch(2))

    def train(self, updates):
        if self.mode == "fit":
            self.model.fit(self.dataset, steps_per_epoch=updates * self.n, epochs=1, verbose=0,
                           shuffle=False)
            return
        for _ in range(updates * self.n):
            self.model.train_on_batch(*self.stream.next_batch(self.train_split, self.b))

    def close(self):
        pass


class TF2Contender:
    """The tf2 engine (tf2_trainer.py): the Keras ConvNet, tf.function micro- and apply-steps."""

    def __init__(self, label, n, b, datasets):
        import keras
        import tf2_accumulator
        import tf2_trainer
        self.label, self.n = label, n
        self.accumulator = tf2_accumulator.GradientAccumulator(
            tf2_trainer.conv_net(0.5, SEED), keras.optimizers.Adam(1e-3),
            tf2_trainer.sparse_cross_entropy)
        self.batches = iter(tf2_trainer.mnist_batches(datasets.train, b, 10 ** 9, SEED))

    def train(self, updates):
        for _ in range(updates * self.n):
            self.accumulator.accumulate(*next(self.batches))
            if self.accumulator.window == self.n:
                self.accumulator.apply()

    def close(self):
        pass


# ---------------------------------------------------------------- timing


def interleaved(contenders, updates, repeats):
    """Seconds per update of each contender, `repeats` rounds, turns rotating per round.

    Returns:
      {label: [seconds per update, one per round]}.
    """
    for c in contenders:
        c.train(updates)  # warm-up: graph optimisation, allocator, oneDNN primitives
    times = collections.defaultdict(list)
    for r in range(repeats):
        shift = r % len(contenders)
        for c in contenders[shift:] + contenders[:shift]:
            start = time.perf_counter()
            c.train(updates)
            times[c.label].append((time.perf_counter() - start) / updates)
    return dict(times)


def paired_ratio(times, label, base):
    """Median and quartiles of the per-round ratio label / base."""
    ratios = sorted(a / b for a, b in zip(times[label], times[base]))
    q = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 \
        else [ratios[0]] * 3
    return {"ratio": statistics.median(ratios), "q1": q[0], "q3": q[2]}


def op_class(op_type):
    for name, pattern in OP_CLASSES:
        if re.search(pattern, op_type):
            return name
    return "other"


def profile(contender, updates):
    """Where one update's time goes, from a tf.profiler trace of `updates` updates.

    Returns:
      dict: wall_ms per update; per op class the kernel ms and calls per update
      (kernel time summed over threads; ops that only hold others are left out).
    """
    from tensorflow.tsl.profiler.protobuf import xplane_pb2
    logdir = tempfile.mkdtemp(prefix="bench-profile-")
    tf.profiler.experimental.start(logdir)
    start = time.perf_counter()
    contender.train(updates)
    wall = time.perf_counter() - start
    tf.profiler.experimental.stop()
    space = xplane_pb2.XSpace()
    with open(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)[0],
              "rb") as f:
        space.ParseFromString(f.read())
    kernel_ms, calls, per_type = collections.Counter(), collections.Counter(), collections.Counter()
    for plane in space.planes:
        for line in plane.lines:
            if not line.name.startswith("tf_Compute"):
                continue
            for event in line.events:
                name = plane.event_metadata[event.metadata_id].name
                if ":" not in name or "::" in name:
                    continue  # executor bookkeeping (ExecutorState::Process), not an op
                op_type = name.rsplit(":", 1)[1]
                if any(op_type.endswith(c) for c in CONTAINER_OPS) or op_type.startswith("__"):
                    continue
                cls = op_class(op_type)
                kernel_ms[cls] += event.duration_ps / 1e9 / updates
                calls[cls] += 1 / updates
                per_type[op_type] += event.duration_ps / 1e9 / updates
    shutil.rmtree(logdir, ignore_errors=True)
    return {"wall_ms": 1e3 * wall / updates, "kernel_ms": dict(kernel_ms), "calls": dict(calls),
            "top": per_type.most_common(6)}


# ---------------------------------------------------------------- memory probes


def _status_mb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _reset_peak():
    """Resets the kernel's peak-RSS counter (VmHWM); False where the kernel cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def run_probe(spec):
    """One memory measurement in this (fresh) process; returns a JSON-able dict.

    The probe keeps only the samples it trains on, so that the 55,000 training images
    (170 MB as float32) do not hide what the strategies change; then it measures the peak
    RSS while training `updates` updates, against the RSS just before.
    """
    config = experiment.Config(average_gradients=spec["n"], batch_size=spec["b"],
                               accumulate=spec["strategy"], model=spec["model"],
                               iterations=spec["n"] * spec["updates"])
    import_mb = _status_mb("VmRSS")  # TensorFlow imported, nothing else yet
    datasets = data.load_mnist()
    samples = spec["n"] * spec["b"] * spec["updates"]
    idx = data.SampleStream(len(datasets.train.labels), SEED).next_indices(samples)
    train = data.Split(datasets.train.images[idx], datasets.train.labels[idx])
    datasets = data.Datasets(train=train, validation=None, test=None)
    run = experiment.Run(config, SEED)
    with run.session() as sess:
        sess.run(run.init_op)
        training = experiment.Training(config, datasets, SEED, sess, run)
        training.stream = data.SampleStream(samples, SEED)
        baseline = _status_mb("VmRSS")
        exact = _reset_peak()
        start = time.perf_counter()
        for _ in range(config.iterations):
            training.step()
        seconds = time.perf_counter() - start
        # Without the reset, the process's lifetime peak (MNIST's loading included).
        peak = _status_mb("VmHWM") if exact else \
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return dict(spec, import_mb=import_mb, baseline_mb=baseline, peak_mb=peak,
                increment_mb=peak - baseline, exact_peak=exact,
                seconds_per_update=seconds / spec["updates"],
                parameters=sum(v.shape.num_elements() for v in
                               run.graph.get_collection(v1.GraphKeys.TRAINABLE_VARIABLES)))


def _spawn_probe(spec, env=None):
    return subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--probe=" + json.dumps(spec)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, **(env or {})))


def _probe_result(spec, proc):
    """The probe's JSON line, or the spec with an `error`."""
    stdout, stderr = proc.communicate()
    if proc.returncode:
        tail = (stderr.strip().splitlines() or ["no output"])[-1]
        return dict(spec, error=f"probe failed ({proc.returncode}): {tail}")
    return json.loads(stdout.strip().splitlines()[-1])


def probe_all(specs, jobs):
    """Runs each spec in a fresh `bench.py --probe` process, `jobs` at a time."""
    out, pending = {}, list(specs)
    while pending:
        batch, pending = pending[:jobs], pending[jobs:]
        procs = [(spec, _spawn_probe(spec)) for spec in batch]
        for spec, proc in procs:
            key = json.dumps(spec, sort_keys=True)
            out[key] = _probe_result(spec, proc)
            print(f"  probe {describe_probe(spec)}: " + (
                out[key].get("error") or f"peak {out[key]['peak_mb']:.0f} MB, "
                f"+{out[key]['increment_mb']:.0f} MB in training"), flush=True)
    return out


def run_kernels_probe(spec):
    """Direct against fused, interleaved, in this process (started with oneDNN off)."""
    datasets = data.load_mnist()
    out = []
    for n, b in spec["configs"]:
        contenders = [SessionContender("direct", experiment.Config(
            average_gradients=1, batch_size=n * b), datasets),
            SessionContender("fused", experiment.Config(
                average_gradients=n, batch_size=b, accumulate="fused"), datasets)]
        times = interleaved(contenders, spec["updates"], spec["repeats"])
        ops = profile(contenders[0], 1)["top"]
        out.append({"n": n, "b": b, "direct_ms": 1e3 * statistics.median(times["direct"]),
                    "fused_ms": 1e3 * statistics.median(times["fused"]),
                    "ratio": paired_ratio(times, "fused", "direct")["ratio"],
                    "onednn_ops": any(t.startswith("_Mkl") for t, _ in ops)})
        for c in contenders:
            c.close()
    return {"kernels": out}


def describe_probe(spec):
    s = spec["strategy"] if spec["n"] > 1 else "direct"
    return f"{spec['model']} {s} N={spec['n']} B={spec['b']}"


def mem_available_mb():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    return float("inf")


# ---------------------------------------------------------------- the sections


def tf1_contenders(n, b, datasets):
    """The direct batch N*B (the post's minimize) and every strategy at N x B."""
    contenders = [SessionContender("direct", experiment.Config(
        average_gradients=1, batch_size=n * b), datasets)]
    for strategy in trainer.STRATEGIES:
        contenders.append(SessionContender(strategy, experiment.Config(
            average_gradients=n, batch_size=b, accumulate=strategy), datasets))
    return contenders


def keras_modes(n, updates):
    """Ways to train with Keras's accumulation: the setup section compares the plain ones
    with one call per update; the speed section times the two that are fastest."""
    return {"train_on_batch": dict(mode="train_on_batch"),
            "fit, steps_per_execution=1": dict(mode="fit", steps_per_execution=1),
            "fit, steps_per_execution=N": dict(mode="fit", steps_per_execution=n),
            "fit, steps_per_execution=N*U": dict(mode="fit", steps_per_execution=n * updates)}


# The Keras contenders of the speed section, by label; a target takes the faster one.
KERAS_CONTENDERS = {"keras": "fit, steps_per_execution=N",
                    "keras_long": "fit, steps_per_execution=N*U"}


def keras_setup_section(datasets, settings, n=5, b=20):
    """Keras used plainly (a call per micro-batch) against one compiled call per update."""
    updates = settings["updates"]
    modes = {label: kw for label, kw in keras_modes(n, updates).items() if not label.endswith("U")}
    contenders = [KerasContender(label, n, b, datasets, **kw) for label, kw in modes.items()]
    times = interleaved(contenders, updates, max(2, settings["repeats"] // 2))
    medians = {label: statistics.median(t) for label, t in times.items()}
    print(f"Keras at N={n} x B={b}: " + ", ".join(
        f"{label}: {1e3 * s:.1f} ms" for label, s in medians.items()), flush=True)
    return {"n": n, "b": b, "medians": medians}


def keras_vs_fused(times):
    """The faster Keras contender's label, and fused's speed-up over it."""
    best = min(KERAS_CONTENDERS, key=lambda k: statistics.median(times[k]))
    return best, paired_ratio(times, best, "fused")


def speed_section(datasets, settings):
    rows = []
    for n, b in settings["configs"]:
        print(f"Speed at N={n} x B={b} (direct: B={n * b})", flush=True)
        contenders = tf1_contenders(n, b, datasets)
        modes = keras_modes(n, settings["updates"])
        contenders += [KerasContender(label, n, b, datasets, **modes[mode])
                       for label, mode in KERAS_CONTENDERS.items()]
        contenders.append(TF2Contender("tf2", n, b, datasets))
        times = interleaved(contenders, settings["updates"], settings["repeats"])
        profiles = {c.label: profile(c, settings["updates"]) for c in contenders}
        for c in contenders:
            c.close()
        keras_best, keras_ratio = keras_vs_fused(times)
        row = {"n": n, "b": b, "times": times, "profiles": profiles, "keras_best": keras_best,
               "median_ms": {k: 1e3 * statistics.median(t) for k, t in times.items()},
               "vs_direct": {k: paired_ratio(times, k, "direct") for k in times},
               "vs_stack": {k: paired_ratio(times, k, "stack") for k in times},
               "keras_vs_fused": keras_ratio}
        print("  " + ", ".join(f"{k}: {row['median_ms'][k]:.1f} ms "
                               f"({row['vs_direct'][k]['ratio']:.2f}x)" for k in times),
              flush=True)
        rows.append(row)
    return rows


def kernels_section(settings):
    """The fused/direct comparison again, on TensorFlow's Eigen kernels instead of
    oneDNN's (TF_ENABLE_ONEDNN_OPTS=0 only acts at start-up: a fresh process)."""
    configs = [c for c in settings["configs"] if c in FUSED_LIMITS]
    if not configs:
        return None
    spec = {"kernels": True, "configs": configs, "updates": settings["updates"],
            "repeats": settings["repeats"]}
    print("Fused against direct with oneDNN off", flush=True)
    result = _probe_result(spec, _spawn_probe(spec, {"TF_ENABLE_ONEDNN_OPTS": "0"}))
    print("  " + (result.get("error") or ", ".join(
        f"N={r['n']} x B={r['b']}: {r['ratio']:.2f}x" for r in result["kernels"])), flush=True)
    return result


def memory_section(settings):
    """Direct batch of S samples against B x (S/B) accumulated, and against B alone."""
    s, b = settings["mem_samples"], settings["mem_batch"]
    n = s // b
    direct = dict(model="convnet", strategy="stack", n=1, b=s, updates=2)
    small = dict(model="convnet", strategy="stack", n=1, b=b, updates=2 * n)
    accumulated = [dict(model="convnet", strategy=k, n=n, b=b, updates=2)
                   for k in settings["mem_strategies"]]
    print(f"Peak memory: {s} samples direct against {n} x {b} accumulated", flush=True)
    out = probe_all([direct, small] + accumulated, settings["probe_jobs"])
    get = lambda spec: out[json.dumps(spec, sort_keys=True)]  # noqa: E731
    return {"samples": s, "n": n, "b": b, "direct": get(direct), "small": get(small),
            "accumulated": {spec["strategy"]: get(spec) for spec in accumulated}}


def host_memory_section(settings):
    """Peak RSS of each strategy as N grows, on a model whose gradients dominate memory."""
    params = 784 * 4096 + 4096 + 4096 * 4096 + 4096 + 4096 * 10 + 10
    grad_mb = 4 * params / MB
    specs, skipped = [], {}
    for strategy in settings["host_strategies"]:
        for n in settings["host_ns"]:
            if n == 1 and strategy != settings["host_strategies"][0]:
                continue  # N=1 is `minimize` whatever the strategy: measured once
            spec = dict(model=HOST_MODEL, strategy=strategy, n=n, b=HOST_BATCH, updates=1)
            # stack keeps N gradients and stacks them: about 2N copies at the apply.
            need = 1024 + (2 * n * grad_mb if strategy == "stack" else 4 * grad_mb)
            if need > 0.8 * mem_available_mb():
                skipped[(strategy, n)] = f"skipped: needs ~{need / 1024:.1f} GB, " \
                    f"{mem_available_mb() / 1024:.1f} GB available"
            else:
                specs.append(spec)
    print(f"Host memory as N grows ({HOST_MODEL}, B={HOST_BATCH})", flush=True)
    out = probe_all(specs, settings["probe_jobs"])
    table = {(spec["strategy"], spec["n"]): out[json.dumps(spec, sort_keys=True)]
             for spec in specs}
    for strategy in settings["host_strategies"]:
        if (settings["host_strategies"][0], 1) in table:
            table[(strategy, 1)] = table[(settings["host_strategies"][0], 1)]
    return {"grad_mb": grad_mb, "params": params, "table": table, "skipped": skipped,
            "ns": settings["host_ns"], "strategies": settings["host_strategies"]}


# ---------------------------------------------------------------- targets and reasons


def _classes_delta(slow, fast):
    """Op classes sorted by how much more kernel time `slow` spends than `fast`."""
    classes = set(slow["kernel_ms"]) | set(fast["kernel_ms"])
    return sorted(classes, key=lambda c: fast["kernel_ms"].get(c, 0) - slow["kernel_ms"].get(c, 0))


def _class_line(cls, a, b, la, lb):
    ka, kb = a["kernel_ms"].get(cls, 0.0), b["kernel_ms"].get(cls, 0.0)
    ca, cb = a["calls"].get(cls, 0.0), b["calls"].get(cls, 0.0)
    per = lambda k, c: f"{1e3 * k / c:.0f} us" if c else "-"  # noqa: E731
    return (f"{cls} {ka:.2f} ms in {ca:.0f} calls ({per(ka, ca)} a call) for {la} against "
            f"{kb:.2f} ms in {cb:.0f} calls ({per(kb, cb)}) for {lb}")


def explain_profile(row, slow, fast, per_call=False):
    """A measured account of why `slow` takes longer than `fast` at this configuration.

    Wall times are the timed rounds' medians (tracing slows some contenders more than
    others); kernel times come from the profile. `per_call`: `slow` runs the kernels of
    `fast` on 1/N of the samples N times; say what a call costs.
    """
    a, b = row["profiles"][slow], row["profiles"][fast]
    wa, wb = row["median_ms"][slow], row["median_ms"][fast]
    ka, kb = sum(a["kernel_ms"].values()), sum(b["kernel_ms"].values())
    order = _classes_delta(a, b)
    text = (f"Profile at N={row['n']} x B={row['b']} (tf.profiler over one block of updates; "
            f"kernel time per update, summed over threads): {slow} {wa:.1f} ms wall, "
            f"{ka:.1f} ms in kernels; {fast} {wb:.1f} ms wall, {kb:.1f} ms in "
            f"kernels. Largest differences: "
            + "; ".join(_class_line(c, a, b, slow, fast) for c in order[:3]) + ".")
    top = order[0]
    ca, cb = a["calls"].get(top, 0), b["calls"].get(top, 0)
    if per_call and ca > cb > 0 and b["kernel_ms"].get(top):
        per_a, per_b = a["kernel_ms"][top] / ca, b["kernel_ms"][top] / cb
        text += (f" The {top} kernels run {ca / cb:.0f}x as often on {cb / ca:.2g} of the "
                 f"samples each; one call costs {per_a / per_b:.2f} of a call on all of them, "
                 f"so per update they cost {a['kernel_ms'][top] / b['kernel_ms'][top]:.2f}x")
        text += (": a cost per call that does not shrink with the batch." if
                 per_a / per_b > 1.2 * cb / ca else ".")
    dw, dk = wa - wb, ka - kb
    text += f" Wall time differs by {dw:+.1f} ms per update, kernel time by {dk:+.1f} ms"
    text += (": most of the difference is outside the kernels (session or function calls, "
             "Python, feeding, the input pipeline)." if dk < dw / 2 else ".")
    return text


def explain_fused(row, kernels=None):
    """Why fused trails the direct batch, with `stack` as the reference that runs the same
    micro-batch kernels one micro-batch at a time, and the same pair on Eigen kernels."""
    text = explain_profile(row, "fused", "direct", per_call=True)
    profiles = row["profiles"]
    if "stack" in profiles:
        ks, kd, kf = (sum(profiles[k]["kernel_ms"].values()) for k in ("stack", "direct", "fused"))
        text += (f" For reference, `stack` runs the same micro-batch kernels one micro-batch "
                 f"at a time: {ks:.1f} ms of kernels per update against direct's {kd:.1f} "
                 f"({ks / kd:.2f}x); fused's {kf:.1f} ms are measured with two micro-batches "
                 f"sharing the cores.")
    eigen = [k for k in (kernels or {}).get("kernels", [])
             if (k["n"], k["b"]) == (row["n"], row["b"]) and not k["onednn_ops"]]
    if eigen:
        k = eigen[0]
        text += (f" The check: with oneDNN off (TF_ENABLE_ONEDNN_OPTS=0, TensorFlow's Eigen "
                 f"kernels, a separate process), fused took {k['ratio']:.2f}x direct here, "
                 f"direct itself {k['direct_ms']:.1f} ms against {row['median_ms']['direct']:.1f} "
                 f"with oneDNN, fused {k['fused_ms']:.1f} against "
                 f"{row['median_ms']['fused']:.1f}: the gap follows the kernels' cost per call.")
    return text


def explain_keras(row):
    """Why fused is not KERAS_SPEEDUP times faster than Keras at this configuration."""
    keras = row["keras_best"]
    slow, fast = (keras, "fused") if row["median_ms"][keras] >= row["median_ms"]["fused"] \
        else ("fused", keras)
    kk, kf = (sum(row["profiles"][k]["kernel_ms"].values()) for k in (keras, "fused"))
    text = (explain_profile(row, slow, fast) + f" Kernel time per update: {keras} "
            f"{kk:.1f} ms, fused {kf:.1f} ms ({kk / kf:.2f}x).")
    if kk < 1.5 * kf:
        text += (f" Keras too runs its loop in one compiled call here; with kernel times "
                 f"this close, fused could be {KERAS_SPEEDUP:g}x faster only if Keras spent "
                 f"more time outside its kernels than fused spends in all.")
    return text


def _status(ok, noisy=False):
    return "met" if ok else ("within noise" if noisy else "missed")


def noise_floor(speed):
    """How far apart identical graphs came out in this run, or None.

    At N=1 every strategy builds the post's `minimize`, the same graph as `direct`: their
    ratios to it differ from 1 by noise alone.
    """
    for row in speed:
        if row["n"] == 1:
            return max(abs(row["vs_direct"][s]["ratio"] - 1) for s in trainer.STRATEGIES)
    return None


def evaluate_targets(speed, mem, host, kernels=None):
    """Each target: what it asks, the measured value, met / within noise / missed, why."""
    rows = {(r["n"], r["b"]): r for r in speed}
    noise = noise_floor(speed)
    targets = []
    for (n, b), limit in FUSED_LIMITS.items():
        name = f"fused <= {limit}x direct at N={n}/B={b}"
        if (n, b) not in rows:
            targets.append(dict(target=name, measured="not measured", status="not measured"))
            continue
        r = rows[(n, b)]["vs_direct"]["fused"]
        ok = r["ratio"] <= limit
        targets.append(dict(target=name, measured=f"{r['ratio']:.2f}x", status=_status(ok),
                            why=None if ok else f"Missed by {r['ratio'] / limit - 1:.0%}. "
                            + explain_fused(rows[(n, b)], kernels)))
    accumulating = [r for r in speed if r["n"] > 1]  # at N=1 every strategy is minimize
    for s in ("running", "graph", "fused"):
        if not accumulating:
            break
        worst = max(accumulating, key=lambda r: r["vs_stack"][s]["ratio"])
        r = worst["vs_stack"][s]
        ok = r["ratio"] <= 1.0
        noisy = r["q1"] <= 1.0 or (noise is not None and r["ratio"] - 1 <= noise)
        why = None
        if not ok:
            why = (f"{s} at N={worst['n']}/B={worst['b']}: {r['ratio']:.3f}x stack (paired "
                   f"rounds, quartiles {r['q1']:.3f}-{r['q3']:.3f}"
                   + (f"; identical graphs differed by up to {noise:.0%} in this run"
                      if noise is not None else "")
                   + ("; so this run cannot tell the two apart). " if noisy else "). ")
                   + explain_profile(worst, s, "stack"))
        targets.append(dict(target=f"{s} never slower than stack (N > 1)",
                            measured=f"worst {r['ratio']:.2f}x at N={worst['n']}/B={worst['b']}",
                            status=_status(ok, noisy), why=why))
    if speed:
        worst = min(speed, key=lambda r: r["keras_vs_fused"]["ratio"])
        r = worst["keras_vs_fused"]
        ok = r["ratio"] >= KERAS_SPEEDUP
        targets.append(dict(
            target=f"fused >= {KERAS_SPEEDUP:g}x faster than Keras's accumulation, every (N, B)",
            measured=f"worst {r['ratio']:.2f}x at N={worst['n']}/B={worst['b']}",
            status=_status(ok),
            why=None if ok else f"Missed by {1 - r['ratio'] / KERAS_SPEEDUP:.0%} at "
            f"N={worst['n']}/B={worst['b']} (Keras as `{worst['keras_best']}`, the faster "
            f"there). " + explain_keras(worst)))
    if mem:
        targets += memory_targets(mem)
    if host:
        targets += host_targets(host)
    return targets


def memory_targets(mem):
    out = []
    small, direct = mem["small"], mem["direct"]
    usable = {s: p for s, p in mem["accumulated"].items() if "error" not in p}
    if "error" in small or "error" in direct or not usable:
        return [dict(target="peak memory at the large effective batch", measured="probe failed",
                     status="missed", why=small.get("error") or direct.get("error"))]
    worst = max(usable, key=lambda s: usable[s]["peak_mb"])
    p = usable[worst]
    ratio_small, ratio_direct = p["peak_mb"] / small["peak_mb"], p["peak_mb"] / direct["peak_mb"]
    feed_mb = mem["samples"] * 784 * 4 / MB
    ok = ratio_small <= ACCUMULATED_VS_SMALL
    out.append(dict(
        target=f"accumulated peak <= {ACCUMULATED_VS_SMALL}x that of B={mem['b']} alone",
        measured=f"worst {ratio_small:.2f}x ({worst})", status=_status(ok),
        why=None if ok else (
            f"{worst} peaked at {p['peak_mb']:.0f} MB against {small['peak_mb']:.0f} MB for "
            f"B={mem['b']} alone: +{p['increment_mb']:.0f} MB over its RSS before training "
            f"against +{small['increment_mb']:.0f} MB. For scale, the window's {mem['samples']} "
            f"images are {feed_mb:.0f} MB as float32.")))
    ok = ratio_direct <= ACCUMULATED_VS_DIRECT
    out.append(dict(
        target=f"accumulated peak <= {ACCUMULATED_VS_DIRECT:g} of the direct batch's",
        measured=f"worst {ratio_direct:.2f} ({worst})", status=_status(ok),
        why=None if ok else (
            f"A fixed floor decides it: RSS before training was {p['baseline_mb']:.0f} MB "
            f"({p['import_mb']:.0f} MB of it right after importing TensorFlow), more than a "
            f"quarter of the direct batch's {direct['peak_mb']:.0f} MB peak. What training adds "
            f"is +{p['increment_mb']:.0f} MB accumulated against +{direct['increment_mb']:.0f} "
            f"MB direct ({p['increment_mb'] / max(direct['increment_mb'], 1e-9):.3f}).")))
    return out


def host_slope(host, strategy):
    """Least-squares MB per added micro-batch over the measured N > 1, or None."""
    points = [(n, host["table"][(strategy, n)]["peak_mb"]) for n in host["ns"]
              if n > 1 and "peak_mb" in host["table"].get((strategy, n), {})]
    if len(points) < 2:
        return None
    ns, mbs = np.array(points, dtype=float).T
    return float(np.polyfit(ns, mbs, 1)[0])


def host_targets(host):
    """Flat in N: less than FLAT_GRADIENTS_PER_N gradients more per added micro-batch
    (a strategy that keeps the window's gradients adds at least one per micro-batch)."""
    out = []
    for s in ("running", "graph", "fused"):
        if s not in host["strategies"]:
            continue
        slope = host_slope(host, s)
        if slope is None:
            out.append(dict(target=f"host memory of {s} flat in N", measured="not measured",
                            status="not measured"))
            continue
        per_n = slope / host["grad_mb"]
        ok = per_n < FLAT_GRADIENTS_PER_N
        out.append(dict(
            target=f"host memory of {s} flat in N", status=_status(ok),
            measured=f"{slope:+.1f} MB per added micro-batch ({per_n:+.3f} gradients)",
            why=None if ok else f"{s} grew by {slope:.1f} MB per added micro-batch, "
            f"{per_n:.2f} of a gradient ({host['grad_mb']:.0f} MB): more than "
            f"{FLAT_GRADIENTS_PER_N} gradients per micro-batch."))
    return out


# ---------------------------------------------------------------- the report


def machine():
    model_name = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        model_name = names[0] if names else model_name
    except OSError:
        pass
    mem = "unknown"
    try:
        with open("/proc/meminfo") as f:
            mem = f"{int(f.readline().split()[1]) / MB:.1f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    import keras
    return (f"{os.cpu_count()} cores ({model_name}), {mem} RAM, {platform.system()} "
            f"{platform.release()}; Python {platform.python_version()}, TensorFlow "
            f"{tf.__version__}, Keras {keras.__version__}, numpy {np.__version__}")


def _ms_ratio(row, label):
    r = row["vs_direct"][label]
    return f"{row['median_ms'][label]:.1f} ms, {r['ratio']:.2f}x"


def render(command, settings, speed, keras_setup, mem, host, targets, elapsed, kernels=None):
    lines = ["# Benchmarks: gradient accumulation, speed and memory", "",
             f"Written by `{command}` on {datetime.datetime.now():%Y-%m-%d %H:%M} in "
             f"{elapsed / 60:.1f} minutes.", "", f"Machine: {machine()}.", "",
             "Ratios are within this one run; CPU timings on a shared machine are noisy, so "
             "compare ratios, not times across runs.", ""]
    lines += ["## Targets", "", "| target | measured | status |", "|---|---|---|"]
    lines += [f"| {t['target']} | {t['measured']} | {t['status']} |" for t in targets]
    noise = noise_floor(speed)
    if noise is not None:
        lines += ["", f"This run's noise: at N=1 every strategy is the post's `minimize`, the "
                  f"same graph as `direct`, and their ratios to it came out up to "
                  f"{noise:.0%} away from 1. A strategy whose ratio to `stack` is above 1 "
                  f"by less than that, or below 1 in a quarter of the rounds, is \"within "
                  f"noise\": this run cannot tell it apart from `stack`."]
    whys = [t for t in targets if t.get("why")]
    if whys:
        lines += ["", "### Why targets were missed", ""]
        lines += [f"- **{t['target']}** ({t['status']}). {t['why']}" for t in whys]
    if speed:
        labels = ["direct"] + list(trainer.STRATEGIES) + list(KERAS_CONTENDERS) + ["tf2"]
        lines += ["", "## Speed: training time per update", "",
                  f"Each update trains N*B samples of real MNIST (the post's ConvNet, dropout "
                  f"on, Adam 1e-3). Median of {settings['repeats']} interleaved rounds of "
                  f"{settings['updates']} updates each, after one untimed block; the ratio is "
                  f"the median of the per-round ratios to `direct` (one batch of N*B, the "
                  f"post's `minimize`). At N=1 every strategy is that same `minimize`: their "
                  f"spread there is this run's noise floor.", "",
                  "| N x B | " + " | ".join(labels) + " | faster Keras / fused |",
                  "|---" * (len(labels) + 2) + "|"]
        for row in speed:
            lines.append(f"| {row['n']} x {row['b']} | " + " | ".join(
                _ms_ratio(row, k) for k in labels)
                + f" | {row['keras_vs_fused']['ratio']:.2f}x |")
        lines += ["", "`keras`, `keras_long`: the same ConvNet as a Keras 3 model, "
                  "`Adam(1e-3, gradient_accumulation_steps=N)`, `model.fit` on a tf.data "
                  "pipeline of B-sized batches, with `steps_per_execution` N (one compiled "
                  "call per update, as `fused`) or N*U (one per timed block): Keras's own "
                  "way to cut the per-step overhead, and its fastest measured here (the plain "
                  "ways are below). Everything runs under op determinism, as `main.py` does, "
                  "under which Keras compiles no XLA."]
        lines += ["", "`tf2`: `--engine=tf2` (tf2_trainer.py): the same ConvNet as a Keras 3 "
                  "model, one tf.function micro-step per B samples into accumulator "
                  "variables and one apply-step per update, on tf.data in the post's order."]
    if keras_setup:
        lines += ["", f"### Keras used plainly (N={keras_setup['n']} x B={keras_setup['b']})",
                  "", "A call per micro-batch against one compiled call per update.", "",
                  "| how | ms per update |", "|---|---|"]
        lines += [f"| {label} | {1e3 * s:.1f} |" for label, s in keras_setup["medians"].items()]
    if speed:
        lines += ["", "## Profile: where one update's time goes", "",
                  "tf.profiler over one block of updates per contender, after the timed "
                  "rounds; kernel milliseconds per update, summed over threads (so they can "
                  "exceed the wall time), by op class. Tracing slows the small ops most.", ""]
        for row in speed:
            labels = list(row["profiles"])
            classes = sorted({c for p in row["profiles"].values() for c in p["kernel_ms"]})
            lines += [f"N={row['n']} x B={row['b']}:", "",
                      "| | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|",
                      "| wall ms, timed rounds | " + " | ".join(
                          f"{row['median_ms'][k]:.1f}" for k in labels) + " |",
                      "| wall ms, traced | " + " | ".join(
                          f"{row['profiles'][k]['wall_ms']:.1f}" for k in labels) + " |"]
            for c in classes:
                lines.append(f"| {c} | " + " | ".join(
                    f"{row['profiles'][k]['kernel_ms'].get(c, 0):.2f}" for k in labels) + " |")
            lines.append("")
    if kernels:
        lines += kernels_markdown(kernels, speed)
    if mem:
        lines += memory_markdown(mem)
    if host:
        lines += host_markdown(host)
    lines += ["", "## Method", "",
              "- Speed: every contender is built once (its own graph and session, or Keras "
              "model), trained one untimed block, then timed in rounds in which each trains "
              "one block; the order rotates every round. Data: the post's sample stream "
              "(TF1 contenders, through `experiment.Training.step`, exactly as `main.py` "
              "trains) or tf.data (Keras); evaluation is not timed.",
              "- Memory: each number is a fresh `bench.py --probe` process: it builds the "
              "graph, keeps only the samples it will train on, resets the kernel's peak-RSS "
              "counter (`/proc/self/clear_refs`), trains, and reads `VmHWM`. \"Before\" is "
              "its RSS just before training, \"import\" right after importing TensorFlow.", ""]
    return "\n".join(lines)


def kernels_markdown(kernels, speed):
    if "error" in kernels:
        return ["", "## oneDNN off", "", kernels["error"]]
    rows = {(r["n"], r["b"]): r for r in speed}
    out = ["", "## The same on Eigen kernels (oneDNN off)", "",
           "`direct` and `fused` again, interleaved as above, in a process started with "
           "`TF_ENABLE_ONEDNN_OPTS=0`, so TensorFlow runs its Eigen kernels instead of "
           "oneDNN's. `main.py` keeps TensorFlow's default (oneDNN on); this only tests where "
           "fused's gap to the direct batch comes from.", "",
           "| N x B | direct, oneDNN | direct, Eigen | fused, oneDNN | fused, Eigen | "
           "fused / direct, oneDNN | fused / direct, Eigen |", "|---|---|---|---|---|---|---|"]
    for k in kernels["kernels"]:
        r = rows[(k["n"], k["b"])]
        note = "" if not k["onednn_ops"] else " (oneDNN ops still seen!)"
        out.append(f"| {k['n']} x {k['b']} | {r['median_ms']['direct']:.1f} ms | "
                   f"{k['direct_ms']:.1f} ms | {r['median_ms']['fused']:.1f} ms | "
                   f"{k['fused_ms']:.1f} ms | {r['vs_direct']['fused']['ratio']:.2f}x | "
                   f"{k['ratio']:.2f}x{note} |")
    return out


def memory_markdown(mem):
    rows = [("direct", f"1 x {mem['samples']}", mem["direct"]),
            (f"B={mem['b']} alone", f"1 x {mem['b']}", mem["small"])]
    rows += [(s, f"{mem['n']} x {mem['b']}", p) for s, p in mem["accumulated"].items()]
    out = ["", f"## Peak memory at {mem['samples']} samples per update", "",
           "The post's ConvNet; peak RSS of a fresh process while it trains 2 updates (B "
           f"alone: as many samples), against its RSS before training.", "",
           "| run | N x B | peak MB | before MB | training adds MB | peak / B alone | "
           "peak / direct |", "|---|---|---|---|---|---|---|"]
    for label, shape, p in rows:
        if "error" in p:
            out.append(f"| {label} | {shape} | {p['error']} | | | | |")
            continue
        small, direct = mem["small"].get("peak_mb"), mem["direct"].get("peak_mb")
        out.append(f"| {label} | {shape} | {p['peak_mb']:.0f} | {p['baseline_mb']:.0f} | "
                   f"{p['increment_mb']:.0f} | "
                   + (f"{p['peak_mb'] / small:.2f} | " if small else "| ")
                   + (f"{p['peak_mb'] / direct:.2f} |" if direct else "|"))
    return out


def host_markdown(host):
    out = ["", "## Host memory as N grows", "",
           f"`--model={HOST_MODEL}` ({host['params']:,} parameters: one gradient is "
           f"{host['grad_mb']:.0f} MB), B={HOST_BATCH}, one update; peak RSS in MB of a fresh "
           "process while it trains (at N=1 every strategy is `minimize`).", "",
           "| N | " + " | ".join(host["strategies"]) + " |",
           "|---" * (len(host["strategies"]) + 1) + "|"]
    for n in host["ns"]:
        cells = []
        for s in host["strategies"]:
            p = host["table"].get((s, n))
            cells.append(host["skipped"].get((s, n), "-") if p is None else
                         p.get("error") or f"{p['peak_mb']:.0f}")
        out.append(f"| {n} | " + " | ".join(cells) + " |")
    slopes = [(s, host_slope(host, s)) for s in host["strategies"]]
    slopes = [f"{s} {m:+.1f} MB ({m / host['grad_mb']:+.3f} gradients)"
              for s, m in slopes if m is not None]
    if slopes:
        out += ["", "Least-squares growth per added micro-batch, over N > 1: "
                + ", ".join(slopes) + f". Flat means under {FLAT_GRADIENTS_PER_N} gradients; "
                "keeping the window's gradients costs at least one."]
    return out


def print_targets(targets):
    print("\nTargets:")
    for t in targets:
        print(f"  {t['status']:>13}: {t['target']} -- {t['measured']}")


def main_bench(argv):
    if len(argv) > 1:
        main.fail(f"unexpected arguments: {' '.join(argv[1:])}")
    if FLAGS.probe:
        try:
            spec = json.loads(FLAGS.probe)
        except json.JSONDecodeError as e:
            main.fail(f"--probe: not JSON ({e})")
        print(json.dumps(run_kernels_probe(spec) if spec.get("kernels") else run_probe(spec)))
        return
    output = FLAGS.output
    try:
        results.check_writable(output)
    except results.ResultsError as e:
        main.fail(str(e).replace("--results", "--output"))
    settings = QUICK if FLAGS.quick else FULL
    command = "python bench.py" + (" --quick" if FLAGS.quick else "") + (
        f" --output={shlex.quote(output)}" if output != "BENCHMARKS.md" else "")
    start = last = time.perf_counter()

    def lap(section):
        nonlocal last
        now = time.perf_counter()
        print(f"({section}: {now - last:.0f} s)", flush=True)
        last = now

    try:
        datasets = data.load_mnist()
    except data.DataError as e:
        main.fail(str(e))
    lap("MNIST")
    keras_setup = None
    if settings["keras_setup"]:
        keras_setup = keras_setup_section(datasets, settings)
        lap("Keras used plainly")
    speed = speed_section(datasets, settings)
    lap("speed")
    kernels = kernels_section(settings)
    lap("oneDNN off")
    mem = memory_section(settings)
    lap("peak memory")
    host = host_memory_section(settings)
    lap("host memory")
    targets = evaluate_targets(speed, mem, host, kernels)
    print_targets(targets)
    text = render(command, settings, speed, keras_setup, mem, host, targets,
                  time.perf_counter() - start, kernels)
    results.atomic_write_text(output, text)
    print(f"\nWrote {output} in {(time.perf_counter() - start) / 60:.1f} minutes.")


if __name__ == "__main__":
    from absl import logging
    logging.set_verbosity(logging.WARNING)
    tf.config.experimental.enable_op_determinism()  # as main.py trains
    app.run(main_bench, flags_parser=main.parse_flags)
