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
# Two workers. tests/conftest.py puts the multi-process tests in one xdist group, but under pytest 9.2 with
# xdist 3.8 the group is not honoured, so two of them may run at once.
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
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

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
