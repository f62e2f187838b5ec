"""Accumulation lets a run fit where the direct batch does not: each path, on a device
whose memory the direct batch of N*B exceeds, trains to the direct batch's weights.

The device is the CPU run as the GPU's BFC allocator, with a memory limit
(tools.memory's probes: one fresh process each, one inter-op thread, oneDNN off so that
an OOM in a convolution raises). The convnet's activations dominate its memory, so the
direct batch needs far more than a mini-batch does.
"""

import concurrent.futures

import pytest

from tests.helpers import assert_probe_trained_to
from tools import memory

pytestmark = pytest.mark.slow  # a dozen probe processes: make test-slow

MODEL, N, B = "convnet", 8, 16
# Between a path's peak (B alone's, about 45 MiB here, plus a little) and the direct
# batch's (well above 100 MiB): the direct batch must not fit, every path must.
LIMIT_MB = 80
PATHS = ("accumulate", "window", "mini_batch", "tf1")
# A peak beside an input pipeline moves from process to process by a BFC chunk (the
# allocator hands out a free chunk of up to twice a request whole, and tf.data's threads
# change which chunks are free): B alone and Keras fit, both fed by Keras's pipeline, are
# each the median of three probes, as the bench takes them.
REPEATS = {"accumulate": 3, "alone": 3, "tf1_alone": 3}


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    """Every probe this module checks, two processes at a time: the references without
    a limit (their weights), the direct batch and every path under it, and B alone under
    it too (the bound's base: an allocator under a limit grows region by region, one
    without takes its memory as one region first, tools.memory)."""
    base = tmp_path_factory.mktemp("memory")
    specs = [("direct", None), ("tf1_direct", None), ("direct", LIMIT_MB)]
    specs += [(alone, LIMIT_MB, k) for alone in ("alone", "tf1_alone")
              for k in range(REPEATS[alone])]
    specs += [(path, LIMIT_MB, k) for path in PATHS for k in range(REPEATS.get(path, 1))]

    def run(spec):
        path, limit, repeat = (*spec, 0)[:3]
        save = base / f"{path}-{limit}-{repeat}.npz"
        return memory.probe(MODEL, path, N, B, limit_mb=limit, save=save), save

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        done = dict(zip(specs, pool.map(run, specs)))
    for path, limit in [("alone", LIMIT_MB), ("tf1_alone", LIMIT_MB)] + [
            (path, LIMIT_MB) for path in PATHS]:
        # the median probe of a path's repeats stands for it
        repeats = sorted((done.pop((path, limit, k)) for k in range(REPEATS.get(path, 1))),
                         key=lambda r: r[0].get("peak_mb", float("inf")))
        done[(path, limit)] = repeats[len(repeats) // 2]
    return done


def test_the_direct_batch_does_not_fit(probed):
    result, _ = probed[("direct", LIMIT_MB)]
    assert result.get("oom"), result
    reference, _ = probed[("direct", None)]
    assert reference["peak_mb"] > LIMIT_MB, reference


@pytest.mark.parametrize("path", PATHS)
def test_each_path_fits_and_trains_to_the_direct_batchs_weights(probed, path):
    _, reference = probed[("tf1_direct" if path == "tf1" else "direct", None)]
    assert_probe_trained_to(probed[(path, LIMIT_MB)], reference)


@pytest.mark.parametrize("path", PATHS)
def test_each_paths_peak_is_within_b_alone_plus_the_largest_variable(probed, path):
    """B alone, plus one temporary the size of the largest variable, plus 5% (4 MiB at
    least): the sums stand in for B alone's gradients. The TF1 graph's bound adds one
    accumulator per trainable variable to its own B alone (its session keeps the
    initializer's zeros: memory.bound_mb with the accumulators)."""
    alone, _ = probed[("tf1_alone" if path == "tf1" else "alone", LIMIT_MB)]
    result, _ = probed[(path, LIMIT_MB)]
    bound = memory.bound_mb(alone["peak_mb"], result["largest_mb"],
                            result["accumulators_mb"] if path == "tf1" else 0.0)
    assert result["peak_mb"] <= bound, (result["peak_mb"], bound)
