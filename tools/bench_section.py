"""The bench's one contract: a section measures, judges its targets and writes its part.
A new section is a subclass and a line in bench.SECTIONS."""

import collections
import datetime
import glob
import os
import time

from experiment import results

Target = collections.namedtuple("Target", "target measured status")


class Section:
    name = title = ""
    FULL = QUICK = {}  # its settings; QUICK None: --quick leaves it out

    def __init__(self, quick=False):
        self.settings = self.QUICK if quick else self.FULL

    def steps(self):
        """The progress bar's steps in measure(), each reported by run.step()."""
        return 1

    def measure(self, run):
        """Its result, what the two below read."""
        raise NotImplementedError

    def targets(self, result):
        """[Target], met or missed."""
        return []

    def markdown(self, result):
        """Its lines of BENCHMARKS.md."""
        raise NotImplementedError

    def heading(self, *paragraphs):
        """Its part's opening lines: the title, then each paragraph, a blank line after each."""
        return [f"## {self.title}", ""] + [line for p in paragraphs for line in (p, "")]


class Run:
    """measure()'s argument: `datasets` (MNIST), `results` of earlier sections by name, `log`."""

    def __init__(self, datasets=None, log=print, advance=lambda n: None):
        self.datasets, self.log, self._advance = datasets, log, advance
        self.results, self._stepped = {}, 0

    def step(self):
        self._stepped += 1
        self._advance(1)

    def measure(self, sections):
        """Each section in turn; returns their targets, in order."""
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
    """A target judged on the worst of `ratios`, {where: a float or a paired ratio}, against
    `limit` (reached with `at_least`, else not exceeded); a paired miss by less than `noise`,
    or met in a quarter of the rounds, is "within noise"; `failed` (a probe): missed."""
    if not ratios:
        return Target(target, *(("probe failed", "missed") if failed else ("not measured",) * 2))
    paired = {k: v if isinstance(v, dict) else {"ratio": v} for k, v in ratios.items()}
    where = (min if at_least else max)(paired, key=lambda k: paired[k]["ratio"])
    r = paired[where]
    ok = (r["ratio"] >= limit if at_least else r["ratio"] <= limit) and not failed
    noisy = noise is not None and "q1" in r and (r["q1"] <= limit or r["ratio"] - limit <= noise)
    measured = quartiles(r) if "q1" in r else f"{r['ratio']:.2f}x"
    if len(ratios) > 1:
        measured = f"worst {measured} {where}"
    return Target(target, measured + ("; a probe failed" if failed else ""),
                  status(ok, noisy and not failed))


def quartiles(r):
    """A paired ratio in words: its median, its quartiles in brackets."""
    return f"{r['ratio']:.2f}x ({r['q1']:.2f}-{r['q3']:.2f})"


def table(header, rows):
    """A markdown table: the header's cells, then each row's."""
    return ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"] + [
        "| " + " | ".join(map(str, row)) + " |" for row in rows]


def header(title, command, elapsed):
    """A report's opening lines: its title, the command that wrote it, when, the machine."""
    when = datetime.datetime.now()
    return [f"# {title}", "", f"Written by `{command}` on {when:%Y-%m-%d %H:%M} in "
            f"{elapsed / 60:.1f} minutes.", "", f"Machine: {results.machine()}.", ""]


def targets_table(targets):
    return ["## Targets", ""] + table(Target._fields, targets)


def xplanes(logdir):
    """The planes (XPlane) of every tf.profiler trace under `logdir`."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    for path in glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True):
        with open(path, "rb") as f:
            yield from xplane_pb2.XSpace.FromString(f.read()).planes


def trace_events(logdir):
    """(line, name, ms) of every traced event under `logdir`; ops run on tf_Compute... lines,
    named "NAME:TYPE"."""
    for plane in xplanes(logdir):
        for line in plane.lines:
            for event in line.events:
                yield (line.name, plane.event_metadata[event.metadata_id].name,
                       event.duration_ps / 1e9)
