"""fpaudit.rules.comparison on hand-built reports: rows, sorting, refusals and notes."""

from __future__ import annotations

import pytest
import torch

from fpaudit.errors import UsageError
from fpaudit.report.runinfo import CompiledInfo
from fpaudit.rules.comparison import common_format, compare, notes

from ..reports import report_from


def test_rows_sort_by_the_rise_of_underflow_and_one_sided_rows_come_last() -> None:
    # fp16 at S = 1 rounds 2**-30 to zero (its edge is 2**-25) and keeps 1.0:
    # BASE a: 4 of 8 underflow -> 0.5; NEW a: 0 of 8 -> 0.0, a change of -0.5.
    # BASE b: 0 of 8 -> 0.0; NEW b: 2 of 8 -> 0.25, a change of +0.25.
    tiny, one = 2.0**-30, 1.0
    base = report_from({
        "a": torch.tensor([tiny] * 4 + [one] * 4),
        "b": torch.ones(8),
        "old": torch.ones(8),
    })  # fmt: skip
    new = report_from({
        "a": torch.ones(8),
        "b": torch.tensor([tiny] * 2 + [one] * 6),
        "renamed": torch.ones(8),
    })  # fmt: skip
    result = compare(base, new, "fp16", log2_scale=0)
    assert [row.module for row in result.rows] == ["b", "a", "renamed", "old"]
    b, a, renamed, old = result.rows
    assert (b.base_underflow, b.new_underflow, b.underflow_change) == (0.0, 0.25, 0.25)
    assert (a.base_underflow, a.new_underflow, a.underflow_change) == (0.5, 0.0, -0.5)
    assert renamed.present == "new" and renamed.base_underflow is None
    assert old.present == "base" and old.new_nonzero is None and old.underflow_change is None
    # overall: BASE 4 of 24 underflow, NEW 2 of 24
    assert (result.overall.base_underflow, result.overall.new_underflow) == (4 / 24, 2 / 24)
    assert [row.module for row in compare(base, new, "fp16", sort="order").rows] == [
        "a", "b", "renamed", "old"
    ]  # fmt: skip


def test_amax_moves_in_binades_and_the_scale_defaults_to_base_s_recommended_one() -> None:
    # a ladder, one value a binade from 3 (binade 1) down to 3 * 2**-40: every binade of S
    # up to the ceiling saves one more value, so each recommendation is its ceiling
    ladder = torch.tensor([3.0 * 2.0**-j for j in range(41)])
    base = report_from({"a": ladder})
    new = report_from({"a": ladder * 2.0**-12})  # amax binade 1 - 12 = -11
    result = compare(base, new, "fp16")
    assert result.rows[0].amax_change_binades == -12
    # 3 * 2**10 = 3072 <= 4094 < 6144: BASE's 2**10; NEW's 2**22
    assert (result.base_recommended, result.new_recommended) == (10, 22)
    assert result.scale_source == "BASE's recommended" and result.log2_scale == 10
    assert result.recommended_change == 12  # NEW's values are 2**12 smaller: scale 2**12 larger
    # at BASE's 2**10, NEW's 3 * 2**(-j - 12 + 10) underflows when <= 2**-25: j >= 25 (16 of 41)
    # against BASE's j >= 37 (4 of 41)
    assert result.overall.base_underflow == pytest.approx(4 / 41)
    assert result.overall.new_underflow == pytest.approx(16 / 41)
    for values, expected in ((ladder, 4), (ladder * 2.0**-12, 16)):  # the cast oracle
        assert int(((values * 2.0**10).half() == 0).sum()) == expected
    by_new = compare(base, new, "fp16", log2_scale="new")
    assert by_new.scale_source == "NEW's recommended" and by_new.log2_scale == 22
    assert by_new.overall.new_underflow == pytest.approx(4 / 41)  # the ladder moved with S


def test_refusals_and_notes() -> None:
    base = report_from({"a": torch.ones(8)}, steps=2)
    new = report_from({"a": torch.ones(8)})
    assert notes(base, new) == (
        "steps differ: BASE ran 2, NEW 1 (fractions compare; counts do not)",
    )
    new.update_info(amp_dtype="float16")
    assert "autocast dtypes differ: BASE none, NEW float16" in notes(base, new)
    base.update_info(formats=("bf16",))
    new.update_info(formats=("fp16",))
    with pytest.raises(UsageError, match="no common format"):
        compare(base, new)
    assert common_format(base, new, "fp16").name == "fp16"
    new.update_info(compiled=CompiledInfo(inductor=True))
    with pytest.raises(UsageError, match="NEW is a compiled report"):
        compare(base, new, "fp16")


def test_two_run_reports_diff_their_skip_rates_and_loss_scale_ranges() -> None:
    base = report_from({"a": torch.ones(8)}, steps=4)
    new = report_from({"a": torch.ones(8)}, steps=4)
    assert compare(base, new, "fp16").run is None  # scans: no scaler to compare
    for report, skipped, scales in (
        (base, [False, True, False, False], [2.0**16, 2.0**15, 2.0**15, 2.0**15]),
        (new, [True, False, True, True], [2.0**16, 2.0**15, 2.0**15, 2.0**14]),
    ):
        report.update_info(command="run")
        report.steps["skipped"] = skipped
        report.steps["loss_scale"] = scales
    run = compare(base, new, "fp16").run
    assert run is not None
    # BASE: no calibration skip (step 0 not skipped): 1 of 4 -> 0.25. NEW: step 0's skip is
    # calibration (the leading run of skips), then 2 of the 3 steps after it -> 2/3.
    assert (run.base_skipped, run.base_steps, run.base_skip_rate) == (1, 4, 0.25)
    assert (run.new_skipped, run.new_steps, run.new_skip_rate) == (2, 3, 2 / 3)
    assert run.skip_rate_change == 2 / 3 - 0.25
    assert run.base_loss_scale == (2.0**15, 2.0**16) and run.new_loss_scale == (2.0**14, 2.0**16)
