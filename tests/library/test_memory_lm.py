"""The decoder language model (tools.memory's lm: a 32,000 x 256 Embedding, two causal
attention blocks, an untied Dense(32,000) output; N=8 x B=4 sequences of 32 tokens, Adam)
under a memory limit that its direct batch exceeds: Keras fit through `accumulate` and
the one-call accumulator fit and train to the direct batch's weights (computed without
the limit, the Embedding's gradient made dense before Adam: memory's dense_direct).

The limit cannot tell rows from rows made dense here: an Embedding's gradient made dense
is one table (31.2 MiB) made at the end of each backward pass, when the output layer's
gradient, a table of the same size made at its start beside the logits, is already
added and freed; the peak is that one (the profile: the output kernel's gradient and the
logits alive at it), so the two peaks differ by far less than a quarter of the table.
The test guards the peak's ratio to B alone's instead, and, from the same profile, that
no op made a table dense in the update (UnsortedSegmentSum, tf.convert_to_tensor of an
IndexedSlices): it fails on the code that made the rows dense.
"""

import concurrent.futures
import math

import keras
import pytest
import tensorflow as tf

from tests.helpers import assert_probe_trained_to
from tools import memory
from tools import models


def _minor(version):
    return tuple(int(part) for part in version.split(".")[:2])


# Six language-model probes, a minute or two each. The limit lies between peaks measured on
# requirements.txt's TensorFlow 2.21 and Keras 3.15: on the oldest supported (2.20, 3.12:
# make test-low) B alone's own warm-up runs out of memory under it.
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    _minor(tf.__version__) < (2, 21) or _minor(keras.__version__) < (3, 15),
    reason="the limit is set between peaks measured on TensorFlow 2.21 and Keras 3.15")]

MODEL, N, B = "lm", 8, 4
# Between the accumulating paths' peaks (about 360 MiB; B alone's 311) and the direct
# batch's of N*B sequences (438 MiB).
LIMIT_MB = 400
PATHS = ("accumulate", "window")
# accumulate's peak over B alone's, measured 1.16 (B alone + the sums, less the
# gradients B alone holds at its own peak, plus the output layer's gradient in flight).
RATIO = 1.2
TABLE_MB = models.VOCABULARIES[MODEL] * models.WIDTH * 4 / memory.MIB


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    base = tmp_path_factory.mktemp("memory_lm")
    specs = [("dense_direct", None), ("direct", LIMIT_MB), ("alone", LIMIT_MB)] + [
        (path, LIMIT_MB) for path in PATHS]

    def run(spec):
        path, limit = spec
        save = base / f"{path}-{limit}.npz"
        return memory.probe(MODEL, path, N, B, limit_mb=limit, save=save,
                            profile=path in PATHS), save

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return dict(zip(specs, pool.map(run, specs)))


def test_the_direct_batch_does_not_fit(probed):
    result, _ = probed[("direct", LIMIT_MB)]
    assert result.get("oom"), result
    reference, _ = probed[("dense_direct", None)]
    assert reference["peak_mb"] > LIMIT_MB, reference


@pytest.mark.parametrize("path", PATHS)
def test_the_accumulated_run_fits_and_trains_to_the_direct_batchs_weights(probed, path):
    _, reference = probed[("dense_direct", None)]
    assert_probe_trained_to(probed[(path, LIMIT_MB)], reference)


@pytest.mark.parametrize("path", PATHS)
def test_the_rows_are_never_made_dense_and_the_peak_stays_near_b_alone(probed, path):
    alone, _ = probed[("alone", LIMIT_MB)]
    result, _ = probed[(path, LIMIT_MB)]
    dense = result["largest_by_op"].get("UnsortedSegmentSum", 0.0)
    assert dense < TABLE_MB / 4, (dense, result["at_peak"])
    if (_minor(tf.__version__) > (2, 21)
            and result["peak_mb"] > RATIO * alone["peak_mb"]):
        pytest.xfail("tf-nightly 2.23 with keras-nightly 3.16 (make test-next): one run "
                     "392.9 MiB against B alone's 326.0, 1.205x, another under 1.2x; TF "
                     "2.21's 1.16x sets the bound (the rows still never dense)")
    assert result["peak_mb"] <= RATIO * alone["peak_mb"], (result, alone["peak_mb"])


@pytest.mark.xfail(
    _minor(tf.__version__) > (2, 21), strict=False,
    reason="tf-nightly 2.23 (make test-next): B=31 peaks at 508.6 MiB in a fresh process, "
    "but after the search's trials its fit under 600 MiB varies run to run (one search's "
    "trial of 31 ran out and it took 26; another's fit, and training at 31 then ran out "
    "and halved to 15): the allocator's layout after the trials is not TF 2.21's, which "
    "this pins; the halving is the designed answer to it")
def test_the_micro_batch_search_trains_at_the_b_it_found():
    """accumulate(micro_batch_size="auto") on the language model under 600 MiB, E=131
    sequences: at least 80% of the largest B that fits. The search's trial of 33 runs out
    of memory (the BFC allocator handed a logits-sized tensor, 129 MiB, a whole 240 MiB
    chunk), and it takes 31; a fresh process fits a fixed B of 31, not 32 or 33 (the
    bench's micro-batch section). Training then keeps 31: the discard after the trial
    that ran out wrote zeros into the sums' own buffers. Where it gave them fresh zeros,
    a 31 MiB sum moved into a 36 MiB chunk, 31 ran out of memory in that process, and
    training halved it to 15."""
    found = memory.probe(MODEL, "accumulate", 1, 131, limit_mb=600, micro_batch="auto")
    assert not found.get("error") and not found["oom"], found
    over = [size for size, peak in found["trials"] if peak is None]
    assert found["halved"] == [], found
    assert found["micro_batch_size"] >= 0.8 * min(over, default=131), found
    # And a fresh process runs out of memory at the B of which the one found is 80%.
    size = math.floor(found["micro_batch_size"] / 0.8) + 1
    beyond = memory.probe(MODEL, "accumulate", 1, 131, limit_mb=600, micro_batch=size)
    assert not beyond.get("error"), beyond
    assert beyond["oom"] or beyond["halved"] == [size], beyond
