"""What ``fpaudit run`` prints about a training loop: the skipped steps, the loss scale
as it went, the misuse findings, the drift of the recommendation. ``show --steps``
(:mod:`fpaudit.cli.render_show`), ``recommend`` and ``simulate`` print some of these
lines too. Results go to stdout, messages to stderr."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.text import Text

from fpaudit.cli.render import recommendation_lines, stdout
from fpaudit.text import percent, power

if TYPE_CHECKING:
    import pandas as pd

    from fpaudit.report.runinfo import Finding, ScalerInfo, SkipStatistics
    from fpaudit.rules.drift import Drift
    from fpaudit.rules.recommendation import Recommendation
    from fpaudit.rules.skips import SkipOrigin, SkipVerdict

SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[float], width: int = 60) -> str:
    """log2 of positive values as a bar per step (or per bucket: its minimum)."""
    finite = [v for v in values if v > 0 and math.isfinite(v)]
    if not finite:
        return ""
    logs = [math.log2(v) if v > 0 and math.isfinite(v) else math.log2(min(finite)) for v in values]
    buckets = max(1, math.ceil(len(logs) / width))
    points = [min(logs[i : i + buckets]) for i in range(0, len(logs), buckets)]
    low, high = min(points), max(points)
    if high == low:
        return SPARK[3] * len(points)
    return "".join(SPARK[round((p - low) / (high - low) * (len(SPARK) - 1))] for p in points)


def steps_list(steps: Sequence[int], count_: int) -> str:
    shown = ", ".join(str(s) for s in steps[:10])
    more = count_ - min(len(steps), 10)
    return shown + (f", … ({more} more)" if more > 0 else "")


def findings(items: Sequence[Finding], console: Console | None = None) -> None:
    """Findings, errors first, each with its file:line."""
    console = console or stdout()
    if not items:
        console.print("No misuse found in the training loop.")
        return
    console.print(f"{len(items)} finding(s) in the training loop:")
    for item in items:
        colour = {"error": "red", "warning": "yellow"}.get(item.severity, "cyan")
        steps = steps_list(item.steps, item.count)
        console.print(
            Text.assemble(
                "  ",
                (item.severity, colour),
                f" {item.where} ",
                (item.code, "bold"),
                f": {item.message} (in {item.count} step(s): {steps})",
            )
        )


def skip_lines(stats: SkipStatistics, scaler: ScalerInfo | None) -> list[str]:
    """Skipped steps, with calibration told apart (expected on a fresh dynamic scaler)."""
    total, skipped = stats.steps, stats.skipped
    if not scaler:
        return [f"{total} step(s); no enabled GradScaler, so no step was skipped."]
    lines = [f"Skipped {skipped} of {total} step(s) ({percent(skipped / total if total else 0)})."]
    calibration = stats.calibration_steps
    if calibration:
        lines.append(
            f"  The first {calibration} skip(s) were calibration: a fresh scaler starts at "
            f"{power(scaler.init_scale)} and halves until gradients fit; expected, not a "
            "problem."
        )
    if stats.steps_after_calibration:
        after = (
            f"  After calibration: {stats.skipped_after_calibration} of "
            f"{stats.steps_after_calibration} skipped "
            f"({percent(stats.skip_rate_after_calibration)})"
        )
        grows = scaler.growth_factor > 1 and scaler.growth_interval <= stats.steps_after_calibration
        if grows:  # a scaler that can grow within the run probes the top of the range
            after += (
                f"; a dynamic scaler that grows every {scaler.growth_interval} clean steps "
                "skips about 1 in that many by design"
            )
        else:  # it held its scale: a skip is an overflow at that scale, nothing by design
            after += "; the scaler did not grow in this run, so each skip is an overflow"
        lines.append(after + ".")
    return lines


SKIPS_SHOWN = 10  # skips after calibration listed by run; show --skips lists them all


def skip_origin_line(skip: SkipOrigin) -> str:
    """One skipped step's origin: forward or backward, the parameters, the op."""
    where = f"step {skip.step} at {power(skip.loss_scale)}: "
    if skip.origin == "forward":
        where += "forward (the loss was inf/NaN)"
    elif skip.origin == "backward":
        where += "backward (finite loss, inf/NaN gradients)"
    else:
        where += "calibration"
    if skip.nonfinite_params >= 0:
        named = ", ".join(skip.params)
        more = skip.nonfinite_params - len(skip.params)
        where += (
            f"; {skip.nonfinite_params} of {skip.params_checked} parameter gradient(s) inf/NaN"
            + (f", first {named}" if named else "")
            + (f" (+{more} more)" if more > 0 else "")
        )
    if skip.op:
        seen = "" if skip.op_step == skip.step else f" in the next step ({skip.op_step}, captured)"
        where += f"; first made by {skip.op_phase} op {skip.op_label}{seen}"
        if skip.op_amax > 0 and math.isfinite(skip.edge_binades):
            side = "over" if skip.edge_binades > 0 else "under"
            where += (
                f", its largest finite value {skip.op_amax:.4g} at {power(skip.op_scale)}, "
                f"{abs(skip.edge_binades):.2f} binade(s) {side} the format's largest"
            )
        elif skip.op_amax == 0:
            where += ", no finite nonzero output left"
    return where


