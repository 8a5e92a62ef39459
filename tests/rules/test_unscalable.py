"""Issue 24: one rule of what a verdict counts, and the gate on a run's error findings.

Values that do not scale with the loss (``scales_with_loss`` false) keep their value at
every loss scale, so one that overflows or underflows a format does so at every S: no
loss scale fixes it. ``recommend``, ``gate``, ``show`` and ``fp16-plan`` judge the values
the scale answers for and count those apart (``fpaudit.rules.analysis``'s ``judged_*`` and
``unscalable_*`` columns).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from fpaudit.numerics.formats import FORMATS
from fpaudit.report.runinfo import Finding
from fpaudit.report.store import Report
from fpaudit.rules import analysis, gating
from fpaudit.rules.findings import SchedulerCall, scheduler_findings
from fpaudit.rules.gating import gate
from fpaudit.rules.recommendation import recommend
from fpaudit.run import fp16plan

from ..reports import report_from

FP16 = FORMATS["fp16"]

# grad scales with the loss; norm does not (an RMSNorm's rsqrt(var + eps) ** 3)
GRAD = torch.tensor([1.0, 2.0**-30])
NORM = torch.tensor([2.0e5, 1.0, 2.0**-30])


def split_report() -> Report:
    return report_from({"grad": GRAD, "norm": NORM}, fixed=frozenset({"norm"}))


def test_values_that_do_not_scale_are_counted_apart_at_every_scale() -> None:
    report = split_report()
    for log2_scale in (-10, 0, 11, 30):
        row = analysis.totals(report, FP16, log2_scale)
        # norm: 2e5 > 65504 overflows fp16 and 2**-30 <= 2**-25 rounds to zero, whatever S
        assert (row.unscalable_overflow, row.unscalable_underflow) == (1, 1)
        assert row.judged_overflow == row.overflow - 1
        assert row.judged_underflow == row.underflow - 1
        # 5 nonzero values: grad 1 and 2**-30, norm 2e5, 1 and 2**-30
        assert row.nonzero == 5
        assert row.judged_underflow_fraction == row.judged_underflow / 5


@pytest.mark.parametrize("log2_scale", range(-20, 40, 3))
def test_the_split_agrees_with_casting_to_fp16(log2_scale: int) -> None:
    """Oracle: torch's own cast. A value that scales is cast at x * 2**k (the judged
    counts at k); one that does not is cast as it is, whatever k (the unscalable ones)."""
    scale = 2.0**log2_scale

    def fates(values: torch.Tensor) -> tuple[int, int]:
        cast = values.to(torch.float16)
        return int(((cast == 0) & (values != 0)).sum()), int(cast.isinf().sum())

    grad_under, grad_over = fates(GRAD.double() * scale)
    norm_under, norm_over = fates(NORM)  # no scale applied: they do not scale
    row = analysis.totals(split_report(), FP16, log2_scale)
    assert (row.unscalable_underflow, row.unscalable_overflow) == (norm_under, norm_over)
    assert (row.judged_underflow, row.judged_overflow) == (grad_under, grad_over)


def test_recommend_lists_the_unscalable_values_apart_and_judges_the_rest() -> None:
    rec = recommend(split_report(), FP16, headroom_bits=4)
    # only grad limits S: amax 1 -> ceiling 2**11 = 2048 <= 65504 / 16 = 4094 < 2**12; the
    # smallest S as good: 2**6, where grad's 2**-30 becomes 2**-24 > 2**-25 (subnormal, as
    # 2**-19 is at 2**11): nothing the scale answers for is lost
    assert rec.ceiling_log2_scale == 11 and rec.log2_scale == 6 and rec.limiting_module == "grad"
    assert rec.underflow_fraction == 0.0
    # at S = 1 grad's 2**-30 <= 2**-25 underflows: 1 of 5 nonzero values
    assert rec.underflow_fraction_at_1 == pytest.approx(1 / 5)
    assert (rec.unscalable_overflow, rec.unscalable_underflow) == (1, 1)
    assert [group.to_dict() for group in rec.unscalable] == [
        {"node": "MulBackward0", "op": "aten.mul.Tensor", "underflow": 1, "overflow": 1,
         "modules": ["norm"]},
    ]  # fmt: skip


def test_the_gate_passes_at_the_recommended_scale_and_shows_what_it_set_apart() -> None:
    result = gate(split_report(), FP16, 0.0)
    assert result.passed and result.log2_scale == 6 and result.scale_source == "recommended"
    # judged: underflow 0 of 5 nonzero, overflow 0; apart: 1 overflow, 1 underflow
    assert (result.underflow, result.overflow, result.nonzero) == (0, 0, 5)
    assert (result.unscalable_overflow, result.unscalable_underflow) == (1, 1)
    assert result.to_dict()["unscalable_overflow"] == 1


def test_fail_unscalable_fails_the_gate_on_them_overall_and_per_module() -> None:
    result = gate(split_report(), FP16, 0.0, fail_unscalable=True)
    assert not result.passed
    (failure,) = result.failures
    assert failure.subject == gating.OVERALL and failure.kinds == (gating.UNSCALABLE,)
    assert failure.as_flag().startswith(
        "overall: 1 value(s) overflow and 1 value(s) underflow at every scale (they do not "
        "scale with the loss), which fails the gate with --fail-unscalable; "
    )
    per_module = gate(split_report(), FP16, 0.0, fail_unscalable=True, per_module=True)
    assert [(f.subject, f.kinds) for f in per_module.failures] == [
        ("norm", (gating.UNSCALABLE,)),
        (gating.OVERALL, (gating.UNSCALABLE,)),
    ]


def test_a_scale_that_overflows_what_it_scales_still_fails() -> None:
    # at 2**16 grad's 1.0 -> 65536 > 65504 overflows: the scale's own fault
    result = gate(split_report(), FP16, 0.0, log2_scale=16)
    assert not result.passed and result.overflow == 1 and result.unscalable_overflow == 1
    assert result.failures[0].kinds == (gating.OVERFLOW,)


def test_fp16_plan_judges_underflow_by_the_same_rule() -> None:
    report = split_report()
    # at S = 1, kept out nothing: 1 judged underflow (grad's 2**-30) of 5 nonzero
    assert (
        fp16plan._underflow(report, FP16, 0, set())
        == analysis.totals(report, FP16, 0).judged_underflow_fraction
        == pytest.approx(1 / 5)
    )


# -- the gate and run's error findings --------------------------------------------
def _finding(code: str, severity: str, line: int) -> Finding:
    return Finding(code, severity, "train.py", line, "what went wrong", steps=(0,), count=1)


def test_the_gate_fails_on_each_error_finding_and_not_on_warnings() -> None:
    report = report_from({"grad": torch.tensor([1.0])})
    report.update_info(findings=(
        _finding("clip-before-unscale", "error", 12),
        _finding("scheduler-on-skipped-step", "warning", 20),
        _finding("unscale-twice", "error", 15),
    ))  # fmt: skip
    result = gate(report, FP16, 0.0)
    assert not result.passed
    # two errors -> two failures, in the findings' order; the warning is not one
    assert [(f.subject, f.kinds) for f in result.failures] == [
        (gating.FINDINGS, (gating.ERROR_FINDING,)),
        (gating.FINDINGS, (gating.ERROR_FINDING,)),
    ]
    assert result.failures[0].as_flag() == (
        "the run found an error: clip-before-unscale at train.py:12 (what went wrong); "
        "pass --allow-errors to gate on the values alone"
    )
    assert "unscale-twice at train.py:15" in result.failures[1].reason
    assert len(result.error_findings) == 2
    allowed = gate(report, FP16, 0.0, allow_errors=True)
    assert allowed.passed and allowed.policy.allow_errors and len(allowed.error_findings) == 2


def test_a_report_without_findings_is_judged_on_its_values() -> None:
    report = report_from({"grad": torch.tensor([1.0])})
    report.update_info(findings=(_finding("scale-falling", "warning", 3),))
    assert gate(report, FP16, 0.0).passed


def test_junit_has_a_findings_case_that_fails_with_the_gate() -> None:
    from fpaudit.cli import ci

    report = report_from({"grad": torch.tensor([1.0])})
    report.update_info(findings=(_finding("clip-before-unscale", "error", 12),))
    result = gate(report, FP16, 0.0)
    text = ci.junit_xml(result, ci.gate_modules(report, result), report_path="r")
    assert '<testcase classname="fpaudit.gate.fp16" name="findings"' in text
    assert 'failures="1"' in text and "clip-before-unscale at train.py:12" in text


# -- calibration skips are not scheduler findings ------------------------------------
def _table(skipped: list[bool]) -> dict[str, list[object]]:
    n = len(skipped)
    return {"step": list(range(n)), "skipped": skipped, "loss_scale": [8.0] * n,
            "scale_after": [8.0] * n}  # fmt: skip


def test_a_scheduler_step_on_a_calibration_skip_is_not_a_finding() -> None:
    # steps 0 and 1 are the leading skips of a fresh scaler (calibration), step 2 is
    # taken, step 3 is skipped after calibration: only step 3's scheduler call is found.
    table = _table([True, True, False, True])
    calls = [SchedulerCall(("train.py", 9), step, "StepLR") for step in range(4)]
    (finding,) = scheduler_findings(table, calls)
    assert (finding.steps, finding.count) == ((3,), 1)


def test_a_run_that_never_takes_a_step_never_calibrated() -> None:
    # every step skipped: skip_statistics counts no calibration, so each call is found
    table = _table([True, True])
    calls = [SchedulerCall(("train.py", 9), step, "StepLR") for step in range(2)]
    (finding,) = scheduler_findings(table, calls)
    assert finding.steps == (0, 1)


def test_the_growth_interval_rule_by_hand() -> None:
    # 1/(N + 1) < 0.0005 -> N + 1 > 2000 -> N = 2000 (1/2001 = 0.04998%)
    assert fp16plan.growth_interval() == 2000
    assert 1 / (2000 + 1) < fp16plan.TARGET_SKIP_RATE <= 1 / 2000
    # a 1% target: 1/(N + 1) < 0.01 -> N = 100
    assert fp16plan.growth_interval(0.01) == 100
    # 3 of 4 steps overflow at 2S: a cycle of 2000 clean steps and 4/3 at 2S -> 1/2001.33
    assert fp16plan.growth_skip_rate(2000, 0.75) == pytest.approx(1 / (2000 + 4 / 3))
    # none seen at 2S: the scaler climbs on, to a scale that may overflow every step
    assert fp16plan.growth_skip_rate(2000, 0.0) == 1 / 2001


def test_the_condensed_columns_are_consistent() -> None:
    table = analysis.module_table(split_report(), FP16, 11)
    assert list(table["module"]) == ["grad", "norm"]
    np.testing.assert_array_equal(table["unscalable_overflow"], [0, 1])
    np.testing.assert_array_equal(table["unscalable_underflow"], [0, 1])
    assert isinstance(table, pd.DataFrame)
    assert (table["judged_underflow"] >= 0).all() and (table["judged_overflow"] >= 0).all()


def test_show_marks_the_values_apart_and_its_json_counts_them(cli, tmp_path: Path) -> None:
    path = tmp_path / "r"
    split_report().write(path)
    shown = cli("show", path, "--format", "fp16")
    assert shown.code == 0, shown.stderr
    assert "at every S" in shown.stdout  # the column, and the note under the table
    assert "not judged by the gate unless --fail-unscalable" in shown.stdout
    rows = {row["module"]: row for row in json.loads(cli("show", path, "--json").stdout)}
    # at the recommended 2**11: norm's 2e5 overflows and 2**-30 underflows, apart
    assert (rows["norm"]["unscalable_overflow"], rows["norm"]["unscalable_underflow"]) == (1, 1)
    assert (rows["norm"]["judged_overflow"], rows["norm"]["judged_underflow"]) == (0, 0)
    assert (rows["norm"]["overflow"], rows["norm"]["underflow"]) == (1, 1)  # what happens
    assert rows["grad"]["unscalable_overflow"] == 0
