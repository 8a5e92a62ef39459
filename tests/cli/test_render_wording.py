"""Wording of rendered lines, on hand-built results (no scan needed)."""

from __future__ import annotations

from rich.text import Text

from fpaudit.cli.render import recommendation_lines
from fpaudit.cli.render_run import drift_lines
from fpaudit.rules.drift import Drift, Window
from fpaudit.rules.recommendation import Recommendation
from fpaudit.text import ROOT_LABEL, module_in_prose


def _window(first: int, last: int, log2: int) -> Window:
    return Window(first, last, last - first + 1, 1.0, log2, "m", "aten.mm", 0.0, 0.0)


def _drift(window_steps: int, windows: list[Window], threshold: int = 2) -> Drift:
    scales = [w.log2_scale for w in windows if w.log2_scale is not None]
    return Drift(
        "fp16", 4, window_steps, windows, min(scales), max(scales) - min(scales), threshold
    )


def test_windows_of_one_step_that_agree() -> None:
    drift = _drift(1, [_window(0, 0, 15), _window(1, 1, 15)])
    assert drift_lines(drift) == [
        "Drift (fp16): per-window recommendations (windows of 1 step) all agree on 2^15."
    ]


def test_one_binade_and_single_step_windows_read_in_the_singular() -> None:
    drift = _drift(1, [_window(0, 0, 14), _window(2, 2, 15)])
    assert drift_lines(drift) == [
        "Drift (fp16): per-window recommendations (windows of 1 step) span 1 binade, "
        "2^14 (step 0) to 2^15 (step 2)."
    ]


def test_wide_windows_and_a_warning_read_in_the_plural() -> None:
    drift = _drift(10, [_window(0, 9, 10), _window(10, 19, 14)])
    lines = drift_lines(drift)
    warning = lines[0]
    assert isinstance(warning, Text) and warning.style == "yellow"
    assert warning.plain == (
        "Drift (fp16): per-window recommendations (windows of 10 steps) span 4 "
        "binades, 2^10 (steps 0-9) to 2^14 (steps 10-19): more than 2."
    )


def test_a_numeric_module_name_reads_as_a_module_in_a_sentence() -> None:
    assert module_in_prose("4") == "module 4"  # a child of a top-level nn.Sequential
    assert module_in_prose("0.2") == "module 0.2"
    assert module_in_prose("layers.4") == "layers.4"
    assert module_in_prose("") == ROOT_LABEL


def _recommendation(fmt: str) -> Recommendation:
    return Recommendation(
        fmt, 4, 120, 2.0**120, 1e-30, "m", "aten.mm", "amax", 0.0, 0.0, 0.0, False
    )


def test_a_bf16_recommendation_says_bf16_rarely_needs_loss_scaling() -> None:
    lines = recommendation_lines(_recommendation("bf16"))
    assert lines[0].startswith("Recommended static loss scale for bf16: S = 2^120 ")
    assert lines[-1].startswith("  Note: bf16 has fp32's exponent range, so it rarely needs")
    assert "S = 1 loses 0% here" in lines[-1]
    assert not any("rarely" in line for line in recommendation_lines(_recommendation("fp16")))
