# Two entry points for a fresh machine (see README.md):
#   make bench   set up .venv (NVIDIA/CPU stack) and run the benchmark sweep on the embedded default
#   make test    set up .venv (plus optimum-habana and pytest) and run the test suite, offline, on CPU; then set up
#                .venv-current (today's transformers line) and run the CUDA script's end-to-end tests again there
VENV ?= .venv
VENV_CURRENT ?= .venv-current
PYTHON ?= python3
PY := $(VENV)/bin/python
PY_CURRENT := $(VENV_CURRENT)/bin/python
# pip installs only uv (requirements-uv.txt); uv fills both venvs from its cache (~/.cache/uv, or UV_CACHE_DIR) by hard
# links, so torch's CUDA build is downloaded and unpacked once for the two routes. A mirror: UV_INDEX_URL (uv does not
# read pip's configuration). A module's bytecode is compiled at its first import (uv's default): a run imports ~4,000 of
# the venvs' ~29,000 modules, and compiling them all at install took 67 of the installs' 111 s. The recipes' Pythons
# may write it: where PYTHONDONTWRITEBYTECODE is set, every process would compile torch and transformers again.
unexport PYTHONDONTWRITEBYTECODE
UV_INSTALL := $(VENV)/bin/uv pip install
BENCH_ARGS ?=

.PHONY: bench test format coverage mutate fixtures cuda-script check-cuda-script not-in-habana-container

$(VENV)/.installed-cuda: requirements.txt requirements-cuda.txt requirements-uv.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements-uv.txt
	$(UV_INSTALL) --python $(PY) -r requirements-cuda.txt
	$(UV_INSTALL) --python $(PY) --no-deps -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed-cuda requirements-test.txt requirements-gaudi.txt
	$(UV_INSTALL) --python $(PY) -r requirements-test.txt
	touch $@

# The current install route (README): today's transformers, accelerate and datasets, in a venv of its own (made by
# uv, with pip: 0.5 s where `python -m venv` takes 4.6 s installing pip).
$(VENV_CURRENT)/.installed-test: $(VENV)/.installed-cuda requirements-cuda-current.txt requirements-test-current.txt pyproject.toml
	$(VENV)/bin/uv venv -q --seed --allow-existing --python $(PYTHON) $(VENV_CURRENT)
	$(UV_INSTALL) --python $(PY_CURRENT) -r requirements-test-current.txt
	$(UV_INSTALL) --python $(PY_CURRENT) --no-deps -e .
	touch $@

# Habana's container keeps its own torch: there, make bench and make test refuse and say what to run instead.
not-in-habana-container:
	@PYTHON=$(PYTHON) sh scripts/refuse_in_habana_container.sh $(firstword $(MAKECMDGOALS))

bench: not-in-habana-container $(VENV)/.installed-cuda
	$(PY) -m bridgetower_bench.tools.bench $(BENCH_ARGS)

# One pytest worker per core, at most 4 (each holds the libraries in memory: the scripts run in its process).
PYTEST_ARGS ?= -n auto --maxprocesses 4 --dist worksteal
# The second pass: the tests marked both_routes, in the files that mark some, on the current route.
BOTH_ROUTES_TESTS ?= $(shell grep -l BOTH_ROUTES tests/test_*.py)
# Lint (ruff, pyproject.toml's [tool.ruff]), formatting, the import contracts (import-linter), the types (mypy,
# [tool.mypy]), then the tests on the pinned route, then the CUDA script's end-to-end tests on the current route.
test: not-in-habana-container $(VENV)/.installed-test $(VENV_CURRENT)/.installed-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(PY) -m pytest $(PYTEST_ARGS)
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(PY_CURRENT) -m pytest -m both_routes $(PYTEST_ARGS) $(BOTH_ROUTES_TESTS)

# ruff's fixes and formatter on the tree; the two scripts stage by stage, so that the patches still apply.
format: $(VENV)/.installed-test
	$(PY) -m bridgetower_bench.tools.make_cuda_script --format
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# Line coverage of the package and the scripts under the whole suite (slower than `make test`).
coverage: not-in-habana-container $(VENV)/.installed-test
	rm -rf .cache/coverage && mkdir -p .cache/coverage
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(PY) -m coverage run -m pytest $(PYTEST_ARGS)
	$(PY) -m coverage combine -q && $(PY) -m coverage report --format=total && $(PY) -m coverage report | tail -n 45

# Mutation testing (slow; not part of `make test`): mutmut ([tool.mutmut] in pyproject.toml) puts one small bug at a
# time into the runtime package and runs the tests that reached the mutated function.
# MODULES="retrieval measurement.throughput": only these modules' mutants; MUTATE_TESTS="test_retrieval or
# test_throughput": only these tests (pytest's -k); MUTATE_ARGS: more options of `mutmut run`, e.g. --max-children 1.
# mutmut run ends with each mutant's result; they stay in mutants/ (git-ignored): `mutmut results` lists those not
# killed, `mutmut show NAME` one's diff.
mutate: not-in-habana-container $(VENV)/.installed-test
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTEST_ADDOPTS='$(if $(MUTATE_TESTS),-k "$(MUTATE_TESTS)")' \
	$(VENV)/bin/mutmut run $(MUTATE_ARGS) $(foreach m,$(MODULES),"bridgetower_bench.$(m).*")

fixtures: $(VENV)/.installed-cuda
	$(PY) -m bridgetower_bench.tools.fixtures

cuda-script: $(VENV)/.installed-cuda
	$(PY) -m bridgetower_bench.tools.make_cuda_script

check-cuda-script: $(VENV)/.installed-cuda
	$(PY) -m bridgetower_bench.tools.make_cuda_script --check
