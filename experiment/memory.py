"""Device memory as TensorFlow's allocator counts it: how many test images one evaluation
call takes.

The device is the one that trains: the first GPU, else the CPU. Its allocator's
statistics (`tf.config.experimental.get_memory_info`: bytes in use now and at the peak)
are kept on every GPU, and on the CPU under the BFC allocator only
(TF_CPU_ALLOCATOR_USE_BFC=true before TensorFlow is imported; TF_CPU_BFC_MEM_LIMIT_IN_MB
then limits it, as a GPU's size does). TensorFlow's default CPU allocator keeps none and
has no limit: it takes host memory as tensors need it.
"""

import numpy as np
import tensorflow as tf

import model
from experiment import data

MAX_CHUNK = 1000  # test images per evaluation call at most: larger calls are no quicker
# What a chunk may need per image over forward_bytes' estimate: kernels hold temporaries
# the estimate leaves out (measured chunks of both models stay well below it).
FORWARD_MARGIN = 2
CPU_BFC_ENV, CPU_LIMIT_ENV = "TF_CPU_ALLOCATOR_USE_BFC", "TF_CPU_BFC_MEM_LIMIT_IN_MB"
MIB = 2 ** 20


def device():
    """The device that trains and evaluates: "GPU:0" where there is a GPU, else "CPU:0"."""
    return "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"


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
    stats = statistics(device())
    if stats is not None:
        room = stats["peak"] - stats["current"]
        most = min(most, room // (FORWARD_MARGIN * forward_bytes(model_name) * batch_size))
    return batch_size * max(most, 1)

