# fpaudit: two commands on a fresh machine.
#   make demo   set up, scan the bundled sample transformer, show and gate the report,
#               then audit the sample training loop (fpaudit run)
#   make test   set up, then run the whole test suite
#   make test-fast  the suite without the end-to-end runs marked `slow` (for development)
#
# torch is installed first, from TORCH_SPEC. The default pins the release these
# machines carry as a CPU wheel; on a CUDA machine use the build you want, e.g.
#   make test TORCH_SPEC='torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128'
# or TORCH_SPEC=torch for whatever pip picks. Users installing fpaudit itself get
# the torch they already have if it is one the suite ran on (pyproject: torch>=2.13,<2.15).
#   make test-torch TORCH_SPEC='torch==2.11.0 --index-url https://download.pytorch.org/whl/cpu'
#               the capture, oracle, patch and CLI tests on another torch, in its own venv

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.fpaudit-installed

.PHONY: setup demo test test-fast test-torch lint format bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet $(TORCH_SPEC)
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: setup
	$(BIN)/fpaudit scan sample_configs/transformer.py --steps 4 --out demo-report --force
	$(BIN)/fpaudit show demo-report --scale recommended --top 8
	$(BIN)/fpaudit gate demo-report --max-underflow 0.001
	$(BIN)/fpaudit run --out demo-run --force -- sample_configs/train_loop.py --steps 200 --bugs

test: setup
	$(BIN)/python -m pytest -q --durations=20

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

# fpaudit installed without its torch pin (--no-deps), so TORCH_SPEC's release is the one tested
TORCH_VENV ?= .venv-torch
test-torch:
	$(PYTHON) -m venv $(TORCH_VENV)
	$(TORCH_VENV)/bin/python -m pip install --quiet $(TORCH_SPEC)
	$(TORCH_VENV)/bin/python -m pip install --quiet --no-deps -e .
	$(TORCH_VENV)/bin/python -m pip install --quiet numpy pandas pyarrow typer rich ninja pytest hypothesis \
		transformers accelerate
	$(TORCH_VENV)/bin/python -c "import torch; print('testing on torch', torch.__version__)"
	$(TORCH_VENV)/bin/python -m pytest -q -m "not slow" tests/test_capture.py tests/test_histogram.py \
		tests/test_formats.py tests/test_torch_patches.py tests/test_transparency.py tests/test_cli.py

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: setup
	$(BIN)/python -m pip install --quiet -e '.[bench]'
	$(BIN)/python benchmarks/bench.py

clean:
	rm -rf $(VENV) $(TORCH_VENV) demo-report demo-run .pytest_cache .mypy_cache .ruff_cache .hypothesis
