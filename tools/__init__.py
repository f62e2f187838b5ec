"""The project's tools, run from the repository root as modules (the post's table is the
experiment's: python -m experiment.reproduce, make reproduce):

    python -m tools.bench       # speed and memory of every averager (make bench)
    python -m tools.launch_workers -- ARGS   # main.py as MultiWorkerMirroredStrategy workers
"""
