# fpaudit: two commands on a fresh machine.
#   make demo   set up, scan the bundled sample transformer, show and gate the report,
#               then audit the sample training loop (fpaudit run)
#   make test   set up, then run the whole test suite (the compiled kernels required)
#   make test-fast  the suite without the end-to-end runs marked `slow` (for development)
#
# torch is installed first, from TORCH_SPEC. The default pins the release these
# machines carry as a CPU wheel; on a CUDA machine use the build you want, e.g.
#   make test TORCH_SPEC='torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128'
# or TORCH_SPEC=torch for whatever pip picks. Users installing fpaudit itself keep
# the torch they already have: pyproject admits torch>=2.10,<2.16, each release tested.
#   make test-release RELEASE=2.10.0   the torch-facing tests on a registry release (cached venv)
#   make test-torch TORCH_SPEC='torch==2.11.0 --index-url https://download.pytorch.org/whl/cpu'
#               the same tests on any torch spec, in a venv of its own

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.fpaudit-installed

.PHONY: setup demo test test-fast test-torch test-release lint format bench clean

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

# FPAUDIT_REQUIRE_KERNEL=1: a compiled kernel (C++ on the CPU, Triton in its interpreter)
# that does not build fails its equality tests instead of skipping them
test: setup
	FPAUDIT_REQUIRE_KERNEL=1 $(BIN)/python -m pytest -q --durations=20

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

# The tests that touch torch's internals or lean on its numerics: the capture, the oracles,
# the patches, the private-torch seam, transparency, the CLI, the cross-release identity,
# torch.compile's backward (Inductor's internals), autocast's op lists, and Triton's launch
# path as each release's Triton has it (the bound launches).
TORCH_TESTS := tests/capture/test_capture.py tests/capture/test_torch_patches.py \
	tests/capture/test_compiled.py tests/capture/test_compiled_zoo.py tests/capture/test_autocast.py \
	tests/kernels/test_histogram.py tests/kernels/test_triton_bound.py tests/numerics/test_formats.py \
	tests/test_torch_seam.py \
	tests/run/test_transparency.py tests/cli/test_cli.py tests/project/test_release_identity.py
TORCH_TEST_DEPS := pytest hypothesis transformers accelerate

# fpaudit installed without its torch pin (--no-deps), so TORCH_SPEC's release is the one tested
TORCH_VENV ?= .venv-torch
test-torch:
	$(PYTHON) -m venv $(TORCH_VENV)
	$(TORCH_VENV)/bin/python -m pip install --quiet $(TORCH_SPEC)
	$(TORCH_VENV)/bin/python -m pip install --quiet --no-deps -e .
	$(TORCH_VENV)/bin/python -m pip install --quiet numpy pandas pyarrow typer rich ninja $(TORCH_TEST_DEPS)
	$(TORCH_VENV)/bin/python -c "import torch; print('testing on torch', torch.__version__)"
	$(TORCH_VENV)/bin/python -m pytest -q -m "not slow" $(TORCH_TESTS)

# One supported torch release from the registry, as a user has it: a venv kept between runs
# under RELEASE_CACHE holds torch==RELEASE; fpaudit is installed into it as users install it
# (`pip install .`, with its dependencies), and the run fails if that changed the torch.
# pip's configuration files are ignored for these installs only (PIP_CONFIG_FILE=/dev/null):
# the machines this project is built on cap torch at 2.14.1 there, the registry does not.
#   make test-release RELEASE=2.10.0     the oldest supported release
#   make test-release RELEASE=2.15.0     the newest
RELEASE ?= 2.15.0
RELEASE_CACHE ?= $(HOME)/.cache/fpaudit
RELEASE_VENV := $(RELEASE_CACHE)/torch-$(RELEASE)
RELEASE_PIP := PIP_CONFIG_FILE=/dev/null $(RELEASE_VENV)/bin/python -m pip
RELEASE_REFERENCE := $(RELEASE_CACHE)/identity-reference.json
test-release: setup
	$(BIN)/python tests/project/test_release_identity.py --write $(RELEASE_REFERENCE)
	test -x $(RELEASE_VENV)/bin/python || $(PYTHON) -m venv $(RELEASE_VENV)
	$(RELEASE_PIP) install --quiet torch==$(RELEASE)
	$(RELEASE_PIP) uninstall --quiet --yes fpaudit 2>/dev/null || true
	$(RELEASE_PIP) install --quiet . $(TORCH_TEST_DEPS)
	$(RELEASE_VENV)/bin/python -c "import sys, torch; v = torch.__version__.split('+')[0]; \
		print('testing on torch', torch.__version__); \
		sys.exit(0 if v == '$(RELEASE)' else f'installing fpaudit changed torch $(RELEASE) to {v}')"
	FPAUDIT_REQUIRE_KERNEL=1 FPAUDIT_IDENTITY_REFERENCE=$(RELEASE_REFERENCE) \
		$(RELEASE_VENV)/bin/python -m pytest -q -m "not slow" -p no:cacheprovider $(TORCH_TESTS)

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
