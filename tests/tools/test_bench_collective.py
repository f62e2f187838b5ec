"""tools/bench_collective.py: the collectives each update runs, counted on two workers."""

import pytest

from tools import bench_collective

# What two workers measured (quick settings: B=8, the convnet of 44,426 weights).
RECORDED = {
    "1": {
        "accumulate + fit": {"ms": [13.5, 27.1], "collectives": [
            {"name": "Cast_2/CollectiveReduceV2", "runs": 1, "bytes": 4, "ms": 1.44},
            {"name": "CollectiveReduceV2", "runs": 1, "bytes": 4, "ms": 7.39},
            {"name": "CollectiveReduceV2_1", "runs": 1, "bytes": 4, "ms": 1.22},
            {"name": "cond/then/_52/cond/adam/CollectiveReduceV2",
             "runs": 1, "bytes": 177704, "ms": 9.61},
            {"name": "div_no_nan/CollectiveReduceV2", "runs": 1, "bytes": 4, "ms": 1.19},
        ]},
        "fit_accumulated": {"ms": [10.1, 14.0], "collectives": [
            {"name": "CollectiveReduceV2", "runs": 1, "bytes": 4, "ms": 7.94},
            {"name": "CollectiveReduceV2_1", "runs": 1, "bytes": 4, "ms": 1.03},
            {"name": "cond/then/_52/cond/adam_1/CollectiveReduceV2",
             "runs": 1, "bytes": 177704, "ms": 1.78},
        ]},
        "command line": {"ms": [11.9, 9.7], "collectives": [
            {"name": "CollectiveReduceV2", "runs": 1, "bytes": 4, "ms": 1.07},
            {"name": "CollectiveReduceV2_1", "runs": 1, "bytes": 4, "ms": 1.4},
            {"name": "cond/then/_65/cond/adam_2/CollectiveReduceV2",
             "runs": 1, "bytes": 177704, "ms": 1.62},
        ]},
        "per mini-batch": {"ms": [8.5, 10.0], "collectives": [
            {"name": "adam_3/CollectiveReduceV2", "runs": 1, "bytes": 177704, "ms": 1.83},
            {"name": "while/body/_1/while/CollectiveReduceV2",
             "runs": 1, "bytes": 177704, "ms": 2.06},
        ]},
    },
    "4": {
        "accumulate + fit": {"ms": [16.8, 19.8], "collectives": [
            {"name": "Cast_2/CollectiveReduceV2", "runs": 1, "bytes": 4, "ms": 0.97},
            {"name": "CollectiveReduceV2", "runs": 1, "bytes": 4, "ms": 1.66},
            {"name": "CollectiveReduceV2_1", "runs": 1, "bytes": 4, "ms": 1.19},
            {"name": "cond/then/_52/cond/adam_4/CollectiveReduceV2",
             "runs": 1, "bytes": 177704, "ms": 1.71},
            {"name": "div_no_nan/CollectiveReduceV2", "runs": 1, "bytes": 4, "ms": 0.39},
        ]},
        "fit_accumulated": {"ms": [17.0, 13.0], "collectives": [
            {"name": "CollectiveReduceV2", "runs": 1, "bytes": 4, "ms": 1.28},
            {"name": "CollectiveReduceV2_1", "runs": 1, "bytes": 4, "ms": 1.79},
            {"name": "cond/then/_52/cond/adam_5/CollectiveReduceV2",
             "runs": 1, "bytes": 177704, "ms": 2.01},
        ]},
        "command line": {"ms": [12.6, 15.1], "collectives": [
            {"name": "CollectiveReduceV2", "runs": 1, "bytes": 4, "ms": 0.99},
            {"name": "CollectiveReduceV2_1", "runs": 1, "bytes": 4, "ms": 1.9},
            {"name": "cond/then/_65/cond/adam_6/CollectiveReduceV2",
             "runs": 1, "bytes": 177704, "ms": 1.6},
        ]},
        "per mini-batch": {"ms": [19.9, 17.9], "collectives": [
            {"name": "adam_7/CollectiveReduceV2", "runs": 1, "bytes": 177704, "ms": 1.64},
            {"name": "while/body/_1/while/CollectiveReduceV2",
             "runs": 4, "bytes": 177704, "ms": 8.15},
        ]},
    },
}
LIBRARY = ("accumulate + fit", "fit_accumulated", "command line")


