"""The micro-batch that fits: the largest mini-batch size B per replica whose window step the
device's memory holds, for an effective batch E trained as N = ceil(E / B) mini-batches. One
search before training, every path's (tf1's too), approaches the peaks from below (an
out-of-memory error costs the allocator's wait). A window out of memory in training is trained
again at half B: the update does not depend on how a window is cut."""

import collections
import logging
import math
import time

import numpy as np
import tensorflow as tf

from gradient_averaging import arguments
from gradient_averaging import device as device_lib
from gradient_averaging import replicas as replicas_lib
from gradient_averaging import window as window_lib

# The search stops when the smallest size over is within TOLERANCE of the largest that fits
# (OOM_NEAR where it ran out of memory: each trial near it risks another), or after MOST_TRIALS.
TOLERANCE, OOM_NEAR, MOST_TRIALS = 0.05, 0.25, 20
GRID_FIRST = 8  # under XLA, the size tried after one sample
NEAR_LIMIT = 0.05  # under XLA, a peak this near the limit may be a whole chunk, not the need
DOUBLING = 16  # below it sizes at most double: a slope over shorter spans is mostly rounding


class MicroBatch(collections.namedtuple(
        "MicroBatch", ["micro_batch_size", "average_gradients", "last", "effective_batch",
                       "replicas", "peak", "update_peak", "budget", "margin", "trials",
                       "traces", "seconds", "out_of_memory", "predicted"],
        defaults=(1, None, None, None, None, (), None, None, (), False))):
    """How E (`effective_batch`) is cut: B per replica (`micro_batch_size`), N
    (`average_gradients`), the last mini-batch's samples, all replicas' (`last`). `trials`: (size,
    peak or None: out of memory); `predicted`: the peak at B extrapolated, not measured."""

    __slots__ = ()

    def __str__(self):
        return describe(self)


# A trainer's trial_window: training's own add(batch, size per replica), window step and
# apply() -> (applied, ...), so the trials' traces are training's; `state`: the variables a
# trial may change; `group`: the samples a trial of one takes (x replicas where add splits).
Trial = collections.namedtuple("Trial", ["add", "window", "state", "group", "apply"])


def mini_batches_of(batch, size):
    """The mini-batches of `size` samples (all replicas') `batch` is cut into: >= 1."""
    samples = int(tf.shape(tf.nest.flatten(batch)[0])[0])
    return max(1, -(-samples // size))


class NothingFits(ValueError):
    """Not even a micro-batch of one sample (or the update) fits in the budget."""


class OutOfMemory(tf.errors.ResourceExhaustedError):
    """Out of memory where training does not retry: an update, or under several replicas."""

    def __init__(self, message):
        super().__init__(None, None, message)


def plan(effective_batch, micro_batch_size, replicas=1, **found):
    """The MicroBatch of E cut into B per replica (at most a replica's share of E)."""
    effective_batch = arguments.check_effective_batch(effective_batch)
    size = arguments.check_micro_batch_size(micro_batch_size)
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
    mib = device_lib.MIB
    peak = ("peak predicted " if found.predicted else "peak ") + f"{found.peak / mib:.1f}"
    return (f"{line}; {why} ({peak} of {found.budget / mib:.1f} MiB, "
            f"{found.margin:.0%} kept free; {len(found.trials)} trials, "
            f"{found.seconds:.1f} s)")


def find_micro_batch(trainer, sample, effective_batch, budget=None, margin=None, spec=None):
    """The largest micro-batch B per replica (a MicroBatch) whose window step fits, for updates of
    E samples (all replicas'): trials on `sample` before training, leaving the trainer bit for bit
    as found. Raises ValueError (a device's memory or peak unknown), NothingFits, WorkerFailed.

    Args:
      trainer: a tf2 accumulator, or an AccumulatingModel fit has built.
      sample: one batch as training gets it; a trial of B takes its first B, repeated where
        it holds fewer; one effective batch of it stays on the device meanwhile.
      budget: bytes of device memory, each replica's; None: device.device_memory().
      margin: the budget's fraction kept free; None: device.default_margin.
      spec: the batches' element spec; None: `sample`'s."""
    effective_batch = arguments.check_effective_batch(effective_batch)
    margin = arguments.check_margin(margin)
    start = time.perf_counter()
    if spec is None:
        spec = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, tf.as_dtype(t.dtype)),
                                     sample)
    trial = trainer.trial_window(spec)
    strategy = trial.window.strategy  # this worker's devices, all replicas' E
    search = Search.on_devices(device_lib.devices_of(strategy), effective_batch, budget, margin,
                               strategy.num_replicas_in_sync,
                               xla=bool(getattr(trainer, "jit_compile", False)))
    search.start, search.workers = start, replicas_lib.workers(strategy)
    trials = _Trials(trial, _sized(sample, effective_batch), search)
    several = search.workers > 1
    try:
        try:
            largest_that_fits(trials.peak, trials.update, search)
        except BaseException:
            if not several:  # a restore's collectives would wait on workers still in the update's
                trials.restore()
            raise
        trials.restore()
        traces = getattr(trial.add, "experimental_get_tracing_count", None)
        found = search.found(traces() if traces else None)
        if several:
            found = agreed(strategy, found)
    except replicas_lib.COLLECTIVE_ERRORS as error:
        if not several:
            raise
        raise replicas_lib.WorkerFailed(
            "another worker failed in the micro-batch search, a collective in flight (out "
            "of memory there, most likely: its own error says): a collective strategy "
            "cannot retry one worker alone; give micro_batch_size as an int, or a budget "
            "every worker's device holds", error) from None
    logging.info("%s", describe(found))
    return found


