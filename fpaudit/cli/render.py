"""Everything fpaudit prints. Results go to stdout, messages to stderr."""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from fpaudit.numerics.formats import Format
from fpaudit.numerics.recipes import Recipe, as_recipe
from fpaudit.text import (
    count,
    expected_count,
    module_in_prose,
    module_label,
    percent,
    power,
    scale_text,
)

if TYPE_CHECKING:
    from fpaudit.capture.autocast import Summary as AutocastSummary
    from fpaudit.report.store import Report
    from fpaudit.rules.blockplan import BlockGateResult, Plan
    from fpaudit.rules.drift import Drift
    from fpaudit.rules.gating import GateResult
    from fpaudit.rules.recommendation import Recommendation
    from fpaudit.rules.simulation import Simulation
    from fpaudit.run.verify import Verification

if TYPE_CHECKING:
    import pandas as pd

    from fpaudit.rules.delayed import Replay as DelayedReplay
    from fpaudit.rules.delayed import Sweep as DelayedSweep
    from fpaudit.rules.origins import Origins as OriginsResult
    from fpaudit.run.fp16plan import Plan as Fp16Plan
    from fpaudit.run.scan import StepProgress

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
    return Console(
        file=stream, highlight=False, soft_wrap=True, width=width, markup=False, emoji=False
    )


def stdout() -> Console:
    return _console(sys.stdout)


def stderr() -> Console:
    return _console(sys.stderr)


def error_line(message: str) -> None:
    """The one line a failed command prints (messages from libraries can hold newlines)."""
    sys.stderr.write(f"fpaudit: error: {' '.join(message.split())}\n")


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, allow_nan=False, default=_json_default) + "\n")


