# `make serve` and `make test` do all set-up: a virtual environment with the
# pinned requirements, created on first use.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin

.PHONY: serve test test-shuffled mutants bench gpu-wheels clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Where torch comes from, e.g. TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu for the CPU
# build (PyPI's is the CUDA one, several GB): torch at requirements.txt's pin from that index
# first, then the rest as usual. Unset: requirements.txt alone, which holds no index options.
TORCH_INDEX_URL ?=

$(VENV)/.runtime: $(BIN)/python requirements.txt
ifneq ($(strip $(TORCH_INDEX_URL)),)
	$(BIN)/python -m pip install --quiet --no-cache-dir --index-url $(TORCH_INDEX_URL) "$$(grep -E '^torch==' requirements.txt)"
endif
	$(BIN)/python -m pip install --quiet --no-cache-dir -r requirements.txt
	touch $@

$(VENV)/.dev: $(VENV)/.runtime requirements-dev.txt
	$(BIN)/python -m pip install --quiet --no-cache-dir -r requirements-dev.txt
	touch $@

serve: $(VENV)/.runtime
	$(BIN)/gunicorn -c gunicorn.conf.py wsgi:app

# More pytest arguments, e.g. PYTEST_ARGS='-m "not slow"' or PYTEST_ARGS=--randomly-seed=1234.
PYTEST_ARGS ?=

test: $(VENV)/.dev
	$(BIN)/python -m pytest --durations=15 $(PYTEST_ARGS)

# The same suite in a random order (pytest-randomly, off in pytest.ini): SEED=<n> replays an
# order. `make test` keeps the file order, so that CI's runs compare.
ifndef SEED
SEED := $(shell date +%s)
endif

test-shuffled: $(VENV)/.dev
	@echo "shuffled with SEED=$(SEED)"
	$(BIN)/python -m pytest -p randomly --randomly-seed=$(SEED) --durations=15 $(PYTEST_ARGS)

# Mutation testing of app/core with the suite's fast part (setup.cfg [mutmut]; docs/testing.md),
# time-boxed, niced, outside CI; then the verdicts. Reruns only what changed since the last run.
MUTANTS_TIME ?= 60m
MUTANTS_CHILDREN ?= 2

mutants: $(VENV)/.dev
	-timeout $(MUTANTS_TIME) nice -n 10 $(BIN)/mutmut run --max-children $(MUTANTS_CHILDREN)
	$(BIN)/mutmut results

bench: $(VENV)/.dev
	$(BIN)/python -m bench

# Runtime wheels for the GPU machine's Python 3.12 (scripts/gpu_check.sh installs them there).
gpu-wheels:
	rm -rf .whl && $(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 -d .whl Flask==3.1.3 Werkzeug==3.1.9 flask-smorest==0.47.0 \
	  marshmallow==4.4.0 webargs==8.7.1 apispec==6.10.1 gunicorn==27.0.1 orjson==3.13.0 blinker==1.9.0 \
	  itsdangerous==2.2.0 swagger-ui-bundle==1.1.0 SQLAlchemy==2.1.9 psycopg==3.3.9 psycopg-binary==3.3.9

clean:
	rm -rf $(VENV)
