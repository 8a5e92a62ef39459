"""What ``fpaudit show`` prints besides its underflow table (:mod:`fpaudit.cli.render`):
the steps of a training loop (``--steps``) and the ops that made inf/NaN
(``--origins``). Results go to stdout, messages to stderr."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rich.table import Table
from rich.text import Text

from fpaudit.cli.render import stdout
from fpaudit.cli.render_run import findings, scale_lines, skip_lines, skip_verdict_lines
from fpaudit.numerics.formats import Format
from fpaudit.text import module_label, percent, power, scale_text

if TYPE_CHECKING:
    import pandas as pd

    from fpaudit.report.runinfo import Finding
    from fpaudit.rules.origins import Origins as OriginsResult
    from fpaudit.rules.skips import SkipVerdict


def skips_view(verdict: SkipVerdict) -> None:
    """``show --skips``: a row per skipped step (its origin, the parameters whose
    gradients held inf/NaN, the op that made it first where a capture saw it), then the
    verdict."""
    console = stdout()
    grid = Table(title=f"skipped steps ({verdict.format})", title_justify="left")
    names = ["step", "scale", "origin", "inf/NaN grads", "first parameters", "first op",
             "seen at", "op amax", "vs max"]  # fmt: skip
    for name in names:
        grid.add_column(name, justify="left" if name in names[2:7] else "right")
    for skip in verdict.skips:
        counted = skip.nonfinite_params >= 0
        grid.add_row(
            str(skip.step),
            power(skip.loss_scale),
            skip.origin,
            f"{skip.nonfinite_params} of {skip.params_checked}" if counted else "",
            ", ".join(skip.params),
            f"{skip.op_phase} {skip.op_label}" if skip.op else "",
            "" if skip.op_step is None else f"step {skip.op_step}, {power(skip.op_scale)}",
            f"{skip.op_amax:.4g}" if skip.op and math.isfinite(skip.op_amax) else "",
            f"{skip.edge_binades:+.2f} binades" if math.isfinite(skip.edge_binades) else "",
        )
    console.print(grid)
    counts = ", ".join(f"{n} {origin}" for origin, n in verdict.counts().items())
    console.print(f"{len(verdict.skips)} skipped step(s): {counts}.")
    for line in skip_verdict_lines(verdict, shown=0):
        console.print(line)


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
    if info.training is None or info.scaler is not None:  # a run without a scaler: all 1
        for line in scale_lines(steps):
            console.print(line)
    # clipping by value (clip_grad_value_): its value and the gradient elements clamped
    by_value = bool(steps["clip_value"].notna().any())
    grid = Table(title="steps", title_justify="left")
    names = ["step", "loss", "scale", "after", "skipped", "grad norm", "grad amax",
             "backward", "captured", "seconds"]  # fmt: skip
    if by_value:
        names.insert(6, "clip value: clamped")
    for name in names:
        grid.add_column(name, justify="left" if name == "skipped" else "right", no_wrap=True)
    shown = steps if len(steps) <= limit else pd_concat_ends(steps, limit)
    for row in shown.itertuples():
        if row.step < 0:
            grid.add_row("…", *[""] * (len(names) - 1))
            continue
        norm = "" if math.isnan(row.grad_norm) else f"{row.grad_norm:.3g}"
        if norm and row.grad_norm > row.clip_max_norm:
            norm += " (clipped)"
        clamped = [] if not by_value else [
            "" if math.isnan(row.clip_value)
            else f"{row.clip_value:.3g}: {percent(row.clipped_fraction)}"
            if not math.isnan(row.clipped_fraction) else f"{row.clip_value:.3g}"
        ]  # fmt: skip
        grid.add_row(
            str(row.step),
            f"{row.loss:.4g}",
            power(row.loss_scale),
            power(row.scale_after),
            Text("skipped", style="red") if row.skipped else "",
            norm,
            *clamped,
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
