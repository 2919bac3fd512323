# Millpond — two commands on a fresh machine: `make run`, then `make test`.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
MILLPOND := $(PY) -m millpond
STAMP := $(VENV)/.installed

.PHONY: run test venv up down status lint bench query report docs backfill clean

run: venv ## set everything up and run the main job on the embedded defaults
	@$(MILLPOND) preflight
	@$(MILLPOND) up
	@$(MILLPOND) run

test: venv ## the whole suite (real S3 server, Delta tables, Spark, Airflow)
	$(VENV)/bin/ruff check jobs dags tests
	$(PY) -m pytest

venv: $(STAMP)

$(STAMP): requirements.lock pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "millpond: error: $(PYTHON) not found: install Python 3.11 or run 'make PYTHON=/path/to/python3.11'"; exit 1; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.lock
	$(PY) -m pip install --quiet --no-deps -e .
	@touch $(STAMP)

up: venv ## start the embedded services (idempotent)
	@$(MILLPOND) up

down: ## stop what `make up` started (idempotent)
	@test -x $(PY) && $(MILLPOND) down || true

status: venv
	@$(MILLPOND) status

lint: venv
	$(VENV)/bin/ruff check jobs dags tests

bench: venv
	$(MILLPOND) bench

query: venv
	@$(MILLPOND) query "$(SQL)"

clean: down
	rm -rf var
