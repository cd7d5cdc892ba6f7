# `make serve` and `make test` do all set-up: a virtual environment with the
# pinned requirements, created on first use.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin

.PHONY: serve test bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.runtime: $(BIN)/python requirements.txt
	$(BIN)/python -m pip install --quiet --no-cache-dir -r requirements.txt
	touch $@

$(VENV)/.dev: $(VENV)/.runtime requirements-dev.txt
	$(BIN)/python -m pip install --quiet --no-cache-dir -r requirements-dev.txt
	touch $@

serve: $(VENV)/.runtime
	$(BIN)/gunicorn -c gunicorn.conf.py wsgi:app

test: $(VENV)/.dev
	$(BIN)/python -m pytest

bench: $(VENV)/.dev
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV)
