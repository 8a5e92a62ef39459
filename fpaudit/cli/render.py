"""Everything fpaudit prints. Results go to stdout, messages to stderr."""

from __future__ import annotations

import errno
import json
import math
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from fpaudit.errors import Ended, ScriptExited, StoppedRun, StoppedWhileWriting
from fpaudit.numerics.formats import Format, as_format
from fpaudit.rules.recommendation import LEAST_UNDERFLOW, LimitedBy
from fpaudit.rules.summary import json_rows, worst_modules
from fpaudit.text import count, module_in_prose, module_label, percent, power, scale_text

if TYPE_CHECKING:
    import pandas as pd

    from fpaudit.capture.autocast import Summary as AutocastSummary
    from fpaudit.report.store import Report
    from fpaudit.rules.comparison import Comparison
    from fpaudit.rules.gating import GateResult
    from fpaudit.rules.recommendation import Recommendation
    from fpaudit.rules.summary import ModuleView
    from fpaudit.run.scan import StepProgress
    from fpaudit.run.verify import Verification

PIPE_WIDTH = 120

MODULE_JSON_KEYS = (
    "module",
    "elements",
    "zeros",
    "nonfinite",
    "infs",
    "nans",
    "nonzero",
    "underflow",
    "flushed",
    "subnormal",
    "overflow",
    "underflow_fraction",
    "flushed_fraction",
    "overflow_fraction",
    "unscalable_underflow",
    "unscalable_overflow",
    "judged_underflow",
    "judged_overflow",
    "judged_underflow_fraction",
    "amax",
)


def _console(stream: Any) -> Console:
    """A console that prints strings as they are: module names, paths and messages are
    data, so no ``[...]`` markup and no ``:emoji:`` codes are interpreted (a ModuleDict
    key ``[/]`` or an --out of ``runs/[bold]x`` prints literally). Styles come from
    :class:`rich.text.Text` objects only."""
    # A terminal tells rich its width; logs and pipes have none, so give tables room.
    width = None
    if not (hasattr(stream, "isatty") and stream.isatty()):
        width = int(os.environ.get("COLUMNS", "") or PIPE_WIDTH)
    return _Console(
        file=stream, highlight=False, soft_wrap=True, width=width, markup=False, emoji=False
    )


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """A closed pipe is an error the command line words (rich would exit 1, the
        gate's failure): raise it."""
        raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))


def stdout() -> Console:
    return _console(sys.stdout)


def stderr() -> Console:
    return _console(sys.stderr)


def error_line(message: str) -> None:
    """The one line a failed command prints (messages from libraries can hold newlines)."""
    sys.stderr.write(f"fpaudit: error: {' '.join(message.split())}\n")


def warning_line(message: str) -> None:
    """A warning the command goes on after, in one line."""
    sys.stderr.write(f"fpaudit: warning: {' '.join(message.split())}\n")


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, allow_nan=False, default=_json_default) + "\n")


def json_records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    """Rows as JSON-ready dicts: NaN and infinities become null."""
    return json_rows(frame)


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def magnitude(value: float) -> str:
    return "0" if value == 0 else f"{value:.3g}"


# -- formats ---------------------------------------------------------------
def formats(formats: Iterable[Format]) -> None:
    """The formats' thresholds, one row each."""
    rows = [f.limits for f in formats]
    table = Table(
        title="Where a value rounds to zero, goes subnormal, overflows", title_justify="left"
    )
    table.add_column("format", no_wrap=True)
    for header in ("subnormal min", "to 0 at ≤", "normal min", "max finite", "overflow"):
        table.add_column(header, justify="right", no_wrap=True)
    for row in rows:
        edge = table_power(row.overflow_edge) + ("" if row.overflow_edge_inclusive else " (>)")
        table.add_row(
            row.format,
            table_power(row.smallest_subnormal),
            table_power(row.round_to_zero_edge),
            table_power(row.smallest_normal),
            table_power(row.max_finite),
            edge,
        )
    console = stdout()
    console.print(table)
    notes = [note for f in formats if (note := f.overflow_note) is not None]
    console.print(
        " ".join(
            [
                "Magnitudes after scaling, round-to-nearest-even. Overflow starts halfway to "
                "the next value the format would have; (>) means that tie still rounds down.",
                *notes,
            ]
        )
    )


