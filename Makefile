# Millpond — two commands on a fresh machine: `make run`, then `make test`.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
MILLPOND := $(PY) -m millpond
STAMP := $(VENV)/.installed
ASSETS := var/datadocs-assets
ASSETS_STAMP := $(ASSETS)/.installed
#: `make test`'s parallel workers (pytest-xdist): a module runs whole on one of them
TEST_WORKERS ?= 2
#: a comma inside a make function's argument (``$(or ...)`` splits its arguments at commas)
comma := ,

.PHONY: run test test-unit soak browser postgresql reference-envs venv up down status lint bench query report docs backfill clean datadocs-assets

run: venv ## set everything up and run the main job on the embedded defaults
	@$(MILLPOND) preflight
	@$(MILLPOND) up
	@$(MILLPOND) run

test: venv browser postgresql reference-envs ## the whole suite (real S3 server, Delta tables, Spark, Airflow, a browser), TEST_WORKERS at once
	$(VENV)/bin/ruff check jobs dags tests bench
	$(PY) -m pytest -n $(TEST_WORKERS)

test-unit: venv ## the pure model and configuration tests: no service, under a minute
	$(PY) -m pytest -m unit -q

soak: venv ## the randomised operations test, long: SEEDS=1,2 (default: three random, printed) STEPS (default 600)
	MILLPOND_OPS_SEEDS=$(or $(SEEDS),$$RANDOM$(comma)$$RANDOM$(comma)$$RANDOM) MILLPOND_OPS_STEPS=$(or $(STEPS),600) \
	  $(PY) -m pytest tests/test_operations_random.py -v

browser: ## Debian's chromium for the Data Docs and Airflow UI tests (installed when missing and root)
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; } ; } || \
	  { echo "millpond: error: chromium not found: install it (Debian: sudo apt-get install -y chromium), then run make test again"; exit 1; }

postgresql: ## Debian's PostgreSQL binaries for the suite's Airflow (installed when missing and root)
	@compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null || command -v initdb >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null; } ; } || \
	  echo "millpond: PostgreSQL not found: the suite's Airflow runs on SQLite and tests/test_airflow_postgres.py skips (Debian: sudo apt-get install -y postgresql)"

reference-envs: venv ## the Beam and Flink peers' own virtualenvs (var/), built once per pin before the suite
	@$(PY) tests/reference/beam_env.py >/dev/null || echo "millpond: the Beam reference venv was not built: its tests say why"
	@$(PY) tests/reference/flink_env.py >/dev/null || echo "millpond: the Flink reference venv was not built: its test says why"

venv: $(STAMP) $(ASSETS_STAMP)

$(STAMP): requirements.lock pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "millpond: error: $(PYTHON) not found: install Python 3.11 or run 'make PYTHON=/path/to/python3.11'"; exit 1; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.lock
	$(PY) -m pip install --quiet --no-deps -e .
	$(PY) -m millpond.orchestration.bytecode
	@touch $(STAMP)

datadocs-assets: $(ASSETS_STAMP) ## CSS/JS for offline Data Docs (npm, pinned by the lock file)

$(ASSETS_STAMP): infra/datadocs-assets/package.json infra/datadocs-assets/package-lock.json
	@command -v npm >/dev/null || { echo "millpond: error: npm not found: install Node.js (Debian: apt-get install -y npm)"; exit 1; }
	@mkdir -p $(ASSETS)
	cp infra/datadocs-assets/package.json infra/datadocs-assets/package-lock.json $(ASSETS)/
	cd $(ASSETS) && npm ci --no-audit --no-fund --ignore-scripts --loglevel=error
	@touch $(ASSETS_STAMP)

up: venv ## start the embedded services (idempotent)
	@$(MILLPOND) up

down: ## stop what `make up` started (idempotent)
	@test -x $(PY) && $(MILLPOND) down || true

status: venv
	@$(MILLPOND) status

lint: venv
	$(VENV)/bin/ruff check jobs dags tests bench

bench: venv
	$(PY) -m bench $(ARGS)

query: venv
	@$(MILLPOND) query "$(SQL)"

report: venv ## build the stream reports (PIPELINE=name for one), print and open the latest
	@$(MILLPOND) report $(if $(PIPELINE),--pipeline $(PIPELINE))
	@page=$$($(MILLPOND) report --latest) && echo "latest report: $$page" && \
	  { [ -n "$$DISPLAY" ] && command -v xdg-open >/dev/null && xdg-open "$$page" >/dev/null 2>&1 || true; }

docs: venv ## build the Data Docs and serve them on 127.0.0.1 (PORT=8765)
	$(MILLPOND) docs --port $(or $(PORT),8765)

backfill: venv ## re-run a pipeline's batches through Airflow: make backfill PIPELINE=x FROM=2026-01-01T00:00Z TO=... [REPROCESS=1]
	@$(MILLPOND) backfill --pipeline "$(PIPELINE)" --from "$(FROM)" --to "$(TO)" $(if $(DEMO),--demo) $(if $(REPROCESS),--reprocess)

clean: down
	rm -rf var