def skip_verdict_lines(verdict: SkipVerdict, shown: int = SKIPS_SHOWN) -> list[str | Text]:
    """Each skip after calibration (the first ``shown``), then the run's verdict."""
    later = [skip for skip in verdict.skips if skip.origin != "calibration"]
    lines: list[str | Text] = [f"  {skip_origin_line(skip)}" for skip in later[:shown]]
    if shown and len(later) > shown:
        lines.append(f"  … {len(later) - shown} more skip(s): fpaudit show REPORT --skips")
    if verdict.verdict == "none":
        return lines
    style = {"persistent": "red", "range": "yellow"}.get(verdict.verdict, "")
    lines.append(Text(f"Skip verdict: {verdict.verdict}: {verdict.reason}.", style=style))
    return lines


def nonfinite_lines(steps: Sequence[int]) -> list[str]:
    """The steps whose loss or gradients were inf or NaN that no loss scaler skipped."""
    if not steps:
        return []
    return [
        f"The loss or gradients were inf or NaN in {len(steps)} step(s) that no loss scaler "
        f"skipped, first at step {steps[0]} (steps {steps_list(steps, len(steps))}): the run "
        "trained on broken values, and `fpaudit gate` fails on them."
    ]


def scale_lines(steps: pd.DataFrame) -> list[str]:
    if steps.empty:
        return []
    scale = steps["loss_scale"].to_numpy()
    after = steps["scale_after"].to_numpy()
    return [
        f"Loss scale: {power(scale[0])} at the start, {power(after[-1])} at the end "
        f"(min {power(min(scale.min(), after.min()))}, "
        f"max {power(max(scale.max(), after.max()))})"
        f"  {sparkline([*list(scale), after[-1]])}"
    ]


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _steps(first: int, last: int) -> str:
    return f"step {first}" if first == last else f"steps {first}-{last}"


def drift_lines(result: Drift) -> list[str | Text]:
    judged = [w for w in result.windows if w.log2_scale is not None]
    if len(judged) < 2:
        return []
    low = min(judged, key=lambda w: w.log2_scale or 0)
    high = max(judged, key=lambda w: w.log2_scale or 0)
    size = _plural(result.window_steps, "step")
    opening = f"Drift ({result.format}): per-window recommendations (windows of {size})"
    if result.binades == 0:
        return [f"{opening} all agree on 2^{low.log2_scale}."]
    text = (
        f"{opening} span {_plural(result.binades, 'binade')}, "
        f"2^{low.log2_scale} ({_steps(low.first_step, low.last_step)}) to "
        f"2^{high.log2_scale} ({_steps(high.first_step, high.last_step)})"
    )
    if not result.warn:
        return [text + "."]
    return [
        Text(f"{text}: more than {result.threshold_binades}.", style="yellow"),
        "  A static scale calibrated on a few steps would be wrong elsewhere in the run; "
        "calibrate on the whole run (as this recommendation does) or use a dynamic scaler.",
    ]


def run_summary(
    path: str,
    report: pd.DataFrame | Any,
    items: Sequence[Finding],
    rec: Recommendation | None,
    drift_result: Drift | None,
    nonfinite_steps: Sequence[int] = (),
    skips: SkipVerdict | None = None,
) -> None:
    console = stdout()
    info = report.info
    steps = report.steps
    captured = int(steps["captured"].sum()) if len(steps) else 0
    # a loop without torch.optim: each step ends at the script's own update
    kind = (
        "optimizer step(s)"
        if report.info.settings.get("optimizers")
        else "step(s) (no torch.optim optimizer: the script's own updates)"
    )
    console.print(
        f"Ran {info.script}: {info.steps_run} {kind}, {captured} captured; report written to {path}"
    )
    assert info.training is not None  # fpaudit run records it
    for line in skip_lines(info.training, info.scaler):
        console.print(line)
    if skips is not None:
        for verdict_line in skip_verdict_lines(skips):
            console.print(verdict_line)
    if info.scaler is not None:  # without a scaler the scale is 1 throughout: nothing to draw
        for line in scale_lines(steps):
            console.print(line)
    for line in nonfinite_lines(nonfinite_steps):
        console.print(Text(line, style="red"))
    findings(items, console)
    if rec is not None:
        for line in recommendation_lines(rec):
            console.print(line)
    if drift_result is not None:
        for drift_line in drift_lines(drift_result):
            console.print(drift_line)
