"""One formatter interface per result (fpaudit.cli.formatters), and the one place that
turns how a command ended into words and an exit status (fpaudit.cli.commands)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from fpaudit.cli import formatters, render
from fpaudit.errors import (
    ForkedChildEnded,
    Interrupted,
    Named,
    ScriptExited,
    StoppedRun,
    StoppedWhileWriting,
    Wording,
)
from fpaudit.numerics.formats import FORMATS
from fpaudit.rules.gating import gate

from ..conftest import CliResult
from ..reports import report_from


def test_json_is_the_results_shape_and_the_terminal_its_drawing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    drawn: list[object] = []
    outputs = formatters.Outputs(lambda result, *, top: drawn.append((result, top)))
    outputs.chosen(False, top=3).write("result")
    assert drawn == [("result", 3)] and capsys.readouterr().out == ""

    class Result:
        def to_dict(self) -> dict[str, int]:
            return {"a": 1}

    outputs.chosen(True, top=3).write(Result())  # the layout is the terminal's alone
    assert json.loads(capsys.readouterr().out) == {"a": 1} and len(drawn) == 1


def test_every_declared_output_has_a_terminal_and_a_json_writer() -> None:
    declared = {
        name: value for name, value in vars(formatters).items()
        if isinstance(value, formatters.Outputs)
    }  # fmt: skip
    assert "GATE" in declared and "FORMATS" in declared
    for name, outputs in declared.items():
        assert isinstance(outputs.chosen(True), formatters.Json), name
        assert isinstance(outputs.chosen(False), formatters.Terminal), name


def test_the_gate_writes_the_same_verdict_to_json_and_github(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import torch

    # 2**-30 is below fp16's round-to-zero edge 2**-25: every value underflows at S = 1
    result = gate(report_from({"a": torch.full((8,), 2.0**-30)}), "fp16", 0.001, log2_scale=0)
    assert not result.passed
    formatters.GATE.chosen(True).write(result)
    shown = json.loads(capsys.readouterr().out)
    assert [f["reason"] for f in shown["failures"]] == [f.as_flag() for f in result.failures]
    stream = io.StringIO()
    formatters.GitHubAnnotations("report", stream).write(result)
    lines = stream.getvalue().splitlines()
    assert lines and all(line.startswith("::error") for line in lines)
    assert capsys.readouterr().out == ""  # annotations go to their stream only


def test_the_formats_json_lists_every_format_once(capsys: pytest.CaptureFixture[str]) -> None:
    formatters.FORMATS.chosen(True).write(FORMATS.values())
    assert [row["format"] for row in json.loads(capsys.readouterr().out)] == list(FORMATS)


def test_how_a_stopped_or_exited_command_ends_is_worded_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    stopped = Interrupted("SIGTERM", 143)
    render.ending(StoppedRun(stopped, 3, 8, "out"))
    render.ending(StoppedRun(stopped, 3, None, "out", Wording("kept; pass ", Named("force", True))))
    during = StoppedWhileWriting(Interrupted(), Path("out"))
    render.ending(StoppedRun(stopped, 3, 8, "out", while_writing=during))
    render.ending(ForkedChildEnded(0))
    render.ending(ScriptExited(1, "bye", note=Wording("kept ", Named("replace_partial", True))))
    assert capsys.readouterr().err.splitlines() == [
        "fpaudit: interrupted by SIGTERM after 3 of 8 step(s); the completed steps are in "
        "out, marked incomplete",
        "fpaudit: error: interrupted by SIGTERM after 3 step(s); kept; pass --force",
        "fpaudit: error: interrupted by SIGINT while writing the report; it was written whole "
        "to out",
        "fpaudit: interrupted by SIGTERM after 3 of 8 step(s); the completed steps are in "
        "out, marked incomplete",
        "fpaudit: note: kept --replace-partial",
        "bye",
    ]


def test_a_run_ends_with_its_scripts_status(tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    script = tmp_path / "train.py"
    script.write_text(
        "import sys, torch\n"
        "model = torch.nn.Linear(2, 1)\n"
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "model(torch.ones(1, 2)).sum().backward()\n"
        "optimizer.step()\n"
        "sys.exit(5)\n"
    )
    result: CliResult = cli("run", "--out", tmp_path / "report", "--", script)
    assert result.code == 5 and "Traceback" not in result.stderr
    assert (tmp_path / "report").is_dir()  # the completed step is kept
