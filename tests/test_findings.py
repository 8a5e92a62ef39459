"""The misuse rules of `fpaudit run` as pure functions over hand-built steps tables."""

from __future__ import annotations

from typing import Any

from fpaudit.training import scale_findings, scheduler_findings

SITE = ("train.py", 42)


def _table(before: list[float], after: list[float], skipped: list[bool]) -> dict[str, list[Any]]:
    return {
        "step": list(range(len(before))),
        "loss_scale": before,
        "scale_after": after,
        "skipped": skipped,
    }


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
    assert (falling.file, falling.line, falling.steps) == ("train.py", 42, [1])
    assert "backed off 6 times in a row (steps 1 to 6, 2^10 to 2^4)" in falling.message
    assert "6 of 7 steps were skipped (85.7%, more than 2.0%)" in found["high-skip-rate"].message
    # one more allowed back-off: no longer a falling scale
    assert "scale-falling" not in _codes(scale_findings(table, SITE, 6, 0.02))


def test_a_scale_below_one_is_found_at_its_first_step() -> None:
    # 2 -> 1 -> 0.5 (after step 1) -> 0.25
    table = _table([2.0, 1.0, 0.5], [1.0, 0.5, 0.25], [False, True, True])
    found = _codes(scale_findings(table, SITE, max_backoffs=5, max_skip_rate=1.0))
    below = found["scale-below-one"]
    assert below.steps == [1] and "(2^-1 after step 1)" in below.message


def test_an_empty_table_has_no_findings() -> None:
    assert scale_findings(_table([], [], []), SITE, 5, 0.02) == []


def test_a_scheduler_step_after_a_skipped_step_is_found_once_per_step() -> None:
    table = _table([8.0] * 4, [8.0, 4.0, 4.0, 2.0], [False, True, False, True])
    site = ("train.py", 7)
    calls = [(site, 0, "StepLR"), (site, 1, "StepLR"), (site, 2, "StepLR"), (site, 3, "StepLR")]
    (finding,) = scheduler_findings(table, calls)
    assert finding.code == "scheduler-on-skipped-step"
    assert (finding.where, finding.steps, finding.count) == ("train.py:7", [1, 3], 2)
    assert finding.message.startswith("StepLR.step() ran after a skipped optimizer step")
