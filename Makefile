# Three commands for a fresh machine (see README):
#   make demo          runs `kernelfleet optimize` on the bundled examples, on the local CPU or GPU
#   make test          runs every test tier that needs no GPU: unit, integration, e2e
#   make cluster-demo  the cluster path on this machine: a real control plane with GPU pools,
#                      the chart's operator, a job on the examples, its results, then down
# Both install what they need into .venv and reuse what is already there.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
BINDIR := $(shell scripts/build-test-binaries.sh --print-dir)
# The CPU build of torch is enough for the tests and the demo; the pin matches the GPU machine.
TORCH  ?= torch==2.11.0

.PHONY: install sandbox-tools binaries demo cluster-demo test test-unit lint gpu-check clean

$(STAMP): pyproject.toml core/pyproject.toml evaluator/pyproject.toml search/pyproject.toml trainer/pyproject.toml operator/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ./core -e ./evaluator -e ./search -e ./trainer -e ./operator -e '.[dev]'
	touch $(STAMP)

install: $(STAMP) sandbox-tools

# bubblewrap walls candidates in (docs/sandbox.md). Installed when missing and we are root on a
# machine with apt; otherwise a note, and candidates run at the strongest level still available.
sandbox-tools:
	@command -v bwrap >/dev/null 2>&1 || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && apt-get install -y -q bubblewrap >/dev/null 2>&1; } || \
	  echo "note: bubblewrap (bwrap) is not installed: install it for the strongest sandbox (docs/sandbox.md)"

# Every server the test tiers start, Kueue's controller included (the e2e tier runs it).
binaries:
	scripts/build-test-binaries.sh kube etcd minio kwok helm jobset kueue

demo: install
	$(VENV)/bin/kernelfleet optimize examples/tasks --policy compile --policy replay:examples/candidates.jsonl --rounds 2

# Builds the servers first if needed (it says how long that takes before it starts).
cluster-demo: install
	$(VENV)/bin/kernelfleet dev-cluster demo

test: install binaries
	KERNELFLEET_BIN_DIR=$(BINDIR) $(PY) -m pytest -m "not gpu" tests

test-unit: install
	$(PY) -m pytest -m unit tests

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) .kernelfleet .pytest_cache .mypy_cache .ruff_cache
