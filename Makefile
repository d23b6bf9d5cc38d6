# The two set-up commands of the README. Each creates .venv when missing and installs the project.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch first and pinned: the machine's local CPU wheel satisfies the project's range without
# pulling a multi-GB CUDA build.
TORCH ?= torch==2.13.0

.PHONY: demo test install clean

$(BIN)/eaglekit: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

install: $(BIN)/eaglekit

demo: install
	$(BIN)/eaglekit run --config src/eaglekit/recipes/demo.yaml

test: install
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