def table_power(value: float) -> str:
    """The formats table's numbers: bf16's maximum as 3.39e+38, not 3.38953e+38."""
    return power(value, large_digits=4)


# -- show ------------------------------------------------------------------
SHADOW_JSON_KEYS = ("lost", "lost_fraction", "overflowed", "shadow_nonzero")


def module_rows(table: pd.DataFrame) -> list[dict[str, Any]]:
    """JSON rows; the shadow counts only where the report has them (``--shadow``)."""
    shadowed = "shadow_calls" in table and bool((table["shadow_calls"] > 0).any())
    keys = (*MODULE_JSON_KEYS, "dtype", *(SHADOW_JSON_KEYS if shadowed else ()))
    rows = []
    for record in table.to_dict(orient="records"):
        row = {key: record[key] for key in keys if key in record}
        for key in ("node", "op"):
            if key in record:
                row[key] = record[key]
        rows.append(row)
    return rows


def short_op(op: str) -> str:
    """``aten.mm.default`` -> ``mm``; ``aten.sum.dim_IntList`` -> ``sum.dim_IntList``."""
    return op.removeprefix("aten.").removesuffix(".default")


def show(view: ModuleView) -> None:
    """``show``'s table, each row :meth:`ModuleView.marked` marks in red."""
    table, fmt, log2_scale, by, top = view.table, view.format, view.log2_scale, view.by, view.top
    kind, scale_source = view.kind, view.scale_source
    title = f"{fmt.name} at S = {scale_text(log2_scale)} ({scale_source}): {kind} values per {by}"
    grid = Table(title=title, title_justify="left")
    longest = max((len(module_label(str(m))) for m in table["module"]), default=6)
    grid.add_column("module", no_wrap=True, min_width=min(longest, 40))
    shadowed = bool((table["shadow_calls"] > 0).any()) if "shadow_calls" in table else False
    if by == "op":
        grid.add_column("node", no_wrap=True, overflow="ellipsis", max_width=24)
        grid.add_column("op", no_wrap=True, overflow="ellipsis", max_width=24)
        counts: tuple[str, ...] = ("values", "under %", "flush %", "overflow")
        if shadowed:  # a live report: which op lost values first, then what the device held
            counts = ("lost", "lost %", "dtype", "values", "zeros", "under %", "overflow")
    else:
        counts = ("values", "zeros", "inf/nan", "underflow", "under %", "flush %", "overflow")
        if shadowed:
            counts = (
                "lost", "lost %", "values", "zeros", "under %", "flush %", "overflowed", "overflow"
            )  # fmt: skip
    if "unscalable_overflow" in table:  # values no loss scale fixes, apart
        apart = table["unscalable_overflow"] + table["unscalable_underflow"]
        if bool((apart > 0).any()):
            counts = (*counts, "at every S")
    for name in counts:  # numbers never truncate; names give way
        width = max(len(name), 7 if name == "dtype" else 9)
        grid.add_column(name, justify="right", no_wrap=True, min_width=width)
    grid.add_column("amax@1", justify="right", no_wrap=True, min_width=8)
    for row, marked in zip(table.itertuples(), view.marked(), strict=True):
        cells = {
            "values": count(row.elements),
            "zeros": count(row.zeros),
            "inf/nan": count(row.nonfinite),
            "underflow": count(row.underflow),
            "under %": percent(row.underflow_fraction),
            "flush %": percent(row.flushed_fraction),
            "overflow": count(row.overflow),
            "dtype": str(row.dtype),
            "lost": count(row.lost) if row.shadow_calls else "-",
            "lost %": percent(row.lost_fraction) if row.shadow_calls else "-",
            "overflowed": count(row.overflowed) if row.shadow_calls else "-",
            "at every S": count(row.unscalable_overflow + row.unscalable_underflow)
            if hasattr(row, "unscalable_overflow")
            else "-",
        }
        first = [module_label(str(row.module))]
        if by == "op":
            first += [str(row.node), short_op(str(row.op))]
        style = "red" if marked else None
        grid.add_row(*first, *(cells[name] for name in counts), magnitude(row.amax), style=style)
    console = stdout()
    console.print(grid)
    if top is not None:
        console.print(f"(the {top} rows with the highest underflow fraction)")
    if view.left_out is not None and view.left_out.format_dtype is not None:
        left = view.left_out
        assert left.format_dtype is not None
        console.print(left_out_line(left.format_dtype, left.nonzero, left.dtypes))
    if "at every S" in counts:
        console.print(
            "(at every S: values that do not scale with the loss and underflow or overflow "
            "whatever the scale; counted in underflow and overflow, not judged by the gate "
            "unless --fail-unscalable)"
        )


