"""The speed of accumulation itself (docs/speed.md): each TF2 path's time per update against
its floor, N x (a step at B alone) - (N - 1) x (the apply alone), each round's from that
round's terms, in CPU time; and the language model's Embedding gradient added as rows."""

import collections
import functools
import os

from tools import bench_contenders as bc
from tools import models
from tools.bench_section import Section
from tools.bench_section import quartiles
from tools.bench_section import table
from tools.bench_section import worst

# Each on MNIST. build: () -> a fresh seeded model; limit: the most a TF2 path may take of
# the floor; mini_batches: per timed block (at least one update).
Workload = collections.namedtuple("Workload", "name build limit mini_batches repeats words")
WORKLOADS = (
    Workload("convnet", models.post_model("convnet"), 1.05, 64, 7,
             "the post's ConvNet (44,426 weights, dropout on)"),
    Workload("mlp", models.post_model("mlp"), 1.10, 4, 3,
             "the mlp (two dense layers of 4096, 20.0M weights, dropout on): adding its "
             "gradients into the sums each mini-batch is a real share of the work"),
)
LABELS = {  # what each contender is
    "alone": "Keras fit at B, steps_per_execution=N: N steps per update",
    "apply": "the optimizer's apply alone (Adam on constant gradients), N - 1 per update",
    "direct": "Keras fit on the direct batch of N*B",
    "keras": "Keras's Adam(gradient_accumulation_steps=N), fit, steps_per_execution=N",
    "window": "fit_accumulated: WindowAccumulator.fit, one call per window",
    "mini_batch": "MiniBatchAccumulator: a call per mini-batch, one to apply",
    "accumulate": "accumulate(model, N) + Keras fit",
    "rows": "accumulate(model, N) + Keras fit: the Embedding's gradient added as rows",
    "dense_rows": "the same with the Embedding's gradient made dense inside the model: "
                  "added dense, a pass over the table per mini-batch",
    "again": "a second `rows`: this run's noise",
}
REFERENCES = ("direct", "keras")
PATHS = ("window", "mini_batch", "accumulate")  # the TF2 paths the targets hold to
NOISE = "alone_again"  # a second `alone` at a workload's first (N, B): this run's noise
# Op classes of the profile: the first pattern that matches the op type names it.
OP_CLASSES = (("conv", r"Conv2D"), ("pool", r"MaxPool"), ("matmul", r"MatMul"),
              ("dropout RNG", r"Random"), ("finite check", r"^(IsFinite|All)$"),
              ("variable adds", r"^Assign(Add|Sub)VariableOp$"),
              ("variable assigns", r"^AssignVariableOp$"),
              ("elementwise", r"^(AddV2|Add|Sub|Mul|RealDiv|Sqrt|Rsqrt|Square|Neg|Maximum|"
                              r"Relu|ReluGrad|Cast|Select|SelectV2|Pow|Identity)$"))

# models.language_model: its Embedding's gradient arrives as rows, which the library sums as
# rows; `dense_rows` makes it dense inside the model (a pass over the table per mini-batch).
LM = ("rows", "dense_rows", "again")  # its contenders beside floor_terms()
LanguageModel = collections.namedtuple("LanguageModel", "name vocabulary n b repeats")
LANGUAGE_MODELS = (LanguageModel("lm", 32_000, 8, 4, 7),
                   LanguageModel("lm_128k", 128_000, 8, 4, 5))
LM_SAMPLES = 512  # the token sequences a language model's batches are cut from
LOAD = (f"`load`: the machine's load average (one minute) as its race ended, on "
        f"{os.cpu_count()} cores.")


def floor_terms(build, base, n, b, jit=False):
    """The floor's terms (alone, apply) and the direct batch on `base` (endless samples)."""
    return [bc.Fit("alone", build(), bc.batched(base, b), n, n, models.adam(), jit),
            bc.Apply("apply", build(), n, jit),
            bc.Fit("direct", build(), bc.batched(base, n * b), 1, 1, models.adam(), jit)]


