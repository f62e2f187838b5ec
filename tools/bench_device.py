"""Peak device memory and speed on a GPU (without one, nothing measured): the post's ConvNet,
each engine's accumulation against its direct batch and B alone, a probe each."""

import functools
import subprocess

import tensorflow as tf

from experiment import averagers
from experiment import data
from tools import bench_contenders as bc
from tools.bench_probe import probe
from tools.bench_section import Section
from tools.bench_section import Target
from tools.bench_section import table
from tools.bench_section import worst
from tools.bench_speed import cell

GPU = "GPU:0"
MB = 1 << 20
# The targets: peak against B alone and direct; time against direct at B >= DEVICE_SPEED_MIN_B.
DEVICE_VS_ALONE, DEVICE_VS_DIRECT = 1.1, 0.3
DEVICE_SPEED, DEVICE_SPEED_MIN_B = 1.1, 32
LABELS = ("direct", *averagers.AVERAGERS, "tf2", "tf2_direct")  # the speed probe's
REFS = ("alone", "direct")  # what each memory probe is set against
NO_GPU = "no GPU: not measured here; `make gpu-check` measures it where there is one."


@functools.cache
def gpus():
    """[{name, device_name, compute_capability, driver, memory}] of the GPUs TensorFlow sees;
    driver and memory: nvidia-smi's ("?" where it does not answer)."""
    try:
        text = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        text = ""
    smi = [[cell.strip() for cell in line.split(",")] for line in text.splitlines()]
    out = []
    for i, gpu in enumerate(tf.config.list_physical_devices("GPU")):
        details = tf.config.experimental.get_device_details(gpu)
        driver, memory = smi[i][1:3] if i < len(smi) and len(smi[i]) == 3 else ("?", "?")
        capability = ".".join(map(str, details.get("compute_capability") or ())) or "?"
        out.append(dict(name=gpu.name, device_name=details.get("device_name", "?"),
                        compute_capability=capability, driver=driver, memory=memory))
    return out


def memory_probe(spec):
    """One peak-memory measurement on the device, in a probe process."""
    contender = bc.SessionContender("probe", spec["n"], spec["b"], data.load_mnist().train,
                                    spec["averager"])
    try:
        contender.train(1)  # untimed: tracing, autotuning, the allocator's first chunks
        tf.config.experimental.reset_memory_stats(GPU)
        before = tf.config.experimental.get_memory_info(GPU)["current"]
        contender.train(spec["updates"])
        peak = tf.config.experimental.get_memory_info(GPU)["peak"]
    finally:
        contender.close()
    return dict(spec, before_mb=before / MB, peak_mb=peak / MB, increment_mb=(peak - before) / MB)


def memory_specs(settings):
    """The memory probes: per engine, its direct batch and B alone, then N x B."""
    n, b = settings["n"], settings["b"]
    specs = []
    for engine, plain, names in (("tf1", "stack", averagers.AVERAGERS), ("tf2", "tf2", ("tf2",))):
        specs += [dict(role="direct", engine=engine, averager=plain, n=1, b=n * b),
                  dict(role="alone", engine=engine, averager=plain, n=1, b=b)]
        specs += [dict(role="accumulated", engine=engine, averager=a, n=n, b=b) for a in names]
    return [dict(spec, updates=settings["updates"]) for spec in specs]


def spec_line(p):
    """A probe in words: a speed probe's N x B, a memory probe's engine, run and N x B."""
    if "role" not in p:
        return f"speed at N={p['n']} x B={p['b']}"
    return f"{p['engine']} {p['averager'] if p['role'] == 'accumulated' else p['role']} " \
           f"N={p['n']} B={p['b']}"


def peak_over(p, memory, ref):
    """p's peak over that of its engine's `ref` probe (REFS), None where either has none."""
    base = next((q for q in memory if (q["engine"], q["role"]) == (p["engine"], ref)), {})
    return p["peak_mb"] / base["peak_mb"] if "peak_mb" in p and "peak_mb" in base else None


