"""The window's building blocks for every path: finite checks, stacking, in-place sums; no
Keras (the TF1 optimizer wrapper imports it). A window: N mini-batches whose gradients
make one update, stacked (where a caller stacks them) on a new leading axis as [N, B, ...]."""

import collections

import numpy as np
import tensorflow as tf

LOW_PRECISION = (tf.float16, tf.bfloat16)  # summed in float32: theirs overflow, lose precision
# A window loop's iterations at once. One: each mini-batch's activations are freed before the
# next pass, as B alone's (TF2 overlaps passes only where parallel_mini_batches asks: in_groups).
PARALLEL_ITERATIONS = 1
FEED_ALIGNMENT = 64  # a session is fed a numpy array this aligned without a copy


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
    """The dtype a sum of `value`'s values (a variable, tensor or numpy array) is kept in."""
    dtype = tf.as_dtype(value.dtype).base_dtype
    return tf.float32 if dtype in LOW_PRECISION else dtype


def nonzero(divisor, dtype):
    """`divisor` in `dtype`, 1 where 0: a sum whose divisor is 0 (no sample) is 0 and stays 0."""
    divisor = tf.cast(divisor, dtype)
    return tf.where(tf.equal(divisor, 0), tf.ones_like(divisor), divisor)


def finite(t):
    """A scalar bool tensor: no NaN or Inf in the dense tensor `t`. float32 and float64 are checked
    by their sum (one pass, no temporary): finite exactly when every addend is, barring an overflow,
    which counts as not finite; narrower dtypes element by element (a sum overflows at 65504)."""
    if t.dtype in (tf.float32, tf.float64):
        return tf.math.is_finite(tf.reduce_sum(t))
    return tf.reduce_all(tf.math.is_finite(t))


def all_finite(tensors):
    """A scalar bool tensor: no NaN or Inf in any of `tensors` (dense tensors, `finite`)."""
    tensors = list(tensors)
    if not tensors:
        return tf.constant(True)
    return tf.reduce_all(tf.stack([finite(t) for t in tensors]))


def stack_padded(mini_batches, alignment=None):
    """The window's mini-batches (array-likes, or equal tuples or dicts of them) stacked, shorter
    ones zero-padded, each array aligned to `alignment` bytes -> (stacked: each array [N, the most
    samples, ...], scalars [N]; sizes: int32 [N], each one's samples, its first array's length)."""
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


