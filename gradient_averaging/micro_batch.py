"""Finding the micro-batch that fits: the largest mini-batch size B whose window step the
device's memory holds, for an effective batch of E samples trained as N = ceil(E / B)
mini-batches, the last one E - (N-1) B.

The peak is measured, not modelled: trial steps of the training path's own mini-batch
pass (the one its window step runs, traced once for every size) each add a mini-batch
into the window's sums and read the allocator's peak (`tf.config.experimental`'s memory
info: a GPU's allocator, or the CPU's with TF_CPU_ALLOCATOR_USE_BFC=true). The search
comes at the limit from below: an out-of-memory error is caught and counts as too large,
but TensorFlow's allocator waits (up to 10 s) for memory to be freed before it raises,
where a peak measured over the limit costs one pass. So sizes grow from one sample, at
most doubling, each step aiming halfway to where the steepest slope measured would meet
the limit (at small sizes a kernel's fixed scratch memory, not the samples, makes the
peak, and an allocator rounds a tensor up to a chunk of up to twice its size: a line
through two close sizes may be far too flat); then the interval between the largest
size that fits and the smallest that does not is halved until they are within 5% of
each other. The update (the optimizer's apply) needs the same memory whatever B: it is
measured once and must fit too. A peak must stay under the budget less a margin, for
what a trial does not see (an allocator's fragmentation over a long run; a batch the
input pipeline prefetches later): 10% of it, or 25% where the allocator grows by regions
(default_margin; reserve_cpu_memory makes the CPU's one region, as a GPU's).

Under XLA (the trainer's jit_compile) each size tried is a program compiled, which costs
more than a pass: the sizes tried are on a grid (grid: four an octave, so that the size
found is over 80% of the largest that fits), aimed at the limit itself (_grid_guess), and
a trial window's samples left are added in sizes compiled already (Search.pieces), so
that a search and its training compile about log2(E) + 2 programs; and a trial holds the
margin's memory while it runs (Search.hold: XLA's temporaries are one buffer, which the
allocator may hand a whole free chunk, counted whole).

In training (EffectiveWindows, on one replica) the trials are the first windows' own
mini-batches, each of the size the search asks for, and their updates are measured: the
update does not depend on how a window is cut, so the search trains as training would:
no weights or optimizer state are copied, nothing is discarded or trained twice (the
first calls' peaks, which include their functions' set-up, are measured too: they err
high). find_micro_batch's trials (a loop of
one's own, the command line, several replicas) leave the model as they found it: no
trial is applied (the window is discarded), and every variable a trial may change (the
weights and the optimizer's for the measured update, the model's other state:
batch-norm statistics, seed generators; metrics) is copied to the host first and
assigned back after, bit for bit.

Under a tf.distribute strategy B is the micro-batch of each replica: a mini-batch holds
B samples per replica, K x B in all.

In training (EffectiveWindows), a window that runs out of memory all the same (a batch of
longer sequences than the search saw, fragmentation) is trained again at half B, on one
replica: the update does not depend on how a window is cut.
"""

import collections
import logging
import math
import numbers
import os
import re
import subprocess
import time

import numpy as np
import tensorflow as tf

from gradient_averaging import replicas as replicas_lib
from gradient_averaging import window as window_lib

# The default margin: the fraction of the budget kept free for what a trial's peak does
# not show (an input pipeline's buffers, fragmentation over a run). More where the
# allocator grows by regions that double in size (the CPU's BFC allocator, unless
# reserve_cpu_memory made it one region; a GPU's with memory growth): it runs out of
# memory well before its limit, and a trial that runs out costs the allocator's wait.
MARGIN, GROWING_MARGIN = 0.1, 0.25
MIB = 1 << 20
RESERVE_SLACK_MB = 4  # reserve_cpu_memory's region: the CPU's limit less this
_cpu_reserved = False  # whether reserve_cpu_memory made the CPU's allocator one region
CPU_BFC_ENV, CPU_LIMIT_ENV = "TF_CPU_ALLOCATOR_USE_BFC", "TF_CPU_BFC_MEM_LIMIT_IN_MB"
# How an allocation failure reads where it is not a ResourceExhaustedError (cuBLAS's,
# cuDNN's and the CUDA driver's own, raised as InternalError or UnknownError).
OUT_OF_MEMORY_TEXT = re.compile(r"\bOOM\b|out of memory|ALLOC_FAILED", re.IGNORECASE)
# The errors an out-of-memory error comes as (is_out_of_memory tells which are).
DEVICE_ERRORS = (tf.errors.ResourceExhaustedError, tf.errors.InternalError,
                 tf.errors.UnknownError)
# The search stops when the smallest size that does not fit is within this fraction of
# the largest that does (or one sample more), or after MOST_TRIALS trials.
TOLERANCE = 0.05
OOM_NEAR = 0.25  # the same, where the smallest size that does not fit ran out of memory
MOST_TRIALS = 20
# Under XLA (a program compiled for each size tried), the size tried after one sample.
GRID_FIRST = 8


