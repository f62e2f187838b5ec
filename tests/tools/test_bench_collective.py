"""tools/bench_collective.py: the collectives each update runs, counted on two workers."""

import pytest

from tools import bench_collective

# What two workers measured (quick settings: B=8, the convnet of 44,426 weights).
RECORDED = {
    "1": {"window": {"ms": [34.0, 20.4], "collectives": [
        {"name": "CollectiveReduceV2", "runs": 1, "bytes": 4},
        {"name": "CollectiveReduceV2_1", "runs": 1, "bytes": 4},
        {"name": "cond/then/_65/cond/adam/CollectiveReduceV2", "runs": 1, "bytes": 177704}]},
        "per mini-batch": {"ms": [10.1, 11.7], "collectives": [
            {"name": "adam_1/CollectiveReduceV2", "runs": 1, "bytes": 177704},
            {"name": "while/body/_1/while/CollectiveReduceV2", "runs": 1, "bytes": 177704}]}},
    "4": {"window": {"ms": [21.7, 23.0], "collectives": [
        {"name": "CollectiveReduceV2", "runs": 1, "bytes": 4},
        {"name": "CollectiveReduceV2_1", "runs": 1, "bytes": 4},
        {"name": "cond/then/_65/cond/adam_2/CollectiveReduceV2", "runs": 1, "bytes": 177704}]},
        "per mini-batch": {"ms": [20.7, 19.3], "collectives": [
            {"name": "adam_3/CollectiveReduceV2", "runs": 1, "bytes": 177704},
            {"name": "while/body/_1/while/CollectiveReduceV2", "runs": 4, "bytes": 177704}]}},
}


def test_the_gradients_exchange_is_told_from_the_counts_and_judged():
    rows = bench_collective.summarize(RECORDED)
    assert [(rows[(n, "window")]["exchanges"], rows[(n, "window")]["gradient_bytes"])
            for n in (1, 4)] == [(1, 177704), (1, 177704)]
    assert rows[(4, "per mini-batch")]["exchanges"] == 5  # 4 in the loop, Adam's
    assert [c["bytes"] for c in rows[(4, "window")]["small"]] == [4, 4]
    section = bench_collective.Collective(quick=True)
    result = {"rows": {f"{n} {path}": row for (n, path), row in rows.items()}}
    once, time_ = section.targets(result)
    assert once.status == "met" and once.measured == "1 exchange of 177704 bytes at N=1, 4"
    assert time_.status == "missed" and time_.measured == "worst 1.12x at N=4"
    table = section.markdown(result)
    assert "| 4 | per mini-batch | 5 | 888520 | none | 20.0 |  |" in table
    assert "| 4 | window | 1 | 177704 | CollectiveReduceV2 x1 (4 B), CollectiveReduceV2_1 x1 " \
           "(4 B) | 22.4 | 1.12x |" in table


def test_a_traced_name_is_found_in_the_graph_under_its_callers_prefix():
    sizes = {"CollectiveReduceV2": 4, "cond/adam/CollectiveReduceV2": 8}
    assert bench_collective.graph_name("cond/then/_65/cond/adam/CollectiveReduceV2",
                                        sizes) == "cond/adam/CollectiveReduceV2"
    assert bench_collective.graph_name("CollectiveReduceV2", sizes) == "CollectiveReduceV2"


@pytest.mark.slow
def test_two_workers_exchange_the_gradients_once_per_window_and_n_times_per_mini_batch():
    """The quick section on two real workers: the window step's gradients all-reduce runs
    once at N=1 and N=4, the per-mini-batch loop's N times (one op in the graph)."""
    probe = bench_collective.two_workers(dict(bench_collective.Collective.QUICK))
    assert "error" not in probe, probe
    rows = bench_collective.summarize({n: p for n, p in probe.items() if n != "seconds"})
    model_bytes = rows[(1, "window")]["gradient_bytes"]
    assert model_bytes > 100_000
    for n in (1, 4):
        assert rows[(n, "window")]["exchanges"] == 1
        assert rows[(n, "window")]["gradient_bytes"] == model_bytes
        assert rows[(n, "per mini-batch")]["exchanges"] == n + 1
        assert [c["runs"] for c in probe[str(n)]["per mini-batch"]["collectives"]
                if c["name"].startswith("while/")] == [n]
