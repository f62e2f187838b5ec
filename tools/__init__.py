"""The bench harness and the tools around it, run from the repository root as modules:

    python -m tools.bench       # speed and memory of every averager (make bench)
    python -m tools.launch_workers -- ARGS   # main.py as MultiWorkerMirroredStrategy workers
"""
