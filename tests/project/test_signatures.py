"""Values cross the library's layers as typed records, not as ``dict[str, Any]``.

Every public signature of the library outside ``cli/`` (a module-level function, a
public method or field of a public class, a public module constant) is read with
``ast``: a parameter, return or field annotated ``dict[str, Any]`` or
``Mapping[str, Any]`` carries data whose keys strict mypy cannot check, so a renamed
key breaks at run time. The ones left are listed below, each with why; a new one fails
this test until it is a record (a frozen dataclass with ``to_dict()``) or listed here.

JSON's own boundary is not counted: ``to_dict``/``to_meta``/``entries`` write JSON
values and ``from_dict``/``from_meta`` read them.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "fpaudit"
UNTYPED = ("dict[str, Any]", "Mapping[str, Any]")
JSON_BOUNDARY = {"to_dict", "to_meta", "entries", "from_dict", "from_meta"}

# Keyword arguments handed through to torch, Dynamo or Inductor as they came: their keys
# are torch's, not fpaudit's.
PASS_THROUGH = {
    "fpaudit.capture.torch_patches.Call.arguments",
    "fpaudit.capture.torch_patches.Call.extra",
    "fpaudit.capture.compiled.compiled_backend(options)",
    "fpaudit.capture.compiled.inductor_options->",
    "fpaudit.capture.compiled.mode_options->",
    "fpaudit.capture.compiled.InPlace.saved",
    "fpaudit.capture.compiled.observe_in_place(options)",
    "fpaudit.capture.oprules.works_on_grad(kwargs)",
    "fpaudit.capture.oprules.written(kwargs)",
    "fpaudit.capture.origin_probe.OriginTracker.before(kwargs)",
    "fpaudit.torch_internals.create_graph(kwargs)",
    "fpaudit.torch_internals_compile.compiled_module_parts->",
    "fpaudit.torch_internals_compile.context_backend->",
    "fpaudit.torch_internals_compile.inductor_backward(kwargs)",
    "fpaudit.torch_internals_compile.compile_backend(options)",
    "fpaudit.torch_internals_compile.plain_backward(kwargs)",
    "fpaudit.torch_internals_compile.mode_options->",
    "fpaudit.torch_internals_compile.cudagraphs_requested(kwargs)",
}

# meta.json itself and the tables' columns as pyarrow takes them: the report's open
# schema (readers use Report.info, a RunInfo, never these keys), and the command line's
# options as the user gave them (RunMeta.options, printed back as they were).
REPORT_FILES = {
    "fpaudit.report.checks.read_meta->",
    "fpaudit.report.checks.read_table(meta)",
    "fpaudit.report.records.STEP_DEFAULTS",
    "fpaudit.report.records.ReportBuilder.columns->",
    "fpaudit.report.runinfo.RunMeta.options",
    "fpaudit.report.schema.histogram_layout->",
    "fpaudit.report.schema.frame(columns)",
    # meta.json's object, derived from Report.info where JSON is written and compared
    "fpaudit.report.data.ReportData.meta->",
    # a writing command's own settings (scan's seed, run's optimizers, a trainer's
    # settings): JSON values no rule decides on, kept as written (RunInfo.settings)
    "fpaudit.report.runinfo.RunInfo.settings",
    "fpaudit.report.data.ReportData.record_run(settings)",
    "fpaudit.report.runinfo.RunInfo.options",  # RunMeta.options, stored
    # the steps table a caller hands the report (fpaudit run's every step): its columns,
    # STEP_COLUMNS, as pyarrow takes them, checked against the steps schema by frame()
    "fpaudit.report.data.ReportData.from_builder(steps)",
    "fpaudit.capture.audit.Audit.build_report(steps)",
    "fpaudit.integrations.AuditSession.finish(meta)",
    "fpaudit.rules.summary.json_rows->",  # a table's rows as JSON: the columns are the schema's
    "fpaudit.rules.summary.ModuleView.rows->",
}

# Not typed yet: none left (issue 36 typed the last ones); a signature that cannot be a
# record yet is named here, with why, so that none is added unseen.
NOT_YET: set[str] = set()

ALLOWED = PASS_THROUGH | REPORT_FILES | NOT_YET


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _function(prefix: str, node: ast.FunctionDef) -> Iterator[tuple[str, ast.expr | None]]:
    if node.name in JSON_BOUNDARY:
        return
    arguments = node.args
    for argument in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs,
                     arguments.vararg, arguments.kwarg):  # fmt: skip
        if argument is not None and argument.arg not in ("self", "cls"):
            yield f"{prefix}{node.name}({argument.arg})", argument.annotation
    yield f"{prefix}{node.name}->", node.returns


def _public(node: ast.stmt) -> str | None:
    """The public name ``node`` defines (a function, class or annotated name), or None."""
    if isinstance(node, ast.FunctionDef | ast.ClassDef):
        name = node.name
    elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        name = node.target.id
    else:
        return None
    return None if name.startswith("_") else name


def _members(prefix: str, body: list[ast.stmt]) -> Iterator[tuple[str, ast.expr | None]]:
    """The annotations of the public functions and annotated names of ``body``."""
    for node in body:
        name = _public(node)
        if name is None:
            continue
        if isinstance(node, ast.FunctionDef):
            yield from _function(prefix, node)
        elif isinstance(node, ast.AnnAssign):
            yield f"{prefix}{name}", node.annotation
        elif isinstance(node, ast.ClassDef) and not prefix:  # a class's own members
            yield from _members(f"{name}.", node.body)


def _annotations(tree: ast.Module) -> Iterator[tuple[str, ast.expr | None]]:
    """Every public signature's annotations, by where they stand."""
    yield from _members("", tree.body)


