"""examples/: every file runs to the end, in a fresh temporary directory, and writes nothing
into the repository; the README snippets that stand for an example are that example.

How they run, for speed: in this process with runpy, by default. The test process has
imported TensorFlow already (conftest.py), so an example then costs only its own work (a
graph-mode TF1 example: well under a second), where a process of its own pays ~5 s of
TensorFlow import first. An example that changes the process for good (TF1 behaviour
switched on, devices or threads configured, a global Keras policy or seed, tf.keras made
Keras 2 by TF_USE_LEGACY_KERAS) or that parses absl flags of its own (they would clash with
main.py's, defined in this process) would spoil the tests after it, so it gets a process of
its own: PROCESS_WIDE lists what sends it there.
"""

import glob
import os
import re
import runpy
import shlex
import subprocess
import sys

import pytest

from tests.helpers import ROOT
from tests.helpers import run_cli

EXAMPLES = sorted(glob.glob(os.path.join(ROOT, "examples", "*.py")))
# Calls whose effect outlives the example, or absl flags of its own: a process of its own.
PROCESS_WIDE = ("disable_v2_behavior", "disable_eager_execution", "enable_v2_behavior",
                "tf.config.", "set_global_policy", "set_floatx", "set_random_seed",
                "set_seed", "app.run(", "flags.DEFINE", "TF_CONFIG", "TF_USE_LEGACY_KERAS",
                "TF_CPU_ALLOCATOR_USE_BFC")
TIMEOUT = 300  # seconds for an example in a process of its own


def source(path):
    with open(path) as f:
        return f.read()


def runs_alone(path):
    return any(call in source(path) for call in PROCESS_WIDE)


def repository_files():
    """The repository's top level and examples/: where an example must not write."""
    return set(os.listdir(ROOT)) | {os.path.join("examples", name) for name in
                                    os.listdir(os.path.join(ROOT, "examples"))}

SEARCHES = {"keras_effective_batch.py"}


def _marked(path):
    """An example that starts tf-keras (legacy Keras) in a process of its own, or searches
    for its micro-batch (SEARCHES), is slow."""
    slow = "TF_USE_LEGACY_KERAS" in source(path) or os.path.basename(path) in SEARCHES
    return pytest.param(path, id=os.path.basename(path), marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("path", [_marked(p) for p in EXAMPLES])
def test_example_runs_in_a_fresh_directory(path, tmp_path, monkeypatch):
    before = repository_files()
    if runs_alone(path):
        proc = subprocess.run(
            [sys.executable, path], cwd=tmp_path, capture_output=True, text=True,
            timeout=TIMEOUT,
            env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                [ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)))
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    else:
        monkeypatch.chdir(tmp_path)
        monkeypatch.setattr(sys, "argv", [path])
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as e:  # an example may end with sys.exit(main())
            assert e.code in (None, 0), f"{path} exited with {e.code}"
    assert repository_files() == before, "the example wrote into the repository"


# README's snippets, one per kind of user: each the body of its example, verbatim.
README_EXAMPLES = ("keras_quickstart.py", "tf2_quickstart.py", "tf1_quickstart.py")


def test_there_are_examples_and_readme_links_each_of_mine():
    names = {os.path.basename(p) for p in EXAMPLES}
    assert {"gradient_averager.py", *README_EXAMPLES} <= names
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    for name in ("gradient_averager.py", *README_EXAMPLES):
        assert f"(examples/{name})" in text, name


def python_blocks(markdown_path):
    with open(markdown_path) as f:
        return re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)


def example_body(name):
    """An example's code after its module docstring, as README shows it."""
    with open(os.path.join(ROOT, "examples", name)) as f:
        source = f.read()
    return source.split('"""\n', 1)[1].strip() + "\n"


def test_readmes_snippets_are_their_examples_verbatim():
    """README's python blocks are its examples' bodies, in order, and nothing else; the
    examples themselves run in test_example_runs_in_a_fresh_directory."""
    assert python_blocks(os.path.join(ROOT, "README.md")) == [
        example_body(name) for name in README_EXAMPLES]