def agreed(strategy, found):
    """`found` cut at the smallest B any worker found: all workers must cut a batch alike."""
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


def largest_that_fits(peak_at, update, search):
    """Runs `search` to the end on peak_at(size) and update(), each a peak (None: out of memory)."""
    search.record(1, peak_at(1))
    search.record_update(update())
    while (size := search.next_size()) is not None:
        search.record(size, peak_at(size))
    return search


class Search:
    """Which size to try next until the largest whose peak fits under `limit` (the budget less its
    margin) is known; `fits`, `over`: size -> peak of the sizes under the limit and the others."""

    def __init__(self, effective_batch, budget, margin, replicas=1, devices=None, xla=False):
        self.effective_batch, self.replicas = effective_batch, replicas
        self.most = math.ceil(effective_batch / replicas)
        self.budget, self.margin, self.devices = budget, margin, devices
        self.limit = budget * (1 - margin)
        self.fits, self.over, self.trials = {}, {}, []
        self.update_peak, self.start = None, time.perf_counter()
        self.predicted = None  # the peak predicted at `most`, taken untried
        self.workers = 1  # the worker processes whose updates run in step
        self.grid = grid(self.most) if xla else None

    @classmethod
    def on_devices(cls, devices, effective_batch, budget=None, margin=None, replicas=1,
                   xla=False):
        """The search for E on `devices`, checked; budget None: the smallest device's memory;
        margin None: the largest default_margin of theirs; `xla`: the sizes on grid(E)."""
        effective_batch = arguments.check_effective_batch(effective_batch)
        margin = arguments.check_margin(margin)
        device_lib.check_statistics(devices)
        budget = arguments.check_budget(budget) or min(device_lib.device_memory(d) for d in devices)
        if margin is None:
            margin = max(device_lib.default_margin(d) for d in devices)
        return cls(effective_batch, budget, margin, replicas, devices, xla)

    @property
    def hold(self):
        """The bytes held on each device in a trial: under XLA the margin's, else 0. XLA's
        temporaries are one buffer the BFC allocator may hand a whole free chunk (a peak that
        reads the device full); with the margin held a need up to the limit reads at most it."""
        return self.budget - int(self.limit) if self.grid else 0

    @property
    def largest(self):
        return max(self.fits, default=0)

    def next_size(self):
        """The next size to try, or None where the search stops (TOLERANCE, MOST_TRIALS)."""
        if not self.fits:
            return 1
        largest, too_large = self.largest, min(self.over, default=self.most + 1)
        near = OOM_NEAR if self.over.get(too_large, 0) is None else TOLERANCE
        if len(self.trials) >= MOST_TRIALS:
            return None
        if too_large - largest <= max(1, near * largest):
            # Nothing over: try `most`, so a whole share of E is one mini-batch where it fits
            if not largest < self.most < too_large:
                return None
            self.predicted = self._predicted_peak_of_most()
            return None if self.predicted else self.most
        if self.grid:
            return _grid_guess(self.fits, self.over, self.most, self.limit, self.grid)
        size = _guess(self.fits, self.over, self.most, self.limit)
        if size == self.most:
            self.predicted = self._predicted_peak_of_most()
        return None if self.predicted else size

    def _predicted_peak_of_most(self):
        """The peak `most` is taken at untried (its trial costs a share of E's passes), or None
        where it must be tried: something was over, no size of half of it fit, or the slope
        puts it over halfway from the highest peak to the limit (half for what it misses)."""
        largest = self.largest
        if self.over or 2 * largest < self.most:
            return None
        highest = max(self.fits.values())
        peak = highest + _slope(self.fits, largest) * (self.most - largest)
        return peak if peak <= highest + (self.limit - highest) / 2 else None

    def record(self, size, peak):
        """Records a trial's peak (None: out of memory); NothingFits where one sample is over."""
        self.trials.append((size, peak))
        if peak is not None and peak <= self.limit:
            self.fits[size] = peak
        else:
            self.over[size] = peak
        if size == 1 and not self.fits:
            raise NothingFits(self._nothing_fits("a mini-batch of one sample", peak))

    def record_update(self, peak):
        """Records an update's peak (None: out of memory); NothingFits where it is over."""
        if peak is None or peak > self.limit:
            line = self._nothing_fits("the update (the optimizer's apply)", peak)
            if self.workers > 1:
                line += ("; under several workers" + (" its collectives were in flight:"
                                                      if peak is None else "") +
                         " a collective strategy cannot retry one worker alone, and the "
                         "other workers stop too")
            raise NothingFits(line)
        self.update_peak = max(peak, self.update_peak or 0)

    def _nothing_fits(self, what, peak):
        mib, budget, margin = device_lib.MIB, self.budget, self.margin
        needs = ("ran out of the device's memory" if peak is None
                 else f"peaks at {peak / mib:.1f} MiB on the device")
        return (f"{what} {needs}, over the {budget * (1 - margin) / mib:.1f} MiB it may use (a "
                f"{budget / mib:.1f} MiB budget, {margin:.0%} kept free): no micro-batch "
                "fits; give a larger budget or a smaller margin, or free the device's memory")

    def found(self, traces=None):
        size, peak = ((self.most, self.predicted) if self.predicted
                      else (self.largest, self.fits[self.largest]))
        return plan(self.effective_batch, size, self.replicas,
                    peak=max(peak, self.update_peak or 0), update_peak=self.update_peak,
                    budget=self.budget, margin=self.margin, trials=tuple(self.trials),
                    traces=traces, seconds=time.perf_counter() - self.start,
                    predicted=bool(self.predicted))


