"""The repository root and its command line, which the tools launch."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAIN = os.path.join(ROOT, "main.py")  # the tools launch the real command line