# -- recommend -------------------------------------------------------------
def recommendation_lines(rec: Recommendation) -> list[str]:
    """What ``recommend`` says, a live ``--shadow`` report's loss first."""
    return lost_lines(rec) + _scale_lines(rec)


def _scale_lines(rec: Recommendation) -> list[str]:
    if rec.log2_scale is None and rec.live_dtype is not None:
        return [
            f"No recommendation for {rec.format}: no nonzero {rec.live_dtype} backward value in "
            "this live report, so there is nothing to size a scale on (at this loss scale the "
            "values may all have underflowed). Run `fpaudit scan` without --amp to measure them "
            "in fp32."
        ]
    if rec.log2_scale is None:
        return [
            f"No recommendation for {rec.format}: the report holds no nonzero finite backward "
            "values that scale with the loss, so any scale keeps them all (there is nothing to "
            "lose)."
        ]
    no_scale = rec.log2_scale == 0 and rec.limited_by == LEAST_UNDERFLOW
    lines = [
        f"Recommended static loss scale for {rec.format}: S = {scale_text(rec.log2_scale)} "
        f"(headroom {rec.headroom_bits} bits)" + (": no loss scale needed." if no_scale else ".")
    ]
    if rec.limited_by == LimitedBy.SCALE_RANGE:
        lines.append("  Limited by the range a loss scale can take (fp32 normal numbers).")
    elif rec.limited_by == LEAST_UNDERFLOW:
        lines.append(
            f"  A larger S loses no fewer values: every S from here up to "
            f"{power_text(rec.ceiling_log2_scale)}, the largest the headroom allows "
            f"({module_in_prose(rec.limiting_module or '')} ({rec.limiting_op}), largest "
            f"backward value {magnitude(rec.amax)} at S = 1), underflows and flushes as many."
        )
    else:
        lines.append(
            f"  Limited by {module_in_prose(rec.limiting_module or '')} ({rec.limiting_op}), "
            f"largest backward value {magnitude(rec.amax)} at S = 1."
        )
    at_scale = "" if rec.log2_scale == 0 else (
        f", {percent(rec.underflow_fraction)} at S = 2^{rec.log2_scale}")  # fmt: skip
    lines.append(
        f"  Underflow: {percent(rec.underflow_fraction_at_1)} of nonzero backward values at S = 1"
        f"{at_scale}."
    )
    if rec.underflow_recovered_by_one_fewer_headroom_bit or rec.underflow_fraction:
        lines.append(
            "  One fewer headroom bit would recover another "
            f"{percent(rec.underflow_recovered_by_one_fewer_headroom_bit)}."
        )
    lines += unscalable_lines(rec)
    if not rec.include_loss:
        lines.append(
            "  The loss seed and <loss> ops are reported but do not limit S (--include-loss)."
        )
    if rec.live_dtype is not None:
        lines.append(
            "  " + left_out_line(rec.live_dtype, rec.left_out_nonzero, rec.left_out_dtypes)
        )
    if as_format(rec.format).fp32_range and not no_scale:
        lines.append(
            f"  Note: {rec.format} has fp32's exponent range, so it rarely needs loss scaling: "
            f"S = 1 loses {percent(rec.underflow_fraction_at_1)} here; a large S only moves "
            "values toward the top of a range they already fit in."
        )
    return lines