def _slope(fits, largest):
    """The peak's steepest slope to the largest from a size at most half it, or 0."""
    return max(((fits[largest] - fits[size]) / (largest - size)
                for size in fits if 2 * size <= largest), default=0)


def _guess(fits, over, most, limit):
    """The next size: until one is over, where the slope puts the peak halfway to the limit, then
    halfway between; at least TOLERANCE above the largest that fits, below the smallest over."""
    largest, too_large = max(fits), min(over, default=most + 1)
    if too_large > most:
        guess, slope = 2 * largest, _slope(fits, largest)
        if slope > 0:  # from the highest peak: a smaller size's, where this one read low
            aim = largest + math.floor((limit - max(fits.values())) / 2 / slope)
            guess = min(guess, aim) if largest < DOUBLING else aim
        if 2 * largest < most:  # half of `most` first: from there its peak is predicted
            guess = min(guess, -(-most // 2))
    else:
        guess = (largest + too_large) // 2
    step = max(1, math.ceil(TOLERANCE * largest))
    return min(max(guess, largest + step), too_large - 1)


def grid(most):
    """The sizes tried under XLA (a compilation each): 1 to 8, m x 2^k for m in 4..7 (each
    at most 1.25 times the one before: within 80% of the largest that fits), and `most`."""
    sizes, k = {most, *range(1, min(most, 8) + 1)}, 1
    while 4 << k <= most:
        sizes.update(m << k for m in (4, 5, 6, 7) if m << k <= most)
        k += 1
    return sorted(sizes)


def _grid_guess(fits, over, most, limit, sizes):
    """_guess on the grid `sizes` (None: none between, or the next predicted over the limit): until
    one is over, the largest where the slope, read on the peaks not NEAR_LIMIT, meets the limit
    itself, at most double or GRID_FIRST; then the middle one between."""
    largest, too_large = max(fits), min(over, default=most + 1)
    between = [size for size in sizes if largest < size < too_large]
    if not between:
        return None
    if too_large <= most:
        return between[(len(between) - 1) // 2]
    aim = max(2 * largest, GRID_FIRST)
    read = {size: peak for size, peak in fits.items() if peak < (1 - NEAR_LIMIT) * limit}
    base = max(read, default=0)
    slope = _slope(read, base)
    if slope > 0:
        aim = min(aim, base + math.floor((limit - max(read.values())) / slope))
    below = [size for size in between if size <= aim]
    return below[-1] if below else None


def _sized(batch, size):
    """`batch`'s first `size` samples, its samples repeated where it holds fewer."""
    first = tf.convert_to_tensor(tf.nest.flatten(batch)[0])
    samples = int(first.shape[0])
    if samples >= size:
        return tf.nest.map_structure(lambda t: tf.convert_to_tensor(t)[:size], batch)
    index = tf.range(size) % samples
    return tf.nest.map_structure(lambda t: tf.gather(tf.convert_to_tensor(t), index), batch)


class _Trials:
    """Trials on a Trial; what a trial may change is saved on the host (not the device)."""

    def __init__(self, trial, held, search):
        self.trial, self.held, self.search = trial, held, search
        self._discard = tf.function(trial.window.discard)
        unique = {id(v): v for v in trial.state}
        self._saved = [(v, np.array(v.numpy(), copy=True)) for v in unique.values()]
        self._warm = False

    def _add(self, size):
        self.trial.add(_sized(self.held, size * self.trial.group), tf.constant(size, tf.int32))

    def peak(self, size):
        """The peak of `size` per replica (None: out of memory), after a first call apart."""
        if not self._warm:
            device_lib.measured_peak(lambda: self._add(1), self.search.devices)
            self._discard()
            self._warm = True
        peak = device_lib.measured_peak(lambda: self._add(size), self.search.devices,
                                        self.search.hold)
        self._discard()
        return peak

    def update(self):
        """The update's peak (None: out of memory) on a one-sample window, at its second call."""
        several, applied = self.search.workers > 1, []
        try:
            self._add(1)
            peak = device_lib.measured_peak(self.trial.apply, self.search.devices)
            if peak is not None:
                self._add(1)
                peak = device_lib.measured_peak(
                    lambda: applied.append(bool(self.trial.apply()[0])), self.search.devices)
        except BaseException:
            if not several:
                self.restore()
            raise
        if peak is None and several:  # collectives in flight: no restore (find_micro_batch)
            return peak
        self.restore()
        if applied == [False]:  # skipped (check_finite): the optimizer did not run
            logging.warning("the sample's loss or gradient was not finite: the update was "
                            "skipped, and its memory is not measured")
        return peak

    def restore(self):
        self._discard()
        put_back(self.trial.window.strategy, self._saved)


def put_back(strategy, saved):
    """Writes each (variable, host value) into each component's own buffer: an assign would move
    it into the value's, splitting the device's free memory so that a size found no longer fits."""
    with strategy.scope():
        for variable, value in saved:
            inner = variable if isinstance(variable, tf.Variable) else variable.value
            components = (inner.values if isinstance(inner, tf.distribute.DistributedValues)
                          else (inner,))
            for component in components:
                with tf.device(component.device):
                    window_lib.assign_in_place(component, tf.constant(value))


class EffectiveWindows:
    """Adds each effective batch as mini-batches of B, at half B from then on where one runs out of
    memory (but see OutOfMemory); `state` (batch-norm statistics, seeds, metrics) is saved on the
    host before each window for the retry. `add(batch, size)` adds mini-batches of `size` per
    replica (an int32 tensor: halving traces nothing new) to the open window, returning how many."""

    def __init__(self, add, window, state):
        self.add_batch, self.window = add, window
        self.state = list({id(v): v for v in state}.values())
        self._discard = tf.function(window.discard)

        def host_values():  # the state's values read in one call, onto the host
            with tf.device("CPU:0"):
                return [tf.identity(v) for v in self.state]
        self._read = tf.function(host_values)

    def add(self, batch, found):
        """Adds `batch`; returns (the mini-batches, `found` or, where one ran out, B halved)."""
        several = self.window.strategy.num_replicas_in_sync > 1
        saved = None if several else [np.array(value, copy=True) for value in self._read()]
        while True:
            try:
                return self._added(batch, found), found
            except device_lib.DEVICE_ERRORS as error:
                if not device_lib.is_out_of_memory(error):
                    raise
            if several:
                raise OutOfMemory(
                    f"out of memory at micro-batch {found.micro_batch_size} per replica, under "
                    f"{found.replicas} replicas: not tried again (an out-of-memory error aborts "
                    "the replicas' collectives); give a smaller micro_batch_size")
            self._discard()
            put_back(self.window.strategy, zip(self.state, saved))
            found = _halved(found, batch)

    def _added(self, batch, found):
        return int(self.add_batch(batch, tf.constant(found.micro_batch_size, tf.int32)))

    def apply(self, apply):
        """Runs the window's update `apply`; OutOfMemory where it runs out (partly applied)."""
        try:
            return apply()
        except device_lib.DEVICE_ERRORS as error:
            if not device_lib.is_out_of_memory(error):
                raise
            raise OutOfMemory(
                "out of memory in a window's update (the optimizer's apply), which does not "
                "depend on the micro-batch: not tried again; the weights and the optimizer "
                "may be partly updated (not saved by this package): free the device's "
                "memory") from None


def _halved(found, batch):
    """`found` with half the B that ran out of memory on `batch`; NothingFits where B was 1."""
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