def json_records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    """Rows as JSON-ready dicts: NaN and infinities become null."""
    return [
        {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
        for row in frame.to_dict(orient="records")
    ]


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def magnitude(value: float) -> str:
    return "0" if value == 0 else f"{value:.3g}"


# -- formats ---------------------------------------------------------------
def formats(formats: Iterable[Format], as_json: bool) -> None:
    rows: list[dict[str, Any]] = [
        {
            "format": f.name,
            "dtype": str(f.dtype).removeprefix("torch."),
            "smallest_subnormal": f.smallest_subnormal,
            "round_to_zero_edge": f.round_to_zero_edge,
            "smallest_normal": f.smallest_normal,
            "max_finite": f.max_finite,
            "overflow_edge": f.overflow_edge,
            "overflow_edge_inclusive": f.overflow_edge_inclusive,
            "overflow_result": f.overflow_result,
        }
        for f in formats
    ]
    if as_json:
        print_json(rows)
        return
    table = Table(
        title="Where a value rounds to zero, goes subnormal, overflows", title_justify="left"
    )
    table.add_column("format", no_wrap=True)
    for header in ("subnormal min", "to 0 at ≤", "normal min", "max finite", "overflow"):
        table.add_column(header, justify="right", no_wrap=True)
    for row in rows:
        edge = _power(row["overflow_edge"]) + ("" if row["overflow_edge_inclusive"] else " (>)")
        table.add_row(
            str(row["format"]),
            _power(row["smallest_subnormal"]),
            _power(row["round_to_zero_edge"]),
            _power(row["smallest_normal"]),
            _power(row["max_finite"]),
            edge,
        )
    console = stdout()
    console.print(table)
    console.print(
        "Magnitudes after scaling, round-to-nearest-even. Overflow starts halfway to the next "
        "value "
        "the format would have; (>) means that tie still rounds down. fp8_e4m3fn has no inf: "
        "torch's cast saturates at 448."
    )


def _power(value: float) -> str:
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


def show(
    table: pd.DataFrame,
    fmt: Format,
    log2_scale: int,
    *,
    kind: str,
    by: str,
    top: int | None,
    scale_source: str,
) -> None:
    title = f"{fmt.name} at S = {scale_text(log2_scale)} ({scale_source}): {kind} values per {by}"
    grid = Table(title=title, title_justify="left")
    longest = max((len(module_label(str(m))) for m in table["module"]), default=6)
    grid.add_column("module", no_wrap=True, min_width=min(longest, 40))
    shadowed = bool((table["shadow_calls"] > 0).any()) if "shadow_calls" in table else False
    if by == "op":
        grid.add_column("node", no_wrap=True, overflow="ellipsis", max_width=24)
        grid.add_column("op", no_wrap=True, overflow="ellipsis", max_width=24)
        counts: tuple[str, ...] = ("values", "under %", "flush %", "overflow")
        if shadowed:  # a live report: what the device held, and which op lost values
            counts = ("dtype", "values", "zeros", "lost", "under %", "overflow")
    else:
        counts = ("values", "zeros", "inf/nan", "underflow", "under %", "flush %", "overflow")
        if shadowed:
            counts = ("values", "zeros", "lost", "under %", "flush %", "overflowed", "overflow")
    if "unscalable_overflow" in table:  # values no loss scale fixes, apart
        apart = table["unscalable_overflow"] + table["unscalable_underflow"]
        if bool((apart > 0).any()):
            counts = (*counts, "at every S")
    for name in counts:  # numbers never truncate; names give way
        width = max(len(name), 7 if name == "dtype" else 9)
        grid.add_column(name, justify="right", no_wrap=True, min_width=width)
    grid.add_column("amax@1", justify="right", no_wrap=True, min_width=8)
    for row in table.itertuples():
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
            "overflowed": count(row.overflowed) if row.shadow_calls else "-",
            "at every S": count(row.unscalable_overflow + row.unscalable_underflow)
            if hasattr(row, "unscalable_overflow")
            else "-",
        }
        first = [module_label(str(row.module))]
        if by == "op":
            first += [str(row.node), short_op(str(row.op))]
        judged = row.judged_overflow > 0 or row.judged_underflow_fraction > 0.01
        style = "red" if judged else None
        grid.add_row(*first, *(cells[name] for name in counts), magnitude(row.amax), style=style)
    console = stdout()
    console.print(grid)
    if top is not None:
        console.print(f"(the {top} rows with the highest underflow fraction)")
    if "at every S" in counts:
        console.print(
            "(at every S: values that do not scale with the loss and underflow or overflow "
            "whatever the scale; counted in underflow and overflow, not judged by the gate "
            "unless --fail-unscalable)"
        )


# -- recommend -------------------------------------------------------------
def recommendation_lines(rec: Recommendation) -> list[str]:
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
    lines = [
        f"Recommended static loss scale for {rec.format}: S = {scale_text(rec.log2_scale)} "
        f"(headroom {rec.headroom_bits} bits)."
    ]
    if rec.limited_by == "scale range":
        lines.append("  Limited by the range a loss scale can take (fp32 normal numbers).")
    else:
        lines.append(
            f"  Limited by {module_in_prose(rec.limiting_module or '')} ({rec.limiting_op}), "
            f"largest backward value {magnitude(rec.amax)} at S = 1."
        )
    lines.append(
        f"  Underflow: {percent(rec.underflow_fraction_at_1)} of nonzero backward values at S = 1, "
        f"{percent(rec.underflow_fraction)} at S = 2^{rec.log2_scale}."
    )
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
            f"  Live report: only values the device really held in {rec.live_dtype} count "
            "(fp32 ops under autocast are left out)."
        )
    if rec.format == "bf16":
        lines.append(
            "  Note: bf16 has fp32's exponent range, so it rarely needs loss scaling: "
            f"S = 1 loses {percent(rec.underflow_fraction_at_1)} here; a large S only moves "
            "values toward the top of a range they already fit in."
        )
    return lines


def _unscalable_counts(overflow: int, underflow: int) -> str:
    """``"480 value(s) overflow fp16"``-like counts of values no loss scale fixes."""
    parts = []
    if overflow:
        parts.append(f"{count(overflow)} value(s) overflow")
    if underflow:
        parts.append(f"{count(underflow)} value(s) underflow")
    return " and ".join(parts)


