"""Interrupted runs keep their work; two runs never write one report; reports stay safe."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from fpaudit.errors import ReportError
from fpaudit.report.files import output_lock
from fpaudit.report.store import Report

from ..conftest import MODELS, ROOT, SAMPLES, default_signals, one_error_line


def _interrupt_scan(tmp_path: Path, sig: signal.Signals, stop_at: int) -> tuple[int, str, Path]:
    marker, out = tmp_path / "ready", tmp_path / "report"
    env = {**os.environ, "FPAUDIT_TEST_MARKER": str(marker), "FPAUDIT_TEST_STOP_AT": str(stop_at)}
    process = subprocess.Popen(
        [sys.executable, "-m", "fpaudit", "scan", str(MODELS / "slow.py"), "--steps", "50",
         "--out", str(out)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        preexec_fn=default_signals,
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while not marker.exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "the scan never reached the step to interrupt"
        time.sleep(0.05)
    process.send_signal(sig)
    _, stderr = process.communicate(timeout=120)
    return process.returncode, stderr, out


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_after_step_k_leaves_exactly_k_steps_marked_incomplete(
    tmp_path: Path, sig: signal.Signals, code: int
) -> None:
    returncode, stderr, out = _interrupt_scan(tmp_path, sig, stop_at=3)
    assert returncode == code, stderr
    assert "Traceback" not in stderr
    assert f"interrupted by {sig.name} after 3 of 50 step(s)" in stderr
    report = Report.read(out)
    assert list(report.steps["step"]) == [0, 1, 2]
    assert report.meta["complete"] is False and report.meta["stopped_by"] == sig.name
    assert set(report.records["step"]) == {0, 1, 2}
    assert not (tmp_path / "report.lock").exists()


def test_readers_flag_an_incomplete_report(cli, tmp_path: Path) -> None:
    _, _, out = _interrupt_scan(tmp_path, signal.SIGINT, stop_at=2)
    show = cli("show", out)
    assert (
        show.code == 0
        and "this report is incomplete: the run was stopped by SIGINT after 2 of 50" in show.stderr
    )
    gate = cli("gate", out, "--max-underflow", "1")
    assert gate.code == 1 and "incomplete" in gate.stdout and "--allow-incomplete" in gate.stdout
    assert (
        json.loads(cli("gate", out, "--max-underflow", "1", "--json").stdout)["complete"] is False
    )
    assert cli("gate", out, "--max-underflow", "1", "--allow-incomplete").code == 0


def test_a_second_run_into_the_same_output_refuses(cli, tmp_path: Path) -> None:
    out = tmp_path / "r"
    with output_lock(out):  # a live run (this process) holds the output
        line = one_error_line(cli("scan", SAMPLES / "quadratic.py", "--steps", "1", "--out", out))
        assert f"another fpaudit run (pid {os.getpid()}) is writing" in line
    assert cli("scan", SAMPLES / "quadratic.py", "--steps", "1", "--out", out).code == 0


def test_a_stale_lock_from_a_killed_run_is_taken_over(cli, tmp_path: Path) -> None:
    out = tmp_path / "r"
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    import platform

    (tmp_path / "r.lock").write_text(f"{dead.stdout.strip()} {platform.node()}\n")
    assert cli("scan", SAMPLES / "quadratic.py", "--steps", "1", "--out", out).code == 0
    assert not (tmp_path / "r.lock").exists()


def test_lock_errors_are_report_errors(tmp_path: Path) -> None:
    with output_lock(tmp_path / "r"), pytest.raises(ReportError), output_lock(tmp_path / "r"):
        pass


def test_steps_table_survives_round_trip_with_incomplete_meta(tmp_path: Path) -> None:
    _, _, out = _interrupt_scan(tmp_path, signal.SIGINT, stop_at=1)
    steps = pd.read_parquet(out / "steps.parquet")
    assert list(steps["step"]) == [0]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["steps_run"] == 1 and meta["steps_requested"] == 50
