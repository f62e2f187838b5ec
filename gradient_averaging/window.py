"""The window's building blocks, shared by every path: its finite checks, its stacking,
its in-place sums and the TF1 graph's loop.

No Keras here: the TF1 optimizer wrapper imports this module too. A window is N
mini-batches whose gradients make one update; stacked (where a caller stacks them), they
lie on a new leading axis, [N, B, ...], shorter ones padded, with their sizes beside them.
"""

import collections

import numpy as np
import tensorflow as tf

# Types whose sums overflow or lose precision too soon: they accumulate in float32.
LOW_PRECISION = (tf.float16, tf.bfloat16)
# Iterations a window loop runs at once. One: a mini-batch's activations are freed
# before the next one's forward pass, so the window holds one mini-batch's, as B alone
# does (the TF2 loops overlap passes only as parallel_mini_batches asks: in_groups).
PARALLEL_ITERATIONS = 1
# TensorFlow feeds a numpy array to a session without copying it when its data is this
# aligned.
FEED_ALIGNMENT = 64


Part = collections.namedtuple("Part", ["numerator", "divisor", "weight", "term"])
Part.__doc__ = """One part of a mini-batch's loss, as the direct batch reduces it.

numerator: a scalar, the part's sum over the mini-batch (weighted, masked losses);
divisor: this mini-batch's share of what the direct batch divides that sum by (a scalar:
  its samples, valid tokens or summed weights), or None where it divides by nothing;
weight: the part's weight in the loss (compile's loss_weights), or None for 1;
term: the parts whose divisors are the same quantity share a term (a hashable key:
  SAMPLES for the mini-batch's samples, None for parts not divided); the window keeps one
  sum per term.
"""
SAMPLES = "samples"  # the term of the parts divided by their mini-batch's samples


def accumulator_dtype(value):
    """The dtype a sum of `value`'s (a variable's, a gradient's or a numpy array's) values
    is kept in."""
    dtype = tf.as_dtype(value.dtype).base_dtype
    return tf.float32 if dtype in LOW_PRECISION else dtype


def nonzero(divisor, dtype):
    """`divisor` in `dtype`, 1 where it is 0: a sum whose divisor is 0 (no sample, no valid
    token) is 0 itself, and stays 0 divided by it."""
    divisor = tf.cast(divisor, dtype)
    return tf.where(tf.equal(divisor, 0), tf.ones_like(divisor), divisor)


def all_finite(tensors):
    """A scalar bool tensor: no NaN or Inf in any of `tensors` (dense tensors)."""
    tensors = list(tensors)
    if not tensors:
        return tf.constant(True)
    return tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(t)) for t in tensors]))


def stack_padded(mini_batches, alignment=None):
    """The window's mini-batches stacked on a new leading axis, shorter ones zero-padded
    (any structure; tf2.stack_window is the TF2 accumulators' (x, y) form of it).

    Args:
      mini_batches: a sequence of array-likes, or of equal structures (tuples, dicts)
        of them; a mini-batch's samples are its first array's first axis (scalars are
        stacked as they are).
      alignment: align the stacked arrays' data to this many bytes (a session feeds an
        aligned array without copying it again).

    Returns:
      (stacked, sizes): the structure of one mini-batch with each array [N, the longest
      mini-batch's samples, ...], and int32 [N], each mini-batch's samples.
    """
    if not len(mini_batches):
        raise ValueError("a window needs at least one mini-batch")
    mini_batches = [_arrays(batch) for batch in mini_batches]
    sizes = np.array([_samples(tf.nest.flatten(batch)[0]) for batch in mini_batches], np.int32)
    width = int(sizes.max())

    def stack(*arrays):
        first = arrays[0]
        shape = (len(arrays),) + ((width,) + first.shape[1:] if first.ndim else ())
        out = _empty(shape, first.dtype, alignment)
        if all(a.shape == shape[1:] for a in arrays):
            return np.stack(arrays, out=out)
        out[...] = 0
        for row, array in zip(out, arrays):
            row[:len(array)] = array
        return out

    return tf.nest.map_structure(stack, *mini_batches), sizes


def _arrays(batch):
    """A mini-batch's tuples and dicts kept, everything else (a list of numbers too) as an
    array."""
    if isinstance(batch, tuple):
        return tuple(_arrays(part) for part in batch)
    if isinstance(batch, dict):
        return {key: _arrays(part) for key, part in batch.items()}
    return np.asarray(batch)


def _samples(array):
    return len(array) if array.ndim else 1


