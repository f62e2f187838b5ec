"""The micro-batch that fits: the largest mini-batch size B (per replica) whose window
step the device's memory holds, for an effective batch E trained as N = ceil(E / B)
mini-batches, the last one E - (N-1) B.

One search, before training, for every path (find_micro_batch; tf1.find_micro_batch
gives it the graph's trials): trial passes of training's own add on the first batch, the
update measured once, every variable a trial may change put back bit for bit. Peaks are
measured (the allocator's), approached from below (an out-of-memory error costs the
allocator's wait), and kept under the budget less a margin (Search). Under several
workers all take the smallest B any found (agreed). Training then runs plain windows of
B; one that runs out of memory all the same is trained again at half B, on one replica
(EffectiveWindows): the update does not depend on how a window is cut.
"""

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

# The search stops when the smallest size that does not fit is within TOLERANCE of the
# largest that does (OOM_NEAR where it ran out of memory), or after MOST_TRIALS.
TOLERANCE, OOM_NEAR, MOST_TRIALS = 0.05, 0.25, 20
GRID_FIRST = 8  # under XLA, the size tried after one sample
# Sizes double up to DOUBLING (a slope read over smaller spans is mostly the allocator's
# rounding); past it, the slope alone says how far to go.
DOUBLING = 16


class MicroBatch(collections.namedtuple(
        "MicroBatch", ["micro_batch_size", "average_gradients", "last", "effective_batch",
                       "replicas", "peak", "update_peak", "budget", "margin", "trials",
                       "traces", "seconds", "out_of_memory", "predicted"],
        defaults=(1, None, None, None, None, (), None, None, (), False))):
    """How E (`effective_batch`) is cut on `replicas` replicas: B per replica
    (`micro_batch_size`), N (`average_gradients`), the last mini-batch's samples (all
    replicas'). Where B was found: the peaks at B and of the update (bytes), the budget
    and margin, the trials as (size, peak or None where it ran out of memory), the trial
    add's traces, the search's seconds; `predicted`: the peak at B is extrapolated, not
    measured (Search.next_size). `out_of_memory`: the micro-batches that ran out of memory
    in training, each then halved (EffectiveWindows). str: describe's line."""

    __slots__ = ()

    def __str__(self):
        return describe(self)


# A trainer's trial_window: training's add(batch, size) (the batch cut into mini-batches
# of `size` per replica), the window step, the variables a trial may change, the samples
# a trial of one per replica takes (passes at once, x replicas where add splits), and
# training's apply() -> (applied, ...): its own functions, so that the trials' traces are
# training's.
Trial = collections.namedtuple("Trial", ["add", "window", "state", "group", "apply"])


def mini_batches_of(batch, size):
    """The mini-batches of `size` samples (all replicas') `batch` is cut into: >= 1."""
    samples = int(tf.shape(tf.nest.flatten(batch)[0])[0])
    return max(1, -(-samples // size))


class NothingFits(ValueError):
    """Not even a micro-batch of one sample (or the update) fits in the budget."""


class OutOfMemory(tf.errors.ResourceExhaustedError):
    """The device ran out of memory where training does not try again (a window's
    update, or under several replicas); its message is one line that says why."""

    def __init__(self, message):
        super().__init__(None, None, message)


def plan(effective_batch, micro_batch_size, replicas=1, **found):
    """The MicroBatch of E cut into mini-batches of B per replica (B at most a replica's
    share of E); `found` fills the search's fields."""
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


# ---------------------------------------------------------------- the search


def find_micro_batch(trainer, sample, effective_batch, budget=None, margin=None, spec=None):
    """The largest micro-batch B (per replica) whose window step fits, for updates of E:
    trials on `sample` before training, the trainer left bit for bit as found.

    Args:
      trainer: a tf2 accumulator, or an AccumulatingModel fit has built: its
        trial_window(spec) gives the Trial.
      sample: one batch as training gets it: a trial of B takes its first B, repeated
        where it holds fewer; one effective batch of it stays on the device meanwhile.
      effective_batch: E, the samples of one update (all replicas').
      budget: bytes of device memory to use; None: device.device_memory(), each replica's.
      margin: the budget's fraction kept free; None: device.default_margin.
      spec: the batches' spec (a dataset's element spec); None: `sample`'s.

    Returns a MicroBatch. Raises ValueError (bad arguments, a device whose memory or peak
    cannot be read), NothingFits (one sample per replica, or the update, needs more than
    the budget less its margin; the line says what it needs), WorkerFailed (another
    worker failed in the search, a collective in flight).
    """
    effective_batch = arguments.check_effective_batch(effective_batch)
    margin = arguments.check_margin(margin)
    start = time.perf_counter()
    if spec is None:
        spec = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, tf.as_dtype(t.dtype)),
                                     sample)
    trial = trainer.trial_window(spec)
    search = Search.on(trial.window.strategy, effective_batch, budget, margin,
                       xla=bool(getattr(trainer, "jit_compile", False)))
    search.start = start
    trials = _Trials(trial, _sized(sample, effective_batch), search)
    several = search.workers > 1
    try:
        try:
            largest_that_fits(trials.peak, trials.update, search)
        except BaseException:
            # Under several workers the restore's collectives would wait for workers
            # still in the update's: the error ends this worker, and so theirs.
            if not several:
                trials.restore()
            raise
        trials.restore()
        traces = getattr(trial.add, "experimental_get_tracing_count", None)
        found = search.found(traces() if traces else None)
        if several:
            found = agreed(trial.window.strategy, found)
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
    """`found` cut at the smallest micro-batch any worker of `strategy` found (a
    collective, run by every worker after its search): every worker must cut a batch
    alike, and each searched its own devices."""
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
    """Runs `search` on trials apart from training, returned done (found(): the B):
    peak_at(1), update(), then peak_at of the sizes it asks for; each a peak, None where
    it ran out of memory. NothingFits: one sample, or the update, does not fit."""
    search.record(1, peak_at(1))
    search.record_update(update())
    while (size := search.next_size()) is not None:
        search.record(size, peak_at(size))
    return search


