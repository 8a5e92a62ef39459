"""The skip verdict (fpaudit.rules.skips) on hand-built steps tables: calibration, range
and persistent told apart, with the numbers derived by hand."""

from __future__ import annotations

import math

import pandas as pd

from fpaudit.numerics.formats import get_format
from fpaudit.report.records import SKIP_COLUMNS
from fpaudit.report.runinfo import ScalerInfo
from fpaudit.rules.skips import origins_of_steps, skip_verdict

FP16 = get_format("fp16")
SCALER = ScalerInfo("torch.amp.GradScaler", 2.0**16, 2.0, 0.5, 4)


def steps_of(
    scales: list[float], skipped: list[bool], finite: list[bool] | None = None
) -> pd.DataFrame:
    """A steps table: the scale in force per step, halved after a skip, else kept."""
    after = [s / 2 if k else s for s, k in zip(scales, skipped, strict=True)]
    return pd.DataFrame(
        {
            "step": range(len(scales)),
            "rank": 0,
            "loss_scale": scales,
            "scale_after": after,
            "skipped": skipped,
            "loss_finite": finite if finite is not None else [True] * len(scales),
        }
    )


def halving(start: float, skipped: list[bool]) -> list[float]:
    scales, scale = [], start
    for skip in skipped:
        scales.append(scale)
        scale = scale / 2 if skip else scale
    return scales


def test_leading_skips_are_calibration_and_a_clean_run_has_no_verdict_to_give() -> None:
    skipped = [True, True, True, False, False]
    verdict = skip_verdict(steps_of(halving(2.0**16, skipped), skipped), None, SCALER, FP16)
    assert verdict is not None and verdict.verdict == "calibration"
    assert verdict.counts() == {"calibration": 3, "forward": 0, "backward": 0}
    clean = [False] * 4
    none = skip_verdict(steps_of(halving(2.0**16, clean), clean), None, SCALER, FP16)
    assert none is not None and none.verdict == "none" and none.skips == ()
    assert skip_verdict(steps_of([1.0], [False]), None, None, FP16) is None  # no scaler


def test_skips_the_back_off_clears_are_range_with_the_static_scale_below_them() -> None:
    # one calibration skip at 2^16, then skips at 2^15 (step 3) and 2^14 (step 6), each
    # followed by clean steps: the smallest scale that skipped is 2^14, so 2^13 avoids them
    skipped = [True, False, False, True, False, False, True, False]
    verdict = skip_verdict(steps_of(halving(2.0**16, skipped), skipped), None, SCALER, FP16)
    assert verdict is not None and verdict.verdict == "range"
    assert verdict.static_log2_scale == 13
    assert [(s.step, s.origin) for s in verdict.skips] == [
        (0, "calibration"), (3, "backward"), (6, "backward"),
    ]  # fmt: skip


def test_a_scale_that_keeps_falling_or_a_nan_loss_is_persistent() -> None:
    # 6 back-offs in a row after calibration: more than max_backoffs 5
    skipped = [False] + [True] * 6 + [False]
    verdict = skip_verdict(steps_of(halving(2.0**16, skipped), skipped), None, SCALER, FP16)
    assert verdict is not None and verdict.verdict == "persistent"
    assert "backed off 6 times in a row" in verdict.reason
    # 5 in a row is within max_backoffs, but one skipped step's loss is NaN: persistent
    skipped = [False, True, False]
    verdict = skip_verdict(steps_of([4.0, 4.0, 2.0], skipped, [True, False, True]), None,
                           SCALER, FP16)  # fmt: skip
    assert verdict is not None and verdict.verdict == "persistent"
    assert verdict.skips[0].origin == "forward"
    assert "the loss itself was inf or NaN in 1 skipped step(s), first at step 1" in (
        verdict.reason
    )
    # a scale that fell below 1: 2^1 -> 2^0 -> 2^-1 with clean steps between
    skipped = [False, True, False, True, False]
    verdict = skip_verdict(steps_of([2.0, 2.0, 1.0, 1.0, 0.5], skipped), None, SCALER, FP16)
    assert verdict is not None and verdict.verdict == "persistent"
    assert "fell below 1 (2^-1)" in verdict.reason


def test_the_same_op_at_three_scales_is_persistent_and_named_with_its_smallest_scale() -> None:
    # skips at 2^10, 2^9, 2^8, each cleared (clean steps between), each from `fc aten.mm`
    skipped = [False, True, False, True, False, True, False]
    steps = steps_of(halving(2.0**10, skipped), skipped)
    rows = []
    for step in (1, 3, 5):
        scale = float(steps.loc[step, "loss_scale"])
        row = {name: "" for name, kind in SKIP_COLUMNS.items() if kind == "string"}
        row.update(step=step, rank=0, loss_scale=scale, loss_finite=True, nonfinite_params=1,
                   params_checked=2, params="fc.weight", op_step=step, op_phase="backward",
                   op_module="fc", op="aten.mm.default", op_amax=32768.0, op_scale=scale)  # fmt: skip
        rows.append(row)
    verdict = skip_verdict(steps, pd.DataFrame(rows), SCALER, FP16)
    assert verdict is not None and verdict.verdict == "persistent"
    assert verdict.culprit == "fc aten.mm.default" and verdict.culprit_min_scale == 2.0**8
    assert "overflowed at 3 different scales, down to 2^8" in verdict.reason
    # 32768 = 2^15 against fp16's largest 65504: log2(32768 / 65504) binades, just under -1
    assert verdict.skips[0].edge_binades == math.log2(32768.0 / 65504.0)
    assert list(verdict.skips[0].params) == ["fc.weight"]


def test_each_steps_origin_is_one_rule() -> None:
    skipped = [True, True, False, True, True, False]
    finite = [True, False, True, False, True, True]
    # leading skips are calibration whatever the loss; later: forward where it is not finite
    assert origins_of_steps(pd.Series(skipped).to_numpy(), pd.Series(finite).to_numpy()) == [
        "calibration", "calibration", "", "forward", "backward", "",
    ]  # fmt: skip


def test_a_replayed_skip_names_the_op_that_overflows_at_the_replayed_scale() -> None:
    import torch

    from fpaudit.rules.simulation import ScalerOverrides, simulate

    from ..reports import report_of_steps

    # step 1 holds 2^10: at a static 2^6 it is 2^16 = 65536, past fp16's overflow edge 65520
    # (torch's own cast agrees); steps 0 and 2 hold 1.0: 2^6, far inside
    assert torch.isinf(torch.tensor(2.0**16).half()) and not torch.isinf(torch.tensor(64.0).half())
    report = report_of_steps([torch.tensor([1.0]), torch.tensor([2.0**10]), torch.tensor([1.0])])
    result = simulate(report, FP16, "static", ScalerOverrides(init_scale=2.0**6),
                      static_scale=2.0**6)  # fmt: skip
    assert [(s.step, s.scale, s.culprit, s.source, s.value_at_scale) for s in result.skip_origins] == [
        (1, 2.0**6, "a aten.mul.Tensor", "records", 65536.0),
    ]  # fmt: skip
    assert result.to_dict()["skip_origins"][0]["culprit"] == "a aten.mul.Tensor"
