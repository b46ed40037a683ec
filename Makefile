# Two entry points for a fresh machine: `make demo` (train the demo MLLM) and `make test` (the test suite).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0

.PHONY: venv demo test bench clean demo-match tune-ranks bench-mars

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VENV)/bin/plait train --config configs/demo.toml --overwrite  # a new demo run replaces runs/demo

# The demo's fine-tuning task (digit_pair, LoRA from the trained demo; trains the demo first when it is missing),
# MARS's rank search on it, and MARS against a full 3x3 grid (bench/mars.py, about 400 CPU s on one core).
runs/demo/final/plait_config.json:
	$(MAKE) demo

demo-match: venv runs/demo/final/plait_config.json
	$(VENV)/bin/plait train --config configs/demo_match.toml --overwrite

tune-ranks: venv runs/demo/final/plait_config.json
	$(VENV)/bin/plait tune-ranks --config configs/demo_match.toml --ranks 2,8,32 --sizes 32,64,128 --batch 4 --val-samples 48

bench-mars: venv runs/demo/final/plait_config.json
	$(PY) bench/mars.py

test: venv
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) runs