def outside_the_checkout(tmp_path):
    """The environment of a process started in `tmp_path` with no PYTHONPATH: only what
    the venv has installed imports there."""
    assert not str(tmp_path).startswith(ROOT)
    return {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}


def test_the_venv_imports_the_checkouts_package_from_any_folder(tmp_path):
    """make install puts the package into .venv, editable: from another folder `import
    gradient_averaging` is this checkout's code, and nothing else of the checkout imports."""
    done = subprocess.run(
        [sys.executable, "-c", "import gradient_averaging\nprint(gradient_averaging.__file__)\n"
         "import importlib.util\nprint(importlib.util.find_spec('main'))"],
        cwd=tmp_path, env=outside_the_checkout(tmp_path), capture_output=True, text=True,
        timeout=60)
    assert done.returncode == 0, done.stderr[-2000:] + "\n(make install installs the package)"
    assert done.stdout.split() == [os.path.join(ROOT, "gradient_averaging", "__init__.py"),
                                   "None"]


@pytest.mark.slow
@pytest.mark.parametrize("name", README_EXAMPLES)
def test_readmes_python_blocks_run_from_a_folder_outside_the_checkout(name, tmp_path):
    """Each of README's python blocks, as README shows it, run by the venv's python in a
    fresh process from a temporary folder, without PYTHONPATH."""
    (block,) = [b for b in python_blocks(os.path.join(ROOT, "README.md"))
                if b == example_body(name)]
    (tmp_path / name).write_text(block)
    done = subprocess.run([sys.executable, name], cwd=tmp_path, capture_output=True,
                          text=True, timeout=TIMEOUT, env=outside_the_checkout(tmp_path))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


def test_the_mechanism_snippet_is_its_example_verbatim():
    (snippet,) = [block for block in python_blocks(os.path.join(ROOT, "docs", "averagers.md"))
                  if "trainer.GradientAverager(" in block]
    assert snippet == example_body("gradient_averager.py")


def documented_flag_errors():
    """docs/bad-input.md's rows whose input is flags alone and whose line is the parser's
    (`error: flag ...`, `error: flags ...`, `error: Unknown command line flag ...`)."""
    with open(os.path.join(ROOT, "docs", "bad-input.md")) as f:
        rows = re.findall(r"^\| `([^`]*)` \| `(error: [^`]*)` \(exit 2\) \|$", f.read(), re.M)
    return [(args.split(), message.replace("\\|", "|")) for args, message in rows
            if all(re.fullmatch(r"--[a-z-]+=\S+", arg) for arg in args.split())
            and message.startswith(("error: flag ", "error: flags ",
                                    "error: Unknown command line flag"))]


def test_bad_input_doc_shows_the_parsers_real_lines(capsys):
    """Each flags-only row of docs/bad-input.md, parsed in this process: the line it prints
    is the one the table shows, and it exits 2."""
    from absl.testing import flagsaver

    import flags  # noqa: F401  (defines main.py's flags in this process)
    from experiment import cli  # main.py's parser

    cases = documented_flag_errors()
    assert len(cases) >= 20 and any("--accumulate=magic" in args for args, _ in cases)
    for args, message in cases:
        with flagsaver.flagsaver(), pytest.raises(SystemExit) as exit_info:
            cli.parse_flags(["main.py", *args])
        assert exit_info.value.code == 2, args
        assert capsys.readouterr().err.strip() == message, args


def test_the_command_lines_flag_table_has_every_flag_once_with_its_default():
    """docs/command-line.md's table: a row per setting of experiment/config.py, no other."""
    from experiment import config

    with open(os.path.join(ROOT, "docs", "command-line.md")) as f:
        rows = re.findall(r"^\| `--([a-z-]+)` \| ([^|]+) \|", f.read(), flags=re.M)
    assert sorted(name for name, _ in rows) == sorted(config.SETTINGS)
    for name, default in rows:
        value = config.SETTINGS[name].default
        if isinstance(value, int) and not isinstance(value, bool):
            assert default.strip() == str(value), name


