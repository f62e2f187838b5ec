"""Where one update's time goes: a tf.profiler trace, its kernel time by op class."""

import collections
import glob
import os
import re
import shutil
import tempfile
import time

import tensorflow as tf

# Op classes for the profile: the first pattern that matches the op type names it.
OP_CLASSES = (("conv", r"Conv2D"), ("pool", r"MaxPool"), ("matmul", r"MatMul"),
              ("dropout RNG", r"Random"), ("finite check", r"^(IsFinite|All)$"),
              ("variable updates", r"ApplyAdam|AssignAddVariable|AssignVariable"))
CONTAINER_OPS = ("While", "If", "PartitionedCall", "Case")  # time of ops they hold


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
    kernel_ms, calls = collections.Counter(), collections.Counter()
    per_type = collections.Counter()
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