def in_groups(count, add, parallel=1):
    """Calls `add` with lists of indices 0 .. count-1 (int32 scalars), in order: `parallel` a list
    while as many are left, then one. Lists run in turn (sums add in place); a list's passes may
    overlap, one more mini-batch's activations each. Returns count, once the last `add` is done."""
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
    """in_groups over `batch`'s mini-batches of `size` samples: the last one shorter where `size`
    does not divide it; an empty batch is one empty mini-batch (every replica counts one, so
    the first replica's count says whether the window holds any). Returns their count."""
    samples = tf.shape(tf.nest.flatten(batch)[0], out_type=tf.int32)[0]
    count = tf.maximum((samples + size - 1) // size, 1)

    def mini_batch(i):
        return tf.nest.map_structure(lambda t: t[i * size:(i + 1) * size], batch)

    return in_groups(count, lambda indices: add([mini_batch(i) for i in indices]), parallel)


def add_in_place(sums, gradients):
    """Adds each gradient into its sum's own buffer; IndexedSlices as rows (add_rows), not dense."""
    return [add_rows(total, gradient) if isinstance(gradient, tf.IndexedSlices)
            else total.assign_add(tf.cast(gradient, total.dtype), read_value=False)
            for total, gradient in zip(sums, gradients) if gradient is not None]


def add_rows(total, rows):
    """Adds `rows` (tf.IndexedSlices, ids may repeat) into the sum variable `total`'s own buffer:
    no table-sized temporary or pass. A scatter turns on copy-on-read (every later read and add
    would copy the table), so it is turned off at once. Returns the op."""
    handle = total.handle  # a replica-local variable's: this replica's (replica context)
    scatter = tf.raw_ops.ResourceScatterAdd(
        resource=handle, indices=rows.indices, updates=tf.cast(rows.values, total.dtype))
    with tf.control_dependencies([scatter]):
        return tf.raw_ops.DisableCopyOnRead(resource=handle)


def assign_in_place(variable, value):
    """Writes `value` into `variable`'s own buffer, then copy-on-read off (as add_rows): an assign
    would take value's buffer, wherever allocated (amid activations); a sum keeps its own so the
    window's memory stays B alone's plus the sums."""
    rank = value.shape.rank
    if not rank:
        return variable.assign(value, read_value=False)
    if rank > 1:  # a scatter of every row: on CPU cheaper than a strided assign
        write = tf.raw_ops.ResourceScatterUpdate(
            resource=variable.handle, indices=tf.range(tf.shape(value)[0]), updates=value)
    else:
        write = tf.raw_ops.ResourceStridedSliceAssign(
            ref=variable.handle, begin=[0], end=[0], strides=[1], value=value,
            begin_mask=1, end_mask=1)  # masked begin and end: the whole axis
    with tf.control_dependencies([write]):
        return tf.raw_ops.DisableCopyOnRead(resource=variable.handle)


def zeros(shape, dtype):
    """Zeros made when the op runs: Grappler folds tf.zeros of a known shape into a constant that
    every executor running it keeps (a weight-sized buffer per accumulator, branch and reset)."""
    return tf.raw_ops.Empty(shape=tf.constant(shape.as_list(), tf.int32), dtype=dtype,
                            init=True)


def scalar_in_place(scatter, variable, scalar):
    """Applies `scatter` (tf.raw_ops.ResourceScatterUpdate or ResourceScatterDiv) of one scalar
    to every element of `variable`'s own buffer, no temporary made, then copy-on-read off (as
    add_rows). A divisor must not be 0 (the scatter refuses it: `nonzero`). Returns the op."""
    scalar = tf.cast(scalar, variable.dtype)
    if not variable.shape.rank:
        value = scalar if scatter is tf.raw_ops.ResourceScatterUpdate else variable / scalar
        return variable.assign(value, read_value=False)
    # The rows from the variable's own shape op, not a static range (see `zeros`).
    rows = tf.range(tf.raw_ops.VariableShape(input=variable.handle, out_type=tf.int64)[0])
    with tf.control_dependencies([scatter(resource=variable.handle, indices=rows,
                                          updates=scalar)]):
        return tf.raw_ops.DisableCopyOnRead(resource=variable.handle)


def zero_sums(sums):
    """Zeros each sum's own buffer, whatever it held (NaN too), no temporary -> [an op to await]."""
    return [tf.group([scalar_in_place(tf.raw_ops.ResourceScatterUpdate, total, 0)
                      for total in sums])]


def first_sums(terms):
    """Per variable (terms as divide_in_place's), its first term's sum: the buffer of its mean."""
    return [next(total for total in variable if total is not None) for variable in zip(*terms)]


def divide_in_place(terms, divisors, addends=None, overwrite=None):
    """Writes each variable's share of the window's mean into its first sum's buffer, one variable
    at a time: the first sum divided in place (scalar_in_place: no temporary, the same bits as a
    division), each other term's share and the addend added after, in that order. Returns (the
    new values, reads that share the buffers; a bool scalar tensor, whether all are finite).

    Args:
      terms: per term, per variable its sum or None (not reached); some term reaches every variable.
      divisors: per term, the scalar its sums are divided by (0: its sums are 0), or None.
      addends: None, or per variable None, a tensor or a function making it (called in turn, so
        its temporary lives only then), added after the division: what samples do not divide.
      overwrite: None, or per variable whether it takes its terms' elementwise maximum,
        undivided (float8's scales and histories)."""
    buffers = first_sums(terms)
    addends = [None] * len(buffers) if addends is None else addends
    overwrite = [False] * len(buffers) if overwrite is None else overwrite
    checks, done = [], []
    for i, buffer in enumerate(buffers):
        sums = [(term[i], divisor) for term, divisor in zip(terms, divisors)
                if term[i] is not None]
        with tf.control_dependencies(done):
            if overwrite[i]:
                value = buffer.read_value()
                for total, _ in sums[1:]:
                    value = tf.maximum(value, total.read_value())
                done = [assign_in_place(buffer, value)]
            else:
                done = _shares_in_place(buffer, sums, addends[i])
        with tf.control_dependencies(done):
            checks.append(finite(buffer.read_value()))
        done = checks[-1:]
    with tf.control_dependencies(done):
        values = [buffer.read_value() for buffer in buffers]
    return values, (tf.reduce_all(tf.stack(checks)) if checks else tf.constant(True))


def _shares_in_place(buffer, sums, addend):
    """divide_in_place's one variable, not overwritten: -> [the op that writes its last]."""
    divisor, done = sums[0][1], []
    if divisor is not None:
        done = [scalar_in_place(tf.raw_ops.ResourceScatterDiv, buffer,
                                nonzero(divisor, buffer.dtype))]
    for total, divisor in sums[1:]:
        with tf.control_dependencies(done):
            part = total if divisor is None else total / nonzero(divisor, total.dtype)
            done = [buffer.assign_add(part, read_value=False)]
    with tf.control_dependencies(done):
        if callable(addend):
            addend = addend()
        if addend is not None:
            done = [buffer.assign_add(tf.cast(addend, buffer.dtype), read_value=False)]
    return done
