"""Device memory as TensorFlow's allocator counts it: how many test images one evaluation
call takes, and the one line for a run that does not fit.

The device is the one that trains: the first GPU, else the CPU. Its allocator's
statistics (`tf.config.experimental.get_memory_info`: bytes in use now and at the peak)
are kept on every GPU, and on the CPU under the BFC allocator only
(TF_CPU_ALLOCATOR_USE_BFC=true before TensorFlow is imported; TF_CPU_BFC_MEM_LIMIT_IN_MB
then limits it, as a GPU's size does). TensorFlow's default CPU allocator keeps none and
has no limit: it takes host memory as tensors need it.
"""

import os
import re

import numpy as np
import tensorflow as tf

import model
from experiment import checkpoint
from experiment import data

# Whether an error is an OOM (a GPU's cuBLAS/cuDNN allocation failure too), and the
# environment that makes the CPU a device of limited memory: the library's.
from gradient_averaging.device import CPU_LIMIT_ENV
from gradient_averaging.device import cpu_runs_bfc
from gradient_averaging.device import default_device
from gradient_averaging.device import is_out_of_memory

MAX_CHUNK = 1000  # test images per evaluation call at most: larger calls are no quicker
# What a chunk may need per image over forward_bytes' estimate: kernels hold temporaries
# the estimate leaves out (measured chunks of both models stay well below it).
FORWARD_MARGIN = 2
MIB = 2 ** 20


def statistics(device_name):
    """{"current", "peak"} bytes of tensors on the device, or None where its allocator
    keeps no statistics."""
    try:
        return tf.config.experimental.get_memory_info(device_name)
    except ValueError:
        return None


def forward_bytes(model_name):
    """Bytes per image that evaluating `model_name` holds at once, by its layer sizes: the
    image (fed for the whole call) and its label, one layer's input and its output."""
    sizes = model.activation_sizes(model_name)
    held = sizes[0] + max(a + b for a, b in zip(sizes, sizes[1:]))
    return (held * np.dtype(data.IMAGE_DTYPE).itemsize
            + np.dtype(data.LABEL_DTYPE).itemsize)


def evaluation_chunk(batch_size, model_name):
    """Test images per evaluation call: a multiple of B that needs no more device memory
    than training did.

    A forward pass of B images needs less than a training step at B, which runs the same
    forward pass and keeps its activations for the gradients: chunks of B fit wherever
    training fits. Where the device keeps statistics, the chunk takes the room training
    showed: the device peaked at `peak` bytes (training, never reset here, so a caller
    measuring the whole run still can) and holds `current` now (weights, optimizer slots,
    accumulators), so a chunk may add peak - current, counting FORWARD_MARGIN times
    forward_bytes per image. Where the device keeps none, it has no limit to stay under
    either (see the module's docstring), and the chunk is the quickest: MAX_CHUNK images.
    Call it after training, before evaluating; the accuracy is the same for every chunk
    (correct answers are counted per image and summed).
    """
    most = max(MAX_CHUNK // batch_size, 1)  # mini-batches per chunk
    stats = statistics(default_device())
    if stats is not None:
        room = stats["peak"] - stats["current"]
        most = min(most, room // (FORWARD_MARGIN * forward_bytes(model_name) * batch_size))
    return batch_size * max(most, 1)


def out_of_memory(error, average_gradients, batch_size, checkpoint_dir=None,
                  effective_batch_size=0):
    """The one line for a run that ran out of device memory, or None for another error.

    It names N, B and the device's memory where known, and suggests the same N x B
    samples per update in smaller mini-batches: B divided by its smallest factor (the
    smallest step; a second try takes the next), N multiplied by it. A checkpoint made
    with this N and B stays as it was, and would refuse the new ones: they go to another
    --checkpoint-dir. With an effective batch E, it suggests half the mini-batch for the
    same E (or --batch-size=auto, on the tf2 engine).
    """
    if not is_out_of_memory(error):
        return None
    n, b = average_gradients, batch_size
    known = _memory_known(error)
    line = f"out of memory at N={n}, B={b}" + (f" ({known})" if known else "")
    if b == 1:
        return (f"{line}: one sample per mini-batch does not fit on this device, and no N "
                f"makes a mini-batch smaller (a larger N needs no less memory)")
    factor = next(f for f in range(2, b + 1) if b % f == 0)
    kept = checkpoint_dir and checkpoint.holds_checkpoints(checkpoint_dir)
    elsewhere = (f", in another --checkpoint-dir: {checkpoint_dir} keeps what this run "
                 f"saved" if kept else "")
    if effective_batch_size:
        return (f"{line}: try --effective-batch-size={effective_batch_size} --batch-size="
                f"{b // 2} (or --batch-size=auto with --engine=tf2: the largest that fits)"
                f"{elsewhere}")
    return (f"{line}: try --average-gradients={n * factor} --batch-size={b // factor} "
            f"(the same {n * b} samples per update{elsewhere})")


def _memory_known(error):
    """The memory of the device that ran out, in words: its limit where set, else its
    statistics' peak, else None."""
    named = re.search(r"device:((?:CPU|GPU):\d+)", str(error))
    device_name = named.group(1) if named else default_device()
    if device_name.startswith("CPU"):
        limit = os.environ.get(CPU_LIMIT_ENV, "")
        if limit.isdigit() and cpu_runs_bfc():
            return f"device memory {int(limit)} MiB"
    stats = statistics(device_name)
    if stats is not None:
        return f"device memory: {stats['peak'] / MIB:.0f} MiB in use at the peak"
    return None
