"""The benchmark and GPU check scripts keep working (smoke runs on the CPU, not timings)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import ROOT, benchmark_module


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
def test_benchmark_runs_quick(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench.py"), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(out.read_text())
    steps = data["steps"][0]
    assert steps["ratio"]["plain"] == 1.0 and steps["ratio"]["fpaudit"] > 0
    assert steps["backward_values_per_step"] > 0
    assert data["memory"]["peak_ratio"] > 0
    assert data["scan"]["report_bytes_per_output_per_step"] > 0
    assert data["read"]["histogram_rows"] > 0 and data["read"]["gate_seconds"] > 0
    assert "step overhead" in result.stdout


def test_kernel_speed_times_every_thread_count_side_by_side(tmp_path: Path) -> None:
    """benchmarks/kernel_speed.py (one tiny size, two repetitions): a row per layout and
    thread count, the one-thread rows with their CPU time, and the speedup over one
    thread for each tensor."""
    out = tmp_path / "kernel.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "kernel_speed.py"), "--dtypes"]
    command += ["bf16", "--sizes", "4K", "--reps", "2", "--json", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(out.read_text())
    threads = sorted({1, data["threads"]})
    # a close of 4 K values: tensors of 64, 256, 1,024 and the 2,752 left
    layouts = ["contiguous", "strided", "close (4 tensors)"]
    assert [(r["layout"], r["threads"]) for r in data["rows"]] == [
        (layout, t) for layout in layouts for t in threads
    ]
    for row in data["rows"]:
        assert row["histogram_ns"] > 0 and row["read_ns"] > 0
        assert ("histogram_cpu_ns" in row) == (row["threads"] == 1)
    if len(threads) > 1:
        assert all(f"bf16 {layout} 4K: " in result.stdout for layout in layouts)


def test_skip_flags_benchmark_times_both_per_parameter_count() -> None:
    """benchmarks/skip_flags.py (two parameter counts, a few steps): a row per count,
    each with the step's time before and with the flags, and what the flags added."""
    command = [sys.executable, str(ROOT / "benchmarks" / "skip_flags.py")]
    command += ["--params", "2", "6", "--reps", "5"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [
        line.split() for line in result.stdout.splitlines() if line.split()[:1] in (["2"], ["6"])
    ]
    assert [row[0] for row in rows] == ["2", "6"]
    for _, before, flagged, added in rows:
        assert float(before) > 0 and float(flagged) > 0
        assert float(added) == pytest.approx(float(flagged) - float(before), abs=0.15)


def test_host_overhead_measures_each_variant_and_the_first_step() -> None:
    """benchmarks/host_overhead.py runs (the small models, one round): every variant is
    timed, the audited ones after their warm-up steps, and the first step apart."""
    host_overhead = benchmark_module("host_overhead")
    result = host_overhead.measure("mlp", host_overhead.deep_mlp(True), 1, 2, warmup=2)
    seconds = result["median_step_seconds"]
    assert list(seconds) == ["plain", "bare mode", "capture, not closed", "audit.step() each step"]
    assert all(s > 0 for s in seconds.values())
    assert result["aten_calls"] > 200 and result["parameters"] == 40
    assert result["us_per_parameter_step_alone"] > 0
    assert result["first_step_seconds"] is not None and result["first_step_seconds"] > 0
    assert (
        host_overhead.measure("mlp", host_overhead.deep_mlp(True), 1, 1, warmup=0)[
            "first_step_seconds"
        ]
        is None
    )  # without warm-up steps no first step is timed apart


@pytest.mark.parametrize(
    ("code", "absent"),
    [
        # Reading reports must not pay torch's start-up (1.6 s); capturing must not carry
        # pandas and pyarrow (about 70 MB) in the training process.
        ("import fpaudit.cli.commands", ("torch",)),
        ("import fpaudit; fpaudit.Report; fpaudit.recommend; fpaudit.gate", ("torch",)),
        ("import fpaudit; fpaudit.audit; fpaudit.Selection", ("pandas", "pyarrow")),
        ("import fpaudit.run.scan", ("pandas", "pyarrow")),
    ],
)
def test_import_weight(code: str, absent: tuple[str, ...]) -> None:
    check = f"{code}\nimport sys\nprint(sorted(m for m in {absent!r} if m in sys.modules))"
    result = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]", result.stdout


def test_package_names_are_not_shadowed_by_submodules() -> None:
    # A lazily loaded name that is also a submodule would turn into the module as soon
    # as something imports the submodule.
    code = (
        "import fpaudit, fpaudit.cli.commands, fpaudit.rules.recommendation, fpaudit.rules.gating, fpaudit.capture.audit\n"
        "import types\n"
        "bad = [n for n in fpaudit.__all__ if isinstance(getattr(fpaudit, n), types.ModuleType)]\n"
        "print(bad)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"
