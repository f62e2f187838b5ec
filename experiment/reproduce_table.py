"""The reproduced table beside the post's: the rows, their statistics, the verdict; pure
functions of the runs (no processes, no files), so checkable against hand-worked numbers."""

import collections
import datetime
import math

from experiment import results
from experiment import stats

# The post's table: (N, B, iterations) -> its mean and population std of the per-run best.
POST_TABLE = collections.OrderedDict([
    ((1, 100, 1000), (95.0, 0.172)),
    ((5, 20, 5000), (94.9, 0.325)),
    ((10, 10, 10000), (95.1, 0.36)),
    ((20, 5, 20000), (95.2, 0.303)),
])
POST_RUNS = 10
EVAL_EVERY = 100                # the post's cadence: every 100 iterations
FAIR_EVAL_EVERY_UPDATES = 100   # FAIR=1: every 100 updates, whatever N
LEVEL = 0.95
ALPHA = 0.05


Row = collections.namedtuple("Row", [
    "setting", "post", "n", "best", "best_ci", "final", "p_best", "p_final", "post_p",
    "updates", "evaluations", "seconds"])


def summarize(setting, runs, reference_runs, post, evaluation_count):
    """One row; `reference_runs`: the N=1 row's, the Welch tests' baseline; `post`: the post's
    (mean, population std) or None."""
    best = [r["best_accuracy"] for r in runs]
    final = [r["final_accuracy"] for r in runs]
    post_p = math.nan
    if post is not None:
        post_mean, post_std = post  # the post reports the population std (ddof=0)
        post_p = stats.welch_from_moments(
            stats.mean(best), stats.sample_variance(best), len(best), post_mean,
            post_std ** 2 * POST_RUNS / (POST_RUNS - 1), POST_RUNS).p
    return Row(
        setting=setting, post=post, n=len(runs),
        best=stats.mean_std(best), best_ci=stats.confidence_interval(best, LEVEL),
        final=stats.mean_std(final),
        p_best=stats.welch_t_test(best, [r["best_accuracy"] for r in reference_runs]).p,
        p_final=stats.welch_t_test(final, [r["final_accuracy"] for r in reference_runs]).p,
        post_p=post_p, updates=sorted({r["updates"] for r in runs}),
        evaluations=evaluation_count,
        seconds=stats.mean([r["train_seconds"] + r["eval_seconds"] for r in runs]))


def fmt_mean_std(mean_std, digits=2):
    mean, std = mean_std
    return f"{mean:.{digits}f} ± {std:.{digits + 1}f}"


def fmt_p(p):
    """A p-value as tables print it: 0.41, 0.012, < 0.001; n/a without a test."""
    if math.isnan(p):
        return "n/a"
    return "< 0.001" if p < 0.001 else f"{p:.2g}"


def fmt_interval(interval):
    low, high = interval
    return "n/a" if math.isnan(low) else f"[{low:.2f}, {high:.2f}]"


TABLE_HEADER = ("| N | B | iterations | updates | evaluations | post: best | ours: best "
                "| 95% CI of ours | p vs N=1 | ours: final | p vs N=1 (final) | s/run |")


def table_lines(rows):
    """The markdown table, one row per configuration, N first."""
    lines = [TABLE_HEADER, "|" + "---|" * TABLE_HEADER.count(" | ") + "---|"]
    for row in rows:
        s = row.setting
        reference = s.average_gradients == rows[0].setting.average_gradients
        post = f"{row.post[0]:.1f} ± {row.post[1]:g}" if row.post else "n/a"
        lines.append(" | ".join([
            f"| {s.average_gradients}", str(s.batch_size), str(s.iterations),
            "/".join(str(u) for u in row.updates), str(row.evaluations), post,
            fmt_mean_std(row.best), fmt_interval(row.best_ci),
            "(reference)" if reference else fmt_p(row.p_best), fmt_mean_std(row.final),
            "(reference)" if reference else fmt_p(row.p_final), f"{row.seconds:.0f} |"]))
    return lines


def _listing(rows):
    return ", ".join(f"N={r.setting.average_gradients}" for r in rows)