class MicroBatch(collections.namedtuple(
        "MicroBatch", ["micro_batch_size", "average_gradients", "last", "effective_batch",
                       "replicas", "peak", "update_peak", "budget", "margin", "trials",
                       "traces", "seconds", "out_of_memory", "windows"],
        defaults=(1, None, None, None, None, (), None, None, (), 0))):
    """How an effective batch is cut: B (`micro_batch_size`, per replica), N
    (`average_gradients`) and the last mini-batch's samples (`last`, all replicas'), for
    E (`effective_batch`) on `replicas` replicas. Where B was found: the peak at the B
    found and the update's (bytes), the budget and margin it was found under, the trials
    as (size, peak bytes or None where it ran out of memory), the trial pass's traces and
    the search's seconds; `windows`: where the trials were the first windows' own
    mini-batches (EffectiveWindows), those windows (their training is in the seconds),
    else 0. `out_of_memory`: the micro-batches that ran out of memory in training, each
    then halved (EffectiveWindows). Its str is describe's line."""

    __slots__ = ()

    def __str__(self):
        return describe(self)


def mini_batches_of(batch, size):
    """The mini-batches of `size` samples (all replicas') a batch (a nested structure
    of tensors) is cut into: at least one."""
    samples = int(tf.shape(tf.nest.flatten(batch)[0])[0])
    return max(1, -(-samples // size))


class NothingFits(ValueError):
    """Not even a micro-batch of one sample (or the update) fits in the budget."""


class OutOfMemory(tf.errors.ResourceExhaustedError):
    """The device ran out of memory where training does not try again (in a window's
    update, or under several replicas); its message is one line that says why."""

    def __init__(self, message):
        super().__init__(None, None, message)


# ---------------------------------------------------------------- arguments


def check_effective_batch(value, name="effective_batch"):
    """E as an int >= 1 (the samples of one update)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be an int >= 1 (samples per update). "
                         f"Received: {name}={value!r}")
    return int(value)


def check_micro_batch_size(value, name="micro_batch_size"):
    """B as an int >= 1, or "auto" (found by find_micro_batch)."""
    if value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be 'auto' or an int >= 1 (samples per mini-batch "
                         f"and replica). Received: {name}={value!r}")
    return int(value)


def check_window(average_gradients, micro_batch_size):
    """One way to say a window, checked before any training: N mini-batches per update
    (`average_gradients`), or each batch one update cut into mini-batches of
    `micro_batch_size` (then N may only be None or 1: one batch per update).

    Returns:
      (average_gradients, micro_batch_size), checked; N is 1 where the micro-batch is
      given.
    """
    if micro_batch_size is None:
        if average_gradients is None:
            raise ValueError("give average_gradients=N (mini-batches per update) or "
                             "micro_batch_size='auto' or B (each batch one update)")
        return window_lib.check_average_gradients(average_gradients), None
    if average_gradients is not None and (isinstance(average_gradients, bool)
                                          or average_gradients != 1):
        raise ValueError(
            f"average_gradients={average_gradients!r} and micro_batch_size="
            f"{micro_batch_size!r} contradict each other: give average_gradients=N for N "
            "mini-batches per update, or micro_batch_size for each batch to be one update "
            "(its effective batch) cut into mini-batches of that size")
    return 1, check_micro_batch_size(micro_batch_size)


def check_margin(margin):
    """The fraction of the budget kept free, in [0, 1), or None (the device's default:
    default_margin)."""
    if margin is None:
        return None
    if isinstance(margin, bool) or not isinstance(margin, numbers.Real) or not 0 <= margin < 1:
        raise ValueError(f"margin must be a fraction of the budget in [0, 1). "
                         f"Received: margin={margin!r}")
    return float(margin)


def check_budget(budget):
    """The budget in bytes, an int >= 1, or None (the device's memory)."""
    if budget is None:
        return None
    if isinstance(budget, bool) or not isinstance(budget, numbers.Integral) or budget < 1:
        raise ValueError(f"budget must be the device memory to use, in bytes (an int >= 1). "
                         f"Received: budget={budget!r}")
    return int(budget)


def plan(effective_batch, micro_batch_size, replicas=1, **found):
    """The MicroBatch of E cut into mini-batches of B per replica (K x B in all; B at
    most a replica's share of E): N and the last mini-batch's samples. `found` fills the
    search's fields."""
    effective_batch = check_effective_batch(effective_batch)
    size = check_micro_batch_size(micro_batch_size)
    if size == "auto":
        raise ValueError("plan needs the micro-batch size: find_micro_batch finds it")
    size = min(size, math.ceil(effective_batch / replicas))
    mini_batch = size * replicas
    n = max(1, math.ceil(effective_batch / mini_batch))
    return MicroBatch(size, n, effective_batch - (n - 1) * mini_batch, effective_batch,
                      replicas, **found)


def describe(found):
    """One line: how E is cut, and why B (where it was found)."""
    mini_batch = found.micro_batch_size * found.replicas
    cut = f"{found.average_gradients} x {mini_batch}"
    if found.last != mini_batch:
        cut = f"{found.average_gradients - 1} x {mini_batch} + {found.last}"
    if found.replicas > 1:
        cut += f" ({found.micro_batch_size} per replica x {found.replicas} replicas)"
    line = f"effective batch {found.effective_batch} = {cut}"
    if found.out_of_memory:
        return (f"{line}; halved after running out of memory in training at "
                + ", ".join(str(size) for size in found.out_of_memory))
    if found.peak is None:
        return line
    why = ("the whole effective batch fits" if mini_batch >= found.effective_batch
           else f"largest mini-batch that fits: {found.micro_batch_size}"
           + (" per replica" if found.replicas > 1 else ""))
    trials = f"{len(found.trials)} trials"
    if found.windows:
        trials += f" in the first {found.windows} update" + ("s" if found.windows > 1 else "")
    return (f"{line}; {why} (peak {found.peak / MIB:.1f} of {found.budget / MIB:.1f} MiB, "
            f"{found.margin:.0%} kept free; {trials}, {found.seconds:.1f} s)")


# ---------------------------------------------------------------- the device


def is_out_of_memory(error):
    """Whether a TensorFlow error says the device's memory ran out."""
    if isinstance(error, tf.errors.ResourceExhaustedError):
        return True
    return (isinstance(error, (tf.errors.InternalError, tf.errors.UnknownError))
            and bool(OUT_OF_MEMORY_TEXT.search(str(error))))


def default_device():
    """The device a model trains on without a strategy: "GPU:0" where there is one."""
    return "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"


def _short_name(device):
    spec = tf.DeviceSpec.from_string(device or default_device())
    return f"{spec.device_type}:{spec.device_index or 0}"


def cpu_runs_bfc():
    """Whether this process's CPU runs the BFC allocator (CPU_BFC_ENV, read by TensorFlow
    when it starts)."""
    return os.environ.get(CPU_BFC_ENV, "").lower() in ("true", "1")


def device_memory(device=None):
    """The device's memory in bytes, read where TensorFlow can be told or asked it.

    On the CPU, the BFC allocator's limit (TF_CPU_ALLOCATOR_USE_BFC=true and
    TF_CPU_BFC_MEM_LIMIT_IN_MB=M, set before TensorFlow starts). On a GPU, the memory
    limit of its logical device where one was set, else its total memory as NVIDIA's
    driver reports it (NVML where pynvml is installed, else nvidia-smi; the GPU is found
    through CUDA_VISIBLE_DEVICES, in the order nvidia-smi numbers them).

    Args:
      device: "GPU:0", "CPU:0" or a full device name; None: the first GPU, else the CPU.

    Raises:
      ValueError: the memory cannot be read; the message says how to give a budget.
    """
    name = _short_name(device)
    kind, index = name.split(":")
    index = int(index)
    if kind == "CPU":
        limit = os.environ.get(CPU_LIMIT_ENV, "")
        if cpu_runs_bfc() and limit.isdigit():
            return int(limit) * MIB
        raise ValueError(
            f"the memory of {name} is not known: run the CPU as a device of M MiB with "
            f"{CPU_BFC_ENV}=true {CPU_LIMIT_ENV}=M (before TensorFlow starts), or give the "
            "budget in bytes (budget=...)")
    if kind == "GPU":
        physical, limit = _gpu_of_logical(index)
        if limit is not None:
            return int(limit) * MIB
        total = _nvidia_total(physical) if physical is not None else None
        if total is not None:
            return total
    raise ValueError(f"the memory of {name} is not known (no NVML, no nvidia-smi): give "
                     "the budget in bytes (budget=...)")


def reserve_cpu_memory(megabytes=None):
    """Makes the CPU's BFC allocator hold its memory as one region, as TensorFlow holds a
    GPU's by default, so that the CPU runs out of memory where such a GPU would: at its
    limit, not where the next region it would grow by (each twice the last) no longer
    fits. The finder then keeps MARGIN free there, not GROWING_MARGIN. Call it first,
    before TensorFlow allocates on the CPU: the regions grown before it stay apart.

    Args:
      megabytes: the region's MiB; None: the limit (TF_CPU_BFC_MEM_LIMIT_IN_MB) less 4
        MiB, which TensorFlow's start may already hold.

    Raises:
      ValueError: the CPU's allocator is not the BFC allocator, or no size is known.
    """
    global _cpu_reserved
    if not cpu_runs_bfc():
        raise ValueError(f"the CPU's allocator grows no regions to reserve: set "
                         f"{CPU_BFC_ENV}=true before TensorFlow starts")
    if megabytes is None:
        megabytes = device_memory("CPU:0") // MIB - RESERVE_SLACK_MB
    with tf.device("CPU:0"):  # uninitialized, freed at once: no page is touched
        tf.raw_ops.Empty(shape=[int(megabytes) * MIB // 4], dtype=tf.float32, init=False)
    _cpu_reserved = True


def default_margin(device=None):
    """The margin kept free on `device` where none is given: GROWING_MARGIN where its
    allocator grows (the CPU's BFC allocator, unless reserve_cpu_memory made it one
    region; a GPU with memory growth on), else MARGIN."""
    kind, index = _short_name(device).split(":")
    if kind == "GPU":
        physical, _ = _gpu_of_logical(int(index))
        gpus = tf.config.list_physical_devices("GPU")
        grows = (os.environ.get("TF_FORCE_GPU_ALLOW_GROWTH", "").lower() == "true"
                 or (physical is not None
                     and tf.config.experimental.get_memory_growth(gpus[physical])))
        return GROWING_MARGIN if grows else MARGIN
    return MARGIN if _cpu_reserved else GROWING_MARGIN


def _gpu_of_logical(index):
    """(physical GPU index, memory limit in MiB or None) of logical GPU `index`."""
    logical = 0
    for physical, gpu in enumerate(tf.config.list_physical_devices("GPU")):
        configs = tf.config.get_logical_device_configuration(gpu) or [None]
        for config in configs:
            if logical == index:
                return physical, getattr(config, "memory_limit", None)
            logical += 1
    return None, None


def _nvidia_total(physical):
    """The total memory in bytes of the `physical`-th visible NVIDIA GPU, or None."""
    visible = [part.strip() for part in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
               if part.strip()]
    ident = visible[physical] if physical < len(visible) else str(physical)
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            handle = (pynvml.nvmlDeviceGetHandleByIndex(int(ident)) if ident.isdigit()
                      else pynvml.nvmlDeviceGetHandleByUUID(ident))
            return int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # NVML absent or failing in any way: nvidia-smi next
        pass
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=memory.total",
                               "--format=csv,noheader,nounits", "-i", ident],
                              capture_output=True, text=True, timeout=30, check=True)
        return int(done.stdout.split()[0]) * MIB
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def check_statistics(devices):
    """Checks the devices' allocators keep statistics (the peak is measured there)."""
    for device in devices:
        try:
            tf.config.experimental.get_memory_info(device)
        except ValueError:
            raise ValueError(
                f"{_short_name(device)}'s allocator keeps no statistics, so the micro-batch "
                f"cannot be measured: on the CPU set {CPU_BFC_ENV}=true before TensorFlow "
                "starts, or give the micro-batch size yourself") from None


# ---------------------------------------------------------------- the search


def find_micro_batch(trainer, sample, effective_batch, budget=None, margin=None):
    """The largest micro-batch B (per replica) whose window step fits, for updates of E.

    Args:
      trainer: what trains: a gradient_averaging.tf2 accumulator, or an
        AccumulatingModel (keras_fit.accumulate) that fit has built. Its trial_window
        method gives the trials its own mini-batch pass.
      sample: one batch as training gets it ((x, y) for the TF2 accumulators; Keras's
        (x, y[, sample_weight])), of any number of samples: a trial of B samples takes
        its first B, repeated where it holds fewer. The E samples of an effective batch
        are kept on the device during the trials, as training keeps one; search while
        your input pipeline holds what it holds in training (an iterator open, its
        first batch taken), as fit does.
      effective_batch: E, the samples of one update (all replicas').
      budget: the device's memory to use, in bytes; None: device_memory(), each
        replica's device.
      margin: the fraction of the budget kept free; None: default_margin (10% on a
        GPU, 25% where the allocator grows: the CPU's, unless reserve_cpu_memory ran,
        a GPU's with memory growth).

    Returns:
      A MicroBatch: B at most ceil(E / replicas), N, the last mini-batch, the peaks.

    Raises:
      ValueError: bad arguments, a device whose memory or peak cannot be read.
      NothingFits: one sample per replica, or the update, needs more than the budget
        less its margin; the message names what it needs.
    """
    effective_batch = check_effective_batch(effective_batch)
    margin = check_margin(margin)
    start = time.perf_counter()
    spec = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, tf.as_dtype(t.dtype)),
                                 sample)
    add, window, state = trainer.trial_window(spec)
    # Under XLA (the trainer's jit_compile) each size tried is a program compiled.
    search = Search.on(window.strategy, effective_batch, budget, margin,
                       xla=bool(getattr(trainer, "jit_compile", False)))
    search.start = start
    held = _sized(sample, effective_batch)  # one effective batch, as training holds it
    trials = _Trials(add, window, state, held, search.devices, search.hold)
    several = search.workers > 1
    try:
        try:
            largest_that_fits(trials.peak, trials.update, search)
        except BaseException:
            # Under several workers the restore's collectives (a metric's assign reads
            # it across the workers) would wait for workers still in the update's: the
            # error ends this worker, and so theirs (WorkerFailed there).
            if not several:
                trials.restore()
            raise
        trials.restore()
        found = search.found(traces=add.experimental_get_tracing_count())
        if several:
            found = agreed(window.strategy, found)
    except replicas_lib.COLLECTIVE_ERRORS:
        if not several:
            raise
        raise replicas_lib.WorkerFailed(
            "another worker failed in the micro-batch search, a collective in flight (out "
            "of memory there, most likely: its own error says): a collective strategy "
            "cannot retry one worker alone; give micro_batch_size as an int, or a budget "
            "every worker's device holds") from None
    logging.info("%s", describe(found))
    return found


def agreed(strategy, found):
    """`found` (this worker's search) cut at the smallest micro-batch any worker of
    `strategy` found, agreed by a collective (every replica's B gathered): every worker
    must cut a batch alike, and each searched its own devices. Run by every worker at
    the same point, after its search: the first collective after the trials."""
    @tf.function
    def smallest():
        sizes = strategy.run(lambda: tf.constant([found.micro_batch_size], tf.int32))
        return tf.reduce_min(strategy.gather(sizes, axis=0))

    size = int(smallest())
    if size == found.micro_batch_size:
        return found
    logging.info("micro-batch %d per replica: the smallest any worker found (this one's: "
                 "%d)", size, found.micro_batch_size)
    cut = plan(found.effective_batch, size, found.replicas)
    return found._replace(micro_batch_size=cut.micro_batch_size,
                          average_gradients=cut.average_gradients, last=cut.last)


class Search:
    """The search's sizes and peaks, on any trials: which size to try next, until the
    largest size whose peak fits in the budget less its margin is known (_guess says
    how). Training's first windows run it (EffectiveWindows: each trial one of their
    mini-batches), and so do find_micro_batch and tf1.find_micro_batch
    (largest_that_fits: each trial added to a window then discarded).

    Attributes:
      trials: (size, peak bytes or None where it ran out of memory) per trial.
      update_peak: the largest peak of the updates measured, or None.
      devices: the devices whose peaks it reads (Search.on: the strategy's).
      windows: the windows whose mini-batches were trials (EffectiveWindows').
      start: perf_counter() when the search began (the first trial, or the caller's
        set-up before it), or None.
    """

    def __init__(self, effective_batch, budget, margin, replicas=1, devices=None, xla=False):
        self.effective_batch, self.replicas = effective_batch, replicas
        self.most = math.ceil(effective_batch / replicas)
        self.budget, self.margin, self.devices = budget, margin, devices
        self.limit = budget * (1 - margin)
        self.fits, self.over, self.trials = {}, {}, []
        self.update_peak, self.windows, self.start = None, 0, None
        self.workers = 1  # the worker processes whose updates run in step (Search.on)
        self.grid = grid(self.most) if xla else None

    @classmethod
    def on(cls, strategy, effective_batch, budget=None, margin=None, xla=False):
        """The search for E on `strategy`'s devices, as on_devices: under several
        workers, this worker's own (each measures its own; find_micro_batch agrees)."""
        search = cls.on_devices(devices_of(strategy), effective_batch, budget, margin,
                                strategy.num_replicas_in_sync, xla)
        search.workers = replicas_lib.workers(strategy)
        return search

    @classmethod
    def on_devices(cls, devices, effective_batch, budget=None, margin=None, replicas=1,
                   xla=False):
        """The search for E on `devices`, checked: allocators that keep statistics, a
        budget (None: the smallest device's memory) and a margin (None: the largest
        default_margin of theirs). `xla`: the pass is XLA-compiled, a program for each
        size: the sizes tried are on grid(E)."""
        effective_batch = check_effective_batch(effective_batch)
        margin = check_margin(margin)
        check_statistics(devices)
        budget = check_budget(budget) or min(device_memory(d) for d in devices)
        if margin is None:
            margin = max(default_margin(d) for d in devices)
        return cls(effective_batch, budget, margin, replicas, devices, xla)

    @property
    def hold(self):
        """The bytes a trial holds on each device while it runs: under XLA the margin's,
        else none. XLA allocates a program's temporaries as one buffer, and an allocator
        (TensorFlow's BFC) hands a whole free chunk to a request of more than half of it,
        counted whole: a peak then reads the device full (measured: 149 of 150 MiB at a
        mini-batch that needs 77). With the margin held, a need up to the limit reads at
        most the limit, and one over it runs out of memory."""
        return self.budget - int(self.limit) if self.grid else 0

    @property
    def largest(self):
        """The largest size that fit (0 before any did)."""
        return max(self.fits, default=0)

    def next_size(self):
        """The next size to try, or None where the search is done: the sizes either side
        of the limit close enough (the largest worth trying tried, where nothing was
        over), or MOST_TRIALS tried."""
        if not self.fits:
            return 1
        largest, too_large = self.largest, min(self.over, default=self.most + 1)
        # Near an out-of-memory error, more trials risk more of them (and their waits):
        # within 25% of the largest size that fits, that one is taken.
        near = OOM_NEAR if self.over.get(too_large, 0) is None else TOLERANCE
        if len(self.trials) >= MOST_TRIALS:
            return None
        if too_large - largest <= max(1, near * largest):
            # Close to the largest size worth trying, with nothing over the limit: that
            # size, so that a whole share of E is one mini-batch where it fits.
            return self.most if largest < self.most < too_large else None
        if self.grid:
            return _grid_guess(self.fits, self.over, self.most, self.limit, self.grid)
        return _guess(self.fits, self.over, self.most, self.limit)

    def pieces(self, samples):
        """`samples` as (size, mini-batches) of sizes that fit, the largest first: as
        many of the largest as they fill, the rest of sizes tried already. Under XLA a
        trial window's samples left are added so, of programs compiled already (one
        sample always fits, where any does)."""
        pieces = []
        for size in sorted(self.fits, reverse=True):
            if samples >= size:
                pieces.append((size, samples // size))
                samples %= size
        return pieces

    def record(self, size, peak):
        """A trial's peak (None where it ran out of memory).

        Raises:
          NothingFits: one sample does not fit.
        """
        self.trials.append((size, peak))
        if peak is not None and peak <= self.limit:
            self.fits[size] = peak
        else:
            self.over[size] = peak
        if size == 1 and not self.fits:
            raise NothingFits(_nothing_fits("a mini-batch of one sample", peak, self.budget,
                                            self.margin))

    def record_update(self, peak):
        """An update's peak (None where it ran out of memory).

        Raises:
          NothingFits: the update does not fit.
        """
        if peak is None or peak > self.limit:
            line = _nothing_fits("the update (the optimizer's apply)", peak, self.budget,
                                 self.margin)
            if self.workers > 1:
                line += ("; under several workers" + (" its collectives were in flight:"
                                                      if peak is None else "") +
                         " a collective strategy cannot retry one worker alone, and the "
                         "other workers stop too")
            raise NothingFits(line)
        self.update_peak = max(peak, self.update_peak or 0)

    def found(self, traces=None):
        """The MicroBatch of the largest size that fit."""
        size = self.largest
        return plan(self.effective_batch, size, self.replicas,
                    peak=max(self.fits[size], self.update_peak or 0),
                    update_peak=self.update_peak, budget=self.budget, margin=self.margin,
                    trials=tuple(self.trials), traces=traces, windows=self.windows,
                    seconds=time.perf_counter() - self.start if self.start else None)


def largest_that_fits(peak_at, update, search):
    """Runs `search` (a Search) on trials apart from training: one sample first, then
    the update, then the sizes the search asks for, until it is done.

    Args:
      peak_at: size -> the peak bytes of one mini-batch's pass of that size added to
        an empty window (None where it ran out of memory), leaving no trace.
      update: () -> the peak bytes of the update (None where it ran out of memory).
      search: the Search for the effective batch, on the device(s) measured.

    Returns:
      `search`, done: its found() is the MicroBatch.

    Raises:
      NothingFits: one sample, or the update, needs more than the budget less its margin.
    """
    search.record(1, peak_at(1))
    search.record_update(update())
    while (size := search.next_size()) is not None:
        search.record(size, peak_at(size))
    return search


def devices_of(strategy):
    """The devices `strategy`'s replicas train on (the default device without one)."""
    try:
        return list(strategy.extended.worker_devices)
    except RuntimeError:  # the default strategy has none
        return [default_device()]


def measured_peak(run, devices, hold=0):
    """run()'s peak in bytes over the devices (the largest), or None where it ran out of
    memory (another error is raised).

    Args:
      hold: bytes held on each device while run() runs (Search.hold: under XLA, the
        margin's), not counted in the peak; where they do not fit, None.
    """
    held = []
    try:
        for device in devices if hold else ():
            with tf.device(device):  # uninitialized: no page is touched
                held.append(tf.raw_ops.Empty(shape=[hold // 4], dtype=tf.float32, init=False))
        _reset_peaks(devices)
        run()
    except DEVICE_ERRORS as error:
        if not is_out_of_memory(error):
            raise
        return None
    finally:
        del held[:]
    return _peak(devices) - (hold // 4) * 4


def _reset_peaks(devices):
    for device in devices:
        tf.config.experimental.reset_memory_stats(device)


def _peak(devices):
    """The largest peak over the devices since their last reset, in bytes."""
    return max(tf.config.experimental.get_memory_info(d)["peak"] for d in devices)


def _nothing_fits(what, peak, budget, margin):
    """The line for a step that does not fit even with one sample."""
    needs = ("ran out of the device's memory" if peak is None
             else f"peaks at {peak / MIB:.1f} MiB on the device")
    return (f"{what} {needs}, over the {budget * (1 - margin) / MIB:.1f} MiB it may use (a "
            f"{budget / MIB:.1f} MiB budget, {margin:.0%} kept free): no micro-batch fits; "
            "give a larger budget or a smaller margin, or free the device's memory")


def _guess(fits, over, most, limit):
    """The next size to try, above the largest that fits and below the smallest that
    does not, at least TOLERANCE above the first (so that the search ends).

    Until a size is too large: where the peak would come halfway from the largest peak
    yet to the limit at the steepest slope measured from a size at most half the
    largest (over such spans an allocator's rounding of one tensor is small), at most
    twice the largest: an overshoot past the device's memory costs the allocator's wait.
    Then halfway between the sizes on either side of the limit (the peak is a step
    function of the size there: a line through two of them guesses no better).
    """
    largest, too_large = max(fits), min(over, default=most + 1)
    if too_large > most:
        slope = max(((fits[largest] - fits[size]) / (largest - size)
                     for size in fits if 2 * size <= largest), default=0)
        guess = 2 * largest
        if slope > 0:
            highest = max(fits.values())  # a smaller size's peak, where this one read low
            guess = min(guess, largest + math.floor((limit - highest) / 2 / slope))
    else:
        guess = (largest + too_large) // 2
    step = max(1, math.ceil(TOLERANCE * largest))
    return min(max(guess, largest + step), too_large - 1)


def grid(most):
    """The sizes a search tries where each is a program compiled (XLA): 1 to 8, then
    four an octave (m x 2^k, m in 4..7: each at most 1.25 times the one before, so that
    the largest that fits of them is over 80% of the largest that fits), and `most`."""
    sizes, k = {most, *range(1, min(most, 8) + 1)}, 1
    while 4 << k <= most:
        sizes.update(m << k for m in (4, 5, 6, 7) if m << k <= most)
        k += 1
    return sorted(sizes)


def _grid_guess(fits, over, most, limit, sizes):
    """_guess where every size tried is a compilation (XLA): a size of `sizes` (grid)
    above the largest that fits and below the smallest that does not, or None where
    there is none. Until a size is too large: the largest at most where the steepest
    slope measured (as _guess) meets the limit itself, not halfway to it, and at most
    twice the largest or GRID_FIRST (the next above where that is none): a step on the
    grid is coarse, each size tried costs a compilation, and below GRID_FIRST samples a
    kernel's fixed scratch memory, not the samples, makes the peak. Then the middle one
    between."""
    largest, too_large = max(fits), min(over, default=most + 1)
    between = [size for size in sizes if largest < size < too_large]
    if not between:
        return None
    if too_large <= most:
        return between[(len(between) - 1) // 2]
    aim = max(2 * largest, GRID_FIRST)
    slope = max(((fits[largest] - fits[size]) / (largest - size)
                 for size in fits if 2 * size <= largest), default=0)
    if slope > 0:
        aim = min(aim, largest + math.floor((limit - max(fits.values())) / slope))
    below = [size for size in between if size <= aim]
    return below[-1] if below else between[0]


def _sized(batch, size):
    """`batch`'s first `size` samples, its samples repeated where it holds fewer."""
    first = tf.convert_to_tensor(tf.nest.flatten(batch)[0])
    samples = int(first.shape[0])
    if samples >= size:
        return tf.nest.map_structure(lambda t: tf.convert_to_tensor(t)[:size], batch)
    index = tf.range(size) % samples
    return tf.nest.map_structure(lambda t: tf.gather(tf.convert_to_tensor(t), index), batch)


class _Trials:
    """The trials on one trainer: a mini-batch's pass added to the window and discarded,
    the update measured once, every variable a trial may change put back after."""

    def __init__(self, add, window, state, held, devices, hold=0):
        self.add, self.window, self.held, self.devices = add, window, held, devices
        self.several = replicas_lib.workers(window.strategy) > 1
        self.hold = hold  # Search.hold
        self.strategy = window.strategy
        self._apply = tf.function(window.apply)
        self._discard = tf.function(window.discard)
        unique = {id(v): v for v in state}
        # Host copies: the device holds nothing more for them.
        self._saved = [(v, np.array(v.numpy(), copy=True)) for v in unique.values()]
        self._warm = False

    def _measured(self, run, hold=0):
        return measured_peak(run, self.devices, hold)

    def _add(self, size):
        self.add(_sized(self.held, size))

    def peak(self, size):
        """The peak of one pass of `size` samples per replica added to an empty window
        (None where it ran out of memory)."""
        if not self._warm:  # the first call of a function sets it up (Grappler allocates)
            self._measured(lambda: self._add(1))
            self._discard()
            self._warm = True
        peak = self._measured(lambda: self._add(size), self.hold)
        self._discard()
        return peak

    def update(self):
        """The update's peak on a window of one sample (None where it ran out of memory),
        measured at its second call (the first sets the function up); everything it
        changed then put back."""
        applied = []
        try:
            self._add(1)
            peak = self._measured(self._apply)  # sets it up; an out-of-memory error: None
            if peak is not None:
                self._add(1)
                peak = self._measured(lambda: applied.append(bool(self._apply()[0])))
        except BaseException:
            if not self.several:
                self.restore()
            raise
        if peak is None and self.several:
            # Its collectives were in flight: the other workers may still wait in them,
            # where the restore's own would wait for theirs (find_micro_batch).
            return peak
        self.restore()
        if applied == [False]:  # skipped (check_finite): the optimizer did not run
            logging.warning("the sample's loss or gradient was not finite: the update was "
                            "skipped, and its memory is not measured")
        return peak

    def restore(self):
        """Discards the open window, and assigns every saved variable its value back."""
        self._discard()
        with self.strategy.scope():
            for variable, value in self._saved:
                variable.assign(value)


# ---------------------------------------------------------------- in training


class EffectiveWindows:
    """Each effective batch added to the open window as mini-batches of B (every path's
    micro-batch training: Keras fit's and the TF2 accumulators'), tried again at half B
    where it runs out of memory; while B is searched for, as the search's trials.

    The update does not depend on how a window is cut, so on one replica a window whose
    mini-batch runs out of memory (a batch of longer sequences than the search saw,
    fragmentation) is discarded and added again at half B, which the rest of the run
    keeps; one warning says so. A failed call keeps the side effects it had already run:
    the variables a pass may change beside the window's own (`state`) are copied to the
    host before each window and assigned back before the retry. The weights and the
    optimizer's variables change only in the update, which is not tried again: an
    out-of-memory error there, or under several replicas (where it aborts the
    collectives), stops training with one line (OutOfMemory).

    For the same reason the search for B (a Search, on one replica) costs next to no
    training: its trials are the first windows' own mini-batches, each of the size the
    search asks for, its peak measured, and each window's update measured too; where the
    search is done, the rest of the window is added at the largest size that fit. Only
    the state is copied, as before every window; nothing is thrown away but after an
    out-of-memory error (the window is trained again, from its first sample), and the
    window's mean is still the direct batch's.
    """

    def __init__(self, add, window, state):
        """
        Args:
          add: (batch, size) -> the mini-batches added (an int scalar tensor): adds the
            effective batch `batch` to the open window as mini-batches of `size` samples
            per replica, an int32 scalar tensor (halving it traces nothing again).
          window: the window_step.WindowStep `add` adds to.
          state: the variables a mini-batch's pass may change, beside the window's own:
            the model's non-trainable variables (batch-norm statistics, seed
            generators), metrics, running totals.
        """
        self._add, self.window = add, window
        self.state = list({id(v): v for v in state}.values())
        self._discard = tf.function(window.discard)
        self._read = tf.function(self._host_values)

    def _host_values(self):
        """The state's values, read in one call (a read each costs an eager op) onto the
        host: the device holds nothing more for them."""
        with tf.device("CPU:0"):
            return [tf.identity(v) for v in self.state]

    def add(self, batch, found):
        """Adds `batch` to the open window as mini-batches of found's B, or, where
        `found` is a Search still going, as its trials.

        Returns:
          (the mini-batches added, the MicroBatch that cut them: `found`, or found with B
          halved, once or more, where a mini-batch ran out of memory; or the Search).

        Raises:
          NothingFits: a mini-batch of one sample ran out of memory.
          OutOfMemory: a mini-batch ran out of memory under several replicas.
        """
        if self.window.strategy.num_replicas_in_sync > 1:
            try:
                return self._added(batch, found), found
            except DEVICE_ERRORS as error:
                if not is_out_of_memory(error):
                    raise
            raise OutOfMemory(
                f"out of memory at micro-batch {found.micro_batch_size} per replica, under "
                f"{found.replicas} replicas: not tried again (an out-of-memory error aborts "
                "the replicas' collectives); give a smaller micro_batch_size")
        saved = [np.array(value, copy=True) for value in self._read()]
        if isinstance(found, Search):
            count = self._trials(batch, found, saved)
            if count is not None:
                return count, found
            # The rest of the window ran out of memory at the largest size that fit.
            found = _halved(found.found(), batch)
        while True:
            try:
                return self._added(batch, found), found
            except DEVICE_ERRORS as error:
                if not is_out_of_memory(error):
                    raise
            self._restore(saved)
            found = _halved(found, batch)

    def _restore(self, saved):
        """Discards the open window, and assigns the state its saved values back."""
        self._discard()
        with self.window.strategy.scope():
            for variable, value in zip(self.state, saved):
                variable.assign(value)

    def _trials(self, batch, search, saved):
        """Adds `batch` as the search's trials, each a mini-batch of the size it asks for
        (of the samples left, where fewer are), its peak measured; the rest, once it is
        done, at the largest size that fit. Returns the mini-batches added, or None where
        the rest ran out of memory (the window discarded, the state put back)."""
        samples = int(tf.shape(tf.nest.flatten(batch)[0])[0])
        search.windows += 1
        search.start = search.start or time.perf_counter()
        offset, count = 0, 0
        while offset < samples:
            size = search.next_size()
            take = min(size or 0, samples - offset)
            # Done, or the samples left fit: the rest at once. Under XLA also where fewer
            # samples are left than the size asked (each size a program): the search goes
            # on in the next window.
            if take <= search.largest or (search.grid and take < size):
                try:
                    return count + self._rest(batch, offset, samples, search)
                except DEVICE_ERRORS as error:
                    if not is_out_of_memory(error):
                        raise
                self._restore(saved)
                return None
            added, peak = self._measured(_part(batch, offset, offset + take), take, search)
            if peak is None:  # the window again from its first sample, at sizes that fit
                self._restore(saved)
                offset, count = 0, 0
            try:
                search.record(take, peak)
            except NothingFits:
                if peak is not None:
                    self._restore(saved)
                raise
            if peak is not None:
                offset, count = offset + take, count + added
        return count

    def _rest(self, batch, offset, stop, search):
        """Adds samples offset..stop of `batch` at the largest size that fit, the last
        mini-batch shorter; under XLA (the search's grid) in sizes it compiled already
        (Search.pieces). Returns the mini-batches added."""
        if not search.grid:
            return self._added(_part(batch, offset, stop), search.largest)
        count = 0
        for size, number in search.pieces(stop - offset):
            count += self._added(_part(batch, offset, offset + size * number), size)
            offset += size * number
        return count

    def _measured(self, batch, size, search):
        """(the mini-batches added, the peak: None where it ran out of memory) of adding
        `batch` as mini-batches of `size`, on the search's devices."""
        added = []
        peak = measured_peak(lambda: added.append(self._added(batch, size)), search.devices,
                             search.hold)
        return (added or [0])[0], peak

    def _added(self, batch, found):
        size = found if isinstance(found, int) else found.micro_batch_size
        return int(self._add(batch, tf.constant(size, tf.int32)))

    def apply(self, apply, found=None):
        """Runs `apply` (the window's update); where `found` is a Search, its peak is
        measured, and the search's MicroBatch made once it is done.

        Returns:
          (what `apply` returns, `found`: a Search still going, or the MicroBatch made).

        Raises:
          OutOfMemory: it ran out of memory: weights and optimizer may be partly updated.
          NothingFits: the update's peak is over the search's budget less its margin.
        """
        searching = isinstance(found, Search)
        try:
            if searching:
                _reset_peaks(found.devices)
            result = apply()
        except DEVICE_ERRORS as error:
            if not is_out_of_memory(error):
                raise
            raise OutOfMemory(
                "out of memory in a window's update (the optimizer's apply), which does not "
                "depend on the micro-batch: not tried again; the weights and the optimizer "
                "may be partly updated (not saved by this package): free the device's "
                "memory") from None
        if not searching:
            return result, found
        found.record_update(_peak(found.devices))
        if found.next_size() is not None:
            return result, found
        traces = getattr(self._add, "experimental_get_tracing_count", None)
        done = found.found(traces() if traces else None)
        logging.info("%s", describe(done))
        return result, done


def _part(batch, start, stop):
    """Samples start..stop of each tensor of `batch`."""
    return tf.nest.map_structure(lambda t: t[start:stop], batch)


def _halved(found, batch):
    """`found` with half the micro-batch that ran out of memory on `batch` (at most its
    samples), said in one warning line; NothingFits where that was one sample."""
    first = tf.nest.flatten(batch)[0]
    samples = int(tf.shape(first)[0])
    ran_out = min(found.micro_batch_size, samples)
    if ran_out <= 1:
        raise NothingFits(
            f"a mini-batch of one sample (inputs shaped {list(first.shape[1:])}) ran out of "
            "the device's memory in training: no micro-batch fits; free the device's "
            "memory or give shorter samples")
    size = ran_out // 2
    cut = plan(found.effective_batch, size, found.replicas)
    logging.warning("out of memory at micro-batch %d: this window and the rest train as "
                    "micro-batches of %d (%s)", ran_out, size, describe(plan(samples, size)))
    return found._replace(micro_batch_size=cut.micro_batch_size,
                          average_gradients=cut.average_gradients, last=cut.last,
                          out_of_memory=found.out_of_memory + (ran_out,))
