"""The views the commands print, computed by the library (fpaudit.rules.summary), and the
bounds each option declares once (fpaudit.cli.options.Bounds)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from fpaudit.cli import options
from fpaudit.errors import OptionError
from fpaudit.numerics.formats import get_format
from fpaudit.rules import analysis
from fpaudit.rules.drift import drift
from fpaudit.rules.recommendation import recommend
from fpaudit.rules.summary import (
    json_rows,
    module_view,
    reading_format,
    recommendation_view,
    report_headroom,
    run_format,
    run_summary,
    scan_summary,
    steps_view,
)

from ..conftest import SAMPLES
from ..reports import report_from, report_of_steps

FP16 = get_format("fp16")


def _two_modules(steps: int = 3):  # type: ignore[no-untyped-def]
    # a: 3 of 8 values at 2**-30, below fp16's smallest subnormal 2**-24 -> 0.375 at S = 1
    # b: 4 values at 2**-10, fine at S = 1
    return report_from(
        {"a": torch.tensor([2.0**-30] * 3 + [1.0] * 5), "b": torch.tensor([2.0**-10] * 4)},
        steps=steps,
    )


def test_scan_summary_is_recommend_and_module_table_at_1_and_at_s() -> None:
    report = _two_modules()
    summary = scan_summary(report, [FP16, get_format("bf16")], 4)
    assert summary.captured == 3 and summary.forward_problems == 0
    assert summary.first_nonfinite == ()
    fp16, bf16 = summary.formats
    # amax 1.0, headroom 4: the largest 2**k with 2**k <= 65504 / 2**4 = 4094 is 2**11, where
    # a's 2**-30 -> 2**-19 is subnormal; the smallest S as good is 2**6 (2**-24, subnormal;
    # 2**-25 at 2**5 rounds to zero)
    assert fp16.recommendation.log2_scale == 6
    assert fp16.recommendation == recommend(report, FP16, 4)
    assert bf16.recommendation == recommend(report, "bf16", 4)
    scope = analysis.default_scope(report, False)
    assert fp16.at_1.equals(analysis.module_table(report, FP16, 0, scope=scope))
    assert fp16.at_scale.equals(analysis.module_table(report, FP16, 6, scope=scope))
    assert fp16.at_1.set_index("module")["underflow_fraction"].to_dict() == {"a": 0.375, "b": 0.0}
    assert fp16.at_scale["underflow_fraction"].tolist() == [0.0, 0.0]  # 2**-30 * 2**6 = 2**-24
    assert fp16.drift == drift(report, FP16, 4)
    # three windows, one scale: neither drifted nor long enough to show
    assert len(fp16.drift.windows) == 3 and not fp16.show_drift
    as_json = json.loads(json.dumps(summary.to_dict()))
    assert as_json["formats"][0]["recommendation"]["log2_scale"] == 6
    assert as_json["formats"][0]["at_1"][0]["underflow_fraction"] == 0.375


def test_the_worst_modules_are_the_most_underflowing_at_1_with_their_numbers_at_s() -> None:
    # a: 3 of its 8 nonzero values underflow fp16 at S = 1 (2**-30 < 2**-25), none at the
    # recommended 2**6 (2**-24; the ceiling is 2**11); b: none at either; c: 2 of 2 at S = 1
    # (2**-40), and still at 2**11
    report = report_from(
        {"b": torch.tensor([2.0**-10] * 4), "a": torch.tensor([2.0**-30] * 3 + [1.0] * 5),
         "c": torch.tensor([2.0**-40] * 2)},
    )  # fmt: skip
    (fp16,) = scan_summary(report, [FP16], 4).formats
    assert fp16.recommendation.log2_scale == 6
    worst = fp16.worst_modules(2)
    assert [(w.module, w.nonzero, w.underflow_fraction_at_1, w.underflow_fraction, w.amax)
            for w in worst] == [("c", 2, 1.0, 1.0, 2.0**-40), ("a", 8, 0.375, 0.0, 1.0)]  # fmt: skip
    assert [w.module for w in fp16.worst_modules(5)] == ["c", "a", "b"]  # the rest, as found


def test_a_long_scan_shows_its_drift() -> None:
    report = _two_modules(steps=10)
    (fp16,) = scan_summary(report, [FP16], 4).formats
    assert len(fp16.drift.windows) == 10 and not fp16.drift.warn and fp16.show_drift


def test_run_summary_judges_nothing_without_records() -> None:
    report = _two_modules()
    summary = run_summary(report, FP16, 4, window_steps=1, threshold_binades=0)
    assert summary.recommendation == recommend(report, FP16, 4)
    assert summary.drift == drift(report, FP16, 4, window_steps=1, threshold_binades=0)
    empty = report_of_steps([])
    assert run_summary(empty, FP16, 4).to_dict() == {
        "recommendation": None,
        "drift": None,
        "findings": [],
        "nonfinite_steps": [],
        "skips": None,  # no loss scaler
    }


def test_the_format_and_headroom_a_report_is_read_in() -> None:
    report = _two_modules()
    assert reading_format(report).name == "fp16"  # no formats stored: fp16
    assert reading_format(report, "bf16").name == "bf16"
    report.update_info(formats=("fp8_e4m3fn", "fp16"))
    assert reading_format(report).name == "fp8_e4m3fn"  # the scan's first
    assert run_format(report).name == "fp16" and run_format(report, "bf16").name == "bf16"
    assert report_headroom(report) == options.default_int("scan", "headroom_bits")


def test_module_view_at_the_recommended_scale_and_the_worst_rows_first() -> None:
    report = _two_modules()
    given = module_view(report, FP16, 0, top=1)
    assert given.scale_source == "given" and given.log2_scale == 0
    assert given.table["module"].tolist() == ["a"]  # 0.375 before 0.0
    assert given.rows() == json_rows(given.table)
    recommended = module_view(report, FP16, None)
    assert recommended.scale_source == "recommended"
    assert recommended.log2_scale == recommend(report, FP16, report_headroom(report)).log2_scale
    by_op = module_view(report, FP16, 0, by="op")
    assert {"node", "op"} <= set(by_op.table.columns)


def test_show_marks_the_modules_that_lose_what_the_scale_answers_for() -> None:
    report = _two_modules()
    # S = 1: a loses 3 of 8 (0.375 > 0.01), b nothing -> a marked
    assert module_view(report, FP16, 0).marked() == [True, False]
    # S = 2**10: a's 2**-30 become 2**-20 (kept), b's 2**-10 become 1 -> none lost
    assert module_view(report, FP16, 10).marked() == [False, False]
    # S = 2**16: a's 1.0 become 65536 > 65504 (overflow) -> a marked again
    assert module_view(report, FP16, 16).marked() == [True, False]


def test_recommendation_view_judges_the_worst_window_alone() -> None:
    # step 0 holds amax 2**10, steps 1-2 amax 1: the worst window is step 0
    report = report_of_steps(
        [torch.tensor([2.0**10, 1.0]), torch.tensor([1.0, 0.5]), torch.tensor([1.0, 0.5])]
    )
    whole = recommendation_view(report, FP16, 4, window_steps=1)
    assert whole.window is None and whole.recommendation == recommend(report, FP16, 4)
    worst = recommendation_view(report, FP16, 4, worst_window=True, window_steps=1)
    assert worst.window is not None and (worst.window.first_step, worst.window.last_step) == (0, 0)
    # amax 2**10: the largest 2**k with 2**(k+10) <= 4094 is 2**1, but 1.0 and 2**10 are fp16
    # normals at S = 1 already: S = 1
    assert worst.recommendation.ceiling_log2_scale == 1
    assert worst.recommendation.log2_scale == 0
    assert worst.to_dict()["window"] == [0, 0]
    assert worst.to_dict()["drift"] == worst.drift.to_dict()


def test_steps_view_holds_the_steps_table() -> None:
    report = _two_modules()
    view = steps_view(report)
    assert view.training is None and view.findings == ()
    assert view.to_dict()["steps"] == json_rows(report.steps)
    assert len(view.to_dict()["steps"]) == 3


def test_recommend_json_is_the_library_views_dict(tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    report = _two_modules()
    report.write(tmp_path / "report")
    printed = cli("recommend", tmp_path / "report", "--json")
    assert printed.code == 0, printed.stderr
    view = recommendation_view(report, FP16, report_headroom(report))
    assert json.loads(printed.stdout) == json.loads(json.dumps(view.to_dict()))


def test_scan_prints_the_library_summary(tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    from fpaudit.report.store import Report

    out = tmp_path / "scan"
    done = cli("scan", SAMPLES / "mlp.py", "--steps", "2", "--out", out)
    assert done.code == 0, done.stderr
    report = Report.read(out)
    (fp16,) = scan_summary(report, [FP16], report_headroom(report)).formats
    rec = fp16.recommendation
    assert rec == recommend(report, FP16, report_headroom(report))
    assert f"Scanned 2 step(s); report written to {out}" in done.stdout
    if rec.log2_scale is not None:
        assert f"at S=2^{rec.log2_scale}" in done.stdout


@pytest.mark.parametrize(
    ("command", "name", "value", "problem"),
    [
        ("scan", "top", 0, "must be at least 1, got 0"),
        ("show", "limit", 1, "must be at least 2, got 1"),
        ("scan", "headroom_bits", -1, "must be between 0 and 64, got -1"),
        ("recommend", "drift_binades", -1, "must be 0 or more, got -1"),
        ("gate", "max_underflow", 1.5, "must be a fraction between 0 and 1, got 1.5"),
        ("show", "kind", "weights", "must be backward, grad or forward, got 'weights'"),
        ("show", "by", "node", "must be module or op, got 'node'"),
        (
            "simulate",
            "policy",
            "fairseq",
            "must be one of torch, apex, deepspeed, megatron, static, te-delayed, "
            "msamp-delayed, got 'fairseq'",
        ),
    ],
)
def test_an_option_out_of_its_declared_bounds_is_named_once(
    command: str, name: str, value: object, problem: str
) -> None:
    bounds = options.spec(command, name).bounds
    assert bounds is not None and bounds.problem(value) == problem
    args = next(a for a in options.COMMAND_ARGS if command == a.COMMAND)
    with pytest.raises(OptionError) as caught:
        args.build({}, {name: value})
    assert caught.value.as_flag() == f"--{name.replace('_', '-')} {problem}"
    with pytest.raises(OptionError):  # a config file's value is checked the same way
        args.build({name: value}, {})


def test_values_within_bounds_and_defaults_pass() -> None:
    for args in options.COMMAND_ARGS:
        args.build({}, {})  # every declared default is within its bounds
    assert options.ScanArgs.build({}, {"top": 1, "headroom_bits": 64}).top == 1
    assert options.GateArgs.build({}, {"max_underflow": 0.0}).max_underflow == 0.0
    assert options.SimulateArgs.build({}, {"policy": "te-delayed"}).policy == "te-delayed"
    assert math.isclose(options.GateArgs.build({}, {"max_underflow": 1.0}).max_underflow or 0, 1)
