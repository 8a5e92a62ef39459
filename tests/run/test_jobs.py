"""A scan or a run to a report on disk, as one library call (fpaudit.run.jobs): where the
report may go, what is written, and how a run that does not simply succeed ends (a typed
exception the CLI maps to its exit status)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from fpaudit.errors import ModelFileError, ReportExists, ScriptExited, UsageError
from fpaudit.report.store import Report
from fpaudit.run.jobs import report_target, run_to_report, scan_to_report
from fpaudit.run.scan import ScanOptions
from fpaudit.run.training import RunOptions

from ..conftest import MODELS

# A loop of N optimizer steps; then it exits with ENDING (None: it finishes).
LOOP = """
import sys
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range({steps}):
    optimizer.zero_grad()
    model(torch.randn(2, 4)).pow(2).mean().backward()
    optimizer.step()
{ending}
"""


def _script(tmp_path: Path, steps: int, ending: str = "") -> Path:
    path = tmp_path / f"loop_{steps}_{len(ending)}.py"
    path.write_text(textwrap.dedent(LOOP.format(steps=steps, ending=ending)))
    return path


def test_a_target_names_a_new_directory_in_the_library_words_and_the_flags(
    tmp_path: Path,
) -> None:
    with pytest.raises(UsageError) as caught:
        report_target(".")
    assert str(caught.value) == (
        "out '.' names no new directory; give the report a name, for example out='fpaudit-report'"
    )
    assert caught.value.as_flag() == (
        "--out '.' names no new directory; give the report a name, for example --out fpaudit-report"
    )
    (tmp_path / "file").write_text("")
    with pytest.raises(UsageError) as caught:
        report_target(tmp_path / "file" / "sub" / "report")
    # the one wording of fpaudit.report.outputs.make_parent, and the file in the way
    assert caught.value.as_flag() == (
        f"--out: cannot create folder {tmp_path / 'file' / 'sub'}: a file is in the way "
        f"({tmp_path / 'file'})"
    )
    with pytest.raises(UsageError, match=r"^out: the name x{40}\.\.\. is 256 bytes long"):
        report_target(tmp_path / ("x" * 256))


def test_a_target_refuses_an_existing_report_unless_forced(tmp_path: Path) -> None:
    (tmp_path / "report").mkdir()
    with pytest.raises(ReportExists) as caught:
        report_target(tmp_path / "report")
    assert caught.value.as_flag().endswith("already exists; pass --force to overwrite it")
    target = report_target(tmp_path / "report", force=True)
    assert target.path == tmp_path / "report" and target.force


class _Dashboard:
    """Counts what the job feeds it."""

    def __init__(self) -> None:
        self.steps = 0
        self.closed_with: list[Report | None] = []

    def write_step(self, audit: object) -> None:
        self.steps += 1

    def close(self, report: Report | None = None) -> None:
        self.closed_with.append(report)


def test_a_scan_is_written_with_its_progress_and_its_dashboard(tmp_path: Path) -> None:
    import contextlib

    advanced: list[int] = []

    @contextlib.contextmanager
    def progress(steps: int):  # type: ignore[no-untyped-def]
        assert steps == 2
        yield lambda update: advanced.append(update.step)

    dashboard = _Dashboard()
    target = report_target(tmp_path / "scan")
    done = scan_to_report(
        MODELS / "tiny_grads.py", ScanOptions(steps=2, device="cpu"), target,
        progress=progress, dashboard=lambda: dashboard,
    )  # fmt: skip
    assert done is not None and done.batches_ended_on == ()
    written = Report.read(tmp_path / "scan")
    assert written.info.steps_run == done.report.info.steps_run == 2
    assert advanced[-1] == 2
    # one captured step each, then closed once (a scan's dashboard gets no report)
    assert dashboard.steps == 2 and dashboard.closed_with == [None]
    assert not (tmp_path / "scan.lock").exists()  # the output lock is released


def test_a_run_is_written_and_its_dashboard_gets_the_report(tmp_path: Path) -> None:
    dashboard = _Dashboard()
    done = run_to_report(
        _script(tmp_path, 3), [], RunOptions(), report_target(tmp_path / "run"),
        dashboard=lambda: dashboard,
    )  # fmt: skip
    assert done.ending is None and done.while_writing is None
    assert Report.read(tmp_path / "run").info.steps_run == 3
    assert dashboard.closed_with == [done.report]
    assert done.format.name == "fp16"  # no autocast: a run is judged in fp16


def test_a_script_that_exits_keeps_its_steps_and_ends_with_its_status(tmp_path: Path) -> None:
    done = run_to_report(
        _script(tmp_path, 2, "sys.exit('stopping here')"), [], RunOptions(),
        report_target(tmp_path / "run"),
    )  # fmt: skip
    assert isinstance(done.ending, ScriptExited)
    # Python prints sys.exit("text")'s text and exits 1
    assert (done.ending.exit_code, done.ending.message) == (1, "stopping here")
    assert Report.read(tmp_path / "run").info.steps_run == 2


def test_a_shorter_run_keeps_a_fuller_report_and_says_so_at_once(tmp_path: Path) -> None:
    run_to_report(_script(tmp_path, 3), [], RunOptions(), report_target(tmp_path / "run"))
    again = report_target(tmp_path / "run", force=True)
    with pytest.raises(ScriptExited) as caught:
        run_to_report(_script(tmp_path, 1, "sys.exit(3)"), [], RunOptions(), again)
    assert caught.value.exit_code == 3 and caught.value.note is not None
    assert caught.value.note.as_flag() == (
        f"kept the existing report {tmp_path / 'run'} (3 completed step(s)): this run "
        "completed 1; pass --replace-partial to replace it anyway"
    )
    assert Report.read(tmp_path / "run").info.steps_run == 3  # untouched
    replace = report_target(tmp_path / "run", force=True, replace_partial=True)
    done = run_to_report(_script(tmp_path, 1, "sys.exit(3)"), [], RunOptions(), replace)
    assert isinstance(done.ending, ScriptExited) and done.ending.exit_code == 3
    assert Report.read(tmp_path / "run").info.steps_run == 1


def test_a_script_without_an_optimizer_step_writes_nothing(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="finished without an optimizer step"):
        run_to_report(_script(tmp_path, 0), [], RunOptions(), report_target(tmp_path / "run"))
    with pytest.raises(ScriptExited) as caught:
        run_to_report(
            _script(tmp_path, 0, "sys.exit(4)"), [], RunOptions(), report_target(tmp_path / "r")
        )
    assert caught.value.exit_code == 4 and caught.value.error is not None
    assert str(caught.value.error).endswith("exited before an optimizer step: nothing to audit")
    assert not (tmp_path / "run").exists() and not (tmp_path / "r").exists()
