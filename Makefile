# Two entry points for a newcomer: `make train` and `make test`. Both create the
# project-local virtual environment first. TORCH picks the torch build: the CPU
# wheel by default, so no CUDA packages are pulled by accident.
VENV ?= .venv
PYTHON ?= python3
TORCH ?= torch==2.13.0+cpu
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup train test bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	echo "$(TORCH)" > $(VENV)/torch-constraint.txt
	$(PY) -m pip install --quiet -c $(VENV)/torch-constraint.txt -e ".[test,bench]"
	touch $@

train: setup
	$(VENV)/bin/merak-train $(ARGS)

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache
