"""Dashboard metrics (fpaudit.rules.metrics) against values known by hand.

The probe's backward values at loss scale 1 are exactly the step's constants ``c``
(MulBackward0: grad * c with grad 1; the sum's backward is a view of the seed, not a
value), inside module ``probe``: 4 nonzero values a step, gradients zeroed between.
fp16 at S = 1 (round to nearest even): |x| <= 2**-25 becomes 0 (the tie too), 2**-24
is its smallest subnormal, |x| >= 65520 becomes inf.
"""

from __future__ import annotations

import math

import torch

import fpaudit
from fpaudit.report.store import Report
from fpaudit.rules import metrics
from tests.models.known_grads import Model

STEPS = [
    [2.0**-26, 2.0**-25, 2.0**-24, 0.5],  # 2 of 4 underflow: 0.5
    [2.0**-30, 0.25, 0.25, 0.25],  # 1 of 4: 0.25
    [70000.0, 1.0, 1.0, 1.0],  # 0 underflow; 1 of 4 overflows: 0.25
]


def audited(live: list[dict[str, float]] | None = None) -> Report:
    model = Model(size=4)  # known_grads' probe: its backward value is c
    with fpaudit.audit(model) as audit:
        for values in STEPS:
            model.zero_grad(set_to_none=True)
            model(torch.tensor(values)).backward()
            audit.step()
            if live is not None:
                live.append(audit.metrics(top=1))
    return audit.report


# Recommended scale, headroom 4: the ceiling is the largest 2**k with amax * 2**k <= 65504 /
# 16 = 4094, the recommendation the smallest 2**k from min(0, ceiling) up that underflows
# and flushes no more than the ceiling. Step 0: amax 0.5 -> 0.5 * 2**12 = 2048 <= 4094 <
# 4096: ceiling 12, where 2**-26 * 2**12 = 2**-14 is normal, and at 2**11 subnormal: k = 12.
# Step 1: amax 0.25 -> ceiling 13, where 2**-30 * 2**13 = 2**-17 is a subnormal; it stays
# one down to 2**6 (2**-24) and rounds to zero at 2**5 (2**-25): k = 6, 0 lost. Step 2:
# amax 70000 -> 70000 * 2**-5 = 2187.5 <= 4094 < 4375 = 70000 * 2**-4: k = -5, and 1.0 *
# 2**-5 is normal: 0.
EXPECTED = [
    (0.5, 0.0, 0.0, 12.0),
    (0.25, 0.0, 0.0, 6.0),
    (0.0, 0.0, 0.25, -5.0),
]


def test_each_steps_metrics_equal_the_hand_count() -> None:
    found = metrics.step_metrics(audited(), "fp16", top=1)
    assert [m.step for m in found] == [0, 1, 2]
    for m, (underflow, at_recommended, overflow, log2_scale) in zip(found, EXPECTED, strict=True):
        assert m.values == {
            "fpaudit/fp16/underflow": underflow,
            "fpaudit/fp16/underflow_at_recommended": at_recommended,
            "fpaudit/fp16/overflow": overflow,
            "fpaudit/fp16/recommended_log2_scale": log2_scale,
            "fpaudit/loss_scale_log2": 0.0,
            "fpaudit/skipped_steps": 0.0,
            "fpaudit/fp16/module_underflow/probe": underflow,  # the only module
        }


def test_the_library_gives_the_last_steps_metrics_as_it_goes() -> None:
    live: list[dict[str, float]] = []
    report = audited(live)
    assert live == [m.values for m in metrics.step_metrics(report, "fp16", top=1)]


def test_a_steps_histogram_is_its_binades_in_unscaled_units() -> None:
    from fpaudit.rules.drift import window_report

    # step 0: 2**-26, 2**-25, 2**-24 and 0.5, one each: binades -26, -25, -24, -1, and
    # every binade between them (-23 .. -2) with a count of 0: 26 upper edges 2**-25 .. 2**0
    edges, counts = metrics.bin_series(window_report(audited(), 0, 0), "probe")
    assert edges.tolist() == [2.0**e for e in range(-25, 1)]
    assert counts.tolist() == [1, 1, 1] + [0] * 22 + [1]


def test_every_metric_name_is_declared_once() -> None:
    names = [m.name for m in metrics.METRICS]
    assert len(names) == len(set(names))
    filled = {"format": "fp16", "module": "probe", "recipe": "mxfp8-e4m3", "origin": "forward"}
    declared = {n.format(**filled) for n in names}
    found = metrics.step_metrics(audited(), "fp16", top=1)
    assert set(found[0].values) <= declared
    assert math.isfinite(sum(found[0].values.values()))


def test_the_recommended_scale_metrics_are_recommends_own_on_each_step() -> None:
    # the dashboard takes recommend()'s scale without its tables: the same numbers on every
    # step of a real scan, at a loss scale (values recorded scaled) and with inf-free steps
    from fpaudit.rules.drift import window_report
    from fpaudit.rules.recommendation import recommend
    from fpaudit.run.scan import ScanOptions, scan

    report = scan("sample_configs/mlp.py", ScanOptions(steps=3, loss_scale=2.0**10))
    found = metrics.step_metrics(report, "fp16", top=0)
    assert [m.step for m in found] == [0, 1, 2]
    for m in found:
        expected = recommend(window_report(report, m.step, m.step), "fp16")
        assert expected.log2_scale is not None
        assert m.values["fpaudit/fp16/recommended_log2_scale"] == expected.log2_scale
        assert m.values["fpaudit/fp16/underflow_at_recommended"] == expected.underflow_fraction
