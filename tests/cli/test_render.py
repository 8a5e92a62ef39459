"""fpaudit/cli/render.py's public helpers called directly, with exact expected output.

(``origins_view``, ``drift_lines`` and ``recommendation_lines`` are tested elsewhere:
test_origins.py, test_render_wording.py.)
"""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from fpaudit.cli import formatters, render, render_run
from fpaudit.numerics.formats import FORMATS
from fpaudit.report.runinfo import Finding, ScalerInfo, SkipStatistics


def test_error_line_is_one_line_whatever_the_message(capsys: pytest.CaptureFixture[str]) -> None:
    render.error_line("cannot read\n  report.parquet:\tbad   magic ")
    captured = capsys.readouterr()
    assert captured.err == "fpaudit: error: cannot read report.parquet: bad magic\n"
    assert captured.out == ""


def test_print_json_takes_numpy_scalars_and_refuses_nan(capsys: pytest.CaptureFixture[str]) -> None:
    render.print_json({"n": np.int64(3), "x": np.float32(0.5), "s": "a"})
    assert json.loads(capsys.readouterr().out) == {"n": 3, "x": 0.5, "s": "a"}
    with pytest.raises(ValueError, match="Out of range float"):
        render.print_json({"x": math.nan})  # strict JSON: callers map NaN to None first
    with pytest.raises(TypeError, match="not JSON serialisable: object"):
        render.print_json({"x": object()})


def test_json_records_turns_non_finite_floats_into_null() -> None:
    frame = pd.DataFrame({"m": ["a", "b", "c"], "v": [1.5, math.nan, -math.inf], "n": [1, 2, 3]})
    assert render.json_records(frame) == [
        {"m": "a", "v": 1.5, "n": 1},
        {"m": "b", "v": None, "n": 2},
        {"m": "c", "v": None, "n": 3},
    ]


@pytest.mark.parametrize(
    ("value", "text"),
    [(0.0, "0"), (1.0, "1"), (65504.0, "6.55e+04"), (2.0**-24, "5.96e-08"), (0.123456, "0.123")],
)
def test_magnitude(value: float, text: str) -> None:
    assert render.magnitude(value) == text


@pytest.mark.parametrize(
    ("value", "text"),
    [(1.0, "2^0"), (65536.0, "2^16"), (2.0**-149, "2^-149"), (0.5, "2^-1"), (3.0, "3"),
     (0.0, "0"), (-4.0, "-4"), (math.inf, "inf"), (1e-05, "1e-05")],
)  # fmt: skip
def test_power_names_powers_of_two(value: float, text: str) -> None:
    assert render.power(value) == text


def test_power_is_one_formatter_with_a_shorter_form_for_the_formats_table() -> None:
    from fpaudit import text
    from fpaudit.rules import findings

    assert render.power is text.power is findings.power
    bf16_max = 3.3895313892515355e38
    assert text.power(bf16_max) == "3.38953e+38"
    assert text.power(bf16_max, large_digits=4) == "3.39e+38"
    assert text.power(65504.0, large_digits=4) == "65504"
    assert text.power(2.0**128, large_digits=4) == "2^128"


def test_short_op() -> None:
    assert render.short_op("aten.mm.default") == "mm"
    assert render.short_op("aten.sum.dim_IntList") == "sum.dim_IntList"
    assert render.short_op("seed") == "seed"


def test_sparkline_maps_log2_onto_eight_levels() -> None:
    assert render_run.sparkline([]) == "" and render_run.sparkline([0.0, -1.0, math.nan]) == ""
    assert render_run.sparkline([4.0, 4.0]) == "▄▄"  # flat: the middle bar
    # log2 = 0..7: one level each
    assert render_run.sparkline([2.0**k for k in range(8)]) == "▁▂▃▄▅▆▇█"
    # a zero or inf value is drawn at the smallest positive value's level
    assert render_run.sparkline([1.0, 0.0, 128.0, math.inf]) == "▁▁█▁"
    # more values than the width: each bar is its bucket's minimum
    assert render_run.sparkline([1.0, 2.0, 128.0, 256.0], width=2) == "▁█"


