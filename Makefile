PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: train test bench install install-test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-test: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

train: $(VENV)/.installed
	$(BIN)/python recipes/coco_swin.py

# Tests run in TEST_WORKERS processes (pytest-xdist; tests marked with one xdist_group share a worker);
# TEST_WORKERS=0 runs them in this one.
TEST_WORKERS ?= 2

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

# Side-by-side speed and memory against timm and torchvision (benchmarks/RESULTS.md), within a 9 min
# budget (cases that would not fit on a slow machine get fewer repeats or are left out, and are listed).
# BENCH_ARGS=--quick for a short run, BENCH_ARGS="--device cuda --budget 0" on a GPU.
bench: $(VENV)/.installed-test
	$(BIN)/python benchmarks/run.py --device cpu --budget 540 $(BENCH_ARGS)

clean:
	rm -rf $(VENV) *.egg-info