def contenders(workload, n, b, base, noise=False, jit=False):
    """floor_terms(), keras and the paths, each on its own model; `noise`: one more alone."""
    from gradient_averaging.keras_fit import accumulate
    build, batches = workload.build, bc.batched(base, b)
    return [*floor_terms(build, base, n, b, jit),
            bc.Fit("keras", build(), batches, n, n, models.adam(gradient_accumulation_steps=n),
                   jit),
            bc.Window("window", build(), batches, n, jit),
            bc.MiniBatch("mini_batch", build(), batches, n, jit),
            bc.Fit("accumulate", accumulate(build(), n), batches, n, 1, models.adam(), jit),
            *([bc.Fit(NOISE, build(), batches, n, n, models.adam(), jit)] if noise else [])]


def missing(vs_floor, limit):
    """The paths over `limit` times the floor."""
    return [k for k in PATHS if vs_floor[k]["ratio"] > limit]


def with_floor(times, noise, **ratios):
    """bc.clocked(`times` and each round's floor, **ratios), with "noise": |the `noise`
    (label, base) ratio - 1|, None if not raced."""
    times = dict(times, floor=[a - p for a, p in zip(times["alone"], times["apply"])])
    return dict(bc.clocked(times, **ratios), noise=abs(bc.paired_ratio(times, *noise)["ratio"] - 1)
                if noise[0] in times else None)


# Each section's clock: with_floor() with its noise and ratios.
clock = functools.partial(with_floor, noise=(NOISE, "alone"),
                          vs_floor=((*REFERENCES, *PATHS), "floor"), vs_keras=(PATHS, "keras"))
lm_clock = functools.partial(with_floor, noise=("again", "rows"),
                             vs_floor=(("direct", "rows", "dense_rows"), "floor"),
                             vs_dense=(("rows",), "dense_rows"))


def summary(clock, cpu, wall=None, profiles=None, **about):
    """A row: `about`, profiles, "wall": clock(wall) (None: cpu's) and clock(cpu)'s keys, the
    judged ones (CPU time leaves out a loaded machine's other work)."""
    return dict(about, profiles=profiles or {}, wall=clock(cpu if wall is None else wall),
                **clock(cpu))


def race_row(contenders, clock, block, rounds, traced=(), **about):
    """bc.race's summary() by `clock` (`block`: updates per timed block), with "load": the
    load average as the race ended."""
    wall, cpu, profiles = bc.race(contenders, block, rounds, traced, OP_CLASSES)
    return summary(clock, cpu, wall, profiles, **about, load=os.getloadavg()[0])


