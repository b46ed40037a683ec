# Two entry points for a fresh machine: `make demo` (train the demo MLLM) and `make test` (the test suite).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0

.PHONY: venv demo test bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VENV)/bin/plait train --config configs/demo.toml --overwrite  # a new demo run replaces runs/demo

test: venv
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) runs