def verdict_lines(rows, fair, scale):
    """A short verdict generated from the numbers: the post, N=1, the protocol's bias."""
    lines = ["**Verdict** (generated from the numbers above)", ""]
    if scale > 1:
        lines.append(f"- SCALE={scale}: every run applied 1/{scale} of the post's updates. "
                     "This is a smoke test of the pipeline; its numbers say nothing about "
                     "the post.")
    if min(r.n for r in rows) < 2:
        lines.append("- Fewer than 2 runs per configuration: no spread, so no confidence "
                     "interval and no test. Use REPS=10 (the default) for a verdict.")
        return lines

    compared = [r for r in rows if r.post]
    if compared:
        lines.append("- Against the post: " + _post_verdict(compared, fair))
    others = rows[1:]
    for field in ("best", "final"):
        p_values = [getattr(r, "p_" + field) for r in others]
        differ = [(r, p) for r, p in zip(others, p_values) if p < ALPHA]
        if not differ:
            lines.append(f"- Averaging against one large batch ({field} accuracy): no N "
                         f"differs from N=1 at the 5% level (Welch p = "
                         + ", ".join(fmt_p(p) for p in p_values) + ").")
            continue
        lines.append(
            f"- Averaging against one large batch ({field} accuracy): "
            + "; ".join(f"N={r.setting.average_gradients} differs from N=1 (p = {fmt_p(p)}, "
                        f"{getattr(r, field)[0] - getattr(rows[0], field)[0]:+.2f} points)"
                        for r, p in differ)
            + ("; the others do not" if len(differ) < len(others) else "")
            + " (5% level).")
    lines.append(f"  With {rows[0].n} runs per configuration, p > 0.05 means that no "
                 "difference was detected, not that none exists.")

    lines.append("- The best accuracy is picked on the test set itself, so it is optimistic"
                 + (" (here every N is evaluated as often)." if fair else
                    ", and favours configurations evaluated more often (the evaluations "
                    "column); the final accuracy has neither bias (`make reproduce FAIR=1`)."))
    return lines


def _post_verdict(rows, fair):
    """Do our rows match the post's: its mean inside our CI, and Welch on its summary."""
    inside, outside = [], []
    for r in rows:
        (inside if r.best_ci[0] <= r.post[0] <= r.best_ci[1] else outside).append(r)
    if not outside:
        text = ("every configuration matches: the post's mean lies inside our 95% "
                f"confidence interval for {_listing(inside)}.")
    else:
        details = "; ".join(
            f"N={r.setting.average_gradients}: ours {r.best[0]:.2f} "
            f"({'above' if r.best[0] > r.post[0] else 'below'} the post's {r.post[0]:.1f})"
            for r in outside)
        text = (f"{len(inside)} of {len(rows)} configurations match (the post's mean lies "
                "inside our 95% confidence interval"
                + (f" for {_listing(inside)}" if inside else "") + f"); {details}.")
    differ = [r for r in rows if r.post_p < ALPHA]
    text += (" Welch's test against the post's own mean and std (10 runs; it allows for "
             "the post's noise as well as ours) finds "
             + (f"a difference at the 5% level for {_listing(differ)}."
                if differ else "no difference at the 5% level for any N."))
    if fair:
        text += " (The post evaluated every 100 iterations, not on this table's cadence.)"
    return text


def figure_lines(drawn, notes, scale):
    """table.md's figures section: an image link per figure drawn, then the notes."""
    if not drawn and not notes:
        return []
    lines = ["", "## Figures", ""] + [f"![{name}]({name})" for name in drawn]
    if drawn and scale > 1:
        lines += ["", f"SCALE={scale}: the post's numbers are not drawn (its runs were not "
                  "scaled down)."]
    if drawn and notes:
        lines.append("")  # the notes apart from the figures
    return lines + [f"- {note}" for note in notes]


def table_document(rows, fair, scale, command, timing, drawn=(), notes=()):
    """table.md: what made it, the table, its columns, the verdict, the figures."""
    protocol = (f"every configuration evaluated every {FAIR_EVAL_EVERY_UPDATES} updates"
                if fair else f"the post's protocol, evaluated every {EVAL_EVERY} iterations")
    lines = [f"# The post's table, reproduced ({protocol})", "",
             f"Made by `{command}` on {datetime.date.today().isoformat()}, {results.machine()}.",
             timing, ""]
    lines += table_lines(rows)
    lines += ["", "Accuracies in percent on the 10,000 test images, mean ± population std over "
              "the runs (the post's convention); *best*: the best of a run's evaluations, "
              "*final*: after the last update. docs/reproducing.md explains every column.", ""]
    lines += verdict_lines(rows, fair, scale)
    lines += figure_lines(drawn, notes, scale)
    return "\n".join(lines) + "\n"