class Device(Section):
    name, title = "device", "Device memory and speed (GPU)"
    FULL = dict(n=8, b=256, updates=4, speed_configs=((8, 32), (8, 256)), speed_updates=20,
                repeats=7)
    QUICK = dict(n=2, b=32, updates=1, speed_configs=((2, 32),), speed_updates=2, repeats=2)

    def measure(self, run):
        found, s = gpus(), self.settings
        if not found:
            run.log("Device memory and speed: no GPU")
            return None

        def logged(p):
            run.log(f"  {spec_line(p)}: " + (p.get("error") or (
                f"peak {p['peak_mb']:.0f} MB (+{p['increment_mb']:.0f} MB in training)"
                if "peak_mb" in p else
                ", ".join(f"{k} {v:.1f} ms" for k, v in p["median_ms"].items()))))
            return p

        run.log(f"Device memory on {found[0]['device_name']}: N={s['n']} x B={s['b']}")
        memory = [logged(probe(memory_probe, spec)) for spec in memory_specs(s)]
        speed = [logged(probe(bc.race_labels, dict(labels=LABELS, n=n, b=b, repeats=s["repeats"],
                                                   updates=s["speed_updates"])))
                 for n, b in s["speed_configs"]]
        return dict(gpu=found, memory=memory, speed=speed)

    def targets(self, d):
        names = [f"accumulated device peak <= {DEVICE_VS_ALONE}x that of B alone",
                 f"accumulated device peak <= {DEVICE_VS_DIRECT:g} of the direct batch's",
                 f"fused <= {DEVICE_SPEED}x the direct batch's time on the device, "
                 f"B >= {DEVICE_SPEED_MIN_B}", f"tf2 <= {DEVICE_SPEED}x the tf2 direct "
                 f"batch's time on the device, B >= {DEVICE_SPEED_MIN_B}"]
        if d is None:
            return [Target(name, "no GPU", "not measured") for name in names]
        memory, speed = d["memory"], [r for r in d["speed"] if r["b"] >= DEVICE_SPEED_MIN_B]
        failed, slow = (any("error" in p for p in probes) for probes in (memory, speed))

        def peaks(ref):
            return {f"({p['engine']} {p['averager']})": peak_over(p, memory, ref) for p in memory
                    if p["role"] == "accumulated" and peak_over(p, memory, ref) is not None}

        def times(of):
            return {f"at N={r['n']}/B={r['b']}": of(r) for r in speed if "error" not in r}

        return [worst(names[0], peaks("alone"), DEVICE_VS_ALONE, failed=failed),
                worst(names[1], peaks("direct"), DEVICE_VS_DIRECT, failed=failed),
                worst(names[2], times(lambda r: r["vs_direct"]["fused"]), DEVICE_SPEED,
                      failed=slow),
                worst(names[3], times(lambda r: bc.paired_ratio(r["times"], "tf2", "tf2_direct")),
                      DEVICE_SPEED, failed=slow)]

    def markdown(self, d):
        if d is None:
            return [f"## {self.title}", "", NO_GPU]
        s = self.settings

        def memory_row(p):
            cells = [p["error"]] if "error" in p else [
                f"{p['peak_mb']:.1f}", f"{p['before_mb']:.1f}", f"{p['increment_mb']:.1f}"] + [
                "" if (r := peak_over(p, d["memory"], ref)) is None else f"{r:.2f}"
                for ref in REFS]
            run = {"alone": "B alone", "direct": "direct"}.get(p["role"], p["averager"])
            return (p["engine"], run, f"{p['n']} x {p['b']}", *cells)

        def speed_row(p):
            return (f"{p['n']} x {p['b']}", *([p["error"]] if "error" in p else [
                *(cell(p, k) for k in LABELS),
                f"{bc.paired_ratio(p['times'], 'tf2', 'tf2_direct')['ratio']:.2f}x"]))

        lines = self.heading(
            f"On {', '.join(g['device_name'] for g in d['gpu'])}: the peak of "
            f"`get_memory_info('{GPU}')` over {s['updates']} updates after an untimed one; "
            "\"before\": in use at the reset (weights, optimizer slots).") + table(
            ("engine", "run", "N x B", "peak MB", "before MB", "training adds MB",
             "peak / B alone", "peak / direct"), map(memory_row, d["memory"]))
        refused = [p for p in d["memory"] + d["speed"] if "determinism_error" in p]
        if refused:
            lines += ["", "Measured without op determinism (TensorFlow refused it): " + "; ".join(
                f"{spec_line(p)} ({p['determinism_error']})" for p in refused) + "."]
        return lines + [
            "", "### Speed on the device", "", f"ms per update, median of {s['repeats']} "
            f"interleaved rounds of {s['speed_updates']} updates, as the speed section; "
            "`tf2_direct`: the tf2 engine's own direct batch of N*B.", ""] + table(
            ("N x B", *LABELS, "tf2 / tf2_direct"), map(speed_row, d["speed"]))
