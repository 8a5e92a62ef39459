"""Shared fixtures: one seed for all randomness, a CLI runner, small reports."""

from __future__ import annotations

import importlib
import os
import random
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import NoReturn

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_configs"
MODELS = Path(__file__).resolve().parent / "models"

# `make test` and .ci/run set it (and CI systems set CI): there a compiled kernel that does
# not build, or FPAUDIT_KERNEL=torch, fails the kernel-equality tests instead of skipping them.
REQUIRE_KERNEL_ENV = "FPAUDIT_REQUIRE_KERNEL"


def kernel_required() -> bool:
    return os.environ.get(REQUIRE_KERNEL_ENV) == "1" or bool(os.environ.get("CI"))


def missing_kernel(kernel: str, why: str) -> NoReturn:
    """Fail where the compiled kernels are required (CI, `make test`); skip elsewhere,
    saying what went untested and why."""
    if kernel_required():
        pytest.fail(
            f"{kernel} is required here ({REQUIRE_KERNEL_ENV}=1 or CI set) but {why}",
            pytrace=False,
        )
    pytest.skip(
        f"{kernel} untested: {why} (with {REQUIRE_KERNEL_ENV}=1 this fails)",
        allow_module_level=True,
    )


def compiled_cpu_kernel() -> ModuleType:
    """The compiled CPU kernel, for a test comparing it with the pure-torch paths."""
    from fpaudit.kernels import build as kernels

    if kernels.mode() == "torch":
        missing_kernel("the compiled CPU kernel", "FPAUDIT_KERNEL=torch turns it off")
    module = kernels.cpu_kernel()
    if module is None:
        missing_kernel("the compiled CPU kernel", f"it did not build: {kernels.failure()}")
    return module


def benchmark_module(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` imported as a module, with its folder on ``sys.path``
    while it loads (the scripts import each other as top-level modules)."""
    folder = str(ROOT / "benchmarks")
    sys.path.insert(0, folder)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(folder)


def default_signals() -> None:
    """``preexec_fn`` for a child the tests will signal: SIGINT and SIGTERM back to
    their defaults, whatever the test run inherited (a shell's background job
    ignores SIGINT, and an ignored signal stays ignored across exec)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


@pytest.fixture(autouse=True)
def _seed() -> None:
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@dataclass
class CliResult:
    code: int
    stdout: str
    stderr: str


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]):
    """Run ``fpaudit ARGS`` in-process; returns exit code, stdout and stderr."""
    from fpaudit.cli.commands import run

    def invoke(*args: object) -> CliResult:
        capsys.readouterr()
        code = run([str(a) for a in args])
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)

    return invoke


def one_error_line(result: CliResult) -> str:
    """Assert the command failed with exit 2 and exactly one 'fpaudit: error:' line, no traceback."""
    assert result.code == 2, (result.code, result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("fpaudit: error: "), lines[0]
    assert "Traceback" not in result.stderr
    return lines[0]
