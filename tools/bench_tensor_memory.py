"""Tensor memory, the bench's memory headline: each path's peak (tools.memory's probes)
against B alone, the direct batch and Keras's accumulation, and its growth in N."""

from tools import memory
from tools import models
from tools.bench_section import Section
from tools.bench_section import Target
from tools.bench_section import status

ACCUMULATING = ("accumulate", "window", "mini_batch", "tf1")
FLAT_IN_N = 0.02  # N=32 within 2% of N=2 at the same B
# A model's own N x B: a language model's logits are large, so a mini-batch is a few sequences.
SHAPES = {"lm": (8, 4), "lm_128k": (8, 4)}
# lm_128k's paths (its direct batch is over memory.RESERVE_MB) and probes.
LM_128K_PATHS, LM_128K_REPEATS = ("alone", "keras", "accumulate", "window", "mini_batch"), 1
LM_REPEATS = 3  # the language model's probes take about twice the others' time


class TensorMemory(Section):
    name, title = "tensor_memory", "Tensor memory: peak of each path (BFC allocator)"
    # Five probes a figure: a peak falls in one of a few modes, and three varied run to run.
    FULL = dict(models=models.MODELS, paths=memory.PATHS + memory.TF1_REFERENCES, n=8, b=32,
                repeats=5, growth_model="convnet", growth_repeats=7,
                growth_ns=(2, 32), growth_paths=("accumulate", "window", "mini_batch"),
                jobs=2)
    QUICK = dict(models=("convnet",), paths=("alone", "direct", "accumulate"), n=4, b=16,
                 repeats=1, growth_model=None, growth_repeats=1, growth_ns=(), growth_paths=(),
                 jobs=2)

    def __init__(self, quick=False, gpu=False):
        super().__init__(quick)
        self.gpu = gpu  # the GPU's own allocator (make gpu-check), not the CPU's BFC

    def steps(self):
        return len(self.settings["models"]) + bool(self.settings["growth_model"])

    def measure(self, run):
        s = self.settings
        tables = {}
        for model in s["models"]:
            n, b = SHAPES.get(model, (s["n"], s["b"]))
            run.log(f"Tensor memory: {model}, N={n} x B={b}")
            paths = [p for p in s["paths"]
                     if not p.startswith("tf1") or model in models.TF1_MODELS]
            repeats = s["repeats"]
            if model == "lm_128k":
                paths, repeats = LM_128K_PATHS, LM_128K_REPEATS
            elif model in models.VOCABULARIES:
                repeats = min(repeats, LM_REPEATS)
            tables[model] = memory.table(model, n, b, paths, repeats=repeats,
                                         jobs=s["jobs"], gpu=self.gpu, log=run.log)
            self._profile_misses(tables[model], run)
            run.step()
        growth = None
        if s["growth_model"]:
            run.log(f"Tensor memory as N grows: {s['growth_model']}, B={s['b']}")
            growth = memory.growth({n: memory.table(
                s["growth_model"], n, s["b"], paths=s["growth_paths"],
                repeats=s["growth_repeats"],
                jobs=s["jobs"], gpu=self.gpu, log=run.log, held=max(s["growth_ns"]) * s["b"])
                for n in s["growth_ns"]})
            run.step()
        return dict(tables=tables, growth=growth)

    def _profile_misses(self, rows, run):
        """A profiled probe for each TF2 path at P=1 over its bound or Keras's, into its row."""
        peaks = {row["path"]: row["peak_mb"] for row in rows}
        keras = peaks.get("keras")
        for row in rows:
            if row["path"] not in memory.ONE_PASS_TF2 or row["peak_mb"] is None:
                continue
            over_keras = keras is not None and row["peak_mb"] > keras + max(
                memory.MARGIN * keras, memory.MARGIN_MIN_MB)
            if (row["to_bound"] or 0) <= 1 and not over_keras:
                continue
            result = memory.probe(row["model"], row["path"], row["n"], row["b"],
                                  gpu=self.gpu, profile=True)
            run.log(memory.probe_line(result))
            if result.get("at_peak"):
                row.update(at_peak=result["at_peak"], at_peak_mb=result["peak_mb"])

    def targets(self, result):
        out = []
        for model, rows in result["tables"].items():
            rows = {row["path"]: row for row in rows}
            paths = [p for p in ACCUMULATING if p in rows]
            bound = {p: rows[p]["to_bound"] for p in paths if rows[p]["to_bound"] is not None}
            out.append(_worst(f"{model}: every path within its bound (TF2 at P=1: B alone "
                              "+ largest variable + 5%; tf1: + accumulators too)", bound,
                              1.0, len(bound) < len(paths)))
            keras = rows.get("keras", {}).get("peak_mb")
            if keras is not None:
                slack = max(memory.MARGIN * keras, memory.MARGIN_MIN_MB)
                over = {p: rows[p]["peak_mb"] / keras for p in paths
                        if rows[p]["peak_mb"] is not None}
                out.append(_worst(f"{model}: every path at or under Keras's accumulation "
                                  f"(+{memory.MARGIN:.0%}, {memory.MARGIN_MIN_MB:.0f} MiB at "
                                  "least)", over, 1 + slack / keras, len(over) < len(paths)))
        if result["growth"]:
            grow = {row["path"]: row["growth"] for row in result["growth"]
                    if row["growth"] is not None}
            ns = self.settings["growth_ns"]
            out.append(_worst(f"peak flat in N: N={ns[-1]} within {FLAT_IN_N:.0%} of "
                              f"N={ns[0]}", grow, 1 + FLAT_IN_N,
                              len(grow) < len(result["growth"])))
        return out

    def markdown(self, result):
        s = self.settings
        lines = self.heading(
            "Peak bytes of live tensors during one update (after a warm-up update), "
            "read from TensorFlow's BFC allocator, which the CPU runs as a GPU does with "
            "`TF_CPU_ALLOCATOR_USE_BFC=true`, its memory taken as one region first as "
            "TensorFlow takes a GPU's; one inter-op thread, oneDNN off, each "
            "figure the median of fresh processes (tools/memory.py). Host RSS would hide "
            "it under TensorFlow's own floor. `alone` is plain fit at batch B over the "
            "same N*B samples, `direct` the direct batch of N*B, `keras` Keras 3's "
            "`gradient_accumulation_steps`, "
            "`accumulate` Keras fit, `window` and `mini_batch` the TF2 accumulators, "
            "`tf1` AveragingOptimizer, `tf1_alone` and `tf1_direct` the TF1 graph's "
            "own B alone and direct batch (plain Adam in a session); `accumulate_p2` "
            "and `window_p2` the same with two mini-batches' passes at once "
            "(`parallel_mini_batches=2`, faster at small B: the speed section), "
            "for the option's price: one more mini-batch's activations and "
            "gradients. `lm` is a decoder language model in plain Keras (a token "
            f"Embedding of V={models.VOCABULARIES['lm']:,} x {models.WIDTH}, "
            f"{models.BLOCKS} pre-norm blocks of causal MultiHeadAttention and a GELU "
            f"feed-forward of {models.FEED_FORWARD}, an untied Dense(V) output; "
            f"sequences of {models.SEQUENCE} tokens, Adam), at N x B = "
            f"{SHAPES['lm'][0]} x {SHAPES['lm'][1]}, {LM_REPEATS} probes a figure; "
            f"`lm_128k` the same at V={models.VOCABULARIES['lm_128k']:,}, for the "
            f"growth in V ({LM_128K_REPEATS} probe a figure). The TF2 paths at "
            "`parallel_mini_batches=1` are held to B alone + the largest variable + "
            "5%: their sums stand in for the gradient set B alone holds; where one "
            "misses, a profiled probe lists what is alive at its peak. On the language "
            "models that premise does not hold: Keras's Adam applies B alone's "
            "variables one after another and makes the table's rows dense for its own "
            "update only, so B alone's peak holds one table-sized gradient, one of "
            "Adam's temporaries and the logits' gradient, never its gradient set; the "
            "accumulating paths hold every sum, the table's kept dense (its rows differ "
            "from mini-batch to mini-batch), both at the backward pass's peak (the "
            "output layer's gradient and the logits' beside them) and at the apply's "
            "(Adam's two table-sized temporaries). What they hold over the bound is the "
            "second table's sum and the small ones, less the logits' gradient and the "
            "margin: only the "
            "embedding's sum kept as rows would remove it, which is not built.")
        for model, rows in result["tables"].items():
            lines += [f"### {model}", "", *memory.markdown(rows).splitlines(), ""]
        if result["growth"]:
            lines += [f"### As N grows ({s['growth_model']}, B={s['b']})", "",
                      "The same samples held on the device at every N and read a batch at "
                      f"a time, {s['growth_repeats']} probes at each N. Each N's figure is "
                      "the peak most of its probes landed on (within 1%): a process's peak "
                      "can land in one of a few modes, by where the allocator found room, "
                      "so a median or the lowest would compare draws of modes; what a path "
                      "held more as N grows would lift every mode. The held samples are "
                      "copied into the measured allocator: made from an array, they landed "
                      "there in some processes only (12 MiB: the modes 49 and 61 MiB that "
                      "this check saw before).", "",
                      *memory.growth_markdown(result["growth"]).splitlines()]
        return lines


def _worst(target, ratios, limit, failed):
    if not ratios:
        return Target(target, "not measured", "missed" if failed else "not measured")
    where = max(ratios, key=ratios.get)
    measured = f"worst {ratios[where]:.3f} ({where})"
    return Target(target, measured + ("; a probe failed" if failed else ""),
                  status(ratios[where] <= limit and not failed))
