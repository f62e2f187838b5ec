"""The micro-batch micro_batch_size="auto" finds for an effective batch E under a device limit,
against the largest that fits (bisection, a tools.memory probe per trial), and its search's
seconds against an epoch's."""

import math
import statistics

from tools import memory
from tools.bench_section import Section
from tools.bench_section import table
from tools.bench_section import worst

EPOCH = 60_000  # the bench's run: an epoch of MNIST's size, in the model's inputs
FOUND_SHARE, SEARCH_SHARE = 0.8, 0.1  # the targets: B found / largest, search / epoch
TOLERANCE = 0.02  # the bisection stops when the sizes either side are this close


class MicroBatchSearch(Section):
    name, title = "micro_batch", "The micro-batch found against the largest that fits"
    # (model, E, limits in MiB[, options]): E prime, so that no B divides it. Options: xla
    # (accumulate's probes compiled), search_repeats (the row's own: the lm's probes are slow).
    FULL = dict(runs=(("convnet", 257, (150, 250)), ("mlp", 4093, (700, 800)),
                      ("convnet", 257, (150,), {"xla": True}),
                      ("lm", 131, (600,), {"search_repeats": 1})),
                timed=2, search_repeats=3)
    QUICK = None  # minutes of probes: see test_bench for its targets and markdown

    def steps(self):
        return sum(len(limits) for _, _, limits, *_ in self.settings["runs"])

    def measure(self, run):
        rows = []
        for model, effective, limits, *options in self.settings["runs"]:
            options = dict(options[0]) if options else {}
            for limit in limits:
                rows.append(self._row(model, effective, limit, run.log, **options))
                run.step()
        return rows

    def _row(self, model, effective, limit, log, xla=False, search_repeats=None):
        """One row: the direct batch, the found B, the bisection up from it (the OOM edge need
        not be monotone in B). `xla` leaves the direct batch uncompiled: on the CPU an XLA
        step out of memory aborts the process."""
        def probe(path, micro_batch=None):
            direct = path == "direct"
            r = memory.probe(model, path, 1, effective, limit_mb=limit, micro_batch=micro_batch,
                             timed=0 if direct else self.settings["timed"],
                             **({"jit_compile": True} if xla and not direct else {}))
            r = dict(r, oom=r.get("oom") or bool(r.get("halved")))  # halved: OOM at its first B
            log(f"micro-batch: {_name(model, xla)}, E={effective} under {limit} MiB, {path} "
                f"B={micro_batch or effective}: " + (
                    r.get("error") or ("OOM" if r["oom"] else f"fits (peak "
                                       f"{r['peak_mb']:.1f} MiB, {r['update_ms']:.0f} ms)")))
            return r

        row = dict(model=model, effective=effective, limit_mb=limit, probes=0, error=None,
                   **({"xla": True} if xla else {}))
        direct = probe("direct")
        row["direct"] = "error" if direct.get("error") else "OOM" if direct["oom"] else "fits"
        searches = []
        for _ in range(search_repeats or self.settings["search_repeats"]):
            searches.append(self._search(probe))
            if isinstance(searches[-1], str):  # no more probes after a failure
                return dict(row, error=searches[-1])
        found, given, _ = searches[0]
        found_ms = (found if given["oom"] else given)["update_ms"]
        seconds = [s for *_, s in searches]
        row.update(found=b_found(found), given="OOM" if given["oom"] else "fits",
                   search_s=statistics.median(seconds), searches=seconds,
                   searched_b=[b_found(f) for f, *_ in searches],
                   search_trials=len(found["trials"]), found_ms=found_ms, largest_ms=found_ms,
                   epoch_s=math.ceil(EPOCH / effective) * found_ms / 1e3)
        return self._bisect(row, found, probe)

    def _search(self, probe):
        """(the search's probe, a fresh process's given its B, the seconds the search added) or
        an error."""
        found = probe("accumulate", "auto")
        if found.get("error") or "micro_batch_size" not in found:
            return found.get("error") or "OOM in the search"
        # Whether the found B fits without the search's history in the allocator, timed as
        # the bisection's trials are.
        given = probe("accumulate", b_found(found))
        if given.get("error"):
            return given["error"]
        if given["oom"]:  # nothing to subtract: the search's own seconds
            return found, given, found["search_s"]
        # Its process's first fit call less the given one's: both trace the same functions.
        return found, given, (found["warmup_ms"] - given["warmup_ms"]) / 1e3

    def _bisect(self, row, found, probe):
        """`row` with the largest B that fits, by bisection up from the found B, first trying
        the smallest size the search ran out of memory at (a fresh process likely does too)."""
        effective, lo = row["effective"], row["found"]
        # B = E holds the direct batch's activations and more: OOM where the direct batch is.
        hi = effective if row["direct"] == "OOM" else effective + 1
        ran_out = min((size for size, peak in found["trials"]
                       if peak is None and lo < size < hi), default=None)
        while hi - lo > max(1, TOLERANCE * lo):
            if hi > effective:
                size = effective
            elif ran_out and lo < ran_out < hi:
                size, ran_out = ran_out, None
            else:
                size = (lo + hi) // 2
            trial = probe("accumulate", size)
            row["probes"] += 1
            if trial.get("error"):
                return dict(row, error=trial["error"])
            if trial["oom"]:
                hi = size
            else:
                lo, row["largest_ms"] = size, trial["update_ms"]
        return dict(row, largest=lo, over=hi if hi <= effective else None)

    def targets(self, result):
        failed = any(row["error"] for row in result)
        done = [row for row in result if not row["error"]]
        return [
            worst(f"micro-batch found >= {FOUND_SHARE:.0%} of the largest that fits",
                  {_where(r): r["found"] / r["largest"] for r in done}, FOUND_SHARE,
                  at_least=True, failed=failed),
            worst(f"micro-batch search < {SEARCH_SHARE:.0%} of an epoch ({EPOCH:,} samples)",
                  {_where(r): r["search_s"] / r["epoch_s"] for r in done}, SEARCH_SHARE,
                  failed=failed)]

    def markdown(self, result):
        s = self.settings
        return self.heading(
            "Each update is one effective batch of E samples under a CPU device of the "
            "limit's size (tools/memory.py's probes, one process each). `B found`: what "
            "`accumulate(model, micro_batch_size=\"auto\")` finds, in brackets whether a "
            "fresh process given it fits; `search s`: the seconds the search added to "
            f"training, the median of {s['search_repeats']} searches (a row's own number "
            "where set), in brackets each search's, the first one's trials and each "
            "search's B where they differ; `largest B`: the largest that trains two updates "
            f"without an OOM, by bisection up from the found B to {TOLERANCE:.0%} of it; the "
            f"epoch: {EPOCH:,} samples at the found B's time per update (the fastest of "
            f"{s['timed'] + 1}). `(XLA)`: accumulate's probes compiled with "
            "`jit_compile=True`. How each is measured: "
            "[docs/limits.md](docs/limits.md#the-micro-batch-found).") + table(
            ["model", "E", "limit MiB", "direct batch", "B found (fresh)", "largest B",
             "found / largest", "search s (each; trials)", "epoch s",
             "search / epoch", "ms per update at found", "at largest", "found / largest"],
            [_cells(r) for r in result])


