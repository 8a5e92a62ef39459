"""The library speaks in its own terms (``force=True``, ``max_underflow``); the CLI says
the same with flags (``--force``, ``--max-underflow``). Called without the CLI, every
message here names the library's parameter; ``as_flag()`` is what the CLI prints."""

from __future__ import annotations

import ast
import pickle
import re
from pathlib import Path

import pytest
import torch

from fpaudit.capture.audit import Selection
from fpaudit.cli import ci
from fpaudit.errors import (
    FpauditError,
    Named,
    OptionError,
    ReportError,
    ReportExists,
    UsageError,
    Wording,
    flag,
)
from fpaudit.report import outputs
from fpaudit.rules.gating import gate

from .conftest import ROOT
from .reports import report_from

N = 8
UNDERFLOWS = torch.full((N,), 2.0**-30)  # below fp16's round-to-zero edge 2**-25 at S = 1
FINE = torch.ones(N)


# -- the mechanism -------------------------------------------------------------
def test_a_named_parameter_is_worded_by_the_library_and_by_the_command_line() -> None:
    cases = [
        (Named("max_steps"), "max_steps", "--max-steps"),
        (Named("force", True), "force=True", "--force"),
        (Named("policy", "torch"), "policy='torch'", "--policy torch"),
        (Named("exclude_modules", ("*",)), "exclude_modules=('*',)", "--exclude-module '*'"),
        (Named("modules", ("a", "b c")), "modules=('a', 'b c')", "--module a --module 'b c'"),
        (Named("recipes", ("mxfp4",)), "recipes=('mxfp4',)", "--recipe mxfp4"),
    ]
    for named, library, command_line in cases:
        assert (str(named), named.as_flag()) == (library, command_line)


def test_only_named_parts_become_flags() -> None:
    # A path (or a module) spelled like a parameter is text: it stays as it is.
    wording = Wording("/tmp/out/force: choose another ", Named("out"), " than out")
    assert str(wording) == "/tmp/out/force: choose another out than out"
    assert wording.as_flag() == "/tmp/out/force: choose another --out than out"


def test_a_parameter_whose_flag_is_spelled_otherwise_takes_its_spec_flag() -> None:
    # Selection's fields are plural, their repeatable flags singular (fpaudit.cli.options).
    assert [flag(n) for n in ("modules", "exclude_modules", "ops", "exclude_ops")] == [
        "--module",
        "--exclude-module",
        "--op",
        "--exclude-op",
    ]
    assert flag("allow_incomplete") == "--allow-incomplete"


# -- errors ----------------------------------------------------------------------
def test_a_module_glob_that_matches_nothing_names_the_selection_field() -> None:
    with pytest.raises(OptionError) as caught:
        Selection(modules=("[",)).check_modules(["linear"])
    assert str(caught.value) == (
        "modules '[' matches no module of the model (modules are: <loss>, linear)"
    )
    assert caught.value.as_flag() == (
        "--module '[' matches no module of the model (modules are: <loss>, linear)"
    )


def test_an_op_glob_that_matches_nothing_names_the_selection_field() -> None:
    with pytest.raises(OptionError) as caught:
        Selection(exclude_ops=("aten.mmm.*",)).check_ops(["aten.mm.default"])
    assert str(caught.value).startswith("exclude_ops 'aten.mmm.*' matches no backward op")
    assert caught.value.as_flag().startswith("--exclude-op 'aten.mmm.*' matches no backward op")


def test_a_selection_that_keeps_nothing_names_its_fields() -> None:
    with pytest.raises(UsageError) as caught:
        Selection(modules=("lin*",), exclude_modules=("*",)).check_modules(["linear"])
    assert str(caught.value) == (
        "the selection modules=('lin*',) exclude_modules=('*',) leaves no module of the "
        "model to measure"
    )
    assert caught.value.as_flag() == (
        "the selection --module 'lin*' --exclude-module '*' leaves no module of the model "
        "to measure"
    )
    with pytest.raises(UsageError) as caught:
        Selection(ops=("aten.mm.*",), exclude_ops=("*",)).check_ops(["aten.mm.default"])
    assert str(caught.value) == (
        "the selection ops=('aten.mm.*',) exclude_ops=('*',) leaves no backward op of the "
        "model to measure"
    )
    assert caught.value.as_flag() == (
        "the selection --op 'aten.mm.*' --exclude-op '*' leaves no backward op of the model "
        "to measure"
    )


