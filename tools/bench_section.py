"""The bench's one contract: a section measures, judges its targets and writes its part.

Adding a section to BENCHMARKS.md is a subclass and a line in bench.SECTIONS:

    class Mine(bench_section.Section):
        name, title = "mine", "What it measures"
        FULL, QUICK = dict(...), dict(...)  # its settings; QUICK None: --quick skips it

        def measure(self, run): ...         # -> its result, whatever the two below read
        def targets(self, result): ...      # -> [Target]; default none
        def markdown(self, result): ...     # -> its lines of BENCHMARKS.md

A measurement that needs a fresh process is a probe (bench_probe.py).
"""

import collections
import time

Target = collections.namedtuple("Target", "target measured status")


class Section:
    """One part of BENCHMARKS.md, measured in turn with the others by Run.measure."""

    name = title = ""
    FULL = QUICK = {}

    def __init__(self, quick=False):
        self.settings = self.QUICK if quick else self.FULL

    def steps(self):
        """The progress bar's steps in measure() (each reported by run.step())."""
        return 1

    def measure(self, run):
        raise NotImplementedError

    def targets(self, result):
        del result
        return []

    def markdown(self, result):
        raise NotImplementedError


class Run:
    """What a section's measure() is given: MNIST (`datasets`), the results of the sections
    measured before it by name (`results`), a `log` of one line and `step()` for the bar."""

    def __init__(self, datasets=None, log=print, advance=lambda n: None):
        self.datasets, self.log, self._advance = datasets, log, advance
        self.results, self._stepped = {}, 0

    def step(self):
        self._stepped += 1
        self._advance(1)

    def measure(self, sections):
        """Each section in turn; returns every section's targets, in order."""
        targets = []
        for section in sections:
            start, self._stepped = time.perf_counter(), 0
            result = self.results[section.name] = section.measure(self)
            self._advance(section.steps() - self._stepped)
            self.log(f"({section.title}: {time.perf_counter() - start:.0f} s)")
            targets += section.targets(result)
        return targets


def status(ok, noisy=False):
    return "met" if ok else ("within noise" if noisy else "missed")


def worst(target, ratios, limit, at_least=False, noise=None, failed=False):
    """A target on ratios: the worst of them against `limit`.

    Args:
      ratios: {where: ratio}: a float, or a paired ratio ({"ratio", "q1", "q3"}:
        bench_contenders.paired_ratio); `where` names it in the measured text.
      at_least: the ratio must reach `limit` (else: stay at or under it).
      noise: the run's noise floor: a miss by less, or whose quartile reaches the limit,
        is "within noise".
      failed: a probe it needs failed: missed whatever the others measured.
    """
    if not ratios:
        return Target(target, "probe failed" if failed else "not measured",
                      "missed" if failed else "not measured")
    value = lambda where: ratios[where]["ratio"] if isinstance(  # noqa: E731
        ratios[where], dict) else ratios[where]
    where = (min if at_least else max)(ratios, key=value)
    r = value(where)
    ok = (r >= limit if at_least else r <= limit) and not failed
    q = ratios[where] if isinstance(ratios[where], dict) else None
    noisy = noise is not None and q is not None and (q["q1"] <= limit or r - limit <= noise)
    measured = f"{r:.2f}x" + (f" ({q['q1']:.2f}-{q['q3']:.2f})" if q else "")
    if len(ratios) > 1:
        measured = f"worst {measured} {where}"
    return Target(target, measured + ("; a probe failed" if failed else ""),
                  status(ok, noisy and not failed))


def targets_table(targets):
    return (["## Targets", "", "| target | measured | status |", "|---|---|---|"]
            + [f"| {t.target} | {t.measured} | {t.status} |" for t in targets])