def floor_race(workload, n, b, base, noise=False, profiled=(), jit=False):
    """One (N, B)'s row; the paths over the limit not in `profiled` (traced at an earlier
    N x B) are profiled after, with the floor's terms."""
    updates = max(1, workload.mini_batches // n)

    def traced(cpu):
        over = [k for k in missing(clock(cpu)["vs_floor"], workload.limit) if k not in profiled]
        return ("alone", "apply", *over) if over else ()

    return race_row(contenders(workload, n, b, base, noise, jit), clock, updates,
                    workload.repeats, traced, model=workload.name, n=n, b=b, updates=updates)


def xla_race(spec):
    """floor_race() all compiled, in a fresh process (op determinism turns Keras's XLA off)."""
    from experiment import data
    w = next(w for w in WORKLOADS if w.name == spec["workload"])._replace(
        mini_batches=spec["mini_batches"], repeats=spec["repeats"])
    return floor_race(w, spec["n"], spec["b"], bc.endless(tuple(data.load_mnist().train)),
                      noise=spec["noise"], profiled=PATHS, jit=True)


def noise_of(rows, model):
    """A workload's noise, alone against a second alone (None: not measured)."""
    return next((r["noise"] for r in rows if r["model"] == model and r["noise"] is not None),
                None)


def floor_profile(row):
    """{op class: kernel ms per update} of the floor: alone's less the N - 1 applies'."""
    alone, apply = row["profiles"]["alone"]["kernel_ms"], row["profiles"]["apply"]["kernel_ms"]
    return {c: alone.get(c, 0.0) - apply.get(c, 0.0) for c in {*alone, *apply}}


class Floor(Section):
    name, title = "floor", "Speed: each path against the floor"
    where = ""  # how the targets name the section's compilation
    base = None  # the samples, an endless dataset, made at each workload's first row
    compiled = "Under op determinism, as `main.py` runs, so no XLA (the next section has it)."
    FULL = dict(workloads=WORKLOADS, batches=(32, 128), ns=(4, 16))
    QUICK = dict(workloads=(WORKLOADS[0]._replace(mini_batches=8, repeats=2),),
                 batches=(32,), ns=(4,))

    def configs(self):
        s = self.settings
        return [(w, n, b) for w in s["workloads"] for b in s["batches"] for n in s["ns"]]

    def steps(self):
        return len(self.configs())

    def measure(self, run):
        rows = []
        for w, n, b in self.configs():
            run.log(f"{self.title}: {w.name} at N={n} x B={b}")
            row = self.race(run, w, n, b, [r for r in rows
                                           if r["model"] == w.name and "error" not in r])
            if "error" in row:
                run.log(f"  {row['error']}")
            else:
                run.log(f"  floor {row['median_ms']['floor']:.1f} CPU ms; " + ", ".join(
                    f"{k}: {row['median_ms'][k]:.1f} ms ({r['ratio']:.2f}x, wall "
                    f"{row['wall']['vs_floor'][k]['ratio']:.2f}x)"
                    for k, r in row["vs_floor"].items()) + self.logged(row))
            rows.append(row)
            run.step()
        return rows

    def logged(self, row):
        """What the log line of a row says after its ratios to the floor."""
        return ""

    def race(self, run, w, n, b, mine):
        """`w`'s row at N x B; at its first (`mine`: none), its samples made and noise raced."""
        if not mine:
            self.base = bc.endless(tuple(run.datasets.train))
        return floor_race(w, n, b, self.base, noise=not mine,
                          profiled={k for r in mine for k in r["profiles"]})

    def targets(self, rows):
        """Each workload's two targets; a failed probe (a row with an error) misses both."""
        out = []
        for w in self.settings["workloads"]:
            failed = any(r["model"] == w.name and "error" in r for r in rows)
            mine = [r for r in rows if r["model"] == w.name and "error" not in r]
            if not mine and not failed:
                continue
            for key, limit, words in (
                    ("vs_floor", w.limit, f"within {w.limit}x of the floor (N x B alone - "
                                          "(N - 1) x apply)"),
                    ("vs_keras", 1.0, "at or faster than Keras's gradient_accumulation_steps")):
                out.append(worst(f"{w.name}{self.where}: every TF2 path {words}",
                                 {f"{k} at N={r['n']}/B={r['b']}": r[key][k]
                                  for r in mine for k in PATHS},
                                 limit, noise=noise_of(mine, w.name), failed=failed))
        return out

    def markdown(self, rows):
        """Each workload's table and profiles; each failed probe in words, after."""
        failed, rows = [r for r in rows if "error" in r], [r for r in rows if "error" not in r]
        lines = self.heading(
            "Each path's time per update of N mini-batches of B against the floor `N x (one "
            "step at B alone) - (N - 1) x (the optimizer's apply alone)`, on real MNIST with "
            "Adam 1e-3, every contender on its own model, in interleaved rounds "
            "(docs/speed.md): each round's floor is that round's `alone` less its `apply`, "
            "each ratio the median of the per-round ratios (quartiles in brackets), in this "
            "process's CPU time, which the targets judge (the wall-clock's: the `wall` "
            "columns). " + self.compiled)
        lines += [f"- `{k}`: {LABELS[k]}" for k in ("alone", "apply", *REFERENCES, *PATHS)]
        for w in self.settings["workloads"]:
            mine = [r for r in rows if r["model"] == w.name]
            if not mine:
                continue
            noise = noise_of(rows, w.name)
            about = (f"{w.words[0].upper()}{w.words[1:]}; {w.repeats} rounds, blocks of "
                     f"{w.mini_batches} mini-batches (at least one update); CPU ms per update "
                     f"(median), the target: the paths within {w.limit}x. " + LOAD)
            if noise is not None:
                about += (f" This run's noise (`alone` against a second `alone`, "
                          f"N={mine[0]['n']} x B={mine[0]['b']}): {noise:.1%} in CPU time, "
                          f"{mine[0]['wall']['noise']:.1%} in wall-clock time.")
            lines += ["", f"### {w.name}", "", about, ""]
            lines += table(("N x B", "alone / N", "apply / (N - 1)", "floor",
                            *REFERENCES, *PATHS, *(f"{k} / keras" for k in PATHS),
                            *(f"{k}, wall" for k in PATHS), "load"), [
                (f"{r['n']} x {r['b']}",
                 f"{r['median_ms']['alone'] / r['n']:.1f} ms",
                 f"{r['median_ms']['apply'] / (r['n'] - 1):.2f} ms",
                 f"{r['median_ms']['floor']:.1f} ms",
                 *(f"{r['median_ms'][k]:.1f} ms, {quartiles(r['vs_floor'][k])}"
                   for k in (*REFERENCES, *PATHS)),
                 *(quartiles(r["vs_keras"][k]) for k in PATHS),
                 *(quartiles(r["wall"]["vs_floor"][k]) for k in PATHS),
                 f"{r['load']:.1f}" if "load" in r else "") for r in mine])
            lines += self._profiles(w, mine)
        return lines + [f"- {r['model']} at N={r['n']} x B={r['b']}: its probe failed: "
                        f"{r['error']}" for r in failed]

    def _profiles(self, workload, rows):
        """Where the time over the floor goes, at each (N, B) where a path missed."""
        lines = []
        for r in rows:
            if not r["profiles"]:
                continue
            p, floor = r["profiles"], floor_profile(r)
            over = [k for k in PATHS if k in p]
            cpu_floor = p["alone"].get("cpu_ms", 0) - p["apply"].get("cpu_ms", 0)
            classes = sorted({*floor, *(c for k in over for c in p[k]["kernel_ms"])})

            lines += ["", f"Where the time over the floor goes, {workload.name} at N={r['n']} "
                      f"x B={r['b']} (each path over {workload.limit}x, at the first N x B "
                      "where it was): tf.profiler over one block of each after the timed "
                      "rounds, ms per update; the floor's is alone's less apply's, each path's "
                      "its own less the floor's. `CPU ms`: the process's; below it the ops' "
                      "durations by class, summed over threads (docs/speed.md).", ""]
            # (what, the floor's, {path: its own}, digits); a path's cell: its own less the floor's
            cells = [("CPU ms, traced", cpu_floor, {k: p[k].get("cpu_ms", 0) for k in over}, 1),
                     ("in kernels", sum(floor.values()),
                      {k: sum(p[k]["kernel_ms"].values()) for k in over}, 1)] + [
                (c, floor.get(c, 0), {k: p[k]["kernel_ms"].get(c, 0) for k in over}, 2)
                for c in classes]
            lines += table(("", "floor", *(f"{k} over it" for k in over)), [
                (what, f"{base:.{d}f}", *(f"{own[k] - base:+.{d}f}" for k in over))
                for what, base, own, d in cells])
        return lines


class FloorXLA(Floor):
    """The floor section compiled by XLA, each N x B in a fresh process."""
    name, title = "floor_xla", "Speed under XLA: each path against the floor"
    where = " under XLA"
    compiled = ("Every contender compiled with XLA (`jit_compile=True`, Keras's default on a "
                "GPU; the accumulating paths compile each mini-batch's pass), each N x B in a "
                "fresh process without op determinism (under which Keras turns XLA off); no "
                "profile.")
    FULL = dict(Floor.FULL, ns=(4,))

    def race(self, run, w, n, b, mine):
        """The row raced by xla_race in a fresh process; where that failed, model, n, b, error."""
        from tools import bench_probe
        row = bench_probe.spawn(xla_race, dict(
            workload=w.name, mini_batches=w.mini_batches, repeats=w.repeats, n=n, b=b,
            noise=not mine))
        return dict(model=w.name, n=n, b=b, error=row["error"]) if "error" in row else row


class LanguageModelSpeed(Floor):
    """Timed as the floor section times its paths: each language model its (model, N, B)."""
    name = "lm_speed"
    title = "Speed: the language model's embedding added as rows, against made dense"
    FULL = dict(models=LANGUAGE_MODELS)
    QUICK = dict(models=(LanguageModel("lm", 1_000, 2, 2, 2),))

    def configs(self):
        return [(lm, lm.n, lm.b) for lm in self.settings["models"]]

    def race(self, run, lm, n, b, mine):
        """`lm`'s row: floor_terms() and accumulate + fit as rows, dense_rows and again, in
        rounds of one update."""
        from gradient_averaging.keras_fit import accumulate

        def build(dense_rows=False):
            import keras
            keras.utils.set_random_seed(models.SEED)
            return models.language_model(lm.vocabulary, dense_rows)

        base = bc.endless(models.tokens(lm.vocabulary, LM_SAMPLES))
        batches = bc.batched(base, b)
        contenders = floor_terms(build, base, n, b) + [
            bc.Fit(label, accumulate(build(dense_rows=label == "dense_rows"), n), batches, n, 1,
                   models.adam()) for label in LM]
        return race_row(contenders, lm_clock, 1, lm.repeats, model=lm.name,
                        vocabulary=lm.vocabulary, n=n, b=b, repeats=lm.repeats)

    def logged(self, row):
        return (f"; V={row['vocabulary']:,}: rows / dense_rows "
                f"{quartiles(row['vs_dense']['rows'])}, noise {row['noise']:.1%}")

    def targets(self, rows):
        return [worst(f"lm: accumulate + fit with rows at or under rows made dense "
                      f"(N={rows[0]['n']})",
                      {f"{r['model']} (V={r['vocabulary']:,})": r["vs_dense"]["rows"]
                       for r in rows}, 1.0, noise=max(r["noise"] for r in rows))] if rows else []

    def markdown(self, rows):
        if not rows:
            return []
        lines = self.heading(
            "What adding the Embedding's gradient as rows saves in time (docs/speed.md): the "
            "tensor-memory section's decoder on random sequences of 32 tokens, Adam 1e-3, per "
            "update of N mini-batches of B sequences, timed as the floor section's paths are, "
            "in rounds of one update each (CPU time; the wall-clock ratio beside); under op "
            "determinism, no XLA.")
        lines += [f"- `{k}`: {LABELS[k]}" for k in ("alone", "apply", "direct", *LM)]
        lines += [""] + table(
            ("model", "N x B", "alone / N", "apply / (N - 1)", "floor", "direct",
             "rows", "dense_rows", "rows / dense_rows", "rows / dense_rows, wall", "noise",
             "rows / floor", "dense_rows / floor", "load"),
            [(f"{r['model']} (V={r['vocabulary']:,})", f"{r['n']} x {r['b']}",
              f"{r['median_ms']['alone'] / r['n']:.1f} ms",
              f"{r['median_ms']['apply'] / (r['n'] - 1):.1f} ms",
              f"{r['median_ms']['floor']:.0f} ms",
              *(f"{r['median_ms'][k]:.0f} ms" for k in ("direct", "rows", "dense_rows")),
              quartiles(r["vs_dense"]["rows"]), quartiles(r["wall"]["vs_dense"]["rows"]),
              f"{r['noise']:.1%}", quartiles(r["vs_floor"]["rows"]),
              quartiles(r["vs_floor"]["dense_rows"]),
              f"{r['load']:.1f}" if "load" in r else "") for r in rows])
        rounds = ", ".join(str(r["repeats"]) for r in rows)
        return lines + ["", f"CPU ms per update (median); {rounds} rounds; `noise`: `again` "
                        "against `rows`, in CPU time. " + LOAD]