def _empty(shape, dtype, alignment):
    if not alignment:
        return np.empty(shape, dtype)
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + alignment, np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def sum_window(mini_batch_gradients, sums, state, data, sizes,
               parallel_iterations=PARALLEL_ITERATIONS):
    """The window loop of a TF1 graph (the experiment's fused averager): adds up each
    mini-batch's gradients, in order, as values carried from mini-batch to mini-batch
    (a graph without automatic control dependencies cannot order in-place additions;
    the TF2 paths add into variables: window_step).

    Args:
      mini_batch_gradients: (i, batch, state) -> (gradients, state) for mini-batch i,
        given as `batch`, each tensor of `data` sliced [i, :sizes[i]] (an `Unbatched`
        entry: [i]); a gradient may be None (the loss does not reach that variable).
      sums: one zero tensor per gradient, in the type it is summed in.
      state: a nested structure of tensors carried from mini-batch to mini-batch (a
        model's other state, running totals, a TensorArray...).
      data: a nested structure of stacked tensors, [N, B, ...]; an entry that is an
        `Unbatched` holds per-mini-batch values without a sample axis ([N, ...]).
      sizes: int [N], each mini-batch's samples.

    Returns:
      (sums, state) after the last mini-batch. The loop holds the activations of at
      most `parallel_iterations` mini-batches at a time.
    """
    def body(i, state, sums):
        batch = tf.nest.map_structure(
            lambda t: t.values[i] if isinstance(t, Unbatched) else t[i, :sizes[i]], data)
        gradients, state = mini_batch_gradients(i, batch, state)
        sums = [s if g is None else s + tf.cast(g, s.dtype) for s, g in zip(sums, gradients)]
        return i + 1, state, sums

    _, state, sums = tf.while_loop(
        lambda i, *_: i < tf.shape(sizes)[0], body, (tf.constant(0), state, list(sums)),
        parallel_iterations=parallel_iterations)
    return sums, state


def in_groups(count, add, parallel=1):
    """Hands `add` the indices 0 .. count-1 (an int32 scalar tensor), in order, in lists
    of `parallel` while as many are left, then one at a time. Iterations run one after
    another (the sums are added in place); a group's passes may run at once, for one
    more mini-batch's activations each. Returns the count, a tensor that exists once
    what `add` returned for the last is done."""
    def loop(start, group):
        def body(i):
            added = add([i + j for j in range(group)])
            with tf.control_dependencies(tf.nest.flatten(added, expand_composites=True)):
                return i + group

        done, = tf.while_loop(lambda i: i + group <= count, body, (start,),
                              parallel_iterations=PARALLEL_ITERATIONS)
        return done

    done = tf.constant(0)
    if parallel > 1:
        done = loop(done, parallel)
    return loop(done, 1)