def unscalable_lines(rec: Recommendation) -> list[str]:
    """The values that underflow or overflow at every scale, apart, by node and op."""
    counts = _unscalable_counts(rec.unscalable_overflow, rec.unscalable_underflow)
    if not counts:
        return []
    groups = []
    for group in rec.unscalable[:3]:
        modules = group["modules"]
        named = ", ".join(module_label(m) for m in modules[:2])
        named += f" and {len(modules) - 2} more" if len(modules) > 2 else ""
        groups.append(
            f"{group['node']} ({short_op(group['op'])}) in {len(modules)} module(s): {named}"
        )
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
    console.print(
        f"{verdict}: {result.format} at S = {scale_text(result.log2_scale)} "
        f"({result.scale_source}): underflow {percent(result.underflow_fraction)} of "
        f"{count(result.nonzero)} nonzero backward values (limit "
        f"{percent(result.max_underflow)}), overflow {count(result.overflow)}{lost}."
    )
    unscalable = _unscalable_counts(result.unscalable_overflow, result.unscalable_underflow)
    if unscalable:
        judged = (
            "judged by --fail-unscalable" if result.fail_unscalable
            else "not judged: --fail-unscalable fails on them"
        )  # fmt: skip
        console.print(
            f"  Apart: {unscalable} at every scale: they do not scale with the loss, so no "
            f"loss scale fixes them ({judged}; `fpaudit recommend` lists their ops)."
        )
    if result.error_findings and result.errors_allowed:
        console.print(
            f"  The run's {len(result.error_findings)} error finding(s) were allowed by "
            "--allow-errors."
        )
    if not result.complete and result.incomplete_allowed:
        console.print(
            "  The report is incomplete (its run was interrupted), allowed by --allow-incomplete."
        )
    if (result.nonfinite or result.nonfinite_loss_steps) and result.nonfinite_allowed:
        console.print("  inf/NaN values were judged anyway, allowed by --allow-nonfinite.")
    for failure in result.failures:
        console.print(f"  {failure.as_flag()}")


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


def report_notes(report: Report, *, incomplete: bool = True) -> None:
    """What a reader of ``report`` should know before its numbers, on stderr
    (``incomplete``: also whether the run was interrupted)."""
    reason = report.incompleteness() if incomplete else None
    if reason is not None:
        sys.stderr.write(f"fpaudit: note: this report is incomplete: {reason}\n")
    out_of_range = report.info.out_of_range
    if out_of_range > 0:
        sys.stderr.write(
            f"fpaudit: note: {count(out_of_range)} recorded fp64 value(s) lay outside fp32's "
            "range (nonzero below 2^-149, or finite above fp32's max): they are binned as zero "
            "or inf, so the counts do not include them as nonzero values\n"
        )
    compiled = report.info.compiled
    if compiled is not None:
        for line in compiled.get("not_covered") or ():
            sys.stderr.write(f"fpaudit: note: not covered: {line}\n")
        fused = compiled.get("fused_away") or {}
        if compiled.get("observed_backward_runs") and fused:
            sys.stderr.write(
                f"fpaudit: note: compiled backward: {count(len(fused))} module(s) kept some "
                "values in a fused kernel's registers (never stored, not counted); "
                "the report's meta.json lists the ops (compiled.fused_away)\n"
            )
    inexact = report.inexact_scales()
    if inexact:
        shown = ", ".join(f"{s:g}" for s in inexact[:3]) + (", ..." if len(inexact) > 3 else "")
        sys.stderr.write(
            f"fpaudit: note: the run's loss scale ({shown}) is not a power of two: counts at "
            "other scales treat it as the power of two below it, so they may be off by one "
            "binade\n"
        )


