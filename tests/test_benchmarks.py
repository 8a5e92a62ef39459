"""The benchmark and GPU check scripts keep working (smoke runs on the CPU, not timings)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT


@pytest.mark.slow
def test_gpu_check_script_runs_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "gpu_check.py"),
            "--device",
            "cpu",
            "--quick",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(out.read_text())
    assert summary["exact"] and summary["amax_exact"] and summary["no_host_sync_during_capture"]
    assert summary["backward_records_per_step"] > 0


@pytest.mark.slow
def test_overhead_benchmark_runs(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "overhead.py"),
            "--model",
            "mlp",
            "--reps",
            "1",
            "--warmup",
            "1",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    assert data["ratio"] > 0 and data["backward_values_per_step"] > 0
