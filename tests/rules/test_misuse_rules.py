"""fpaudit.rules.findings and fpaudit.run.steps on hand-built inputs: each rule fired and not fired,
with its exact site, steps and message (the arithmetic of each threshold shown)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from fpaudit.report.records import STEP_COLUMNS
from fpaudit.rules.findings import (
    CallLog,
    GradCall,
    SchedulerCall,
    SpanScale,
    grad_call_findings,
    mixed_scale_findings,
    scale_findings,
    scheduler_findings,
    skip_statistics,
    sorted_findings,
)
from fpaudit.run.steps import Step, steps_table

SITE = ("train.py", 42)


def _table(before: list[float], after: list[float], skipped: list[bool]) -> dict[str, list[Any]]:
    return {
        "step": list(range(len(before))),
        "loss_scale": before,
        "scale_after": after,
        "skipped": skipped,
    }


# -- calls on gradients still scaled (clip, step, .grad read) or unscaled twice --------
def test_calls_on_scaled_gradients_are_found_with_their_site_steps_and_message() -> None:
    log = CallLog()
    clip, step, read, unscale = (("train.py", n) for n in (30, 31, 32, 33))
    for index in (4, 5):
        log.add("clip", clip, index, True, "clip_grad_norm_(..., 1)")
        log.add("clip", clip, index, True, "clip_grad_norm_(..., 2)")  # the first detail stays
        log.add("step", step, index, True, "SGD")
        log.add("read", read, index, True)
        log.add("read", read, index, True)  # twice in a step counts once
        log.add("unscale", unscale, index, False)
    found = {f.code: f for f in grad_call_findings(log)}
    assert list(found) == [
        "clip-before-unscale",
        "step-without-unscale",
        "grad-read-while-scaled",
        "unscale-twice",
    ]
    assert [(f.where, f.steps, f.count) for f in found.values()] == [
        ("train.py:30", (4, 5), 2),
        ("train.py:31", (4, 5), 2),
        ("train.py:32", (4, 5), 2),
        ("train.py:33", (4, 5), 2),
    ]
    assert [f.severity for f in found.values()] == ["error", "error", "warning", "error"]
    assert found["clip-before-unscale"].message == (
        "clip_grad_norm_(..., 1) clipped gradients still multiplied by the loss scale S: the "
        "threshold is meant for unscaled gradients, so clipping is off by a factor S; "
        "call scaler.unscale_(optimizer) before clipping"
    )
    assert found["step-without-unscale"].message == (
        "SGD.step() ran on gradients still multiplied by the loss scale; "
        "call scaler.step(optimizer) (or scaler.unscale_(optimizer) first)"
    )
    assert found["grad-read-while-scaled"].message == (
        ".grad read while the gradients are still multiplied by the loss scale: values "
        "logged or checked here are S times too large; call scaler.unscale_(optimizer) first"
    )
    assert found["unscale-twice"].message == (
        "unscale_() ran again on gradients already unscaled since they were last "
        "zeroed: they are divided by the scale twice"
    )


def test_calls_on_unscaled_gradients_and_a_first_unscale_are_not_findings() -> None:
    log = CallLog()
    for index in range(3):
        log.add("unscale", SITE, index, True)  # the first unscale_ of each batch
        log.add("clip", SITE, index, False, "clip_grad_value_(..., 0.5)")
        log.add("step", SITE, index, False, "Adam")
        log.add("read", SITE, index, False)
    assert grad_call_findings(log) == []
    assert log.items[GradCall("step", SITE, False)].count == 3


def test_a_site_scaled_in_some_steps_only_is_found_at_those_steps() -> None:
    log = CallLog()
    for index in range(30):
        log.add("step", SITE, index, index % 2 == 1, "SGD")  # odd steps skip unscaling
    (finding,) = grad_call_findings(log)
    assert finding.code == "step-without-unscale"
    assert finding.count == 15
    assert finding.steps == (1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29)


def test_the_log_lists_the_first_twenty_steps_and_counts_them_all() -> None:
    log = CallLog()
    for index in range(50):
        log.add("read", SITE, index, True)
    (finding,) = grad_call_findings(log)
    assert (finding.steps, finding.count) == (tuple(range(20)), 50)


# -- mixed-scale-accumulation ----------------------------------------------------
def test_micro_batches_scaled_differently_are_found_at_the_later_scale_call() -> None:
    values = np.array([2.0**16, 2.0**15, 2.0**15])
    a, b = ("train.py", 10), ("train.py", 11)
    # one accumulated batch: scale() at line 10 under 2^16, then at line 11 under 2^15
    spans = [[SpanScale(0, 0, a, 3), SpanScale(1, 1, b, 3)]]
    (finding,) = mixed_scale_findings(spans, values, ("train.py", 20))
    assert finding.code == "mixed-scale-accumulation" and finding.severity == "error"
    assert (finding.where, finding.steps, finding.count) == ("train.py:11", (3,), 1)
    assert finding.message == (
        "a micro-batch scaled by 2^15 was accumulated onto gradients scaled by 2^16"
        " (scaler.update() at train.py:20 ran between them): unscale_ divides the sum by one "
        "scale, so micro-batches are weighted unequally; update the scaler once per optimizer step"
    )


def test_equal_scales_or_one_micro_batch_are_not_mixed() -> None:
    values = np.array([8.0, 8.0, 4.0])
    same = [SpanScale(0, 0, SITE, 0), SpanScale(1, 1, SITE, 0)]  # updated, value unchanged
    alone = [SpanScale(2, 2, SITE, 1)]
    assert mixed_scale_findings([same, alone, []], values, SITE) == []


def test_mixed_scales_without_an_update_site_name_no_update() -> None:
    values = np.array([4.0, 3.0])
    (finding,) = mixed_scale_findings(
        [[SpanScale(0, 0, SITE, 0), SpanScale(1, 1, SITE, 0)]], values, None
    )
    assert finding.message.startswith(
        "a micro-batch scaled by 3 was accumulated onto gradients scaled by 2^2: unscale_"
    )


# -- scheduler-on-skipped-step ---------------------------------------------------
def test_a_scheduler_step_after_a_taken_step_or_before_any_is_not_a_finding() -> None:
    table = _table([8.0, 8.0], [8.0, 8.0], [False, True])
    calls = [SchedulerCall(SITE, 0, "StepLR"), SchedulerCall(SITE, -1, "StepLR")]
    assert scheduler_findings(table, calls) == []
    (finding,) = scheduler_findings(table, [SchedulerCall(SITE, 1, "OneCycleLR")])
    assert (finding.code, finding.where, finding.steps) == (
        "scheduler-on-skipped-step",
        "train.py:42",
        (1,),
    )
    assert finding.message == (
        "OneCycleLR.step() ran after a skipped optimizer step: the learning rate moved on "
        "while the weights did not; step the scheduler only when scaler.get_scale() did not fall"
    )


# -- scale-falling: the --max-backoffs arithmetic ------------------------------------
@pytest.mark.parametrize(
    ("backoffs", "max_backoffs", "fired"),
    [(5, 5, False), (6, 5, True), (3, 2, True), (3, 3, False)],
)
def test_scale_falling_needs_more_back_offs_in_a_row_than_allowed(
    backoffs: int, max_backoffs: int, fired: bool
) -> None:
    # step 0 is taken at 2^12 (no calibration); steps 1..n each halve the scale
    # without skipping (a back-off with a taken step: the trajectory alone decides)
    before = [2.0**12] + [2.0 ** (12 - i) for i in range(backoffs)]
    after = [2.0**12] + [2.0 ** (11 - i) for i in range(backoffs)]
    found = {
        f.code: f
        for f in scale_findings(
            _table(before, after, [False] * len(before)), SITE, max_backoffs, 1.0
        )
    }
    assert ("scale-falling" in found) is fired
    if fired:
        falling = found["scale-falling"]
        assert (falling.where, falling.steps, falling.count) == ("train.py:42", (1,), 1)
        # n back-offs: steps 1..n, from 2^12 to 2^(12-n)
        assert falling.message.startswith(
            f"the scale backed off {backoffs} times in a row (steps 1 to {backoffs}, "
            f"2^12 to 2^{12 - backoffs}): every step overflows whatever the scale"
        )


def test_two_short_runs_of_back_offs_are_not_one_long_one() -> None:
    # 3 back-offs, a growth, 3 back-offs: runs of 3 and 3, never more than max 5
    before = [64.0, 32.0, 16.0, 8.0, 16.0, 8.0, 4.0]
    after = [32.0, 16.0, 8.0, 16.0, 8.0, 4.0, 2.0]
    table = _table([128.0, *before], [128.0, *after], [False] * 8)
    assert "scale-falling" not in {f.code for f in scale_findings(table, SITE, 5, 1.0)}


# -- scale-below-one -----------------------------------------------------------
def test_a_scale_of_exactly_one_is_not_below_one() -> None:
    table = _table([2.0, 1.0], [1.0, 1.0], [False, False])
    assert scale_findings(table, SITE, 5, 1.0) == []
    table = _table([2.0, 1.0, 1.0], [1.0, 1.0, 0.5], [False, False, True])
    (below,) = scale_findings(table, SITE, 5, 1.0)
    assert (below.code, below.where, below.steps) == ("scale-below-one", "train.py:42", (2,))
    assert below.message == (
        "the scale fell below 1 (2^-1 after step 2): gradients are now held smaller than "
        "unscaled, so loss scaling only adds underflow; something overflows at every scale"
    )


# -- high-skip-rate: the --max-skip-rate arithmetic ---------------------------------
def test_high_skip_rate_counts_only_after_calibration_and_needs_three_skips() -> None:
    # 2 calibration skips, then 20 steps of which 3 skipped: 3/20 = 15% > 10%
    skipped = [True, True] + [False] * 17 + [True] * 3
    table = _table([8.0] * 22, [8.0] * 22, skipped)
    (high,) = scale_findings(table, SITE, 5, 0.10)
    assert (high.code, high.where, high.steps) == ("high-skip-rate", "train.py:42", (2,))
    assert high.message.startswith(
        "3 of 20 steps after calibration were skipped (15.0%, more than 10.0%)"
    )
    assert scale_findings(table, SITE, 5, 0.15) == []  # 15% is not more than 15%
    # two skips after calibration (2/20 = 10% > 2%) are still too few to tell
    two = _table([8.0] * 22, [8.0] * 22, [True, True] + [False] * 18 + [True] * 2)
    assert scale_findings(two, SITE, 5, 0.02) == []


def test_skip_statistics_of_a_run_that_never_stepped_count_every_skip() -> None:
    stats = skip_statistics(np.array([True, True, True]))
    assert stats.calibration_steps == 0 and stats.skipped_after_calibration == 3
    assert stats.skip_rate_after_calibration == 1.0


def test_findings_sort_errors_first_then_by_file_and_line() -> None:
    table = _table([2.0, 1.0], [1.0, 0.5], [True, True])
    warning = scale_findings(table, ("b.py", 1), 5, 1.0)[0]
    values = np.array([4.0, 2.0])
    error = mixed_scale_findings(
        [[SpanScale(0, 0, SITE, 0), SpanScale(1, 1, ("z.py", 9), 0)]], values, None
    )[0]
    assert [f.code for f in sorted_findings([warning, error])] == [
        "mixed-scale-accumulation",
        "scale-below-one",
    ]


# -- the steps table -------------------------------------------------------------
def test_the_steps_table_unscales_norms_and_amax_and_reads_skips() -> None:
    # slots: 0 scale before, 1 scale after, 2 found_inf, 3 loss, 4 norm (scaled), 5 amax (scaled)
    values = np.array([2.0**10, 2.0**9, 1.0, 0.25, 3.0 * 2**10, 2.0**12])
    step = Step(index=7, started=0.0, capture=False, backward_calls=2, stepped=True)
    step.scaler = object()
    step.scale_before, step.norm, step.norm_scaled, step.max_norm = 0, 4, True, 1.0
    step.slots = {"scale_after": 1, "found_inf": 2, "loss": 3, "grad_amax": 5}
    plain = Step(index=8, started=0.0, capture=False, backward_calls=1, stepped=True)
    table = steps_table([step, plain], values)
    assert set(table) == set(STEP_COLUMNS)
    row = {name: column[0] for name, column in table.items()}
    assert (row["step"], row["loss_scale"], row["scale_after"]) == (7, 2.0**10, 2.0**9)
    assert row["skipped"] is True and row["optimizer_step"] is False  # found_inf > 0
    assert row["grad_norm"] == 3.0 and row["clipped"] is True  # 3*2^10 / 2^10 = 3 > 1
    assert row["grad_amax"] == 4.0 and row["loss"] == 0.25  # 2^12 / 2^10
    other = {name: column[1] for name, column in table.items()}
    assert (other["loss_scale"], other["scale_after"], other["skipped"]) == (1.0, 1.0, False)
    assert other["optimizer_step"] is True and math.isnan(other["grad_norm"])


# -- the steps-table rules on whole runs (moved from test_findings.py) -----------------
def _codes(findings: list[Any]) -> dict[str, Any]:
    return {f.code: f for f in findings}


def test_a_healthy_run_has_no_findings() -> None:
    # 2^16 all along, one skip in 10 steps (rate 10%, but fewer than 3 skips)
    table = _table([2.0**16] * 10, [2.0**16] * 10, [False] * 9 + [True])
    assert scale_findings(table, SITE, max_backoffs=5, max_skip_rate=0.02) == []


def test_calibration_back_offs_are_not_a_falling_scale() -> None:
    # steps 0-6 back off from 2^16 to 2^9 while skipped: calibration (leading skips)
    before = [2.0 ** (16 - i) for i in range(7)] + [2.0**9] * 3
    after = [2.0 ** (15 - i) for i in range(7)] + [2.0**9] * 3
    table = _table(before, after, [True] * 7 + [False] * 3)
    assert scale_findings(table, SITE, max_backoffs=5, max_skip_rate=0.02) == []


def test_six_back_offs_in_a_row_after_calibration_fall_and_skip_too_often() -> None:
    # step 0 steps at 2^10; steps 1-6 each halve the scale: 6 back-offs > max 5,
    # 2^10 -> 2^4; 6 of 7 steps after calibration (0 calibration steps) skipped: 85.7%
    before = [2.0**10] + [2.0 ** (10 - i) for i in range(6)]
    after = [2.0**10] + [2.0 ** (9 - i) for i in range(6)]
    table = _table(before, after, [False] + [True] * 6)
    found = _codes(scale_findings(table, SITE, max_backoffs=5, max_skip_rate=0.02))
    assert set(found) == {"scale-falling", "high-skip-rate"}
    falling = found["scale-falling"]
    assert (falling.file, falling.line, falling.steps) == ("train.py", 42, (1,))
    assert "backed off 6 times in a row (steps 1 to 6, 2^10 to 2^4)" in falling.message
    assert "6 of 7 steps were skipped (85.7%, more than 2.0%)" in found["high-skip-rate"].message
    # one more allowed back-off: no longer a falling scale
    assert "scale-falling" not in _codes(scale_findings(table, SITE, 6, 0.02))


def test_a_scale_below_one_is_found_at_its_first_step() -> None:
    # 2 -> 1 -> 0.5 (after step 1) -> 0.25
    table = _table([2.0, 1.0, 0.5], [1.0, 0.5, 0.25], [False, True, True])
    found = _codes(scale_findings(table, SITE, max_backoffs=5, max_skip_rate=1.0))
    below = found["scale-below-one"]
    assert below.steps == (1,) and "(2^-1 after step 1)" in below.message


def test_an_empty_table_has_no_findings() -> None:
    assert scale_findings(_table([], [], []), SITE, 5, 0.02) == []


def test_a_scheduler_step_after_a_skipped_step_is_found_once_per_step() -> None:
    table = _table([8.0] * 4, [8.0, 4.0, 4.0, 2.0], [False, True, False, True])
    site = ("train.py", 7)
    calls = [(site, 0, "StepLR"), (site, 1, "StepLR"), (site, 2, "StepLR"), (site, 3, "StepLR")]
    (finding,) = scheduler_findings(table, calls)
    assert finding.code == "scheduler-on-skipped-step"
    assert (finding.where, finding.steps, finding.count) == ("train.py:7", (1, 3), 2)
    assert finding.message.startswith("StepLR.step() ran after a skipped optimizer step")