def lost_lines(rec: Recommendation) -> list[str]:
    """A live ``--shadow`` report's first line: what the device really lost."""
    if not rec.shadow_nonzero:
        return []
    worst = sorted(
        (m for m in rec.modules if m.lost), key=lambda m: -m.lost_fraction
    )[:3]  # fmt: skip
    where = "; ".join(
        f"{module_label(m.module)} {percent(m.lost_fraction)} ({count(m.lost)})" for m in worst
    )
    return [
        f"Lost on the device: {percent(rec.lost_fraction)} ({count(rec.lost)} of "
        f"{count(rec.shadow_nonzero)} nonzero values of the fp32 re-run were zero in "
        f"{rec.live_dtype or rec.format} at the run's loss scale)"
        + (f"; most in {where}." if where else ".")
    ]


def left_out_line(dtype: str, nonzero: int, dtypes: tuple[str, ...]) -> str:
    """A live report: the one line on the values its format leaves out, and why."""
    if not nonzero:
        return f"Live report: every backward value counted was held in {dtype} on the device."
    held = ", ".join(dtypes)
    return (
        f"Live report: only values the device held in {dtype} count; {count(nonzero)} "
        f"nonzero value(s) held in {held} (ops autocast keeps in fp32) are left out: they "
        "never were in the format."
    )


def unscalable_counts(overflow: int, underflow: int) -> str:
    """``"480 value(s) overflow fp16"``-like counts of values no loss scale fixes."""
    parts = []
    if overflow:
        parts.append(f"{count(overflow)} value(s) overflow")
    if underflow:
        parts.append(f"{count(underflow)} value(s) underflow")
    return " and ".join(parts)


def unscalable_lines(rec: Recommendation) -> list[str]:
    """The values that underflow or overflow at every scale, apart, by node and op."""
    counts = unscalable_counts(rec.unscalable_overflow, rec.unscalable_underflow)
    if not counts:
        return []
    groups = []
    for group in rec.unscalable[:3]:
        modules = group.modules
        named = ", ".join(module_label(m) for m in modules[:2])
        named += f" and {len(modules) - 2} more" if len(modules) > 2 else ""
        groups.append(f"{group.node} ({short_op(group.op)}) in {len(modules)} module(s): {named}")
    more = f"; and {len(rec.unscalable) - 3} more op(s)" if len(rec.unscalable) > 3 else ""
    return [
        f"  Apart: {counts} {rec.format} at every scale: {'; '.join(groups)}{more}.",
        "    They do not scale with the loss, so no loss scale fixes them and they neither "
        "limit S nor count in its underflow: keep these ops in fp32 (autocast does for "
        "most norms) or see `fpaudit fp16-plan`; `gate --fail-unscalable` fails on them.",
    ]


def recommendation(rec: Recommendation) -> None:
    console = stdout()
    for line in recommendation_lines(rec):
        console.print(line)


