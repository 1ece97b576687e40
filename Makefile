# Two commands for a fresh machine (Python 3.11):
#   make run    install, then run the whole pipeline on the built-in model and task
#   make test   install, then run the test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: install run test serve clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[test]"
	touch $@

run: install
	$(BIN)/align server start
	$(BIN)/align run

test: install
	$(BIN)/python -m pytest -q

serve: install
	$(BIN)/align serve

clean:
	rm -rf artifacts .pytest_cache