def test_docs_links_reach_their_files_and_headings():
    """Every relative link of README.md and docs/ names a file that exists and, with a
    #fragment, a heading of that file (as GitHub makes its anchors)."""
    def anchors(path):
        with open(path) as f:
            headings = re.findall(r"^#+ (.*)$", f.read(), flags=re.M)
        return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}

    pages = [os.path.join(ROOT, "README.md")] + glob.glob(os.path.join(ROOT, "docs", "*.md"))
    checked = 0
    for page in pages:
        with open(page) as f:
            links = re.findall(r"\]\(([^)\s]+)\)", f.read())
        for link in links:
            if link.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, fragment = link.partition("#")
            target = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            assert os.path.exists(target), (page, link)
            if fragment and target.endswith(".md"):
                assert fragment in anchors(target), (page, link)
            checked += 1
    assert checked > 100


def test_tf2_engine_docs_fit_accumulated_block_runs_and_prints_what_it_says(
        tmp_path, monkeypatch, capsys):
    """docs/tf2-engine.md's own-model block, run as shown: its closing comment is its output."""
    (block,) = [b for b in python_blocks(os.path.join(ROOT, "docs", "tf2-engine.md"))
                if "fit_accumulated(" in b]
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(ROOT)
    exec(compile(block, "docs/tf2-engine.md", "exec"), {"__name__": "__main__"})
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    assert printed == block.rstrip().splitlines()[-1].split("# ", 1)[1]


def test_docs_excerpts_are_lines_of_the_examples_they_link():
    """The snippets that stand for an example (docs/tf1-code.md's "excerpt" blocks, fenced
    `py`) are that file's lines, in order."""
    def blocks(path, fence, keep=lambda block: True):
        """(block, the last examples/*.py linked before it) for each kept block."""
        with open(os.path.join(ROOT, path)) as f:
            text = f.read()
        return [(m.group(1), re.findall(r"\((?:\.\./)?(examples/\w+\.py)\)",
                                        text[:m.start()])[-1])
                for m in re.finditer(rf"```{fence}\n(.*?)```", text, flags=re.S)
                if keep(m.group(1))]

    excerpts = blocks("docs/tf1-code.md", "py")
    assert len(excerpts) >= 3

    def code(line):
        return line.split("  # ")[0].strip()  # comments aside

    for block, example in excerpts:
        with open(os.path.join(ROOT, example)) as f:
            lines = [code(line) for line in f]
        position = 0
        for line in (code(line) for line in block.splitlines()):
            if line and line != "...":
                assert line in lines[position:], (example, line)
                position = lines.index(line, position) + 1


def readme_commands():
    """README's main.py command lines: (the environment they set, main.py's arguments)."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    blocks = re.findall(r"```sh\n(.*?)```", text, flags=re.S)
    lines = [line for block in blocks
             for line in block.replace("\\\n", " ").splitlines() if "main.py" in line]
    lines += re.findall(r"`(main\.py [^`]*)`", text)  # the table's
    commands = []
    for line in lines:
        words = shlex.split(line.split("#")[0])
        at = next(i for i, word in enumerate(words) if word.endswith("main.py"))
        env = dict(word.split("=", 1) for word in words[:max(at - 1, 0)])
        if (env, words[at + 1:]) not in commands:
            commands.append((env, words[at + 1:]))
    return commands


def test_readmes_command_lines_parse(capsys):
    """Each of README's command lines passes main.py's flag checks as written."""
    from absl.testing import flagsaver

    import flags  # noqa: F401  (defines main.py's flags in this process)
    from experiment import cli

    commands = readme_commands()
    assert len(commands) >= 5
    for _, args in commands:
        with flagsaver.flagsaver():
            cli.parse_flags(["main.py", *args])


@pytest.mark.slow
@pytest.mark.parametrize("env, args", readme_commands())
def test_readmes_command_lines_train(env, args):
    """Each of README's command lines trains, shortened to one run of a few mini-batches
    (later flags win)."""
    proc = run_cli(*args, "--reps=1", "--iterations=6", "--eval-every=0", env=env,
                   timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Training finished." in proc.stdout
