"""CI output for ``fpaudit gate``: a JUnit XML file and GitHub Actions annotations.

:func:`junit_xml` turns a :class:`~fpaudit.rules.gating.GateResult` into one JUnit
``<testsuite>`` that test-report tools (Jenkins, GitLab, GitHub test-report
actions) display: one ``<testcase>`` per module in network order, one
``overall`` for the whole model, one ``evidence`` when the report is no evidence
(it measured nothing, holds inf/NaN or no completed step), for an
interrupted run one ``complete``, and for a ``fpaudit run`` report with error
findings one ``findings``. Which testcases fail is read from the gate's
own verdict (:attr:`~fpaudit.rules.gating.GateResult.failures`), never decided here.
A module fails only when the gate judged it (``--per-module``); with
``--overall`` the modules are listed as passing, their numbers in
``<system-out>``, and only ``overall`` can fail. ``overall`` fails when the
whole model's underflow fraction exceeds the limit or anything overflows,
whichever mode the gate ran in (with ``--per-module`` some module then fails
too). The XML agrees with the gate's exit code: it has a failure exactly when
the gate failed.

:func:`github_annotations` gives one ``::error`` workflow command per failing
testcase, for the CLI to print when ``GITHUB_ACTIONS`` is ``"true"``
(:func:`in_github_actions`). :func:`write_junit` writes the file atomically.
Standard library only (``xml.etree.ElementTree`` does the escaping).
"""

from __future__ import annotations

import os
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fpaudit.errors import flag
from fpaudit.report.outputs import write_atomically
from fpaudit.text import module_label, percent, scale_text

if TYPE_CHECKING:
    import pandas as pd

    from fpaudit.report.store import Report
    from fpaudit.rules.comparison import Change
    from fpaudit.rules.gating import Failure, GateResult

__all__ = [
    "ANNOTATION_TITLE",
    "escape_data",
    "escape_property",
    "gate_modules",
    "github_annotations",
    "in_github_actions",
    "junit_xml",
    "write_junit",
]

ANNOTATION_TITLE = "fpaudit gate"
OVERALL = "overall"
COMPLETE = "complete"
EVIDENCE = "evidence"
FINDINGS = "findings"
BASELINE = "baseline"  # the baseline report (gate --baseline) is no evidence
XML_DECLARATION = '<?xml version="1.0" encoding="UTF-8"?>\n'

_NOT_MODULES = (OVERALL, EVIDENCE, COMPLETE, FINDINGS, BASELINE)

# Characters XML 1.0 cannot hold at all (ElementTree writes them unescaped, which
# breaks every parser); lone surrogates come from undecodable file names.
_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


@dataclass(frozen=True)
class _Numbers:
    """What a testcase judges: one module's counts, or the whole model's."""

    underflow_fraction: float
    underflow: int
    nonzero: int
    overflow: int

    @classmethod
    def of(cls, row: Mapping[str, Any]) -> _Numbers:
        return cls(
            float(row["underflow_fraction"]),
            int(row["underflow"]),
            int(row["nonzero"]),
            int(row["overflow"]),
        )


@dataclass(frozen=True)
class _Failure:
    name: str  # testcase name: a module label, "overall" or "complete"
    kind: str  # JUnit failure type: "underflow", "overflow" or "incomplete"
    message: str
    details: str


def _limits(result: GateResult) -> list[tuple[str, str]]:
    """The gate's limits as (key, value): ``max_underflow``, and against a baseline
    ``baseline`` and ``max_increase``."""
    pairs = []
    if result.policy.max_underflow is not None:
        pairs.append(("max_underflow", f"{result.policy.max_underflow:g}"))
    if result.policy.max_increase is not None:
        pairs += [
            ("baseline", str(result.baseline)),
            ("max_increase", f"{result.policy.max_increase:g}"),
        ]
    return pairs


def _numbers_text(numbers: _Numbers, result: GateResult) -> str:
    """Every number of a testcase, one ``key: value`` per line."""
    return "\n".join(
        [
            f"format: {result.format}",
            f"scale: {scale_text(result.log2_scale)} ({result.scale_source})",
            *(f"{key}: {value}" for key, value in _limits(result)),
            f"underflow_fraction: {numbers.underflow_fraction:.6g} "
            f"({percent(numbers.underflow_fraction)})",
            f"underflow: {numbers.underflow}",
            f"nonzero: {numbers.nonzero}",
            f"overflow: {numbers.overflow}",
        ]
    )


