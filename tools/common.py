"""What the tools share: the repository root, a quiet TensorFlow import, the machine."""

import importlib.metadata
import os
import platform

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAIN = os.path.join(ROOT, "main.py")  # the tools launch the real command line


def import_tensorflow_quietly():
    """Imports TensorFlow with fd 2 closed: its C++ start-up lines ignore log levels.

    Errors still surface: stderr is restored before an import failure propagates.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            try:
                import tensorflow as tf
                tf.config.list_physical_devices()  # device probing logs too
            finally:
                os.dup2(saved, 2)
    finally:
        os.close(saved)
    tf.get_logger().setLevel("ERROR")


def _version(package):
    """An installed package's version, read without importing it (TensorFlow is slow)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def machine():
    """The machine and the software in a few words, for the record beside the numbers."""
    cpu = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    memory = "unknown"
    try:
        with open("/proc/meminfo") as f:  # MemTotal, in kB
            memory = f"{int(f.readline().split()[1]) / (1 << 20):.1f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    return (f"{os.cpu_count()} cores ({cpu}), {memory} RAM, {platform.system()} "
            f"{platform.release()}; Python {platform.python_version()}, TensorFlow "
            f"{_version('tensorflow')}, Keras {_version('keras')}, numpy {_version('numpy')}")
