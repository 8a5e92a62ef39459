"""What fpaudit prints about a training loop (`run`, `show --steps`, `simulate`), origins
(`show --origins`) and `fp16-plan`. Results go to stdout, messages to stderr."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from fpaudit.cli.render import recommendation_lines, short_op, stdout, unscalable_counts
from fpaudit.numerics.formats import Format
from fpaudit.rules import scalers
from fpaudit.text import module_label, percent, power, scale_text

if TYPE_CHECKING:
    import pandas as pd

    from fpaudit.report.runinfo import Finding, ScalerInfo, SkipStatistics
    from fpaudit.rules.delayed import Replay as DelayedReplay
    from fpaudit.rules.delayed import Sweep as DelayedSweep
    from fpaudit.rules.drift import Drift
    from fpaudit.rules.origins import Origins as OriginsResult
    from fpaudit.rules.recommendation import Recommendation
    from fpaudit.rules.simulation import Simulation
    from fpaudit.run.fp16plan import Fp16Plan

# -- training loop (fpaudit run, show --steps, simulate) ----------------------
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


def _steps_list(steps: Sequence[int], count_: int) -> str:
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
        steps = _steps_list(item.steps, item.count)
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
        return [f"{total} optimizer step(s); no enabled GradScaler, so no step was skipped."]
    lines = [f"Skipped {skipped} of {total} step(s) ({percent(skipped / total if total else 0)})."]
    calibration = stats.calibration_steps
    if calibration:
        lines.append(
            f"  The first {calibration} skip(s) were calibration: a fresh scaler starts at "
            f"{power(scaler.init_scale)} and halves until gradients fit; expected, not a "
            "problem."
        )
    if stats.steps_after_calibration:
        lines.append(
            f"  After calibration: {stats.skipped_after_calibration} of "
            f"{stats.steps_after_calibration} skipped "
            f"({percent(stats.skip_rate_after_calibration)}); a dynamic scaler that grows "
            f"every {scaler.growth_interval} clean steps skips about 1 in that many by design."
        )
    return lines


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
) -> None:
    console = stdout()
    info = report.info
    steps = report.steps
    captured = int(steps["captured"].sum()) if len(steps) else 0
    console.print(
        f"Ran {info.script}: {info.steps_run} optimizer step(s), {captured} captured; "
        f"report written to {path}"
    )
    assert info.training is not None  # fpaudit run records it
    for line in skip_lines(info.training, info.scaler):
        console.print(line)
    for line in scale_lines(steps):
        console.print(line)
    findings(items, console)
    if rec is not None:
        for line in recommendation_lines(rec):
            console.print(line)
    if drift_result is not None:
        for drift_line in drift_lines(drift_result):
            console.print(drift_line)


def steps_view(report: Any, limit: int, items: Sequence[Finding]) -> None:
    """``show --steps``: skip rate, scale sparkline, findings, and the steps table."""
    console = stdout()
    steps = report.steps
    info = report.info
    if info.training is not None:
        for line in skip_lines(info.training, info.scaler):
            console.print(line)
    else:
        skipped = int(steps["skipped"].sum())
        console.print(f"{len(steps)} step(s), {skipped} skipped.")
    for line in scale_lines(steps):
        console.print(line)
    grid = Table(title="steps", title_justify="left")
    for name in ("step", "loss", "scale", "after", "skipped", "grad norm", "grad amax",
                 "backward", "captured", "seconds"):  # fmt: skip
        grid.add_column(name, justify="left" if name == "skipped" else "right", no_wrap=True)
    shown = steps if len(steps) <= limit else pd_concat_ends(steps, limit)
    for row in shown.itertuples():
        if row.step < 0:
            grid.add_row("…", *[""] * 9)
            continue
        norm = "" if math.isnan(row.grad_norm) else f"{row.grad_norm:.3g}"
        if row.clipped:
            norm += " (clipped)"
        grid.add_row(
            str(row.step),
            f"{row.loss:.4g}",
            power(row.loss_scale),
            power(row.scale_after),
            Text("skipped", style="red") if row.skipped else "",
            norm,
            "" if math.isnan(row.grad_amax) else f"{row.grad_amax:.3g}",
            str(row.backward_calls),
            "yes" if row.captured else "",
            f"{row.seconds:.3g}",
        )
    console.print(grid)
    if items:
        findings(items, console)


def pd_concat_ends(steps: pd.DataFrame, limit: int) -> pd.DataFrame:
    """The first and last ``limit // 2`` rows with a marker row (step -1) between."""
    import pandas as pd

    half = max(1, limit // 2)
    marker = steps.iloc[:1].copy()
    marker["step"] = -1
    return pd.concat([steps.iloc[:half], marker, steps.iloc[-half:]])


def simulation(result: Simulation) -> None:
    console = stdout()
    policy, static = result.policy, result.static
    trajectory = policy.trajectory
    settings = {k: v for k, v in policy.settings.items() if v is not None and k != "policy"}
    described = ", ".join(
        f"{k} {power(v) if k in scalers.SCALE_PARAMETERS else v}" for k, v in settings.items()
    )
    console.print(
        f"Replayed {policy.name} ({described}) over {len(trajectory.scale)} step(s), "
        f"{result.format}:"
    )
    grid = Table(title_justify="left")
    for name in ("policy", "skipped", "first skipped steps", "scale at the end", "scale range",
                 "underflow (captured steps)"):  # fmt: skip
        grid.add_column(name, justify="left" if name == "policy" else "right", no_wrap=True)
    rows = [(policy, f"{policy.name} (dynamic)"),
            (static, f"static {power(static.settings['init_scale'])}")]  # fmt: skip
    if scalers.REGISTRY[policy.name].is_static:  # --policy static: its row is the static one
        rows = rows[1:]
    for run, label in rows:
        summary = run.summary()
        grid.add_row(
            label,
            str(summary["skipped"]),
            ", ".join(str(s) for s in summary["skipped_steps"][:8]) or "-",
            power(summary["final_scale"]),
            f"{power(summary['min_scale'])}..{power(summary['max_scale'])}",
            percent(run.underflow_fraction) if run.nonzero else "not measured",
        )
    console.print(grid)
    console.print(f"Scale ({policy.name}): {sparkline(list(trajectory.scale))}")
    real = result.thresholds.real_scale
    if len(real) and (real != trajectory.scale).any():
        console.print(f"Scale (real run):  {sparkline(list(real))}")
    elif len(real):
        console.print("The replayed trajectory equals the real run's, step for step.")
    if trajectory.aborted_at is not None:
        console.print(
            Text(
                f"{policy.name} would have stopped the run at step "
                f"{trajectory.aborted_at}: an overflow at the minimum scale.",
                style="yellow",
            )
        )
    for note in result.notes:
        console.print(f"Note: {note}")


def _bounded(lower: float, upper: float) -> str:
    """A fraction, or its bounds when the replay could only bound it."""
    return percent(lower) if lower == upper else f"{percent(lower)}..{percent(upper)}"


def fp8_replay(result: DelayedReplay, top: int = 10) -> None:
    """``simulate --policy te-delayed``: overflow and flush per op, and the overflow steps."""
    console = stdout()
    s = result.settings
    summary = result.summary()
    console.print(
        f"Replayed {s.policy} (amax_history_len {s.amax_history_len}, margin {s.margin}, "
        f"{s.amax_compute_algo}) over {summary['steps']} step(s), {summary['ops']} op(s):"
    )
    lower, upper = result.overflow_steps("lower"), result.overflow_steps("upper")
    if upper:
        console.print(
            f"Overflow in {_steps_list(upper, len(upper))}"
            + ("" if lower == upper else f" ({len(lower)} certain, {len(upper)} possible)")
        )
    else:
        console.print("No step overflows.")
    overflow = _bounded(summary["overflow_fraction_lower"], summary["overflow_fraction_upper"])
    flushed = _bounded(summary["flushed_fraction_lower"], summary["flushed_fraction_upper"])
    console.print(
        f"Overflow: {overflow} of nonzero values; flushed below the smallest normal: {flushed}."
    )
    ops = result.per_op()
    ops = ops.sort_values(
        ["overflow_steps_upper", "flushed_upper_fraction"], ascending=False, kind="stable"
    ).head(top)
    grid = Table(title="ops (worst first)", title_justify="left")
    for name in ("module", "op", "format", "overflow steps", "overflow", "flushed",
                 "scale range"):  # fmt: skip
        grid.add_column(name, justify="left" if name in ("module", "op", "format")
                        else "right", no_wrap=True)  # fmt: skip
    for row in ops.itertuples():
        steps = str(row.overflow_steps_upper)
        if row.overflow_steps_lower != row.overflow_steps_upper:
            steps = f"{row.overflow_steps_lower}..{steps}"
        grid.add_row(
            module_label(str(row.module)),
            str(row.op).removeprefix("aten.").removesuffix(".default"),
            str(row.format),
            steps,
            _bounded(row.overflow_lower_fraction, row.overflow_upper_fraction),
            _bounded(row.flushed_lower_fraction, row.flushed_upper_fraction),
            f"{row.min_scale:.4g}..{row.max_scale:.4g}",
        )
    console.print(grid)
    for note in result.notes:
        console.print(f"Note: {note}")


def fp8_sweep(result: DelayedSweep) -> None:
    """``simulate --policy te-delayed --sweep``: the grid and the recommended pair."""
    console = stdout()
    console.print(
        f"Swept {result.policy} ({result.amax_compute_algo}) over amax_history_len x margin; "
        f"gate: at most {result.max_overflow_steps} overflow step(s)."
    )
    grid = Table(title_justify="left")
    for name in ("history", "margin", "overflow steps", "overflow", "flushed", ""):
        grid.add_column(name, justify="right", no_wrap=True)
    for replay in result.replays:
        summary = replay.summary()
        low, high = summary["overflow_steps_lower"], summary["overflow_steps_upper"]
        grid.add_row(
            str(replay.settings.amax_history_len),
            str(replay.settings.margin),
            str(high) if low == high else f"{low}..{high}",
            _bounded(summary["overflow_fraction_lower"], summary["overflow_fraction_upper"]),
            _bounded(summary["flushed_fraction_lower"], summary["flushed_fraction_upper"]),
            "<- recommended" if replay is result.recommended else "",
        )
    console.print(grid)
    chosen = result.recommended
    if chosen is None:
        console.print("No pair passes the gate.")
    else:
        console.print(
            f"Recommended: DelayedScaling(amax_history_len={chosen.settings.amax_history_len}, "
            f"margin={chosen.settings.margin}, "
            f'amax_compute_algo="{chosen.settings.amax_compute_algo}")'
        )
    for note in result.notes:
        console.print(f"Note: {note}")


def origins_view(
    live: OriginsResult, predicted: pd.DataFrame, fmt: Format, log2_scale: int, top: int = 10
) -> None:
    """``show --origins``: the ops that made inf/NaN, then the ones predicted at S."""
    console = stdout()
    found = live.origins
    carried = int(live.propagation["op_calls"].sum()) if len(live.propagation) else 0
    if found.empty:
        console.print("No op made inf or NaN in the recorded steps.")
    else:
        console.print(
            f"{len(found)} op call(s) made inf/NaN from finite inputs (origins); "
            f"{carried} more only carried them (propagation, not blamed)."
        )
        console.print(
            _op_calls_table(
                found.head(top),
                {"inf/NaN": "{:,}", "of": "{:,}", "largest finite input": "{:.4g}"},
                ("nonfinite", "elements", "largest_finite_input"),
                title="origins, in execution order",
            )
        )
        if len(found) > top:
            console.print(f"… {len(found) - top} more (--top N, or --json)")
    by_design = live.deliberate
    if not by_design.empty:
        places = sorted({f"{row.module or '(root)'} {row.op}" for row in by_design.itertuples()})
        shown = ", ".join(places[:3]) + (f", … {len(places) - 3} more" if len(places) > 3 else "")
        console.print(
            f"{len(by_design)} op call(s) wrote inf/NaN by design (constants, finfo masks), "
            f"not blamed: {shown}."
        )
    first = predicted[predicted["first"]]
    edge = f"{fmt.overflow_edge:g}"
    if first.empty:
        console.print(
            f"Predicted at S = {scale_text(log2_scale)}: no op's values reach {edge} "
            f"({fmt.name}'s overflow edge)."
        )
        return
    console.print(
        f"Predicted at S = {scale_text(log2_scale)}: {len(predicted)} op call(s) reach {edge} "
        f"({fmt.name}) from inputs below it; the first of each step:"
    )
    console.print(
        _op_calls_table(
            first.head(top),
            {"value at S": "{:.4g}", "largest input at S": "{:.4g}"},
            ("value_at_scale", "largest_input_at_scale"),
        )
    )


def _op_calls_table(
    rows: pd.DataFrame, shown: dict[str, str], columns: Sequence[str], title: str | None = None
) -> Table:
    """Op calls, one a row: step, phase, module, op, then ``columns`` of ``rows`` under
    the headers of ``shown`` (header -> format), right-aligned."""
    grid = Table(title=title, title_justify="left")
    for name in ("step", "phase", "module", "op", *shown):
        grid.add_column(name, justify="left" if name in ("phase", "module", "op") else "right",
                        no_wrap=True)  # fmt: skip
    for row in rows.to_dict(orient="records"):
        numbers = [
            pattern.format(row[c]) for pattern, c in zip(shown.values(), columns, strict=True)
        ]
        grid.add_row(
            str(row["step"]), str(row["phase"]), module_label(str(row["module"])), str(row["op"]),
            *numbers,
        )  # fmt: skip
    return grid


def fp16plan_target() -> float:
    from fpaudit.run.fp16plan import TARGET_SKIP_RATE

    return TARGET_SKIP_RATE


def fp16_plan(plan: Fp16Plan) -> None:
    """``fpaudit fp16-plan``: the modules to keep out, the scale, the verification, a snippet."""
    console = stdout()
    console.print(
        f"fp16 plan for {plan.model_file} ({plan.steps} step(s) scanned in fp32, headroom "
        f"{plan.headroom_bits} bit(s), underflow limit {percent(plan.max_underflow)}):"
    )
    if plan.log2_scale is None:
        console.print(Text("No scale keeps the underflow within the limit.", style="red"))
    if plan.keep_out:
        console.print("Keep out of fp16 (autocast disabled, fp32 inputs):")
        for r in plan.ranges:
            console.print(
                f"  {module_label(r.module)}: forward amax {r.forward_amax:.4g}, "
                f"backward amax {r.backward_amax:.4g} (unscaled)"
            )
    else:
        console.print("No module needs to leave fp16.")
    if plan.log2_scale is not None:
        console.print(
            f"Loss scale S = {scale_text(plan.log2_scale)}: "
            f"{percent(plan.underflow_fraction)} of the backward values left in fp16 underflow."
        )
    why = plan.scales_differ_because()
    if plan.recommended_log2_scale is not None and plan.log2_scale is not None:
        same = "the same scale" if why is None else f"S = {scale_text(plan.recommended_log2_scale)}"
        console.print(
            f"scan/recommend give {same} (headroom {plan.recommended_headroom_bits} bits, every "
            f"module in fp16){'' if why is None else ': ' + why}."
        )
    unscalable = unscalable_counts(plan.unscalable_overflow, plan.unscalable_underflow)
    if unscalable:
        ops = "; ".join(
            f"{g.node} ({short_op(g.op)}) in {len(g.modules)} module(s)"
            for g in plan.unscalable[:3]
        )
        console.print(
            f"{unscalable} fp16 at every scale in the fp32 scan ({ops}): no loss scale fixes "
            "them; the verifying step below shows whether autocast keeps them in fp32."
        )
    console.print(
        f"growth_interval = {plan.growth_interval}: growth attempts skip at most 1/(N + 1) "
        f"of the steps, kept below {percent(fp16plan_target())}; "
        f"{round(plan.overflow_rate_at_2s * plan.steps)} of {plan.steps} scanned step(s) "
        f"overflow at 2S, so growth would skip about {percent(plan.predicted_skip_rate)} of "
        "steps."
    )
    for note in plan.notes:
        console.print(f"Note: {note}")
    result = plan.verification
    if result is not None:
        updated = sum(1 for p in result.parameters if p.changed_mixed)
        if result.passed:
            console.print(
                f"Verified: an fp16 step at S with these modules kept out is finite, loses "
                f"{percent(result.lost_fraction)} of nonzero gradient elements, and updates "
                f"{updated} of {len(result.parameters)} parameter(s) (every one fp32 updates)."
            )
        else:
            problem = "its gradients held inf or NaN" if result.skipped else (
                f"{len(result.stalled)} parameter(s) did not update"
            )  # fmt: skip
            console.print(
                Text(f"FAIL: the verifying fp16 step did not pass: {problem}.", style="red")
            )
    if plan.log2_scale is not None:
        console.print("Paste:")
        console.print(plan.snippet(), markup=False, highlight=False)
