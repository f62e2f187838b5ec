"""What the tools share: the repository root and the machine (the quiet TensorFlow import
is cli.import_tensorflow_quietly, shared with main.py)."""

import importlib.metadata
import os
import platform

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAIN = os.path.join(ROOT, "main.py")  # the tools launch the real command line


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
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    return (f"{os.cpu_count()} cores ({cpu}), {memory:.1f} GiB RAM, {platform.system()} "
            f"{platform.release()}; Python {platform.python_version()}, TensorFlow "
            f"{_version('tensorflow')}, Keras {_version('keras')}, numpy {_version('numpy')}")