def _cells(r):
    """A row of the table: a failed row's error in place of what it did not measure."""
    cells = [_name(r["model"], r.get("xla")), r["effective"], r["limit_mb"], r["direct"]]
    if r["error"]:
        return cells + [r["error"]] + ["–"] * 8
    over = f" ({r['over']}: OOM)" if r["over"] else ""
    searches = ", ".join(f"{s:.1f}" for s in r["searches"]) + f"; {r['search_trials']}"
    if len(set(r["searched_b"])) > 1:
        searches += f"; B found {', '.join(map(str, r['searched_b']))}"
    return cells + [
        f"{r['found']} ({r['given']})", f"{r['largest']}{over}",
        f"{r['found'] / r['largest']:.2f}", f"{r['search_s']:.1f} ({searches})",
        f"{r['epoch_s']:.0f}", f"{r['search_s'] / r['epoch_s']:.3f}", f"{r['found_ms']:.0f}",
        f"{r['largest_ms']:.0f}", f"{r['found_ms'] / r['largest_ms']:.2f}"]


def b_found(found):
    """The B a search began training at (before any halving)."""
    return (found.get("halved") or [found["micro_batch_size"]])[0]


def _name(model, xla):
    return f"{model} (XLA)" if xla else model


def _where(row):
    return f"{_name(row['model'], row.get('xla'))} under {row['limit_mb']} MiB"