# -- gate ------------------------------------------------------------------
def gate(result: GateResult) -> None:
    """The verdict line, then every reason the gate failed (decided by the gate)."""
    console = stdout()
    verdict = "PASS" if result.passed else "FAIL"
    lost = (
        f", lost {percent(result.lost_fraction)} of {count(result.shadow_nonzero)} live values"
        if result.shadow_nonzero
        else ""
    )
    limits = (
        []
        if result.policy.max_underflow is None
        else [f"limit {percent(result.policy.max_underflow)}"]
    )
    base = result.baseline_overall
    if base is not None and result.policy.max_increase is not None:
        limits.insert(0, f"baseline {percent(base.base_underflow or 0.0)}, increase limit "
                         f"{percent(result.policy.max_increase)}")  # fmt: skip
    against = f" (baseline {count(base.base_overflowed or 0)})" if base is not None else ""
    console.print(
        f"{verdict}: {result.format} at {result.scale_words}: underflow "
        f"{percent(result.underflow_fraction)} of "
        f"{count(result.nonzero)} nonzero backward values ({'; '.join(limits)}), overflow "
        f"{count(result.overflow)}{against}{lost}."
    )
    moved = scale_move_line(result)
    if moved:
        console.print(moved)
    unscalable = unscalable_counts(result.unscalable_overflow, result.unscalable_underflow)
    if unscalable:
        judged = (
            "judged by --fail-unscalable" if result.policy.fail_unscalable
            else "not judged: --fail-unscalable fails on them"
        )  # fmt: skip
        console.print(
            f"  Apart: {unscalable} at every scale: they do not scale with the loss, so no "
            f"loss scale fixes them ({judged}; `fpaudit recommend` lists their ops)."
        )
    if result.error_findings and result.policy.allow_errors:
        console.print(
            f"  The run's {len(result.error_findings)} error finding(s) were allowed by "
            "--allow-errors."
        )
    if not result.complete and result.policy.allow_incomplete:
        console.print(
            "  The report is incomplete (its run was interrupted), allowed by --allow-incomplete."
        )
    if (result.nonfinite or result.nonfinite_loss_steps) and result.policy.allow_nonfinite:
        console.print("  inf/NaN values were judged anyway, allowed by --allow-nonfinite.")
    for failure in result.failures:
        console.print(f"  {failure.as_flag()}")


def scale_move_line(result: GateResult) -> str:
    """Against a baseline: how the recommended scale moved, and what that means for a
    static scale calibrated on the baseline ("" when it did not move)."""
    base_k, new_k, base = result.base_recommended, result.new_recommended, result.baseline_overall
    if base_k is None or new_k is None or base_k == new_k or base is None:
        return ""
    at = "a static scale calibrated on BASE" if result.scale_source != "given" else (
        f"at S = 2^{result.log2_scale}")  # fmt: skip
    return (
        f"  Recommended S moved 2^{base_k} -> 2^{new_k} ({new_k - base_k:+d} binades): {at} "
        f"now loses {percent(base.new_underflow or 0.0)} (BASE lost "
        f"{percent(base.base_underflow or 0.0)}); --scale recommended judges NEW at its own."
    )


# -- diff ------------------------------------------------------------------
def change_text(change: float | None) -> str:
    """A change of a fraction in percentage points: ``+5.19%``, ``-0.0123%``, ``0%``."""
    if change is None:
        return "-"
    return ("+" if change > 0 else "-" if change < 0 else "") + percent(abs(change))


def fraction_text(fraction: float | None) -> str:
    return "-" if fraction is None else percent(fraction)


def only_in(present: str) -> str | None:
    """A diff row's change cell for a row present in one report only (else None)."""
    from fpaudit.rules.comparison import BASE_ONLY, NEW_ONLY

    return {BASE_ONLY: "only in BASE", NEW_ONLY: "only in NEW"}.get(present)


def comparison_grid(
    title: str, leading: Iterable[tuple[str, int | None]], columns: Iterable[str]
) -> Table:
    """A diff table: its ``leading`` name columns (name, max width or None), then the
    number columns, which never truncate (the names give way)."""
    grid = Table(title=title, title_justify="left")
    for name, width in leading:
        grid.add_column(name, no_wrap=True, overflow="ellipsis", max_width=width)
    for name in columns:
        grid.add_column(name, justify="right", no_wrap=True, min_width=max(len(name), 8))
    return grid


def comparison_summary(result: Comparison) -> str:
    """diff's first line: the whole model's change, the recommended scales, the steps."""
    overall = result.overall
    moved = result.recommended_change
    binades = "" if moved is None else f" ({moved:+d} binades)"
    return (
        f"{result.format} at S = {scale_text(result.log2_scale)} ({result.scale_source}): "
        f"underflow {fraction_text(overall.base_underflow)} -> "
        f"{fraction_text(overall.new_underflow)} ({change_text(overall.underflow_change)}), "
        f"overflow {fraction_text(overall.base_overflow)} -> "
        f"{fraction_text(overall.new_overflow)}; recommended S "
        f"{power_text(result.base_recommended)} -> {power_text(result.new_recommended)}"
        f"{binades}; steps: BASE {result.base_steps}, NEW {result.new_steps}."
    )