def test_an_existing_report_asks_for_force_true(tmp_path: Path) -> None:
    error = ReportExists(tmp_path / "r")
    assert str(error) == f"{tmp_path / 'r'} already exists; pass force=True to overwrite it"
    assert error.as_flag() == f"{tmp_path / 'r'} already exists; pass --force to overwrite it"


def test_an_output_that_cannot_be_made_names_the_option_that_gave_it(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(UsageError) as caught:
        outputs.make_parent(tmp_path / "file" / "report", "out")
    assert str(caught.value) == (
        f"out: cannot create folder {tmp_path / 'file'}: a file is in the way"
    )
    assert caught.value.as_flag() == (
        f"--out: cannot create folder {tmp_path / 'file'}: a file is in the way"
    )
    with pytest.raises(UsageError) as caught:
        ci.write_junit("<x/>", tmp_path)
    assert str(caught.value) == f"junit: {tmp_path} is a directory"
    assert caught.value.as_flag() == f"--junit: {tmp_path} is a directory"


def test_a_missing_recipe_names_the_recipes_parameter() -> None:
    from fpaudit.rules.blockplan import block_table

    with pytest.raises(UsageError) as caught:
        block_table(report_from({"a": FINE}), "mxfp4")
    assert str(caught.value) == (
        "the report has no block statistics for recipe 'mxfp4' (recorded: none); "
        "scan or run with recipes=('mxfp4',)"
    )
    assert caught.value.as_flag().endswith("; scan or run with --recipe mxfp4")


def test_scale_text_errors_name_the_option_given() -> None:
    from fpaudit.cli import config

    with pytest.raises(OptionError) as caught:
        config.parse_scale("3", "loss_scale")
    assert str(caught.value).startswith("loss_scale 3 is not a power of two")
    assert caught.value.as_flag().startswith("--loss-scale 3 is not a power of two")


class _OneRank:
    """torch.distributed for a world of one rank that pickles what it sends, as gloo does."""

    @staticmethod
    def get_rank() -> int:
        return 0

    @staticmethod
    def get_world_size() -> int:
        return 1

    @staticmethod
    def broadcast_object_list(objects: list[object], src: int) -> None:
        objects[:] = [pickle.loads(pickle.dumps(o)) for o in objects]

    @staticmethod
    def all_gather_object(gathered: list[object], mine: object) -> None:
        gathered[:] = [pickle.loads(pickle.dumps(mine))]


def test_an_error_crosses_ranks_with_its_parameters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rank 0 sends an error's parts to the others, which raise it again: its parameters
    # are still parameters there, so the CLI still words them as flags.
    from fpaudit.run import distributed

    monkeypatch.setattr(distributed, "dist", _OneRank())
    (tmp_path / "file").write_text("")
    with pytest.raises(UsageError) as caught:
        distributed._write_parts(report_from({"a": FINE}), tmp_path / "file" / "r", False)
    assert str(caught.value) == (
        f"out: cannot create folder {tmp_path / 'file'}: a file is in the way"
    )
    assert caught.value.as_flag() == (
        f"--out: cannot create folder {tmp_path / 'file'}: a file is in the way"
    )
    assert distributed._parts(OSError("disk")) == ("disk",)
    assert ReportError("writing failed: ", *distributed._parts(caught.value)).as_flag() == (
        f"writing failed: --out: cannot create folder {tmp_path / 'file'}: a file is in the way"
    )


# -- gate verdicts -----------------------------------------------------------------
def test_gate_reasons_name_the_library_options_and_render_as_flags() -> None:
    report = report_from({"a": UNDERFLOWS})
    report.update_info(complete=False)
    result = gate(report, "fp16", 0.001, log2_scale=0)
    reasons = result.reasons
    assert any("the limit 0.1% (max_underflow)" in reason for reason in reasons), reasons
    incomplete = [f for f in result.failures if f.subject == "(complete)"]
    assert [f.reason for f in incomplete] == [
        "the report is incomplete (its run was interrupted), which fails the gate; "
        "pass allow_incomplete=True to judge it anyway"
    ]
    assert [f.as_flag() for f in incomplete] == [
        "the report is incomplete (its run was interrupted), which fails the gate; "
        "pass --allow-incomplete to judge it anyway"
    ]
    assert not any("--" in reason for reason in reasons), reasons
    # gate --json prints the flags; the library's dict keeps its own terms.
    flagged = [f["reason"] for f in result.to_dict(flags=True)["failures"]]
    assert flagged == [f.as_flag() for f in result.failures]
    assert [f["reason"] for f in result.to_dict()["failures"]] == reasons
    assert any("the limit 0.1% (--max-underflow)" in reason for reason in flagged)


def test_nonfinite_and_empty_reasons_name_the_library_options() -> None:
    report = report_from({"a": torch.tensor([float("inf"), 1.0])})
    result = gate(report, "fp16", 0.5, log2_scale=0)
    (nonfinite,) = [f for f in result.failures if "nonfinite" in f.kinds]
    assert nonfinite.reason.endswith("; pass allow_nonfinite=True to judge them anyway")
    assert nonfinite.as_flag().endswith("; pass --allow-nonfinite to judge them anyway")


def test_measured_nothing_names_the_selection_fields() -> None:
    report = report_from({"a": torch.zeros(N)})
    report.update_info(selection={"modules": ("a", "b"), "exclude_ops": ("x",)})
    result = gate(report, "fp16", 0.5, log2_scale=0)
    (nothing,) = [f for f in result.failures if "nothing-measured" in f.kinds]
    assert "the scan's selection was modules a b; exclude_ops x; " in nothing.reason
    assert "the scan's selection was --module a b; --exclude-op x; " in nothing.as_flag()


# -- no flag in a library's raised message -------------------------------------------
# The CLI and its renderer speak in flags; every other module words its messages in
# library terms and names parameters with Named (fpaudit.errors).
CLI_MODULES = {
    "cli/commands.py",
    "cli/commands_report.py",
    "cli/commands_run.py",
    "cli/common.py",
    "cli/render.py",
}
_FLAG = re.compile(r"(?<![\w-])--[a-z]")
_MESSAGE_CALLS = re.compile(r"(Error|Exists|Exit|Wording|Failure)$")


def _called_name(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def _message_strings(tree: ast.AST) -> list[tuple[int, str]]:
    """String constants inside ``raise X(...)`` and inside calls that build a message
    (an error class, ``Wording``, ``Failure``), wherever they are."""
    calls: dict[int, ast.AST] = {}  # by id: a raised error's call is met twice
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and node.exc is not None:
            calls[id(node.exc)] = node.exc
        elif isinstance(node, ast.Call) and _MESSAGE_CALLS.search(_called_name(node)):
            calls[id(node)] = node
    found: dict[int, tuple[int, str]] = {}  # by id: a call may sit inside another
    for call in calls.values():
        for inner in ast.walk(call):
            if isinstance(inner, ast.Constant) and isinstance(inner.value, str):
                found[id(inner)] = (inner.lineno, inner.value)
    return sorted(found.values())


def test_library_messages_name_no_flag() -> None:
    package = ROOT / "fpaudit"
    files = [
        p
        for p in sorted(package.rglob("*.py"))
        if p.relative_to(package).as_posix() not in CLI_MODULES
    ]
    assert len(files) > 30  # the scan reads the library, not an empty folder
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {text!r}"
        for path in files
        for line, text in _message_strings(ast.parse(path.read_text(), str(path)))
        if _FLAG.search(text)
    ]
    assert offenders == []


def test_the_flag_scan_sees_a_flag_in_a_raised_message() -> None:
    caught = _message_strings(ast.parse('raise UsageError(f"choose another --out {x}")'))
    assert [text for _, text in caught if _FLAG.search(text)] == ["choose another --out "]
    assert _message_strings(ast.parse('x = "--out"')) == []


def test_every_fpaudit_error_has_a_command_line_wording() -> None:
    assert FpauditError("plain text").as_flag() == "plain text"