def cut(batch, size, add, parallel=1):
    """Hands `add` the mini-batches of `size` samples of `batch` (a nested structure of
    tensors), in order, in lists (in_groups: `parallel` at a time): the last one shorter
    where `size` does not divide the batch, one empty mini-batch where the batch is empty
    (every replica counts one, so the first replica's count says whether the window holds
    any). Returns the mini-batches, an int32 scalar tensor that exists once the last is
    added."""
    samples = tf.shape(tf.nest.flatten(batch)[0], out_type=tf.int32)[0]
    count = tf.maximum((samples + size - 1) // size, 1)

    def mini_batch(i):
        return tf.nest.map_structure(lambda t: t[i * size:(i + 1) * size], batch)

    return in_groups(count, lambda indices: add([mini_batch(i) for i in indices]), parallel)


def add_in_place(sums, gradients):
    """Adds each gradient into its sum variable, in the sum's own buffer (zero_sums
    empties them between windows); a gradient that arrives as rows (`tf.IndexedSlices`:
    an embedding lookup's) is added as its rows (add_rows), never made dense. Returns
    the ops."""
    return [add_rows(total, gradient) if isinstance(gradient, tf.IndexedSlices)
            else total.assign_add(tf.cast(gradient, total.dtype), read_value=False)
            for total, gradient in zip(sums, gradients) if gradient is not None]


def add_rows(total, rows):
    """Adds `rows` (tf.IndexedSlices, ids repeated or not) into the dense sum variable
    `total`, row by row, in its own buffer: no table-sized temporary, no pass over the
    table. A scatter switches TensorFlow's variable to copy-on-read (every later read
    and dense add would copy it), so the switch is turned off again at once. Returns
    the op."""
    handle = total.handle  # a replica-local variable's: this replica's (replica context)
    scatter = tf.raw_ops.ResourceScatterAdd(
        resource=handle, indices=rows.indices, updates=tf.cast(rows.values, total.dtype))
    with tf.control_dependencies([scatter]):
        return tf.raw_ops.DisableCopyOnRead(resource=handle)


def assign_in_place(variable, value):
    """Writes `value` into the buffer `variable` holds, and turns off the copy-on-read
    switch that the write sets (left on, every later read and add copies the variable).
    An assign would make the variable take value's buffer, wherever the allocator placed
    it (amid a pass's activations, in the holes of the apply): a sum must keep its own
    buffer for the window's memory to stay B alone's plus the sums. A variable of rank 2
    or more is written row by row (a scatter of every row: a copy each, a third of a
    strided assign's CPU time). Returns the op."""
    rank = value.shape.rank
    if not rank:
        return variable.assign(value, read_value=False)
    if rank > 1:
        write = tf.raw_ops.ResourceScatterUpdate(
            resource=variable.handle, indices=tf.range(tf.shape(value)[0]), updates=value)
    else:
        write = tf.raw_ops.ResourceStridedSliceAssign(
            ref=variable.handle, begin=[0], end=[0], strides=[1], value=value,
            begin_mask=1, end_mask=1)  # masked begin and end: the whole axis
    with tf.control_dependencies([write]):
        return tf.raw_ops.DisableCopyOnRead(resource=variable.handle)


def zeros(shape, dtype):
    """Zeros made when the op runs. Grappler folds a zeros_like or tf.zeros of a known
    shape into a constant, which every executor that runs it then keeps: a weight-sized
    buffer per accumulator, per branch and per op that resets the window."""
    return tf.raw_ops.Empty(shape=tf.constant(shape.as_list(), tf.int32), dtype=dtype,
                            init=True)


def zero_sums(sums):
    """Writes zeros into each sum variable's buffer, one after another (assign_in_place
    says why in place), with one temporary the size of a variable at a time: whatever
    the sums held (a NaN too). Returns [the op that zeroes the last], to wait for."""
    done = []
    for total in sums:
        with tf.control_dependencies(done):
            done = [assign_in_place(total, zeros(total.shape, total.dtype))]
    return done


def divide_in_place(terms, divisors, addends=None, overwrite=None):
    """Writes each variable's share of the window's mean into its first sum's buffer,
    one variable after the other (assign_in_place), and says whether all are finite:
    one variable's temporaries at a time (all at once would hold a second copy of the
    gradients).

    Args:
      terms: per term, one sum variable or None (the term does not reach it) per
        variable, aligned; each variable is reached by at least one term.
      divisors: per term, the scalar its sums are divided by (0: its sums are zero, as
        every numerator was), or None: not divided.
      addends: None, or per variable None, a tensor, or a function of no arguments that
        makes it (run in turn, so that its temporary lives only then), added after the
        division: what does not depend on the window's samples.
      overwrite: None, or per variable whether it is written with its "gradient"
        (float8's scales and histories): its terms' elementwise maximum, undivided.

    Returns:
      (values, finite): each variable's value after the division (a read that shares
      its buffer), and a bool scalar tensor: no NaN or Inf in any of them (a sum or
      addend that was not finite, a sum that overflowed).
    """
    count = len(terms[0]) if terms else 0
    addends = [None] * count if addends is None else addends
    overwrite = [False] * count if overwrite is None else overwrite
    finite, done, buffers = [], [], []
    for i in range(count):
        sums = [(term[i], divisor) for term, divisor in zip(terms, divisors)
                if term[i] is not None]
        buffer = sums[0][0]
        with tf.control_dependencies(done):
            value = None
            for total, divisor in sums:
                if overwrite[i]:
                    part = total.read_value()
                    value = part if value is None else tf.maximum(value, part)
                    continue
                part = total
                if divisor is not None:
                    part = total / nonzero(divisor, total.dtype)
                value = part if value is None else value + part
            addend = addends[i]
            if callable(addend):
                addend = addend()
            if addend is not None and not overwrite[i]:
                value += tf.cast(addend, buffer.dtype)
            check = tf.reduce_all(tf.math.is_finite(value))
            finite.append(check)
            with tf.control_dependencies([check]):
                done = [assign_in_place(buffer, value)]
        buffers.append(buffer)
    with tf.control_dependencies(done):
        values = [buffer.read_value() for buffer in buffers]
    return values, (tf.reduce_all(tf.stack(finite)) if finite else tf.constant(True))


class Unbatched:
    """Marks per-mini-batch values that have no sample axis (a seed per mini-batch), so
    sum_window hands mini-batch i its row as it is."""

    def __init__(self, values):
        self.values = values