def power_text(log2_scale: int | None) -> str:
    return "none" if log2_scale is None else f"2^{log2_scale}"


def comparison(result: Comparison) -> None:
    """diff: the summary line, one note per difference, then the table of rows."""
    console = stdout()
    console.print(comparison_summary(result))
    run = result.run
    if run is not None:
        ranges = [f"{power(low)}..{power(high)}" for low, high in
                  (run.base_loss_scale, run.new_loss_scale)]  # fmt: skip
        console.print(
            f"run: skipped {count(run.base_skipped)} of {count(run.base_steps)} steps after "
            f"calibration ({percent(run.base_skip_rate)}) -> {count(run.new_skipped)} of "
            f"{count(run.new_steps)} ({percent(run.new_skip_rate)}); loss scale {ranges[0]} -> "
            f"{ranges[1]}."
        )
    for note in result.notes:
        console.print(f"note: {note}")
    by = "module" if result.by == "module" else "module and op"
    leading: list[tuple[str, int | None]] = [("module", None)]
    if result.by == "op":
        leading += [("node", 24), ("op", 24)]
    columns = ("BASE under", "NEW under", "change", "BASE over", "NEW over", "amax moved",
               "BASE values", "NEW values")  # fmt: skip
    grid = comparison_grid(
        f"BASE {result.base_report} vs NEW {result.new_report}, per {by}", leading, columns
    )
    for row in result.rows:
        first = [module_label(row.module)]
        if result.by == "op":
            first += [str(row.node), short_op(str(row.op))]
        moved = row.amax_change_binades
        cells = [
            fraction_text(row.base_underflow),
            fraction_text(row.new_underflow),
            only_in(row.present) or change_text(row.underflow_change),
            fraction_text(row.base_overflow),
            fraction_text(row.new_overflow),
            "-" if moved is None else f"{moved:+d}",
            "-" if row.base_nonzero is None else count(row.base_nonzero),
            "-" if row.new_nonzero is None else count(row.new_nonzero),
        ]
        worse = (row.underflow_change or 0.0) > 0 or (row.overflow_change or 0.0) > 0
        grid.add_row(*first, *cells, style="red" if worse else None)
    console.print(grid)
    console.print(
        "(fractions of each report's own nonzero values; amax moved: binades of the "
        "unscaled amax; a renamed module is two rows)"
    )


# -- verify ----------------------------------------------------------------
def verification(result: Verification) -> None:
    console = stdout()
    grid = Table(
        title=(
            f"verify {result.model_file}: fp32 step vs {result.amp} step at S = "
            f"{scale_text(result.log2_scale)}, {result.optimizer}"
            + (f", clip at {result.clip_norm:g} (unscaled)" if result.clip_norm is not None else "")
        ),
        title_justify="left",
    )
    grid.add_column("parameter", no_wrap=True)
    columns = (
        "elements",
        "zeroed",
        "grad error",
        "changed fp32",
        f"changed {result.amp}",
        "step error",
    )
    for name in columns:
        grid.add_column(name, justify="right", no_wrap=True)

    def error(value: float) -> str:
        return "inf" if value == math.inf else f"{value:.3g}"

    for check in result.parameters:
        grid.add_row(
            check.name,
            count(check.elements),
            percent(check.zeroed_fraction),
            error(check.relative_error),
            "yes" if check.changed_fp32 else "no",
            "yes" if check.changed_mixed else "no",
            error(check.update_error),
            style="red" if check.changed_fp32 and not check.changed_mixed else None,
        )
    console.print(grid)
    console.print(
        f"Gradient norm before clipping: fp32 {result.grad_norm_fp32:.6g}, {result.amp} "
        f"(unscaled) {result.grad_norm_mixed:.6g}."
    )
    if result.passed:
        console.print(f"PASS: every parameter that changes in fp32 also changes in {result.amp}.")
    for reason in result.reasons:
        console.print(f"FAIL: {reason}.")