def test_the_gradients_exchange_is_told_from_the_counts_and_judged():
    rows = bench_collective.summarize(RECORDED)
    assert {(rows[(n, path)]["exchanges"], rows[(n, path)]["gradient_bytes"])
            for n in (1, 4) for path in LIBRARY} == {(1, 177704)}
    assert rows[(4, "per mini-batch")]["exchanges"] == 5  # 4 in the loop, Adam's
    assert [c["bytes"] for c in rows[(4, "command line")]["small"]] == [4, 4]
    # Keras's train function reads its loss across the replicas too: two more counts.
    assert [c["name"] for c in rows[(4, "accumulate + fit")]["small"]] == [
        "Cast_2/CollectiveReduceV2", "CollectiveReduceV2", "CollectiveReduceV2_1",
        "div_no_nan/CollectiveReduceV2"]
    section = bench_collective.Collective(quick=True)
    result = {"rows": rows}
    once, time_ = section.targets(result)
    assert once.status == "met"
    assert once.measured == "1 exchange of 177704 bytes on every path at N=1, 4"
    assert time_.status == "met" and time_.measured == "worst 0.98x (accumulate + fit at N=4)"
    table = section.markdown(result)
    assert "| 4 | `per mini-batch` | 5 | 888520 | none | 18.9 | 9.8 |  |" in table
    assert "| 4 | `command line` | 1 | 177704 | CollectiveReduceV2 x1 (4 B), " \
           "CollectiveReduceV2_1 x1 (4 B) | 13.8 | 4.5 | 0.74x |" in table
    assert [line.split(" | ")[1] for line in table if line.startswith("| 4 |")] == [
        "`accumulate + fit`", "`fit_accumulated`", "`command line`", "`per mini-batch`"]


def test_a_path_exchanging_the_gradients_twice_or_slower_misses_by_name():
    slow = dict(RECORDED["4"]["accumulate + fit"], ms=[40.0, 40.0])
    recorded = {"4": dict(RECORDED["4"], **{"fit_accumulated": RECORDED["4"]["per mini-batch"],
                                            "accumulate + fit": slow})}
    rows = bench_collective.summarize(recorded)
    once, time_ = bench_collective.Collective(quick=True).targets({"rows": rows})
    assert once.status == "missed" and once.measured == "fit_accumulated: 5 at N=4"
    assert time_.status == "missed" and time_.measured == "worst 2.12x (accumulate + fit at N=4)"


def test_a_traced_name_is_found_in_the_graph_under_its_callers_prefix():
    sizes = {"CollectiveReduceV2": 4, "cond/adam/CollectiveReduceV2": 8}
    assert bench_collective.graph_name("cond/then/_65/cond/adam/CollectiveReduceV2",
                                        sizes) == "cond/adam/CollectiveReduceV2"
    assert bench_collective.graph_name("CollectiveReduceV2", sizes) == "CollectiveReduceV2"


@pytest.mark.slow
def test_two_workers_exchange_the_gradients_once_per_update_on_every_path():
    """The quick section on two real workers: the gradients' all-reduce of accumulate +
    fit, fit_accumulated and the command line runs once at N=1 and N=4, the
    per-mini-batch loop's N times (one op in the graph)."""
    probe = bench_collective.two_workers(dict(bench_collective.Collective.QUICK))
    assert "error" not in probe, probe
    rows = bench_collective.summarize(probe)  # its "seconds" left out
    model_bytes = rows[(1, "command line")]["gradient_bytes"]
    assert model_bytes > 100_000
    for n in (1, 4):
        for path in LIBRARY:
            assert rows[(n, path)]["exchanges"] == 1, (n, path, probe[str(n)][path])
            assert rows[(n, path)]["gradient_bytes"] == model_bytes, (n, path)
        assert rows[(n, "per mini-batch")]["exchanges"] == n + 1
        assert [c["runs"] for c in probe[str(n)]["per mini-batch"]["collectives"]
                if c["name"].startswith("while/")] == [n]