def _failure(failure: Failure, result: GateResult, report_path: str) -> _Failure:
    """The testcase failure of one of the gate's failures (the gate decided it; this
    only names its testcase and adds the numbers)."""
    from fpaudit.rules import gating

    if failure.subject == gating.OVERALL:
        name, numbers = OVERALL, _numbers_text(_overall(result), result)
    elif failure.subject == gating.COMPLETE:
        name, numbers = COMPLETE, "complete: false"
    elif failure.subject == gating.EVIDENCE:
        name, numbers = EVIDENCE, _evidence_text(result)
    elif failure.subject == gating.FINDINGS:
        name, numbers = FINDINGS, f"error findings: {len(result.error_findings)}"
    elif failure.subject == gating.BASELINE:
        name, numbers = BASELINE, f"baseline: {result.baseline}"
    else:
        name = module_label(failure.subject)
        offender = next((o for o in result.offenders if o.module == failure.subject), None)
        regressed = next((c for c in result.regressions if c.module == failure.subject), None)
        numbers = ""
        if offender is not None:
            counts = (offender.underflow_fraction, offender.underflow, offender.nonzero)
            numbers = _numbers_text(_Numbers(*counts, offender.overflow), result)
        elif regressed is not None:
            numbers = _change_text(regressed, result)
    # An overflow is the worse failure: a dynamic scaler skips the step, a static one trains on inf.
    kind = gating.OVERFLOW if gating.OVERFLOW in failure.kinds else failure.kinds[0]
    # The JUnit file and annotations are the command line's output: its flags, not parameters.
    message = failure.as_flag()
    return _Failure(name, kind, message, f"report: {report_path}\n{numbers}".rstrip())


def _change_text(change: Change, result: GateResult) -> str:
    """A regressed module's numbers in both reports, one ``key: value`` per line."""
    return "\n".join(
        [
            f"format: {result.format}",
            f"scale: {scale_text(result.log2_scale)} ({result.scale_source})",
            *(f"{key}: {value}" for key, value in _limits(result)),
            f"baseline_underflow_fraction: {change.base_underflow or 0.0:.6g}",
            f"underflow_fraction: {change.new_underflow or 0.0:.6g}",
            f"increase: {change.underflow_change or 0.0:.6g}",
            f"baseline_overflow: {change.base_overflowed}",
            f"overflow: {change.new_overflowed}",
        ]
    )


def _evidence_text(result: GateResult) -> str:
    return "\n".join(
        [
            f"steps_run: {result.steps_run}",
            f"nonzero: {result.nonzero}",
            f"nonfinite: {result.nonfinite}",
            f"nonfinite_loss_steps: {result.nonfinite_loss_steps}",
            f"allow_nonfinite: {'true' if result.policy.allow_nonfinite else 'false'}",
        ]
    )


def _overall(result: GateResult) -> _Numbers:
    return _Numbers(result.underflow_fraction, result.underflow, result.nonzero, result.overflow)


def _failures(result: GateResult, report_path: str) -> list[_Failure]:
    """Every failing testcase, in file order: modules, ``overall``, ``evidence``, ``complete``."""
    failures = [_failure(f, result, report_path) for f in result.failures]
    # Two failures never share a testcase: modules, overall, evidence, complete are apart.
    order = {OVERALL: 1, EVIDENCE: 2, COMPLETE: 3, FINDINGS: 4, BASELINE: 5}
    return sorted(failures, key=lambda f: order.get(f.name, 0))


def gate_modules(report: Report, result: GateResult, *, include_loss: bool = False) -> pd.DataFrame:
    """The module table :func:`junit_xml` wants: at the gate's scale, format and scope.

    Pass the ``include_loss`` the gate ran with.
    """
    from fpaudit.rules.gating import judged_module_table

    table = judged_module_table(report, result, include_loss=include_loss)
    # the numbers the gate judged (values no loss scale fixes apart, as the gate counts them)
    return table.assign(
        underflow_fraction=table["judged_underflow_fraction"],
        underflow=table["judged_underflow"],
        overflow=table["judged_overflow"],
    )


def _xml_text(text: str) -> str:
    return _NOT_XML.sub("\ufffd", text)


def _sub(parent: ET.Element, tag: str, text: str | None = None, **attributes: str) -> ET.Element:
    element = ET.SubElement(parent, tag, {k: _xml_text(v) for k, v in attributes.items()})
    if text is not None:
        element.text = _xml_text(text)
    return element


