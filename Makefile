# Two entry points for a newcomer: `make train` and `make test`. Both create the
# project-local virtual environment first. TORCH picks the torch build: the CPU
# wheel by default, so no CUDA packages are pulled by accident. Every other
# package comes at the tested version in constraints.txt; `make lock` re-resolves
# them from pyproject.toml's ranges, rewrites constraints.txt and re-runs the tests.
VENV ?= .venv
PYTHON ?= python3
TORCH ?= torch==2.13.0+cpu
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# Two workers, each free to run a multi-process test. Whole suite on 2 cores: 1,242-1,543 s with --dist load,
# 1,735-1,746 s with --dist loadgroup, 1,954 s with the multi-process tests one after another in one worker;
# three workers were slower still.
PYTEST_WORKERS ?= 2
LOCK_VENV := $(VENV)-lock

.PHONY: setup train test lock bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	echo "$(TORCH)" > $(VENV)/torch-constraint.txt
	$(PY) -m pip install --quiet -c $(VENV)/torch-constraint.txt -c constraints.txt -e ".[test,bench,loggers,data,fp8]"
	touch $@

train: setup
	$(VENV)/bin/merak-train $(ARGS)

test: setup
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist load $(PYTEST_ARGS)

lock:
	rm -rf $(LOCK_VENV)
	$(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(LOCK_VENV)/bin/python -m pip install --quiet "$(TORCH)"
	echo "$(TORCH)" > $(LOCK_VENV)/torch-constraint.txt
	$(LOCK_VENV)/bin/python -m pip install --quiet -c $(LOCK_VENV)/torch-constraint.txt -e ".[test,bench,loggers,data,fp8]"
	{ sed -n '/^#/p' constraints.txt; $(LOCK_VENV)/bin/python -m pip freeze --exclude-editable | grep -v '^torch=='; } > constraints.txt.new
	mv constraints.txt.new constraints.txt
	rm -rf $(LOCK_VENV)
	$(MAKE) test

clean:
	rm -rf $(VENV) $(LOCK_VENV) outputs multirun .pytest_cache