def test_skip_lines_without_and_with_a_scaler() -> None:
    stats = SkipStatistics(steps=10, skipped=3, calibration_steps=2, steps_after_calibration=8,
                           skipped_after_calibration=1, skip_rate_after_calibration=1 / 8)  # fmt: skip
    assert render_run.skip_lines(stats, None) == [
        "10 step(s); no enabled GradScaler, so no step was skipped."
    ]
    scaler = ScalerInfo("torch.amp.GradScaler", 65536.0, 2.0, 0.5, growth_interval=2000)
    lines = render_run.skip_lines(stats, scaler)
    assert lines[0] == "Skipped 3 of 10 step(s) (30%)."
    assert lines[1].startswith(
        "  The first 2 skip(s) were calibration: a fresh scaler starts at 2^16"
    )
    # growing every 2000 clean steps, it never grew in 8: no sentence on growth by design
    assert lines[2] == (
        "  After calibration: 1 of 8 skipped (12.5%); the scaler did not grow in this run, so "
        "each skip is an overflow."
    )
    assert len(lines) == 3
    growing = ScalerInfo("torch.amp.GradScaler", 65536.0, 2.0, 0.5, growth_interval=4)
    line = render_run.skip_lines(stats, growing)[2]
    assert line.startswith("  After calibration: 1 of 8 skipped (12.5%); a dynamic scaler")
    assert "every 4 clean steps" in line
    static = ScalerInfo("torch.amp.GradScaler", 65536.0, 1.0, 0.5, growth_interval=4)
    assert "dynamic" not in render_run.skip_lines(stats, static)[2]


def test_scale_lines() -> None:
    assert render_run.scale_lines(pd.DataFrame({"loss_scale": [], "scale_after": []})) == []
    steps = pd.DataFrame({"loss_scale": [65536.0, 32768.0, 32768.0],
                          "scale_after": [32768.0, 32768.0, 65536.0]})  # fmt: skip
    assert render_run.scale_lines(steps) == [
        "Loss scale: 2^16 at the start, 2^16 at the end (min 2^15, max 2^16)  █▁▁█"
    ]


def test_findings(capsys: pytest.CaptureFixture[str]) -> None:
    render_run.findings([])
    assert capsys.readouterr().out == "No misuse found in the training loop.\n"
    item = {"severity": "error", "file": "train.py", "line": 12, "code": "FP001",
            "message": "clip before unscale", "steps": list(range(12)), "count": 15}  # fmt: skip
    render_run.findings([Finding.from_dict(item)])
    assert capsys.readouterr().out == (
        "1 finding(s) in the training loop:\n"
        "  error train.py:12 FP001: clip before unscale (in 15 step(s): "
        "0, 1, 2, 3, 4, 5, 6, 7, 8, 9, … (5 more))\n"
    )


def test_formats_json_is_the_formats_own_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    formatters.FORMATS.chosen(as_json=True).write(FORMATS.values())
    rows = json.loads(capsys.readouterr().out)
    assert [row["format"] for row in rows] == list(FORMATS)
    fp16 = next(row for row in rows if row["format"] == "fp16")
    assert fp16["dtype"] == "float16" and fp16["max_finite"] == 65504.0
    assert fp16["smallest_subnormal"] == 2.0**-24 and fp16["round_to_zero_edge"] == 2.0**-25
    assert fp16["smallest_normal"] == 2.0**-14 and fp16["overflow_edge"] == 65520.0
    for row in rows:
        f = FORMATS[row["format"]]
        assert (row["smallest_subnormal"], row["max_finite"]) == (
            f.smallest_subnormal,
            f.max_finite,
        )


def test_formats_table_writes_powers_of_two(capsys: pytest.CaptureFixture[str]) -> None:
    render.formats([FORMATS["fp16"], FORMATS["fp8_e4m3fn"]])
    lines = capsys.readouterr().out.splitlines()
    rows = {
        cells[0]: cells[1:]
        for line in lines
        if len(cells := [cell.strip() for cell in line.split("│")[1:-1]]) == 6
    }
    # fp16: 65520 is a tie that rounds to inf; e4m3fn's tie at 464 still rounds down to 448
    assert rows["fp16"] == ["2^-24", "2^-25", "2^-14", "65504", "65520"]
    assert rows["fp8_e4m3fn"] == ["2^-9", "2^-10", "2^-6", "448", "464 (>)"]


def test_module_rows_add_shadow_counts_only_when_measured() -> None:
    table = pd.DataFrame(
        {key: [1] for key in render.MODULE_JSON_KEYS} | {"dtype": ["float32"], "shadow_calls": [0],
         "lost": [0], "lost_fraction": [0.0], "overflowed": [0], "shadow_nonzero": [0]}
    )  # fmt: skip
    plain = render.module_rows(table)
    assert list(plain[0]) == [*render.MODULE_JSON_KEYS, "dtype"]
    table["shadow_calls"] = 1
    assert list(render.module_rows(table)[0]) == [
        *render.MODULE_JSON_KEYS, "dtype", *render.SHADOW_JSON_KEYS
    ]  # fmt: skip


def test_the_console_prints_markup_literally(capsys: pytest.CaptureFixture[str]) -> None:
    render.stdout().print("runs/[bold]x :smile:")
    assert capsys.readouterr().out == "runs/[bold]x :smile:\n"
