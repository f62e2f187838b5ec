"""A run's TensorBoard events: scalars written as plain `simple_value` events (no
tensorboard package needed)."""

import os

import tensorflow as tf

from experiment import faults
from experiment import results


class Writer:
    """TensorBoard scalars at LOGDIR.

    Events are a run's curves, not its results: the first write that fails (a full disk,
    a lost permission) is warned about once, through `warn`, and the run goes on without
    events. faults.check sees each write as one to LOGDIR/events.out.tfevents.
    """

    def __init__(self, logdir, warn):
        self.logdir, self.warn = logdir, warn
        self._writer = self._attempt(tf.summary.create_file_writer, logdir)

    def _attempt(self, write, *args):
        """write(*args), or None where it failed (warned; the writer is then dropped)."""
        try:
            faults.check(os.path.join(self.logdir, "events.out.tfevents"))
            return write(*args)
        except (tf.errors.OpError, OSError) as e:
            self.warn(f"--logdir: cannot write TensorBoard events in {self.logdir} "
                      f"({results.cause(e)}); the run goes on without them")
            self._writer = None
            return None

    def scalar(self, tag, value, step):
        if self._writer is None:
            return
        summary = tf.compat.v1.Summary(
            value=[tf.compat.v1.Summary.Value(tag=tag, simple_value=float(value))])

        def write():
            with self._writer.as_default():
                tf.summary.experimental.write_raw_pb(summary.SerializeToString(), step=step)

        self._attempt(write)

    def close(self):
        if self._writer is not None:
            self._attempt(self._writer.close)
            self._writer = None