def signatures() -> dict[str, str]:
    """The library's public signatures outside ``cli/`` (the command line's own: nothing
    reads them across a layer), where -> annotation."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module(path)
        if not module.startswith("fpaudit.cli"):
            for where, annotation in _annotations(ast.parse(path.read_text())):
                found[f"{module}.{where}"] = ast.unparse(annotation) if annotation else ""
    return found


def untyped_signatures() -> set[str]:
    """Where the library's public signatures carry ``dict[str, Any]``-like data."""
    return {where for where, text in signatures().items() if any(u in text for u in UNTYPED)}


def test_no_new_untyped_values_cross_a_layer() -> None:
    added = sorted(untyped_signatures() - ALLOWED)
    assert not added, "carry these as frozen, typed records (or list them, with why):\n" + (
        "\n".join(added)
    )


def test_the_allowed_list_names_only_what_is_there() -> None:
    # a signature typed since, or renamed: its entry goes, so the list stays true
    assert sorted(ALLOWED - untyped_signatures()) == []


def test_the_records_of_issue_36_are_typed() -> None:
    # the values the command line reads most: typed, so a renamed field fails mypy
    typed = {
        "fpaudit.rules.analysis.totals->",
        "fpaudit.rules.findings.skip_statistics->",
        "fpaudit.rules.recommendation.unscalable->",
        "fpaudit.rules.recommendation.Recommendation.modules",
        "fpaudit.report.runinfo.RunInfo.scaler",
        "fpaudit.report.runinfo.RunInfo.training",
    }
    annotations = signatures()
    assert {where: annotations[where] for where in sorted(typed)} == {
        "fpaudit.report.runinfo.RunInfo.scaler": "ScalerInfo | None",
        "fpaudit.report.runinfo.RunInfo.training": "SkipStatistics | None",
        "fpaudit.rules.analysis.totals->": "Totals",
        "fpaudit.rules.findings.skip_statistics->": "SkipStatistics",
        "fpaudit.rules.recommendation.Recommendation.modules": "list[ModuleUnderflow]",
        "fpaudit.rules.recommendation.unscalable->": "list[UnscalableOp]",
    }


def test_the_capture_and_report_records_of_issue_36_are_typed() -> None:
    # what the capture writes into a report and the report hands its readers
    typed = {
        "fpaudit.capture.torch_patches.scaler_settings->": "ScalerInfo",
        "fpaudit.capture.autocast.probe->": "AutocastPrediction",
        "fpaudit.capture.autocast.predict(prediction)": "AutocastPrediction | None",
        "fpaudit.capture.compiled_receiver.CompiledReceiver.info->": "CompiledInfo | None",
        "fpaudit.kernels.blockstats.summary->": "BlockCounts",
        "fpaudit.report.runinfo.RunInfo.autocast": "AutocastPrediction | None",
        "fpaudit.report.runinfo.RunInfo.compiled": "CompiledInfo | None",
    }
    annotations = signatures()
    assert {where: annotations[where] for where in typed} == typed
