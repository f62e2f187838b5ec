"""The TF1 examples' data: a small regression cut into windows of N mini-batches, and
each window as the one direct batch its update must equal."""

import numpy as np


def toy_windows(n, windows, batch, seed=0):
    """(mini-batches, direct batches): windows * n mini-batches (x [batch, 3] and
    y [batch, 1], float64), and the concatenation of each window's n."""
    rng = np.random.RandomState(seed)
    mini_batches = [(rng.rand(batch, 3), rng.rand(batch, 1)) for _ in range(windows * n)]
    direct = [tuple(np.concatenate(part) for part in zip(*mini_batches[k:k + n]))
              for k in range(0, len(mini_batches), n)]
    return mini_batches, direct
