PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: train test install install-test clean

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

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) *.egg-info
