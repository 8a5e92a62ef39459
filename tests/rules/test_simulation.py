"""fpaudit simulate and drift: overflow thresholds, policy replays, per-window recommendations."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from fpaudit.numerics.formats import get_format
from fpaudit.report.store import Report
from fpaudit.rules import scalers
from fpaudit.rules.analysis import totals
from fpaudit.rules.drift import drift, window_report
from fpaudit.rules.recommendation import recommend
from fpaudit.rules.simulation import (
    SOURCE_AMAX,
    SOURCE_OBSERVED,
    ScalerOverrides,
    simulate,
    thresholds,
)

from ..conftest import one_error_line
from ..reports import report_of_steps
from ..run.test_training import AMP

FP16 = get_format("fp16")


def test_threshold_from_amax_matches_a_torch_cast() -> None:
    report = report_of_steps([torch.tensor([2.0, -0.5])])
    limits = thresholds(report, FP16, scope_of(report))
    # 65520 (the fp16 overflow edge, where the tie rounds to inf) / amax 2 = 32760
    assert limits.threshold[0] == 32760.0 and limits.source == [SOURCE_AMAX]
    # so 2^15 overflows and 2^14 does not -- as torch's own cast says
    assert torch.isinf(torch.tensor(2.0 * 2**15).half())
    assert not torch.isinf(torch.tensor(2.0 * 2**14).half())


def scope_of(report: Report):  # type: ignore[no-untyped-def]
    from fpaudit.rules import analysis

    return analysis.default_scope(report)


def test_observed_overflow_pins_the_threshold_at_the_real_scale() -> None:
    # Recorded at S = 2^10: 1.0 is 2^-10 unscaled.
    report = report_of_steps([torch.tensor([1.0])] * 3, loss_scale=2.0**10)
    report.update_info(command="run")
    report.steps["skipped"] = [False, True, False]
    limits = thresholds(report, FP16, scope_of(report))
    # amax alone says 65520 / 2^-10 = 67092480; the run saw step 1 overflow at 2^10.
    assert limits.threshold[0] == 67092480.0 and limits.source[0] == SOURCE_AMAX
    assert limits.threshold[1] == 1024.0 and limits.source[1] == SOURCE_OBSERVED
    assert limits.threshold[2] == 67092480.0


def test_a_clean_step_at_a_scale_above_the_estimate_moves_the_threshold_up() -> None:
    # 131072 recorded at S = 2^15 is 4 unscaled.
    report = report_of_steps([torch.tensor([131072.0])], loss_scale=2.0**15)
    report.update_info(command="run")
    # estimate 65520 / 4 = 16380 < 2^15, yet the run did not overflow at 2^15: it wins.
    limits = thresholds(report, FP16, scope_of(report))
    assert limits.threshold[0] == math.nextafter(2.0**15, math.inf)
    assert limits.source == [SOURCE_OBSERVED]


def test_underflow_per_step_at_the_replayed_scale() -> None:
    # 2^-30 * 2^6 = 2^-24, fp16's smallest subnormal: kept. At 2^5 it is 2^-25, the tie: zero.
    assert torch.tensor(2.0**-24).half().item() != 0 and torch.tensor(2.0**-25).half().item() == 0
    report = report_of_steps([torch.full((4,), 2.0**-30)] * 3)
    result = simulate(
        report, FP16, "static", ScalerOverrides(init_scale=2.0**6), static_scale=2.0**5
    )
    assert list(result.policy.underflow) == [0.0, 0.0, 0.0]
    assert list(result.static.underflow) == [1.0, 1.0, 1.0]
    assert result.static.underflow_count == 12 and result.static.nonzero == 12


@pytest.fixture(scope="module")
def run_report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fpaudit.cli.commands import run

    out = tmp_path_factory.mktemp("sim") / "report"
    code = run(["run", "--out", str(out), "--capture-every", "5", "--", str(AMP), "--steps",
                "40", "--overflow-at", "3", "7", "20", "21", "33", "--unscale-first"])  # fmt: skip
    assert code == 0
    return out


def test_simulate_torch_reproduces_the_real_gradscaler_step_for_step(cli, run_report: Path) -> None:
    report = Report.read(run_report)
    result = cli("simulate", run_report, "--policy", "torch", "--json")
    assert result.code == 0, result.stderr
    data = json.loads(result.stdout)
    # the run's own scaler settings are the defaults: init 2^10, growth interval 4
    assert data["policy"]["settings"]["init_scale"] == 1024.0
    assert data["policy"]["settings"]["growth_interval"] == 4
    assert [s["scale"] for s in data["steps"]] == list(report.steps["loss_scale"])
    assert [s["skipped"] for s in data["steps"]] == list(report.steps["skipped"])
    assert list(np.flatnonzero(report.steps["skipped"])) == [3, 7, 20, 21, 33]
    # and the report's scale trajectory has growth in it, not only back-offs
    assert (report.steps["scale_after"] > report.steps["loss_scale"]).any()
    text = cli("simulate", run_report).stdout
    assert "The replayed trajectory equals the real run's, step for step." in text


def test_a_runs_summary_is_a_typed_record_with_the_jsons_keys(run_report: Path) -> None:
    report = Report.read(run_report)
    result = simulate(report, FP16, "torch")
    summary = result.policy.summary()
    # the real GradScaler skipped the steps the script overflowed (the run's steps table)
    assert summary.skipped_steps == tuple(int(s) for s in np.flatnonzero(report.steps["skipped"]))
    assert summary.skipped == 5 and summary.settings.init_scale == 1024.0
    assert summary.min_scale == float(report.steps["loss_scale"].min())
    assert summary.final_scale == float(report.steps["scale_after"].iloc[-1])
    # the JSON's keys, in the order --json has always printed them
    assert list(summary.to_dict()) == [
        "policy", "settings", "skipped", "skipped_steps", "final_scale", "min_scale",
        "max_scale", "underflow_fraction", "aborted_at",
    ]  # fmt: skip
    assert summary.to_dict()["settings"] == scalers.settings("torch", **{
        "init_scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5,
        "growth_interval": 4}).to_dict()  # fmt: skip
    assert result.to_dict()["policy"] == summary.to_dict()


def test_simulate_other_policies_replay_the_same_thresholds(cli, run_report: Path) -> None:
    report = Report.read(run_report)
    limits = thresholds(report, FP16, scope_of(report))
    data = json.loads(cli("simulate", run_report, "--policy", "deepspeed", "--init-scale",
                          "2^12", "--hysteresis", "3", "--min-scale", "2^4", "--json").stdout)  # fmt: skip
    expected = scalers.replay_thresholds(
        scalers.settings("deepspeed", init_scale=4096.0, hysteresis=3, min_scale=16.0),
        limits.threshold,
    )
    assert [s["scale"] for s in data["steps"]] == list(expected.scale)
    assert [s["skipped"] for s in data["steps"]] == list(expected.skipped)
    assert data["policy"]["settings"]["hysteresis"] == 3


def test_simulate_static_defaults_to_the_recommended_scale(cli, run_report: Path) -> None:
    from fpaudit.rules.recommendation import recommend

    data = json.loads(cli("simulate", run_report, "--json").stdout)
    assert (
        data["static"]["settings"]["init_scale"] == recommend(Report.read(run_report), FP16).scale
    )


def test_policy_static_replays_one_static_scale_in_one_row(cli, run_report: Path) -> None:
    from fpaudit.rules.recommendation import recommend

    recommended = recommend(Report.read(run_report), FP16).scale
    data = json.loads(cli("simulate", run_report, "--policy", "static", "--json").stdout)
    assert data["policy"]["settings"]["init_scale"] == recommended
    assert data["static"]["settings"]["init_scale"] == recommended
    shown = cli("simulate", run_report, "--policy", "static").stdout
    rows = [line for line in shown.splitlines() if line.startswith("│ static")]
    assert len(rows) == 1 and "(dynamic)" not in shown


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--policy", "nope"], "--policy must be one of torch, apex, deepspeed, megatron, static"),
        (
            ["--policy", "torch", "--hysteresis", "2"],
            "--hysteresis does not apply to --policy torch",
        ),
        (["--init-scale", "lots"], "--init-scale 'lots' is not a number"),
        (["--policy", "apex", "--growth-factor", "0.5"], "--growth-factor must be"),
        (["--policy", "static", "--init-scale", "8"], "takes its scale from --static-scale"),
        (["--static-scale", "-4"], "--static-scale must be a positive number"),
    ],
)
def test_simulate_bad_options_are_one_line(
    cli, run_report: Path, args: list[str], says: str
) -> None:
    assert says in one_error_line(cli("simulate", run_report, *args))


def drifting_report() -> Report:
    """Steps 0-9 with amax 1, steps 10-19 with amax 64 (gradients grow 6 binades)."""
    return report_of_steps(
        [torch.tensor([1.0, 2.0**-20])] * 10 + [torch.tensor([64.0, 2.0**-20])] * 10
    )


def test_drift_per_window_recommendations() -> None:
    result = drift(drifting_report(), FP16, 4, window_steps=10)
    # limit 65504 / 2^4 = 4094: amax 1 gives the ceiling 2^11 (2048 <= 4094 < 4096), where
    # 2^-20 -> 2^-9 is normal; the smallest S keeping it normal (>= 2^-14) is 2^6. amax 64
    # gives the ceiling 2^5, where 2^-20 -> 2^-15 is subnormal, as at S = 1 (>= 2^-24): 2^0.
    assert [w.log2_scale for w in result.windows] == [6, 0]
    assert [(w.first_step, w.last_step) for w in result.windows] == [(0, 9), (10, 19)]
    # the run's ceiling is 2^5, where every 2^-20 is subnormal, as at S = 1: 2^0
    assert result.binades == 6 and result.warn and result.run_log2_scale == 0
    assert result.worst is not None and result.worst.first_step == 10
    # 2^-20 at the run's 2^0 is an fp16 subnormal: kept. No underflow anywhere.
    assert result.windows[0].underflow_at_run_scale == 0.0
    quiet = drift(drifting_report(), FP16, 4, window_steps=10, threshold_binades=6)
    assert not quiet.warn


def test_each_window_is_what_recommend_says_of_that_window_alone() -> None:
    # amax and the tiny values move from step to step, so windows differ in scale and
    # in underflow; window 3 holds one step (9) only.
    values = [torch.tensor([2.0**step, 2.0 ** (-20 - 2 * step), 0.0]) for step in range(10)]
    report = report_of_steps(values)
    result = drift(report, FP16, 4, window_steps=3)
    assert [(w.first_step, w.last_step) for w in result.windows] == [(0, 2), (3, 5), (6, 8), (9, 9)]
    run_scale = result.run_log2_scale
    assert run_scale is not None
    assert run_scale == recommend(report, FP16, 4).log2_scale  # the whole run: one rule
    for w in result.windows:
        alone = window_report(report, w.first_step, w.last_step)
        expected = recommend(alone, FP16, 4)
        assert w.captured_steps == w.last_step - w.first_step + 1
        assert w.log2_scale == expected.log2_scale and w.amax == expected.amax
        assert w.underflow_fraction == expected.underflow_fraction
        at_run = totals(alone, FP16, run_scale)
        assert w.underflow_at_run_scale == at_run.underflow / at_run.nonzero
    # by hand (ceiling, then the smallest S that underflows and flushes no more): steps 0-2,
    # amax 4: ceiling 2^9, where 2^-24 -> 2^-15 is subnormal and 2^-20, 2^-22 normal, as
    # from 2^8 (2^-22 -> 2^-14): 2^8. Steps 3-5, amax 32: ceiling 2^6, 2^-26..2^-30 all
    # subnormal there; below 2^6 2^-30 rounds to zero: 2^6. Steps 6-8 (amax 256, ceiling
    # 2^3) and 9 (amax 512, ceiling 2^2): their tiny values underflow at every S up to the
    # ceiling (2^-32 * 2^3 = 2^-29 <= 2^-25): 2^0.
    assert [w.log2_scale for w in result.windows] == [8, 6, 0, 0]


def test_the_scale_rule_on_one_number() -> None:
    from fpaudit.rules.recommendation import log2_scale_for

    # fp16: limit 65504 / 2^4 = 4094; amax 1 -> 2^11 (2048 <= 4094 < 4096)
    assert log2_scale_for(1.0, FP16, 4) == (11, "amax")
    assert log2_scale_for(0.0, FP16, 4) == (None, "no nonzero values")
    # amax 2^-200: 2^211 would fit, but scales stop at fp32's 2^127
    assert log2_scale_for(2.0**-200, FP16, 4) == (127, "scale range")


def test_window_report_keeps_only_its_steps() -> None:
    part = window_report(drifting_report(), 10, 19)
    assert set(part.records["step"]) == set(range(10, 20))
    assert list(part.records["record_id"]) == list(range(10))
    assert part.records["amax"].max() == 64.0
    assert int(part.bins["count"].sum()) == 20


def test_recommend_worst_window_and_drift_warning(cli, tmp_path: Path) -> None:
    drifting_report().write(tmp_path / "r")
    text = cli("recommend", tmp_path / "r", "--drift-window", "10").stdout
    # see test_drift_per_window_recommendations: the run's S = 1, its windows' 2^6 and 2^0
    assert "S = 2^0 = 1" in text and "span 6 binades" in text and "more than 2" in text
    worst = cli("recommend", tmp_path / "r", "--worst-window", "--drift-window", "10", "--json")
    data = json.loads(worst.stdout)
    assert data["window"] == [10, 19] and data["log2_scale"] == 0
    assert data["drift"]["binades"] == 6
    assert "--drift-window must be at least 1" in one_error_line(
        cli("recommend", tmp_path / "r", "--drift-window", "0")
    )


def test_scaler_overrides_keep_the_flags_order_and_give_only_what_is_set() -> None:
    overrides = ScalerOverrides(growth_factor=3.0, hysteresis=2)
    assert list(overrides.to_dict()) == list(scalers.PARAMETERS)  # the declared order
    assert overrides.given == {"growth_factor": 3.0, "hysteresis": 2}
    assert ScalerOverrides(**overrides.to_dict()) == overrides
