"""The speed sections: time per update of every contender at the post's (N, B) and where it
goes, Keras used plainly, and fused against direct again on Eigen kernels (oneDNN off)."""

from experiment import averagers
from tools import bench_contenders as bc
from tools import bench_probe
from tools.bench_section import Section
from tools.bench_section import table
from tools.bench_section import worst

EDGES = ((5, 20), (20, 5))  # the post's largest and smallest B: tf2 against fused here
TF2_VS_FUSED = 1.15  # the tf2 window against tf1's fused, at EDGES
KERAS_FIT_CONFIG = (5, 20)  # fit with accumulate no slower than Keras's own here
KERAS = ("keras", "keras_long")  # Keras's accumulation, one call per update or per block
SMALL_B = 10  # where one pass leaves this CPU's cores idle (parallel_mini_batches)
CONTENDERS = {  # in words: the section's list and the figure's legend
    "direct": "one batch of N*B, the post's minimize",
    "stack": "the post's averager (numpy)",
    "running": "a numpy running sum",
    "graph": "the window in variables",
    "fused": "one compiled call per update",
    "optimizer": "AveragingOptimizer",
    "keras": "Keras's, steps_per_execution=N",
    "keras_long": "Keras's, steps_per_execution=N*U",
    "tf2": "--engine=tf2, a window per call",
    "keras_fit": "accumulate(model, N) + fit",
    "tf2_p2": "tf2 with --parallel-mini-batches=2 (two passes at once)",
    "keras_fit_p2": "keras_fit with parallel_mini_batches=2",
}
LABELS = ("direct", *averagers.AVERAGERS, *KERAS, "tf2", "keras_fit", "tf2_p2", "keras_fit_p2")

ABOUT = """\
Each update trains N*B = 100 samples of real MNIST (the post's ConvNet, dropout on, Adam \
1e-3): the engines through their `step` as `main.py`'s loop does, Keras on tf.data (its \
plain ways are below), all under op determinism, so no XLA. The targets compare the paths \
with one another only (docs/speed.md says why). {repeats} interleaved rounds of {updates} \
updates, timed as the floor section's; the ratio is the median of the per-round ratios to \
`direct`. At N=1 each tf1 averager is `direct`'s graph (their spread there is this run's \
noise), and Keras does not accumulate."""


def noise_floor(rows):
    """This run's noise: the averagers' largest |ratio to direct - 1| at N=1 (the same graph)."""
    return next((max(abs(r["vs_direct"][s]["ratio"] - 1) for s in averagers.AVERAGERS)
                 for r in rows if r["n"] == 1), None)


def cell(row, label):
    """A label's ms per update in a speed row, and its ratio to direct."""
    return f"{row['median_ms'][label]:.1f} ms, {row['vs_direct'][label]['ratio']:.2f}x"


def _ratios(rows, label, base):
    """{"at N=../B=..": paired ratio label / base} over rows."""
    return {f"at N={r['n']}/B={r['b']}": bc.paired_ratio(r["times"], label, base) for r in rows}