class Search:
    """The sizes and peaks of a search: which size to try next (next_size), until the
    largest size whose peak fits under the budget less its margin is known.

    Attributes:
      trials: (size, peak bytes or None where it ran out of memory) per trial.
      fits, over: size -> peak of the sizes under the limit and of the others.
      update_peak: the largest peak of the updates measured, or None.
      devices: the devices whose peaks it reads (Search.on: the strategy's).
      start: perf_counter() when the search began (its caller's set-up included).
    """

    def __init__(self, effective_batch, budget, margin, replicas=1, devices=None, xla=False):
        self.effective_batch, self.replicas = effective_batch, replicas
        self.most = math.ceil(effective_batch / replicas)
        self.budget, self.margin, self.devices = budget, margin, devices
        self.limit = budget * (1 - margin)
        self.fits, self.over, self.trials = {}, {}, []
        self.update_peak, self.start = None, time.perf_counter()
        self.predicted = None  # the peak predicted at `most`, taken untried
        self.workers = 1  # the worker processes whose updates run in step (Search.on)
        self.grid = grid(self.most) if xla else None

    @classmethod
    def on(cls, strategy, effective_batch, budget=None, margin=None, xla=False):
        """The search for E on `strategy`'s devices (under several workers, this
        worker's own: find_micro_batch agrees), as on_devices."""
        search = cls.on_devices(device_lib.devices_of(strategy), effective_batch, budget,
                                margin, strategy.num_replicas_in_sync, xla)
        search.workers = replicas_lib.workers(strategy)
        return search

    @classmethod
    def on_devices(cls, devices, effective_batch, budget=None, margin=None, replicas=1,
                   xla=False):
        """The search for E on `devices`, checked: allocators that keep statistics, a
        budget (None: the smallest device's memory), a margin (None: the largest
        device.default_margin of theirs). `xla`: a program per size, the sizes on grid(E)."""
        effective_batch = arguments.check_effective_batch(effective_batch)
        margin = arguments.check_margin(margin)
        device_lib.check_statistics(devices)
        budget = arguments.check_budget(budget) or min(device_lib.device_memory(d) for d in devices)
        if margin is None:
            margin = max(device_lib.default_margin(d) for d in devices)
        return cls(effective_batch, budget, margin, replicas, devices, xla)

    @property
    def hold(self):
        """The bytes a trial holds on each device: under XLA the margin's, else none.
        XLA's temporaries are one buffer, which the BFC allocator may hand a whole free
        chunk, counted whole (a peak that reads the device full); with the margin held a
        need up to the limit reads at most the limit, and one over it runs out."""
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
        # Near an out-of-memory error more trials risk more of them, and their waits.
        near = OOM_NEAR if self.over.get(too_large, 0) is None else TOLERANCE
        if len(self.trials) >= MOST_TRIALS:
            return None
        if too_large - largest <= max(1, near * largest):
            # Nothing over the limit: the largest worth trying, so that a whole share
            # of E is one mini-batch where it fits.
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
        """The peak the largest size worth trying is taken at untried, or None where it
        must be tried: nothing was over the limit, a size of at least half of it fit, and
        the steepest slope from there puts its peak at most halfway from the highest
        peak to the limit (_guess's aim; the other half for what the slope misses, and
        training's retry for the rest). A trial there would cost a whole share of E's
        passes, discarded."""
        largest = self.largest
        if self.over or 2 * largest < self.most:
            return None
        highest = max(self.fits.values())
        peak = highest + _slope(self.fits, largest) * (self.most - largest)
        return peak if peak <= highest + (self.limit - highest) / 2 else None

    def record(self, size, peak):
        """A trial's peak (None where it ran out of memory); NothingFits where one sample
        does not fit."""
        self.trials.append((size, peak))
        if peak is not None and peak <= self.limit:
            self.fits[size] = peak
        else:
            self.over[size] = peak
        if size == 1 and not self.fits:
            raise NothingFits(_nothing_fits("a mini-batch of one sample", peak, self.budget,
                                            self.margin))

    def record_update(self, peak):
        """An update's peak (None where it ran out of memory); NothingFits where it does
        not fit."""
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
        size, peak = ((self.most, self.predicted) if self.predicted
                      else (self.largest, self.fits[self.largest]))
        return plan(self.effective_batch, size, self.replicas,
                    peak=max(peak, self.update_peak or 0), update_peak=self.update_peak,
                    budget=self.budget, margin=self.margin, trials=tuple(self.trials),
                    traces=traces, seconds=time.perf_counter() - self.start,
                    predicted=bool(self.predicted))


