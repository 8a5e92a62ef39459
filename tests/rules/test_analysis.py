"""Counts at any power-of-two scale, recommendation and gate, against the cast oracle and by hand."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fpaudit.kernels import histogram
from fpaudit.numerics.formats import FORMATS
from fpaudit.report.store import Report
from fpaudit.rules import analysis
from fpaudit.rules.gating import gate
from fpaudit.rules.recommendation import largest_log2_scale, recommend

from ..oracle import edge_values, oracle_counts
from ..reports import report_from

KEYS = (
    "elements",
    "zeros",
    "nonfinite",
    "nonzero",
    "underflow",
    "flushed",
    "subnormal",
    "overflow",
)


def _counts(x: torch.Tensor) -> np.ndarray:
    hist = histogram.Histogram(x.device)
    hist.add(x)
    host = hist.host()
    return host.counts


# Scales that put some edge value of some format right at a threshold, plus extremes.
EDGE_SCALES = sorted({-149, -126, -114, -107, -20, -11, -1, 0, 1, 10, 15, 24, 40, 100, 127})


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("log2_scale", EDGE_SCALES)
def test_counts_match_the_cast_oracle_on_edge_values(name: str, log2_scale: int) -> None:
    x = edge_values()
    predicted = analysis.histogram_counts(_counts(x), FORMATS[name], log2_scale)
    assert {k: predicted[k] for k in KEYS} == oracle_counts(x, FORMATS[name], log2_scale)


@settings(max_examples=200, deadline=None)
@given(
    patterns=st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=200),
    name=st.sampled_from(list(FORMATS)),
    log2_scale=st.integers(-149, 127),
)
def test_counts_match_the_cast_oracle_on_arbitrary_tensors(
    patterns: list[int], name: str, log2_scale: int
) -> None:
    x = torch.tensor(patterns, dtype=torch.int64).to(torch.int32).view(torch.float32)
    predicted = analysis.histogram_counts(_counts(x), FORMATS[name], log2_scale)
    assert {k: predicted[k] for k in KEYS} == oracle_counts(x, FORMATS[name], log2_scale)


@settings(max_examples=100, deadline=None)
@given(
    # magnitudes near the thresholds that matter, as gradients have them
    exponents=st.lists(st.integers(-40, 20), min_size=1, max_size=100),
    fractions=st.lists(st.integers(0, 2**23 - 1), min_size=1, max_size=100),
    name=st.sampled_from(list(FORMATS)),
    log2_scale=st.integers(-30, 40),
)
def test_counts_match_the_cast_oracle_on_gradient_like_values(
    exponents: list[int], fractions: list[int], name: str, log2_scale: int
) -> None:
    values = [(1 + f / 2**23) * 2.0**e for e, f in zip(exponents, fractions, strict=False)]
    x = torch.tensor(values, dtype=torch.float32)
    predicted = analysis.histogram_counts(_counts(x), FORMATS[name], log2_scale)
    assert {k: predicted[k] for k in KEYS} == oracle_counts(x, FORMATS[name], log2_scale)


def test_hand_derived_fp16_counts() -> None:
    # fp16 at S = 1: |x| <= 2**-25 rounds to 0; below 2**-14 is flushed by FTZ hardware.
    x = torch.tensor([2.0**-25, -(2.0**-26), 2.0**-24, 2.0**-15, 2.0**-14, 1.0, 0.0, float("nan")])
    counts = analysis.histogram_counts(_counts(x), FORMATS["fp16"], 0)
    # nonzero finite: 6 (0 and NaN excluded); underflow: 2**-25 (the tie) and 2**-26 -> 2;
    # flushed: those 2 plus 2**-24 and 2**-15 -> 4; subnormal 4 - 2 = 2; overflow 0.
    assert (counts["nonzero"], counts["underflow"], counts["flushed"], counts["subnormal"]) == (
        6,
        2,
        4,
        2,
    )
    # At S = 2**11: 2**-25 * 2**11 = 2**-14 is normal, nothing underflows, 2**-26 -> 2**-15 is subnormal
    # flushed: 2**-26 -> 2**-15 only -> 1; 1.0 * 2**11 = 2048 is fine.
    counts = analysis.histogram_counts(_counts(x), FORMATS["fp16"], 11)
    assert (counts["underflow"], counts["flushed"], counts["overflow"]) == (0, 1, 0)
    # At S = 2**16: 1.0 * 65536 >= 65520 overflows -> 1.
    assert analysis.histogram_counts(_counts(x), FORMATS["fp16"], 16)["overflow"] == 1


def test_range_loss_per_module_and_loss_scale_shift() -> None:
    tiny = torch.full((4,), 2.0**-30)  # underflows fp16 at S = 1 (2**-30 <= 2**-25)
    fine = torch.full((4,), 2.0**-10)
    report = report_from({"a": tiny, "b": fine})
    table = analysis.module_table(report, FORMATS["fp16"], 0)
    assert list(table["module"]) == ["a", "b"]
    assert list(table["underflow"]) == [4, 0]
    assert list(table["underflow_fraction"]) == [1.0, 0.0]
    # The same values captured under a loss scale of 2**8 are 2**8 times larger but
    # mean the same unscaled values: the analysis at S = 1 must not change.
    scaled = report_from({"a": tiny * 2**8, "b": fine * 2**8}, loss_scale=2.0**8)
    assert analysis.module_table(scaled, FORMATS["fp16"], 0).equals(table)


def test_values_that_do_not_scale_with_the_loss_keep_their_fate() -> None:
    # A fixed intermediate of 2**-30 underflows fp16 at every scale; a gradient of
    # 2**-30 is rescued by S = 2**10 (2**-20 > 2**-25).
    report = report_from({"grad": torch.full((2,), 2.0**-30), "fixed": torch.full((2,), 2.0**-30)},
                         fixed=frozenset({"fixed"}))  # fmt: skip
    table = analysis.module_table(report, FORMATS["fp16"], 10)
    assert dict(zip(table["module"], table["underflow"], strict=True)) == {"grad": 0, "fixed": 2}


def test_largest_log2_scale_by_hand() -> None:
    # fp16 with 4 headroom bits: limit 65504 / 16 = 4094. amax 3: 3 * 2**10 = 3072 <= 4094,
    # 3 * 2**11 = 6144 > 4094 -> k = 10.
    assert largest_log2_scale(3.0, 65504.0 / 16) == 10
    # an exact fit counts: 4094 * 2**-5 * 2**5 = 4094 -> k = 5.
    assert largest_log2_scale(4094.0 / 32, 4094.0) == 5
    assert largest_log2_scale(1e-30, 1.0) == 99  # 1e-30 * 2**99 = 0.63, * 2**100 = 1.27


def test_recommend_by_hand() -> None:
    values = torch.tensor([3.0, 2.0**-30, 2.0**-20, 0.0])
    report = report_from({"layer": values})
    rec = recommend(report, FORMATS["fp16"], headroom_bits=4)
    # The headroom's ceiling is 2**10 (see test_largest_log2_scale_by_hand). At 2**10:
    # 2**-30 -> 2**-20 (subnormal, below 2**-14), 2**-20 -> 2**-10 (normal): none underflows,
    # one is flushed. The smallest scale losing no more: 2**6 (2**-30 -> 2**-24, fp16's
    # smallest subnormal; 2**-20 -> 2**-14, its smallest normal). At 2**5, 2**-30 -> 2**-25
    # rounds to zero (a tie, to even).
    assert rec.ceiling_log2_scale == 10 and rec.log2_scale == 6 and rec.scale == 64.0
    assert rec.limiting_module == "layer" and rec.limiting_op == "aten.mul.Tensor"
    assert rec.amax == 3.0
    # At S = 1: 2**-30 and 2**-20 underflow? 2**-30 <= 2**-25 yes; 2**-20 no -> 1 of 3 nonzero.
    assert rec.underflow_fraction_at_1 == pytest.approx(1 / 3)
    assert rec.underflow_fraction == 0.0
    assert rec.limited_by == "least underflow"
    for k, zeros in ((5, 1), (6, 0), (10, 0)):  # the cast oracle
        assert int(((values[:3] * 2.0**k).half() == 0).sum()) == zeros


def test_recommend_with_scales_below_one() -> None:
    report = report_from({"layer": torch.tensor([60000.0, 1.0])})
    # 60000 * 2**-4 = 3750 <= 4094; 60000 * 2**-3 = 7500 > 4094 -> 2**-4.
    assert recommend(report, FORMATS["fp16"], headroom_bits=4).log2_scale == -4


def test_recommend_ignores_values_that_do_not_scale() -> None:
    report = report_from({"grad": torch.tensor([2.0**-10]), "fixed": torch.tensor([300.0])},
                         fixed=frozenset({"fixed"}))  # fmt: skip
    # Only 2**-10 limits: 2**-10 * 2**k <= 4094 -> ceiling k = 21 (2**11 = 2048 <= 4094,
    # 2**12 > 4094). 2**-10 is an fp16 normal (>= 2**-14) at S = 1 already: S = 1.
    rec = recommend(report, FORMATS["fp16"], 4)
    assert rec.ceiling_log2_scale == 21 and rec.log2_scale == 0


def test_all_zero_gradients_get_a_clear_answer() -> None:
    report = report_from({"layer": torch.zeros(8)})
    rec = recommend(report, FORMATS["fp16"])
    assert rec.log2_scale is None and rec.scale is None
    assert rec.limited_by == "no nonzero values"
    result = gate(report, FORMATS["fp16"], 0.0)
    # 0% underflow of 0 nonzero values proves nothing: the gate fails on evidence.
    assert not result.passed and result.underflow_fraction == 0.0 and result.nonzero == 0
    assert [f.kinds for f in result.failures] == [("nothing-measured",)]
    assert result.failures[0].reason.startswith("measured nothing: ")


def test_recommendation_is_monotone_in_headroom() -> None:
    report = report_from({"layer": torch.randn(1000) * 1e-3})
    recs = [recommend(report, FORMATS["fp16"], h) for h in range(0, 10)]
    scales = [rec.ceiling_log2_scale for rec in recs]
    assert all(rec.log2_scale is not None and rec.log2_scale <= rec.ceiling_log2_scale  # type: ignore[operator]
               for rec in recs)  # fmt: skip
    assert all(
        a - b == 1 for a, b in itertools.pairwise(scales)
    )  # one bit of headroom = one binade


def test_recommendation_reports_what_one_fewer_headroom_bit_recovers() -> None:
    # amax 1 -> k = 11 (2**11 = 2048 <= 4094, 2**12 > 4094).
    # 1.5 * 2**-37 at S = 2**11 is 1.5 * 2**-26 < 2**-25: zero. At S = 2**12 it is
    # 1.5 * 2**-25 > 2**-25: kept. So one fewer headroom bit recovers 1 of 2 values.
    report = report_from({"layer": torch.tensor([1.0, 1.5 * 2.0**-37])})
    rec = recommend(report, FORMATS["fp16"], 4)
    # 1.5 * 2**-37 underflows at every S up to the ceiling 2**11, 1.0 is normal at every one:
    # S = 1 loses as little as 2**11, so S = 1 is recommended.
    assert rec.ceiling_log2_scale == 11 and rec.log2_scale == 0
    assert rec.underflow_fraction == 0.5
    assert rec.underflow_recovered_by_one_fewer_headroom_bit == 0.5


def test_recommendation_is_clamped_to_the_fp32_scale_range() -> None:
    # bf16 normal at S = 1 (2**-100 >= 2**-126): S = 1 whatever the ceiling, 2**(127+100-4)
    # clamped to 2**127
    rec = recommend(report_from({"layer": torch.tensor([2.0**-100])}), FORMATS["bf16"], 4)
    assert rec.log2_scale == 0 and rec.ceiling_log2_scale == 127
    assert rec.limited_by == "least underflow"
    # fp16, 2**-117 and 2**-141: the ceiling 2**(-117 + k) <= 4094 -> k = 128, clamped to 127;
    # 2**-141 is an fp16 normal (2**-14) only at 2**127, subnormal at 2**126: S = 2**127.
    both = report_from({"layer": torch.tensor([2.0**-117, 2.0**-141])})
    rec = recommend(both, FORMATS["fp16"], 4)
    assert rec.log2_scale == 127 and rec.limited_by == "scale range"


def test_gate_by_hand() -> None:
    # module a: 1 of 2 underflows at S = 1 (2**-30); module b: 0 of 2.
    report = report_from({"a": torch.tensor([2.0**-30, 1.0]), "b": torch.tensor([1.0, 2.0])})
    fp16 = FORMATS["fp16"]
    overall = gate(report, fp16, 0.25, log2_scale=0)  # 1 of 4 = 0.25 <= 0.25: pass
    assert overall.passed and overall.underflow_fraction == 0.25
    assert not gate(report, fp16, 0.2, log2_scale=0).passed  # 0.25 > 0.2
    per_module = gate(report, fp16, 0.25, log2_scale=0, per_module=True)  # a: 0.5 > 0.25
    assert not per_module.passed and [o.module for o in per_module.offenders] == ["a"]
    # a's numbers at S = 1, in gate --json's keys and order: 1 of 2 nonzero underflows
    assert per_module.to_dict()["offenders"] == [
        {"module": "a", "underflow_fraction": 0.5, "underflow": 1, "nonzero": 2, "overflow": 0,
         "unscalable_underflow": 0, "unscalable_overflow": 0, "lost": 0, "lost_fraction": 0.0}
    ]  # fmt: skip
    # recommended scale: amax 2 -> 2 * 2**11 = 4096 > 4094 -> ceiling k = 10, where 2**-30 ->
    # 2**-20 is subnormal; the smallest S as good: 2**6 (2**-24, subnormal; at 2**5, 2**-25
    # rounds to zero).
    recommended = gate(report, fp16, 0.0)
    assert recommended.passed and recommended.log2_scale == 6
    # A scale that overflows fails whatever the underflow: 2 * 2**15 = 65536 >= 65520.
    overflowing = gate(report, fp16, 1.0, log2_scale=15)
    assert not overflowing.passed and overflowing.overflow == 1


@settings(max_examples=50, deadline=None)
@given(st.floats(0, 1), st.floats(0, 1))
def test_gate_verdict_is_monotone_in_the_threshold(low: float, high: float) -> None:
    low, high = min(low, high), max(low, high)
    report = report_from(
        {"a": torch.tensor([2.0**-30, 1.0, 2.0**-26]), "b": torch.tensor([1e-9, 1.0])}
    )
    for per_module in (False, True):
        strict = gate(report, FORMATS["fp16"], low, log2_scale=0, per_module=per_module)
        loose = gate(report, FORMATS["fp16"], high, log2_scale=0, per_module=per_module)
        assert loose.passed or not strict.passed


def test_log2_exact() -> None:
    assert analysis.log2_exact(1024.0) == 10 and analysis.log2_exact(0.125) == -3
    for bad in (0.0, -2.0, 3.0, math.inf, math.nan):
        with pytest.raises(ValueError):
            analysis.log2_exact(bad)


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [(torch.float32, None), (torch.float16, "float16"), (torch.bfloat16, "bfloat16")],
)
def test_held_dtype_is_the_low_precision_dtype_backward_ran_in(
    dtype: torch.dtype, expected: str | None
) -> None:
    import fpaudit

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)).to(dtype)
    with fpaudit.audit(model) as audit:
        model(torch.randn(3, 4, dtype=dtype)).float().sum().backward()
        audit.step()
    assert analysis.held_dtype(audit.report) == expected


def test_held_dtype_under_autocast_ignores_the_fp32_values() -> None:
    import fpaudit

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.Linear(64, 1))
    with fpaudit.audit(model) as audit:
        with torch.autocast("cpu", torch.bfloat16):
            out = model(torch.randn(3, 4))
        out.float().sum().backward()  # parameter gradients stay fp32, the matmuls run in bf16
        audit.step()
    records = audit.report.records
    assert set(records["dtype"]) >= {"float32", "bfloat16"}
    assert analysis.held_dtype(audit.report) == "bfloat16"


def test_a_scale_that_is_not_a_power_of_two_counts_as_the_power_below_it(
    tmp_path: Path,
) -> None:
    # Captured (scaled) values at S = 1000. 1.5 * 2^-10 / 1000 = 2^-19.38 lies in binade -20,
    # but counts at other scales shift it as if S were 2^9 = 512, to 1.5 * 2^-19 in binade
    # -19: at 2^-6 the true value 2^-25.38 rounds to zero in fp16 (<= 2^-25) while the count
    # says 1.5 * 2^-25 does not. That is the documented approximation; amax divides exactly.
    captured = torch.tensor([1.5 * 2.0**-10, 3.0, 0.0, 2.0**-30])
    at_1000 = report_from({"a": captured}, loss_scale=1000.0)
    at_512 = report_from({"a": captured}, loss_scale=512.0)
    at_1000.write(tmp_path / "r")  # written and read back: nothing is refused
    read = Report.read(tmp_path / "r")
    assert read.inexact_scales() == [1000.0] and at_512.inexact_scales() == []
    for k in (-6, 0, 4, 12):
        counts, counts_512 = analysis.totals(read, "fp16", k), analysis.totals(at_512, "fp16", k)
        assert counts.amax == 3.0 / 1000 and counts_512.amax == 3.0 / 512
        assert replace(counts, amax=0.0) == replace(counts_512, amax=0.0)
    assert torch.tensor(1.5 * 2.0**-10 / 1000 * 2.0**-6).half() == 0  # the truth at 2^-6
    assert torch.tensor(1.5 * 2.0**-25).half() != 0  # what the count assumes
    assert analysis.totals(read, "fp16", -6).underflow == 1  # only 2^-30 / 512 * 2^-6
    assert recommend(read, "fp16").amax == 3.0 / 1000