class Speed(Section):
    name, title = "speed", "Speed at the post's configurations: training time per update"
    FULL = dict(configs=((1, 100), (5, 20), (10, 10), (20, 5)), updates=20, repeats=5)
    QUICK = dict(configs=((5, 20),), updates=1, repeats=2)

    def steps(self):
        return len(self.settings["configs"])

    def measure(self, run):
        s, rows = self.settings, []
        for n, b in s["configs"]:
            run.log(f"Speed at N={n} x B={b} (direct: B={n * b})")
            row = bc.race_labels(dict(s, labels=LABELS, n=n, b=b), run.datasets, profiled=True)
            run.log("  " + "; ".join(f"{k}: {cell(row, k)}" for k in LABELS))
            rows.append(row)
            run.step()
        return rows

    def targets(self, rows):
        def at(n, b):
            return [r for r in rows if (r["n"], r["b"]) == (n, b)]

        accumulating = [r for r in rows if r["n"] > 1]
        out = [worst(f"{s} never slower than stack (N > 1)", _ratios(accumulating, s, "stack"),
                     1.0, noise=noise_floor(rows)) for s in ("running", "graph", "fused")]
        out += [worst(f"tf2 <= {TF2_VS_FUSED}x fused at N={n}/B={b}",
                      _ratios(at(n, b), "tf2", "fused"), TF2_VS_FUSED) for n, b in EDGES]
        n, b = KERAS_FIT_CONFIG
        out.append(worst(f"fit with accumulate <= Keras's gradient_accumulation_steps with "
                         f"steps_per_execution=N at N={n}/B={b}",
                         _ratios(at(n, b), "keras_fit", "keras"), 1.0))
        small = [r for r in accumulating if r["b"] <= SMALL_B]
        out += [worst(f"{label} with two passes at once faster than one at a time "
                      f"(B <= {SMALL_B})", _ratios(small, f"{label}_p2", label), 1.0,
                      noise=noise_floor(rows)) for label in ("tf2", "keras_fit")]
        return out

    def markdown(self, rows):
        def cells(r):
            keras = min(KERAS, key=lambda k: r["median_ms"][k])  # the faster
            return (f"{r['n']} x {r['b']}", *(cell(r, k) for k in LABELS),
                    f"{bc.paired_ratio(r['times'], keras, 'fused')['ratio']:.2f}x")

        lines = self.heading(ABOUT.format(**self.settings))
        lines += [f"- `{k}`: {CONTENDERS[k]}" for k in LABELS] + [""]
        lines += table(("N x B", *LABELS, "faster Keras / fused"), map(cells, rows))
        noise = noise_floor(rows)
        if noise is not None:
            lines += ["", f"This run's noise (the averagers at N=1 against `direct`): {noise:.0%}."
                      " A miss by less, or met in a quarter of the rounds, is \"within noise\"."]
        lines += ["", "## Profile: where one update's time goes", "",
                  "tf.profiler over one block per contender, after the timed rounds: kernel ms "
                  "per update by op class, summed over threads (so above the wall time)."]
        for r in rows:
            p = r["profiles"]
            classes = sorted({c for profile in p.values() for c in profile["kernel_ms"]})
            lines += ["", f"N={r['n']} x B={r['b']}:", ""] + table(("", *LABELS), [
                ("wall ms, timed rounds", *(f"{r['median_ms'][k]:.1f}" for k in LABELS)),
                ("wall ms, traced", *(f"{p[k]['wall_ms']:.1f}" for k in LABELS))] + [
                (c, *(f"{p[k]['kernel_ms'].get(c, 0):.2f}" for k in LABELS)) for c in classes])
        return lines


class KerasPlain(Section):
    name, title = "keras_plain", "Keras used plainly"
    FULL, QUICK = dict(n=5, b=20, updates=20, repeats=3), None

    def measure(self, run):
        s = self.settings
        contenders = [bc.keras_contender(label, s["n"], s["b"], run.datasets, per_call)
                      for label, per_call in (("train_on_batch", None),
                                              ("fit, steps_per_execution=1", 1),
                                              ("fit, steps_per_execution=N", s["n"]))]
        times, _, _ = bc.race(contenders, s["updates"], s["repeats"])
        ms = bc.clocked(times)["median_ms"]
        run.log("  " + ", ".join(f"{label}: {v:.1f} ms" for label, v in ms.items()))
        return ms

    def markdown(self, ms):
        return [f"## {self.title} (N={self.settings['n']} x B={self.settings['b']})", "",
                "Keras's accumulation, a call per mini-batch against one compiled call per "
                "update.", ""] + table(("how", "ms per update"),
                                       [(label, f"{v:.1f}") for label, v in ms.items()])


class Kernels(Section):
    name, title = "kernels", "The same on Eigen kernels (oneDNN off)"
    FULL, QUICK = Speed.FULL, Speed.QUICK

    def measure(self, run):
        """[{"onednn": the speed section's row, "eigen": the same race in a probe}]."""
        rows = []
        for row in [r for r in run.results.get("speed") or [] if (r["n"], r["b"]) in EDGES]:
            eigen = bench_probe.probe(bc.race_labels, dict(
                self.settings, labels=("direct", "fused"), n=row["n"], b=row["b"]),
                env={"TF_ENABLE_ONEDNN_OPTS": "0"})
            run.log(f"Fused against direct with oneDNN off, N={row['n']} x B={row['b']}: "
                    + (eigen.get("error") or f"{eigen['vs_direct']['fused']['ratio']:.2f}x"))
            rows.append(dict(onednn=row, eigen=eigen))
        return rows

    def markdown(self, rows):
        if not rows:
            return []
        body = []
        for r in rows:
            one, eigen = r["onednn"], r["eigen"]
            body.append((f"{one['n']} x {one['b']}", *([eigen["error"]] if "error" in eigen else [
                f"{x['median_ms'][k]:.1f} ms" for k in ("direct", "fused") for x in (one, eigen)]
                + [f"{x['vs_direct']['fused']['ratio']:.2f}x" for x in (one, eigen)])))
        return self.heading(
            "`direct` and `fused` again, interleaved as above, in a probe process with "
            "`TF_ENABLE_ONEDNN_OPTS=0` (`main.py` keeps oneDNN on): a gap that closes here "
            "is oneDNN's cost per kernel call.") + table(
            ("N x B", "direct, oneDNN", "direct, Eigen", "fused, oneDNN", "fused, Eigen",
             "fused / direct, oneDNN", "fused / direct, Eigen"), body)