def kernel_build_notice() -> None:
    stderr().print(
        "building fpaudit's CPU histogram kernel: once per machine and torch version, "
        "about a minute (FPAUDIT_KERNEL=torch skips it)"
    )


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
        judged = "judged_underflow_fraction"  # what the recommendation judges
        at_1 = at_1.assign(underflow_fraction=at_1[judged])
        at_scale = at_scale.assign(underflow_fraction=at_scale[judged])
        merged = at_1.merge(at_scale, on="module", suffixes=("_at_1", "_at_s"))
        worst = merged.sort_values("underflow_fraction_at_1", ascending=False, kind="stable").head(
            top
        )
        grid = Table(
            title=f"{rec.format}: modules losing the most to underflow at S = 1",
            title_justify="left",
        )
        grid.add_column("module", no_wrap=True)
        grid.add_column("nonzero values", justify="right", no_wrap=True)
        grid.add_column("underflow at S=1", justify="right", no_wrap=True)
        grid.add_column(f"at S=2^{rec.log2_scale}", justify="right", no_wrap=True)
        grid.add_column("amax@1", justify="right", no_wrap=True)
        for row in worst.itertuples():
            grid.add_row(
                module_label(str(row.module)),
                count(row.nonzero_at_1),
                percent(row.underflow_fraction_at_1),
                percent(row.underflow_fraction_at_s),
                magnitude(row.amax_at_1),
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


def findings(items: Sequence[dict[str, Any]], console: Console | None = None) -> None:
    """Findings, errors first, each with its file:line."""
    console = console or stdout()
    if not items:
        console.print("No misuse found in the training loop.")
        return
    console.print(f"{len(items)} finding(s) in the training loop:")
    for item in items:
        colour = {"error": "red", "warning": "yellow"}.get(item["severity"], "cyan")
        where = f"{item['file']}:{item['line']}"
        steps = _steps_list(item["steps"], item["count"])
        console.print(
            Text.assemble(
                "  ",
                (str(item["severity"]), colour),
                f" {where} ",
                (str(item["code"]), "bold"),
                f": {item['message']} (in {item['count']} step(s): {steps})",
            )
        )


def skip_lines(stats: Mapping[str, Any], scaler: Mapping[str, Any] | None) -> list[str]:
    """Skipped steps, with calibration told apart (expected on a fresh dynamic scaler)."""
    total, skipped = stats["steps"], stats["skipped"]
    if not scaler:
        return [f"{total} optimizer step(s); no enabled GradScaler, so no step was skipped."]
    lines = [f"Skipped {skipped} of {total} step(s) ({percent(skipped / total if total else 0)})."]
    calibration = stats["calibration_steps"]
    if calibration:
        lines.append(
            f"  The first {calibration} skip(s) were calibration: a fresh scaler starts at "
            f"{power(scaler['init_scale'])} and halves until gradients fit; expected, not a "
            "problem."
        )
    if stats["steps_after_calibration"]:
        lines.append(
            f"  After calibration: {stats['skipped_after_calibration']} of "
            f"{stats['steps_after_calibration']} skipped "
            f"({percent(stats['skip_rate_after_calibration'])}); a dynamic scaler that grows "
            f"every {scaler['growth_interval']} clean steps skips about 1 in that many by design."
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
    items: Sequence[dict[str, Any]],
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


def steps_view(report: Any, limit: int, items: Sequence[dict[str, Any]]) -> None:
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
    described = ", ".join(f"{k} {power(v) if 'scale' in k else v}" for k, v in settings.items())
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
    if policy.name == "static":  # --policy static: its row is the static one
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
    unscalable = _unscalable_counts(plan.unscalable_overflow, plan.unscalable_underflow)
    if unscalable:
        ops = "; ".join(
            f"{g['node']} ({short_op(g['op'])}) in {len(g['modules'])} module(s)"
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


# -- block-scaled recipes (--recipe) -----------------------------------------
def recipes(items: Iterable[Recipe], as_json: bool) -> None:
    items = list(items)
    rows: list[dict[str, Any]] = [
        {
            "recipe": r.name,
            "element": r.element.name,
            "block": "tensor" if r.per_tensor else f"{r.block[0]}x{r.block[1]}",
            "orientation": r.orientation,
            "scale_rule": r.scale_rule,
            "scale_format": r.scale_format,
            # round to nearest: every magnitude up to this becomes 0; stochastic rounding
            # flushes none for certain, and any below the smallest subnormal may flush
            "element_flush_at": None if r.expected else r.element.round_to_zero_edge,
            "element_may_flush_below": r.element.smallest_subnormal if r.expected else None,
            "element_smallest_normal": r.element.smallest_normal,
            "element_max": r.element.max_finite,
            "rounding": r.rounding,
            "cost": r.cost,
            "description": r.description,
        }
        for r in items
    ]
    if as_json:
        print_json(rows)
        return
    table = Table(
        title="Block-scaled recipes (--recipe), cheapest first; element thresholds after "
        "the block scale",
        title_justify="left",
    )
    headers = ("recipe", "element", "block", "rule", "scale", "round", "to 0 ≤", "normal", "max")
    for header in headers:
        table.add_column(header, no_wrap=True, justify="left" if header == "recipe" else "right")
    for row, recipe in zip(rows, items, strict=True):
        below = row["element_may_flush_below"]
        table.add_row(
            row["recipe"],
            row["element"].split("_", 1)[-1],
            row["block"],
            row["scale_rule"],
            row["scale_format"],
            "SR" if recipe.expected else "RN",
            f"< {_power(below)}" if below is not None else _power(row["element_flush_at"]),
            _power(row["element_smallest_normal"]),
            f"{row['element_max']:g}",
        )
    console = stdout()
    console.print(table)
    console.print(
        "mx-floor: OCP E8M0 2^(floor(log2 amax) - emax), the block max may saturate; mx-rceil: "
        "2^ceil(log2(amax/max)); nvfp4: E4M3 per 16 under an fp32 per-tensor scale; pow2-floor: "
        "(max/amax) rounded down to a power of two. Add :col for columnwise blocks. RN: "
        "round to nearest; SR: stochastic rounding, whose counts are expected values."
    )


BLOCK_JSON_KEYS = (
    "nonzero",
    "flushed",
    "subnormal",
    "saturated",
    "poisoned",
    "blocks",
    "blocks_flushed",
    "scales_out_of_range",
    "flush_fraction",
    "saturate_fraction",
    "subnormal_fraction",
)


def block_rows(table: pd.DataFrame) -> list[dict[str, Any]]:
    keys = [c for c in ("module", "kind", "node", "op") if c in table.columns]
    return json_records(table[[*keys, *BLOCK_JSON_KEYS]])


EXPECTED_NOTE = "stochastic rounding: expected counts over its random draws"


def block_table(
    table: pd.DataFrame, recipe: str, by: str, top: int | None = None, kind: str | None = None
) -> None:
    expected = as_recipe(recipe).expected
    what = "expected flushed" if expected else "flushed"
    values = f"{kind} values" if kind is not None else "values"
    grid = Table(
        title=f"{recipe}: {what} (nonzero -> 0), subnormal and saturated {values} per {by}, "
        "all steps" + (f" ({EXPECTED_NOTE})" if expected else ""),
        title_justify="left",
    )
    keys = ["module"] + (["kind", "op"] if by == "op" else [])
    for key in keys:
        grid.add_column(key, no_wrap=True)
    for header in (
        "nonzero",
        "flushed",
        "subnormal",
        "saturated",
        "blocks",
        "w/ flush",
        "scale out",
    ):
        grid.add_column(header, justify="right", no_wrap=True)
    rows = table if top is None else table.head(top)
    for row in rows.itertuples():
        cells = [module_label(str(row.module))]
        if by == "op":
            cells += [str(row.kind), str(row.op)]
        cells += [
            count(row.nonzero),
            percent(float(row.flush_fraction)),
            percent(float(row.subnormal_fraction)),
            percent(float(row.saturate_fraction)),
            count(row.blocks),
            expected_count(row.blocks_flushed),
            count(row.scales_out_of_range),
        ]
        grid.add_row(*cells)
    stdout().print(grid)


def block_gate(result: BlockGateResult) -> None:
    console = stdout()
    verdict = "PASS" if result.passed else "FAIL"
    if not result.measured:
        console.print(
            f"FAIL: {result.recipe}: no nonzero value was measured, so nothing was judged."
        )
        return
    expected = "expected " if result.expected else ""
    console.print(
        f"{verdict}: {result.recipe}: {expected}flushed {percent(result.flush_fraction)} of "
        f"{count(result.nonzero)} nonzero values (limit {percent(result.max_flush)}), "
        f"{expected}saturated {percent(result.saturate_fraction)} "
        f"(limit {percent(result.max_saturate)})."
        + (f" ({EXPECTED_NOTE})" if result.expected else "")
    )
    for offender in result.offenders:
        console.print(
            f"  {module_label(offender['module'])}: {expected}flushed "
            f"{percent(offender['flush_fraction'])} ({expected_count(offender['flushed'])} of "
            f"{count(offender['nonzero'])}), {expected}saturated "
            f"{percent(offender['saturate_fraction'])}"
        )


def plan(result: Plan, output: str) -> None:
    if output == "json":
        print_json(result.to_dict())
        return
    if output == "names":
        for name in result.keep:
            sys.stdout.write(f"{module_label(name)}\n")
        return
    console = stdout()
    if not result.modules:
        console.print(
            "No candidate: no module that owns a weight ran a matrix multiply in backward "
            "(or the report predates GEMM operand statistics: scan again). Frameworks "
            "quantize only Linear/GEMM operands, so every module stays in bf16."
        )
    else:
        grid = Table(
            title=f"Cheapest passing recipe per GEMM module, judged on its backward GEMM "
            f"operands (flush ≤ {percent(result.max_flush)}, saturate ≤ "
            f"{percent(result.max_saturate)}; tried {', '.join(result.recipes)})",
            title_justify="left",
        )
        for header in ("module", "recipe", "flushed", "saturated", "limited by"):
            grid.add_column(header, no_wrap=header != "limited by")
        for m in result.modules:
            grid.add_row(
                module_label(m.module),
                m.recipe,
                "-" if m.flush_fraction is None else percent(m.flush_fraction),
                "-" if m.saturate_fraction is None else percent(m.saturate_fraction),
                m.limiting or "-",
            )
        console.print(grid)
        keep = result.keep
        console.print(
            f"{len(keep)} of {len(result.modules)} GEMM modules must stay in bf16"
            + (f": {', '.join(module_label(k) for k in keep)}" if keep else ".")
        )
    for single in result.single_limits:
        flag = "--max-saturate" if single.limit == "max_saturate" else "--max-flush"
        what = "saturates" if single.limit == "max_saturate" else "flushes"
        limit = result.max_saturate if single.limit == "max_saturate" else result.max_flush
        line = (
            f"{single.recipe} is ruled out for every kept module by {flag} {limit:g} alone: it "
            f"{what} up to {percent(single.needed)} of a module's operands "
            f"({flag} {single.needed:.3g} would pass it)"
        )
        if single.alternatives:
            flags = " ".join(f"--recipe {name}" for name in single.alternatives)
            line += f"; the round-up scale rule never saturates: scan with {flags}"
        console.print(line + ".")
    if result.not_candidates:
        console.print(
            f"Not candidates (no GEMM with a weight; frameworks keep them in bf16): "
            f"{', '.join(module_label(m) for m in result.not_candidates)}."
        )
    expected = [name for name in result.recipes if as_recipe(name).expected]
    if expected:
        console.print(f"{', '.join(expected)}: {EXPECTED_NOTE}; fractions are expected ones.")
