# kv-event-bridge: make demo (the quickstart of README.md), make test (docs/development/testing.md), and a few helpers.
#   make demo   install, then run a simulated engine -> bridge -> stdout (no broker needed)
#   make playground [BROKER=kafka|redis|nats]   the same with a real local broker and the example consumer
#   make test   install everything (Python deps, Kafka/Redis/NATS/Prometheus, helm), check the generated files,
#               build the docs site, then ruff, mypy, the Go consumer's vet and unit tests (needs Go), pytest
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install demo playground test lint servers servers-stop soak clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

install: $(PY)
	$(PY) -m pip install --quiet -e ./consumer
	$(PY) -m pip install --quiet -e '.[dev]'

demo: install
	@$(PY) -m bridge demo

# Simulated engines -> the bridge (state on) -> a real local broker -> the example consumer (Ctrl-C stops all).
BROKER ?= kafka
playground: install
	@$(PY) -m tools.playground --broker $(BROKER)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

servers: install
	$(PY) -m tests.infra install
	$(PY) -m tests.infra start

servers-stop:
	$(PY) -m tests.infra stop

test: install
	$(PY) -m tests.infra install
	$(PY) -m tests.infra image
	bash tools/helm.sh >/dev/null
	$(PY) tools/chart_schema.py --check
	$(PY) tools/chart_readme.py --check
	$(PY) tools/config_reference.py --check
	$(PY) -m mkdocs build --strict --quiet --site-dir site
	$(PY) -m bridge schema --check schema/kv-events.schema.json
	$(PY) -m bridge schema state --check schema/kv-state.schema.json
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	cd go/kvconsumer && GOFLAGS="-mod=mod -buildvcs=false" go vet ./... && GOFLAGS="-mod=mod -buildvcs=false" go test ./...
	$(PY) -m pytest

soak: install
	$(PY) -m tests.infra install
	$(PY) -m benchmarks.soak --duration 120

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis build site *.egg-info