# -- scan ------------------------------------------------------------------
@contextmanager
def step_progress(steps: int) -> Iterator[Callable[[StepProgress], None]]:
    """A progress bar over steps on stderr; yields the callback the scan calls per step."""
    progress = Progress(
        TextColumn("scan"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[loss]}"),
        TimeElapsedColumn(),
        console=stderr(),
        transient=True,
    )
    task = progress.add_task("scan", total=steps, loss="")

    def advance(update: StepProgress) -> None:
        text = "" if update.loss is None else f"loss {update.loss:.4g}"
        progress.update(task, completed=update.step, loss=text)

    with progress:
        yield advance


def interrupted(path: str, signal_name: str, done: int, steps: int | None) -> None:
    of = f" of {steps}" if steps else ""
    sys.stderr.write(
        f"fpaudit: interrupted by {signal_name} after {done}{of} step(s); the completed "
        f"steps are in {path}, marked incomplete\n"
    )


def ending(ended: Ended) -> None:
    """The words of a command that ends neither in success nor on bad input (a forked
    child ends quietly; ``fpaudit.errors.Ended``), on stderr."""
    if isinstance(ended, StoppedWhileWriting):
        error_line(
            f"interrupted by {ended.signal_name} while writing the report; it was written "
            f"whole to {ended.path}"
        )
    elif isinstance(ended, StoppedRun):
        if ended.while_writing is not None:
            ending(ended.while_writing)
        if ended.kept is None:
            interrupted(ended.out, ended.signal_name, ended.done, ended.planned)
        else:
            of = f" of {ended.planned}" if ended.planned else ""
            error_line(f"interrupted by {ended.signal_name} after {ended.done}{of} step(s); "
                       f"{ended.kept.as_flag()}")  # fmt: skip
    elif isinstance(ended, ScriptExited):
        if ended.error is not None:
            error_line(ended.error.as_flag())
        if ended.note is not None:
            sys.stderr.write(f"fpaudit: note: {ended.note.as_flag()}\n")
        if ended.message is not None:  # as Python prints sys.exit("text")
            sys.stderr.write(f"{ended.message}\n")
            sys.stderr.flush()


def batches_ended(ranks: Iterable[int], steps_run: int | None) -> None:
    """Under torchrun: the batches of some ranks ended first, and every rank stopped there."""
    sys.stderr.write(
        f"fpaudit: note: the batches of rank {', '.join(map(str, ranks))} ended after "
        f"{steps_run} step(s); every rank stopped there\n"
    )


def report_notes(
    report: Report, *, incomplete: bool = True, one_compiled_line: bool = False
) -> None:
    """What a reader of ``report`` should know before its numbers, on stderr
    (``incomplete``: also whether the run was interrupted; ``one_compiled_line``: what a
    compiled backward left uncounted in one line, ``fpaudit run``'s one line on the
    script's stderr)."""
    reason = report.incompleteness() if incomplete else None
    if reason is not None:
        sys.stderr.write(f"fpaudit: note: this report is incomplete: {reason}\n")
    out_of_range = report.info.out_of_range or 0
    if out_of_range > 0:
        sys.stderr.write(
            f"fpaudit: note: {count(out_of_range)} recorded fp64 value(s) lay outside fp32's "
            "range (nonzero below 2^-149, or finite above fp32's max): they are binned as zero "
            "or inf, so the counts do not include them as nonzero values\n"
        )
    compiled = report.info.compiled
    if compiled is not None:
        notes = [f"not covered: {line}" for line in compiled.not_covered]
        fused = compiled.fused_away
        if compiled.observed_backward_runs and fused:
            notes.append(
                f"compiled backward: {count(len(fused))} module(s) kept some "
                "values in a fused kernel's registers (never stored, not counted); "
                "the report's meta.json lists the ops (compiled.fused_away)"
            )
        for note in ["; ".join(notes)] if one_compiled_line and notes else notes:
            sys.stderr.write(f"fpaudit: note: {note}\n")
    inexact = report.inexact_scales()
    if inexact:
        shown = ", ".join(f"{s:g}" for s in inexact[:3]) + (", ..." if len(inexact) > 3 else "")
        sys.stderr.write(
            f"fpaudit: note: the run's loss scale ({shown}) is not a power of two: counts at "
            "other scales treat it as the power of two below it, so they may be off by one "
            "binade\n"
        )