def _nothing_fits(what, peak, budget, margin):
    """The line for a step that does not fit even with one sample."""
    mib = device_lib.MIB
    needs = ("ran out of the device's memory" if peak is None
             else f"peaks at {peak / mib:.1f} MiB on the device")
    return (f"{what} {needs}, over the {budget * (1 - margin) / mib:.1f} MiB it may use (a "
            f"{budget / mib:.1f} MiB budget, {margin:.0%} kept free): no micro-batch fits; "
            "give a larger budget or a smaller margin, or free the device's memory")


def _slope(fits, largest):
    """The steepest slope of the peak measured from a size at most half the largest
    (over such spans an allocator's rounding of one tensor is small), or 0."""
    return max(((fits[largest] - fits[size]) / (largest - size)
                for size in fits if 2 * size <= largest), default=0)


def _guess(fits, over, most, limit):
    """The next size, above the largest that fits and below the smallest that does not,
    at least TOLERANCE above the first. Until a size is too large: where the peak would
    come halfway from the largest peak yet to the limit at the steepest slope, at most
    twice the largest below DOUBLING (an overshoot costs the allocator's wait), and at
    most half of `most` until one that large fit (Search._most_predicted). Then halfway
    between (the peak is a step function of the size there)."""
    largest, too_large = max(fits), min(over, default=most + 1)
    if too_large > most:
        guess, slope = 2 * largest, _slope(fits, largest)
        if slope > 0:  # from the highest peak: a smaller size's, where this one read low
            aim = largest + math.floor((limit - max(fits.values())) / 2 / slope)
            guess = min(guess, aim) if largest < DOUBLING else aim
        if 2 * largest < most:  # half of the largest worth trying, which it predicts
            guess = min(guess, -(-most // 2))
    else:
        guess = (largest + too_large) // 2
    step = max(1, math.ceil(TOLERANCE * largest))
    return min(max(guess, largest + step), too_large - 1)


def grid(most):
    """The sizes a search tries where each is a program compiled (XLA): 1 to 8, then
    four an octave (m x 2^k, m in 4..7: each at most 1.25 times the one before, so the
    largest that fits of them is over 80% of the largest that fits), and `most`."""
    sizes, k = {most, *range(1, min(most, 8) + 1)}, 1
    while 4 << k <= most:
        sizes.update(m << k for m in (4, 5, 6, 7) if m << k <= most)
        k += 1
    return sorted(sizes)


def _grid_guess(fits, over, most, limit, sizes):
    """_guess on the grid `sizes` (XLA), or None where no size is between. Until a size
    is too large: the largest at most where the steepest slope meets the limit itself
    (each size costs a compilation), at most twice the largest or GRID_FIRST; then the
    middle one between."""
    largest, too_large = max(fits), min(over, default=most + 1)
    between = [size for size in sizes if largest < size < too_large]
    if not between:
        return None
    if too_large <= most:
        return between[(len(between) - 1) // 2]
    aim, slope = max(2 * largest, GRID_FIRST), _slope(fits, largest)
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
    """A search's trials on one trainer (a Trial): training's add on `held`, into an
    empty window then discarded; the update measured once; every variable a trial may
    change copied to the host first (the device holds nothing more) and put back."""

    def __init__(self, trial, held, search):
        self.trial, self.held, self.search = trial, held, search
        self.strategy = trial.window.strategy
        self._apply = trial.apply
        self._discard = tf.function(trial.window.discard)
        unique = {id(v): v for v in trial.state}
        self._saved = [(v, np.array(v.numpy(), copy=True)) for v in unique.values()]
        self._warm = False

    def _add(self, size):
        self.trial.add(_sized(self.held, size * self.trial.group), tf.constant(size, tf.int32))

    def peak(self, size):
        """The peak of `size` samples per replica (None: out of memory), after a first
        call apart (it sets the function up: Grappler allocates)."""
        if not self._warm:
            device_lib.measured_peak(lambda: self._add(1), self.search.devices)
            self._discard()
            self._warm = True
        peak = device_lib.measured_peak(lambda: self._add(size), self.search.devices,
                                        self.search.hold)
        self._discard()
        return peak

    def update(self):
        """The update's peak on a window of one sample (None where it ran out of
        memory), at its second call (the first sets it up); then everything put back."""
        several, applied = self.search.workers > 1, []
        try:
            self._add(1)
            peak = device_lib.measured_peak(self._apply, self.search.devices)
            if peak is not None:
                self._add(1)
                peak = device_lib.measured_peak(
                    lambda: applied.append(bool(self._apply()[0])), self.search.devices)
        except BaseException:
            if not several:
                self.restore()
            raise
        if peak is None and several:
            # Its collectives were in flight: other workers may wait in them, where the
            # restore's own would wait for theirs (find_micro_batch).
            return peak
        self.restore()
        if applied == [False]:  # skipped (check_finite): the optimizer did not run
            logging.warning("the sample's loss or gradient was not finite: the update was "
                            "skipped, and its memory is not measured")
        return peak

    def restore(self):
        """Discards the open window, and writes every saved variable's value back."""
        self._discard()
        put_back(self.strategy, self._saved)


def put_back(strategy, saved):
    """Writes each (variable, host value) of `saved` into the buffer the variable holds,
    each component of a distributed one, one after another. An assign would move the
    variable into the value's buffer, wherever the allocator placed it: weights and
    optimizer slots so moved after a search's trials split the device's free memory,
    and a size the search found no longer fit in training (window.assign_in_place)."""
    with strategy.scope():
        for variable, value in saved:
            inner = variable if isinstance(variable, tf.Variable) else variable.value
            components = (inner.values if isinstance(inner, tf.distribute.DistributedValues)
                          else (inner,))
            for component in components:
                with tf.device(component.device):
                    window_lib.assign_in_place(component, tf.constant(value))


# ---------------------------------------------------------------- in training


class EffectiveWindows:
    """Each effective batch added to the open window as mini-batches of B (every TF2
    path's training with a micro-batch), trained again at half B where it runs out of
    memory, which the rest of the run keeps (one warning line each time): the update
    does not depend on how a window is cut. The variables a pass may change beside the
    window's own (`state`: batch-norm statistics, seed generators, metrics, totals) are
    copied to the host before each window and put back before the retry. Not tried
    again (one line, OutOfMemory): the update (weights and optimizer change only
    there), and anything under several replicas (it aborts the collectives)."""

    def __init__(self, add, window, state):
        """`add(batch, size)`: adds the effective batch to the open window as mini-batches
        of `size` per replica (an int32 scalar tensor: halving traces nothing again),
        returns the mini-batches; `window`: the window step it adds to."""
        self.add_batch, self.window = add, window
        self.state = list({id(v): v for v in state}.values())
        self._discard = tf.function(window.discard)
        self._read = tf.function(self._host_values)

    def _host_values(self):
        """The state's values read in one call, onto the host."""
        with tf.device("CPU:0"):
            return [tf.identity(v) for v in self.state]

    def add(self, batch, found):
        """Adds `batch` as mini-batches of found's B. Returns (the mini-batches, `found`,
        or found with B halved where one ran out of memory). NothingFits: one sample ran
        out of memory; OutOfMemory: a mini-batch did, under several replicas."""
        if self.window.strategy.num_replicas_in_sync > 1:
            try:
                return self._added(batch, found), found
            except device_lib.DEVICE_ERRORS as error:
                if not device_lib.is_out_of_memory(error):
                    raise
            raise OutOfMemory(
                f"out of memory at micro-batch {found.micro_batch_size} per replica, under "
                f"{found.replicas} replicas: not tried again (an out-of-memory error aborts "
                "the replicas' collectives); give a smaller micro_batch_size")
        saved = [np.array(value, copy=True) for value in self._read()]
        while True:
            try:
                return self._added(batch, found), found
            except device_lib.DEVICE_ERRORS as error:
                if not device_lib.is_out_of_memory(error):
                    raise
            self._discard()
            put_back(self.window.strategy, zip(self.state, saved))
            found = _halved(found, batch)

    def _added(self, batch, found):
        return int(self.add_batch(batch, tf.constant(found.micro_batch_size, tf.int32)))

    def apply(self, apply):
        """Runs `apply` (the window's update) and returns what it returns; OutOfMemory
        where it ran out of memory (the weights and optimizer may be partly updated)."""
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
