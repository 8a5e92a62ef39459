"""The environment at fault, through real processes: standard output that cannot be
written, a full disk under the dashboard, a read-only Inductor cache. Each is one line
naming the culprit (exit 2), or for the dashboard one warning while the run goes on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fpaudit.report.store import Report

from ..conftest import MODELS, ROOT
from .test_faults import _default_signals, _error_line, _fill, _good_report, _tmpfs

FAULTS = MODELS / "faults.py"
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "FPAUDIT_KERNEL": "torch"}


def _fpaudit(args: list[object], stdout: int, **env: str) -> tuple[int, str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "fpaudit", *map(str, args)], cwd=ROOT, stdout=stdout,
        stderr=subprocess.PIPE, text=True, env={**ENV, **env}, preexec_fn=_default_signals,
    )  # fmt: skip
    _, err = process.communicate(timeout=600)
    return process.returncode, err


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("stdout") / "r"
    _good_report(out, steps=1)
    return out


def test_a_full_standard_output_is_one_line(report: Path) -> None:
    # Before: "internal error: OSError: [Errno 28] No space left on device"
    with open("/dev/full", "w") as full:
        code, err = _fpaudit(["gate", report, "--max-underflow", "1"], full.fileno())
    assert code == 2
    line = "fpaudit: error: cannot write the result to standard output: No space left on device"
    assert _error_line(err) == line


@pytest.mark.parametrize("command", [["show"], ["gate", "--max-underflow", "1"]])
def test_a_closed_pipe_is_one_line_not_the_gates_exit_1(report: Path, command: list[str]) -> None:
    # Before: exit 1 and no word (typer's way with a closed pipe): a failed gate's status
    read, write = os.pipe()
    os.close(read)  # `fpaudit show r | head -0`: nobody reads
    try:
        code, err = _fpaudit([command[0], report, *command[1:]], write)
    finally:
        os.close(write)
    assert code == 2
    assert _error_line(err) == (
        "fpaudit: error: standard output was closed before fpaudit wrote its result (Broken pipe)"
    )


def test_a_full_disk_under_the_dashboard_is_one_warning_and_the_run_goes_on(
    tmp_path: Path,
) -> None:
    # Before: "Exception in thread Thread-1: Traceback ... OSError: [Errno 28]", 7+ lines
    script = tmp_path / "train.py"
    script.write_text(
        "import torch\nm = torch.nn.Linear(64, 64)\nopt = torch.optim.SGD(m.parameters(), 0.1)\n"
        "for _ in range(4):\n    opt.zero_grad()\n    m(torch.ones(2, 64)).sum().backward()\n"
        "    opt.step()\n"
    )
    with _tmpfs(tmp_path / "disk", "64k") as disk:
        _fill(disk, leave=0)
        out = tmp_path / "r"
        code, err = _fpaudit(["run", "--capture-every", "1", "--tensorboard", disk / "tb",
                              "--out", out, "--", script], subprocess.DEVNULL)  # fmt: skip
    assert code == 0, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == [
        f"fpaudit: warning: writing TensorBoard event files to {disk / 'tb'} failed (OSError: "
        "[Errno 28] No space left on device); the audit goes on without them"
    ], err
    assert Report.read(out).complete and Report.read(out).info.steps_run == 4


def test_a_read_only_inductor_cache_is_named_not_an_internal_error(tmp_path: Path) -> None:
    # Before: "internal error: OSError: [Errno 30] Read-only file system: '.../inductor'"
    with _tmpfs(tmp_path / "disk", "64k") as disk:
        remounted = subprocess.run(["mount", "-o", "remount,ro", str(disk)], capture_output=True)
        if remounted.returncode != 0:
            pytest.skip(f"cannot remount read-only: {remounted.stderr.decode().strip()}")
        out = tmp_path / "r"
        code, err = _fpaudit(["scan", FAULTS, "--compile", "--steps", "1", "--out", out],
                             subprocess.DEVNULL, TORCHINDUCTOR_CACHE_DIR=str(disk / "inductor"))  # fmt: skip
    assert code == 2
    assert _error_line(err) == (
        f"fpaudit: error: torch.compile cannot write Inductor's cache folder {disk / 'inductor'} "
        "(TORCHINDUCTOR_CACHE_DIR): Read-only file system; set TORCHINDUCTOR_CACHE_DIR to a "
        "writable folder"
    )
    assert not out.exists()