def junit_xml(
    result: GateResult,
    modules: pd.DataFrame,
    *,
    report_path: str,
    suite_name: str = "fpaudit gate",
) -> str:
    """The gate's verdict as a JUnit XML document (declaration included, indented).

    ``modules`` is :func:`fpaudit.rules.analysis.module_table` at the gate's scale,
    format and scope (see :func:`gate_modules`); its rows, in order, become the
    module testcases. Each failure's ``message`` holds the numbers: underflow
    fraction against the limit, counts, overflow, format and scale.
    """
    classname = f"fpaudit.gate.{result.format}"
    failures: dict[str, _Failure] = {}
    for failure in _failures(result, report_path):  # evidence may fail for several reasons
        first = failures.get(failure.name)
        failures[failure.name] = (
            failure
            if first is None
            else _Failure(
                first.name, first.kind, f"{first.message}; {failure.message}", first.details
            )
        )
    cases: list[tuple[str, str | None]] = []  # (name, system-out)
    seen: set[str] = set()
    for row in _rows(modules):
        name = module_label(str(row["module"]))
        seen.add(name)
        cases.append((name, f"report: {report_path}\n{_numbers_text(_Numbers.of(row), result)}"))
    # Offenders the table lacks (it should hold them all) still get their testcase.
    for missing in failures.values():
        if missing.name not in seen and missing.name not in _NOT_MODULES:
            cases.append((missing.name, None))
    cases.append((OVERALL, f"report: {report_path}\n{_numbers_text(_overall(result), result)}"))
    if EVIDENCE in failures:  # the report measured nothing, or inf/NaN, or no step
        cases.append((EVIDENCE, None))
    if not result.complete:
        allowed = (
            f"allowed by {flag('allow_incomplete')}"
            if result.policy.allow_incomplete
            else "not allowed"
        )
        cases.append((COMPLETE, f"the report's run was interrupted ({allowed})"))
    if result.error_findings:  # fpaudit run's misuse rules of severity error
        allowed = (
            f"allowed by {flag('allow_errors')}" if result.policy.allow_errors else "not allowed"
        )
        cases.append((FINDINGS, f"error findings: {len(result.error_findings)} ({allowed})"))
    if BASELINE in failures:  # gate --baseline: the baseline is no evidence
        cases.append((BASELINE, None))

    n_failures = sum(1 for name, _ in cases if name in failures)
    counts = {
        "tests": str(len(cases)),
        "failures": str(n_failures),
        "errors": "0",
        "skipped": "0",
        "time": "0",
    }
    root = ET.Element("testsuites", {"name": _xml_text(suite_name), **counts})
    suite = _sub(root, "testsuite", name=suite_name, **counts)
    properties = _sub(suite, "properties")
    for key, value in _properties(result, report_path):
        _sub(properties, "property", name=key, value=value)
    for name, system_out in cases:
        case = _sub(suite, "testcase", classname=classname, name=name, time="0")
        failed = failures.get(name)
        if failed is not None:  # its text holds the numbers: no <system-out> too
            _sub(case, "failure", failed.details, message=failed.message, type=failed.kind)
        elif system_out is not None:
            _sub(case, "system-out", system_out)
    ET.indent(root, space="  ")
    return XML_DECLARATION + ET.tostring(root, encoding="unicode") + "\n"


def _properties(result: GateResult, report_path: str) -> list[tuple[str, str]]:
    """The suite's properties: the gate's format, scale, limits, mode and verdict."""
    return [
        ("format", result.format),
        ("scale", scale_text(result.log2_scale)),
        ("log2_scale", str(result.log2_scale)),
        ("scale_source", result.scale_source),
        *_limits(result),
        ("mode", "per-module" if result.policy.per_module else "overall"),
        ("report", report_path),
        ("complete", "true" if result.complete else "false"),
        ("passed", "true" if result.passed else "false"),
    ]


def _rows(modules: pd.DataFrame) -> Iterable[dict[str, Any]]:
    columns = ("module", "underflow_fraction", "underflow", "nonzero", "overflow")
    missing = [c for c in columns if c not in modules.columns]
    if missing:
        raise ValueError(f"modules lacks column(s) {', '.join(missing)}")
    for row in modules[list(columns)].to_dict(orient="records"):
        yield {str(k): v for k, v in row.items()}


def write_junit(text: str, path: Path) -> None:
    """Write ``text`` (UTF-8, LF) to ``path`` atomically (``outputs.write_atomically``).

    Missing folders are created; raises :class:`~fpaudit.errors.UsageError` (one
    line) when one cannot be or the file cannot be written.
    """
    data = text.encode("utf-8")
    write_atomically(path, lambda handle: handle.write(data), option="junit")


def escape_data(text: str) -> str:
    """Escape the message of a GitHub workflow command (``%``, CR, LF)."""
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def escape_property(text: str) -> str:
    """Escape a property value of a workflow command (as data, plus ``:`` and ``,``)."""
    return escape_data(text).replace(":", "%3A").replace(",", "%2C")


def github_annotations(result: GateResult, *, report_path: str) -> list[str]:
    """One ``::error`` line per failing testcase of :func:`junit_xml`; empty when passed.

    GitHub shows the first 10 error annotations of a step; the JUnit file has them all.
    """
    if result.passed:
        return []
    title = escape_property(ANNOTATION_TITLE)
    return [
        f"::error title={title}::{escape_data(f'{report_path}: {failure.message}')}"
        for failure in _failures(result, report_path)
    ]


def in_github_actions(environ: Mapping[str, str] = os.environ) -> bool:
    """True inside a GitHub Actions job (``GITHUB_ACTIONS`` is exactly ``"true"``)."""
    return environ.get("GITHUB_ACTIONS") == "true"
