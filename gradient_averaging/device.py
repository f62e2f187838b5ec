"""The device's memory as the micro-batch search reads it; the CPU stands in for a GPU under the
BFC allocator with a limit (CPU_BFC_ENV, CPU_LIMIT_ENV, set before TensorFlow starts)."""

import os
import re
import subprocess

import tensorflow as tf

# Default margins: more where the allocator grows by doubling regions (the CPU's, unless
# reserve_cpu_memory ran; a GPU's with memory growth): it runs out well before its limit.
MARGIN, GROWING_MARGIN = 0.1, 0.25
MIB = 1 << 20
RESERVE_SLACK_MB = 4  # reserve_cpu_memory's region: the CPU's limit less this
CPU_BFC_ENV, CPU_LIMIT_ENV = "TF_CPU_ALLOCATOR_USE_BFC", "TF_CPU_BFC_MEM_LIMIT_IN_MB"
# The out-of-memory text of cuBLAS, cuDNN and the driver (raised as InternalError, UnknownError)
OUT_OF_MEMORY_TEXT = re.compile(r"\bOOM\b|out of memory|ALLOC_FAILED", re.IGNORECASE)
DEVICE_ERRORS = (tf.errors.ResourceExhaustedError, tf.errors.InternalError,
                 tf.errors.UnknownError)
_cpu_one_region = False


def is_out_of_memory(error):
    """Whether a TensorFlow error says the device's memory ran out."""
    return isinstance(error, tf.errors.ResourceExhaustedError) or (
        isinstance(error, DEVICE_ERRORS) and bool(OUT_OF_MEMORY_TEXT.search(str(error))))


def default_device():
    """The device a model trains on without a strategy: "GPU:0" where there is one."""
    return "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"


def _short_name(device):
    spec = tf.DeviceSpec.from_string(device or default_device())
    return f"{spec.device_type}:{spec.device_index or 0}"


def cpu_runs_bfc():
    """Whether this process's CPU runs the BFC allocator (read as TensorFlow starts)."""
    return os.environ.get(CPU_BFC_ENV, "").lower() in ("true", "1")


def device_memory(device=None):
    """The device's memory in bytes: the CPU's BFC limit, a GPU's logical memory limit or else its
    total (NVML, nvidia-smi); `device` None: the first GPU, else the CPU. ValueError: unknown."""
    name = _short_name(device)
    kind, index = name.split(":")
    if kind == "CPU":
        limit = os.environ.get(CPU_LIMIT_ENV, "")
        if cpu_runs_bfc() and limit.isdigit():
            return int(limit) * MIB
        raise ValueError(
            f"the memory of {name} is not known: run the CPU as a device of M MiB with "
            f"{CPU_BFC_ENV}=true {CPU_LIMIT_ENV}=M (before TensorFlow starts), or give the "
            "budget in bytes (budget=...)")
    if kind == "GPU":
        physical, limit = _gpu_of_logical(int(index))
        if limit is not None:
            return int(limit) * MIB
        total = _nvidia_total(physical) if physical is not None else None
        if total is not None:
            return total
    raise ValueError(f"the memory of {name} is not known (no NVML, no nvidia-smi): give "
                     "the budget in bytes (budget=...)")


def reserve_cpu_memory(megabytes=None):
    """Makes the CPU's BFC allocator one region, as a GPU's: it runs out at its limit, not where its
    next doubled region fails. Call before TensorFlow allocates on the CPU. ValueError: not BFC."""
    if not cpu_runs_bfc():
        raise ValueError(f"the CPU's allocator grows no regions to reserve: set "
                         f"{CPU_BFC_ENV}=true before TensorFlow starts")
    if megabytes is None:
        megabytes = device_memory("CPU:0") // MIB - RESERVE_SLACK_MB
    with tf.device("CPU:0"):  # uninitialized, freed at once: no page is touched
        tf.raw_ops.Empty(shape=[int(megabytes) * MIB // 4], dtype=tf.float32, init=False)
    global _cpu_one_region
    _cpu_one_region = True


def default_margin(device=None):
    """`device`'s margin where none is given: GROWING_MARGIN where its allocator grows."""
    kind, index = _short_name(device).split(":")
    if kind == "GPU":
        physical, _ = _gpu_of_logical(int(index))
        gpus = tf.config.list_physical_devices("GPU")
        grows = (os.environ.get("TF_FORCE_GPU_ALLOW_GROWTH", "").lower() == "true"
                 or (physical is not None
                     and tf.config.experimental.get_memory_growth(gpus[physical])))
        return GROWING_MARGIN if grows else MARGIN
    return MARGIN if _cpu_one_region else GROWING_MARGIN


def _gpu_of_logical(index):
    """(physical GPU index, memory limit in MiB or None) of logical GPU `index`."""
    logical = 0
    for physical, gpu in enumerate(tf.config.list_physical_devices("GPU")):
        for config in tf.config.get_logical_device_configuration(gpu) or [None]:
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
    except Exception:  # NVML absent or failing: nvidia-smi next
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


def devices_of(strategy):
    """The devices `strategy`'s replicas train on (the default device without one)."""
    try:
        return list(strategy.extended.worker_devices)
    except RuntimeError:  # the default strategy has none
        return [default_device()]


def measured_peak(run, devices, hold=0):
    """run()'s peak in bytes over the devices, None: out of memory; `hold` a device not counted."""
    held = []
    try:
        for device in devices if hold else ():
            with tf.device(device):  # uninitialized: no page is touched
                held.append(tf.raw_ops.Empty(shape=[hold // 4], dtype=tf.float32, init=False))
        for device in devices:
            tf.config.experimental.reset_memory_stats(device)
        run()
    except DEVICE_ERRORS as error:
        if not is_out_of_memory(error):
            raise
        return None
    finally:
        del held[:]
    return max(tf.config.experimental.get_memory_info(d)["peak"] for d in devices) - hold // 4 * 4
