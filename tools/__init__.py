"""The project's tools, run from the repository root as modules:

    python -m tools.reproduce   # the post's table (make reproduce)
    python -m tools.bench       # speed and memory of every averager (make bench)
    python -m tools.launch_workers -- ARGS   # main.py as MultiWorkerMirroredStrategy workers
"""