def kernel_build_notice(line: str) -> None:
    """The one line said before the CPU kernel builds (``line``: the library's reason)."""
    stderr().print(f"{line} (FPAUDIT_KERNEL=torch skips it)")


def scan_summary(
    path: str,
    steps: int,
    captured: int,
    at_1: pd.DataFrame,
    at_scale: pd.DataFrame,
    rec: Recommendation,
    top: int,
    forward_problems: int,
    first_nonfinite: list[str],
    *,
    first: bool = True,
) -> None:
    """One format's summary of a scan; ``first``: also the lines about the whole scan
    (said once when several formats follow)."""
    console = stdout()
    captured_text = "" if captured == steps else f", captured {captured}"
    if first:
        console.print(f"Scanned {steps} step(s){captured_text}; report written to {path}")
    if forward_problems and first:
        console.print(
            Text.assemble(
                (f"{forward_problems} step(s) had a non-finite loss", "red"),
                ": recorded as forward problems; their backward values are not counted.",
            )
        )
        if first_nonfinite:
            console.print(
                f"  The first forward op to produce inf or NaN: {', '.join(first_nonfinite)}."
            )
        else:
            console.print("  Scan with --forward to find the forward op that first produced it.")
    if rec.log2_scale is not None:
        live = rec.shadow_nonzero > 0  # a live --shadow scan leads with what the device lost
        what = "lost on the device" if live else "losing the most to underflow at S = 1"
        grid = Table(title=f"{rec.format}: modules {what}", title_justify="left")
        grid.add_column("module", no_wrap=True)
        if live:
            grid.add_column("lost", justify="right", no_wrap=True)
            grid.add_column("lost %", justify="right", no_wrap=True)
        grid.add_column("nonzero values", justify="right", no_wrap=True)
        grid.add_column("underflow at S=1", justify="right", no_wrap=True)
        grid.add_column(f"at S=2^{rec.log2_scale}", justify="right", no_wrap=True)
        grid.add_column("amax@1", justify="right", no_wrap=True)
        for row in worst_modules(at_1, at_scale, top):
            lost = [count(row.lost), percent(row.lost_fraction)] if live else []
            grid.add_row(
                module_label(row.module),
                *lost,
                count(row.nonzero),
                percent(row.underflow_fraction_at_1),
                percent(row.underflow_fraction),
                magnitude(row.amax),
            )
        console.print(grid)
    for line in recommendation_lines(rec):
        console.print(line)


def autocast_prediction(result: AutocastSummary | None, *, every_name: bool = True) -> None:
    """scan and show: which modules' backward values fp16 autocast would hold in fp16
    (scan names the first few fp32 modules; show names every module)."""
    if result is None:
        return
    console = stdout()
    if result.error is not None:
        console.print(
            f"No fp16 autocast prediction: the model failed under autocast ({result.error})."
        )
        return

    def names(modules: list[str]) -> str:
        shown = modules if every_name or len(modules) <= 4 else modules[:3]
        more = "" if len(shown) == len(modules) else ", …"
        return ", ".join(module_label(m) for m in shown) + more if modules else "none"

    if every_name:
        console.print(
            f"Under fp16 autocast ({result.device}, predicted by a forward probe): backward "
            f"values fp32 in {len(result.fp32)} module(s): {names(result.fp32)}; fp16 in "
            f"{len(result.fp16)}: {names(result.fp16)}; both in {len(result.mixed)} (as a "
            "Linear: fp16 products, fp32 gradients of the casts of its inputs)."
        )
        return
    console.print(
        f"Under fp16 autocast ({result.device}, predicted by a forward probe): backward values "
        f"fp32 in {len(result.fp32)} module(s) ({names(result.fp32)}), fp16 in "
        f"{len(result.fp16)}, both in {len(result.mixed)}; `fpaudit show` names them."
    )
