"""The commands that read a report (``show``, ``recommend``, ``simulate``, ``plot``,
``gate``, ``plan``; ``diff`` reads two) and those that list what fpaudit knows
(``formats``, ``recipes``).

Each reads the report, calls one library function for its view (most in
:mod:`fpaudit.rules.summary`) and hands it to the formatter ``--json`` picks
(:mod:`fpaudit.cli.formatters`: a table, or its JSON shape); a verdict (``gate``) is
returned, and :mod:`fpaudit.cli.commands` turns it into the exit status.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from fpaudit.cli import config, formatters, render
from fpaudit.cli import options as specs
from fpaudit.cli.common import (
    JsonOption,
    Judged,
    ReportArgument,
    from_report,
    named_scale,
    outside_report,
    scale,
)
from fpaudit.cli.options import (
    DiffArgs,
    ExportArgs,
    GateArgs,
    PlanArgs,
    PlotArgs,
    RecommendArgs,
    ShowArgs,
    SimulateArgs,
)
from fpaudit.errors import UsageError
from fpaudit.numerics.formats import FORMATS, get_format
from fpaudit.numerics.recipes import RECIPES
from fpaudit.rules import fp8_policies, scalers

if TYPE_CHECKING:
    from fpaudit.report.store import Report

BaseArgument = Annotated[
    Path, typer.Argument(help="The report to compare against (what main measured).",
                         show_default=False),
]  # fmt: skip
NewOptionalArgument = Annotated[
    Path | None,
    typer.Argument(help="plot BASE NEW: a second report, drawn against the first.",
                   show_default=False),
]  # fmt: skip
NewArgument = Annotated[Path, typer.Argument(help="The report of the change.", show_default=False)]


def formats_command(json_output: JsonOption = None) -> None:
    """List the formats and their thresholds.

    Example: fpaudit formats --json
    """
    formatters.FORMATS.chosen(json_output).write(FORMATS.values())


def recipes_command(json_output: JsonOption = None) -> None:
    """List the block-scaled recipes (--recipe): element format, block, scale rule.

    Example: fpaudit recipes --json
    """
    formatters.RECIPES.chosen(json_output).write(RECIPES.values())


def _show_origins(report_path: Path, options: ShowArgs) -> None:
    """``show --origins``: live origins and propagation, and predicted origins at S."""
    from fpaudit.report.store import Report
    from fpaudit.rules.summary import origins_view, reading_format

    log2_scale = scale(options.scale)
    report = Report.read(report_path)
    render.report_notes(report)
    if report.origins is None:
        raise UsageError(f"{report_path} has no origins: scan it with --origins")
    view = origins_view(report, reading_format(report, options.format), log2_scale)
    formatters.ORIGINS.chosen(options.json, top=options.top or 10).write(view)


def _show_skips(report_path: Path, options: ShowArgs) -> None:
    """``show --skips``: each skipped step's origin, and the verdict on them."""
    from fpaudit.report.store import Report
    from fpaudit.rules.skips import report_skip_verdict
    from fpaudit.rules.summary import run_format

    report = Report.read(report_path)
    render.report_notes(report)
    verdict = report_skip_verdict(report, run_format(report, options.format))
    if verdict is None:
        raise UsageError(
            f"{report_path} has no loss scaler's skips: only `fpaudit run` of a script "
            "with an enabled GradScaler records them"
        )
    formatters.SKIPS.chosen(options.json).write(verdict)


def show_command(report_path: ReportArgument, options: ShowArgs) -> None:
    """Per-module table of zeros, underflow, flush and overflow at a scale (or --steps).

    Example: fpaudit show report --format fp16 --scale 2^12 --top 5
    """
    from fpaudit.report.store import Report
    from fpaudit.rules.summary import module_view, reading_format, steps_view

    if options.origins:
        _show_origins(report_path, options)
        return
    if options.skips:
        _show_skips(report_path, options)
        return
    if options.steps:
        report = Report.read(report_path)
        render.report_notes(report)
        shown = formatters.STEPS.chosen(options.json, report=report, limit=options.limit)
        shown.write(steps_view(report))
        return
    if options.recipe is not None:
        _show_blocks(report_path, options, options.recipe)
        return
    log2_scale = scale(options.scale)
    report = Report.read(report_path)
    render.report_notes(report)
    view = module_view(
        report, reading_format(report, options.format), log2_scale,
        kind=options.kind, by=options.by, top=options.top,
    )  # fmt: skip
    formatters.MODULES.chosen(options.json, report=report).write(view)


def _show_blocks(report_path: Path, options: ShowArgs, recipe_name: str) -> None:
    """show --recipe: block statistics of --kind's rows per module, or per module and op."""
    from fpaudit.numerics.recipes import get_recipe
    from fpaudit.report.store import Report
    from fpaudit.rules.blockplan import block_table

    recipe = get_recipe(recipe_name)
    report = Report.read(report_path)
    render.report_notes(report)
    by = ("module",) if options.by == "module" else ("module", "kind", "op")
    table = block_table(report, recipe, by, kind=options.kind)
    if options.top is not None:
        table = table.sort_values("flush_fraction", ascending=False, kind="stable")
        table = table.head(options.top)
    layout = {"recipe": recipe.name, "by": options.by, "kind": options.kind}
    formatters.BLOCKS.chosen(options.json, **layout).write(table)


def recommend_command(report_path: ReportArgument, options: RecommendArgs) -> None:
    """Recommend a power-of-two static loss scale, and say what limited it.

    Example: fpaudit recommend report --format fp16 --headroom-bits 4 --json
    """
    from fpaudit.report.store import Report
    from fpaudit.rules.summary import reading_format, recommendation_view

    report = Report.read(report_path)
    render.report_notes(report)
    view = recommendation_view(
        report, reading_format(report, options.format),
        from_report(options, "headroom_bits", report),
        include_loss=bool(from_report(options, "include_loss", report)),
        worst_window=options.worst_window, window_steps=options.drift_window,
        threshold_binades=options.drift_binades,
    )  # fmt: skip
    if options.worst_window and view.window is None:
        raise UsageError(f"--worst-window: {report_path} has no window with nonzero values")
    formatters.RECOMMENDATION.chosen(options.json).write(view)


def simulate_command(report_path: ReportArgument, options: SimulateArgs) -> None:
    """Replay a loss-scaler policy over a report's steps: skips, scales, underflow.

    With --policy te-delayed or msamp-delayed, replay FP8 delayed scaling per op instead.

    Example: fpaudit simulate run-report --policy deepspeed --hysteresis 2 --min-scale 1
    """
    from fpaudit.report.store import Report
    from fpaudit.rules.simulation import ScalerOverrides, simulate
    from fpaudit.rules.summary import reading_format

    if options.policy in fp8_policies.REGISTRY:
        _simulate_delayed(report_path, options)
        return
    entry = scalers.REGISTRY[options.policy]  # one of the declared choices
    for name in _FP8_SETTINGS:  # a config file may hold them for another --policy
        if name in options.flagged:
            flag = specs.spec("simulate", name).flag
            raise UsageError(f"{flag} applies to --policy te-delayed or msamp-delayed only")
    # the flags of scalers.PARAMETERS, by name; a scale's as the number its text says
    values = {name: getattr(options, name) for name in _LOSS_SCALER_SETTINGS}
    numbers = {name: config.parse_number(text, name) if text is not None else None
               for name, text in values.items() if name in _SCALE_SETTINGS}  # fmt: skip
    values.update(numbers)
    if entry.scale_option != scalers.INIT_SCALE:  # static: one scale, its own option's
        if values[scalers.INIT_SCALE] is not None:
            flag = specs.spec("simulate", entry.scale_option).flag
            raise UsageError(f"--policy {entry.name} takes its scale from {flag}")
        values[scalers.INIT_SCALE] = values[entry.scale_option]
    overrides = ScalerOverrides(**{name: values[name] for name in scalers.PARAMETERS})
    report = Report.read(report_path)
    render.report_notes(report)
    fmt = reading_format(report, options.format)
    headroom = from_report(options, "headroom_bits", report)
    result = simulate(
        report, fmt, options.policy, overrides, values[scalers.STATIC_SCALE],
        headroom_bits=headroom,
    )  # fmt: skip
    formatters.SIMULATION.chosen(options.json).write(result)


_FP8_SETTINGS = ("amax_history_len", "margin", "amax_compute_algo", "sweep", "max_overflow_steps")
# simulate's loss-scaler flags: every parameter the scalers declare, and the static scale
_LOSS_SCALER_SETTINGS = (*scalers.PARAMETERS, scalers.STATIC_SCALE)
_SCALE_SETTINGS = (*scalers.SCALE_PARAMETERS, scalers.STATIC_SCALE)


def _simulate_delayed(report_path: Path, options: SimulateArgs) -> None:
    """``simulate --policy te-delayed|msamp-delayed``: FP8 delayed scaling, one or a sweep."""
    from fpaudit.report.store import Report
    from fpaudit.rules import delayed

    for name in _LOSS_SCALER_SETTINGS:
        if getattr(options, name) is not None:
            flag = specs.spec("simulate", name).flag
            raise UsageError(f"{flag} is a loss-scaler setting; --policy {options.policy} "
                             "takes --amax-history-len, --margin, --amax-compute-algo")  # fmt: skip
    algo = options.amax_compute_algo
    fmt = get_format(options.format) if options.format is not None else None
    report = Report.read(report_path)
    render.report_notes(report)
    if options.sweep:
        for name in ("amax_history_len", "margin"):
            if name in options.given:
                flag = specs.spec("simulate", name).flag
                raise UsageError(f"--sweep tries every {flag}; drop {flag}")
        swept = delayed.sweep(
            report, options.policy, amax_compute_algo=algo,
            max_overflow_steps=options.max_overflow_steps, fmt=fmt,
        )  # fmt: skip
        formatters.FP8_SWEEP.chosen(options.json).write(swept)
        return
    if "max_overflow_steps" in options.given:
        raise UsageError("--max-overflow-steps is the gate of --sweep; add --sweep")
    settings = delayed.Settings(options.policy, options.amax_history_len, options.margin, algo)
    result = delayed.replay(report, settings, fmt)
    formatters.FP8_REPLAY.chosen(options.json).write(result)


def plot_command(
    report_path: ReportArgument, new: NewOptionalArgument = None, *, options: PlotArgs
) -> None:
    """Draw a report: value histogram against the format's bands, modules x binades, scale.

    With --recipe (a scan or run with --recipe): the scale codes of every block and the
    flushed fraction per module and recipe instead. With two reports (BASE NEW): both
    histograms overlaid at one scale, and each module's change of underflow.

    Example: fpaudit plot report -o report.png --format fp16 --scale recommended
    """
    from fpaudit.cli.plot import image_format, plot_report
    from fpaudit.report.store import Report
    from fpaudit.rules.summary import reading_format

    if options.output is None:
        raise UsageError("plot needs --output FILE.png or FILE.svg (-o for short)")
    output = Path(options.output)
    image_format(output)  # a bad suffix fails before the report is read
    if new is not None:
        _plot_comparison(report_path, new, output, options)
        return
    if options.recipe:
        from fpaudit.cli.plot import plot_blocks

        report = Report.read(report_path)
        render.report_notes(report)
        written = plot_blocks(report, output, options.recipe)
        render.stdout().print(f"Wrote {written}")
        return
    log2_scale = scale(options.scale)
    report = Report.read(report_path)
    render.report_notes(report)
    fmt = reading_format(report, options.format)
    headroom = from_report(options, "headroom_bits", report)
    written = plot_report(report, output, fmt, log2_scale, headroom_bits=headroom)
    render.stdout().print(f"Wrote {written}")


def _plot_comparison(base: Path, new: Path, output: Path, options: PlotArgs) -> None:
    """plot BASE NEW: the comparison of ``fpaudit diff`` drawn (one format, one scale)."""
    from fpaudit.cli.plot_diff import plot_comparison
    from fpaudit.report.store import Report
    from fpaudit.rules.comparison import compare

    if options.recipe:
        raise UsageError("--recipe draws one report; compare recipes with `fpaudit diff --recipe`")
    if base.resolve() == new.resolve():
        raise UsageError(f"BASE and NEW are the same report ({new}); compare two reports")
    base_report, new_report = Report.read(base), Report.read(new)
    for report in (base_report, new_report):
        render.report_notes(report)
    headroom = options.headroom_bits if "headroom_bits" in options.given else None
    result = compare(base_report, new_report, options.format, log2_scale=scale(options.scale),
                     headroom_bits=headroom)  # fmt: skip
    written = plot_comparison(result, base_report, new_report, output)
    render.stdout().print(f"Wrote {written}")


def gate_command(report_path: ReportArgument, options: GateArgs) -> Judged:
    """CI gate: exit 1 when underflow exceeds a fraction (or anything overflows) at a scale,
    or when the report measured nothing, holds inf/NaN, no completed step, or a run's error.

    Example: fpaudit gate report --max-underflow 0.001 --format fp16 --per-module
    """
    from fpaudit.report.store import Report
    from fpaudit.rules.gating import gate as run_gate
    from fpaudit.rules.summary import reading_format

    if options.recipe is not None or options.max_flush is not None:
        return _gate_blocks(report_path, options)
    limit = options.max_underflow
    if limit is None and options.baseline is None and options.max_increase is None:
        raise UsageError(
            "gate needs --max-underflow FRACTION (for example 0.001), --baseline BASE with "
            "--max-increase FRACTION, or max_underflow in --config"
        )
    from fpaudit.rules.gating import SCALE_NAMES

    log2_scale = named_scale(options.scale, SCALE_NAMES)
    if options.junit is not None:
        outside_report(Path(options.junit), report_path, "--junit")
    report = Report.read(report_path)
    baseline = _baseline(options.baseline, report_path)
    render.report_notes(report, incomplete=False)  # the verdict says if it is incomplete
    fmt = reading_format(report, options.format)
    headroom = from_report(options, "headroom_bits", report)
    include = bool(from_report(options, "include_loss", report))
    result = run_gate(
        report, fmt, limit, log2_scale=log2_scale, per_module=options.per_module,
        headroom_bits=headroom, include_loss=include, allow_incomplete=options.allow_incomplete,
        allow_nonfinite=options.allow_nonfinite, fail_unscalable=options.fail_unscalable,
        allow_errors=options.allow_errors, baseline=baseline, max_increase=options.max_increase,
    )  # fmt: skip
    shown = [formatters.GATE.chosen(options.json)]
    if options.junit is not None:  # written first: the file is there when the verdict is read
        shown.insert(0, formatters.JUnit(Path(options.junit), report, str(report_path), include))
    if os.environ.get("GITHUB_ACTIONS") == "true":
        stream = sys.stderr if options.json else sys.stdout  # keep --json parseable
        shown.append(formatters.GitHubAnnotations(str(report_path), stream))
    for formatter in shown:
        formatter.write(result)
    return result


def _baseline(path: str | None, report_path: Path) -> Report | None:
    """gate --baseline: the report to gate against, read (not the report itself)."""
    from fpaudit.errors import ReportError
    from fpaudit.report.store import Report

    if path is None:
        return None
    if Path(path).resolve() == report_path.resolve():
        raise UsageError(f"--baseline {path} is the report being gated; name the baseline's report")
    try:
        return Report.read(path)
    except ReportError as error:
        raise ReportError(f"--baseline: {error.as_flag()}") from None


def _gate_blocks(report_path: Path, options: GateArgs) -> Judged:
    """gate --recipe R --max-flush F: judge block statistics (per module), exit 0 or 1."""
    from fpaudit.report.store import Report
    from fpaudit.rules.blockplan import block_gate

    if options.recipe is None or options.max_flush is None:
        raise UsageError("a block gate needs both --recipe R and --max-flush FRACTION")
    if options.baseline is not None or options.max_increase is not None:
        raise UsageError(
            "--baseline does not apply to a block gate (--recipe): compare block statistics "
            "with `fpaudit diff BASE NEW --recipe R`"
        )
    report = Report.read(report_path)
    render.report_notes(report)
    result = block_gate(report, options.recipe, options.max_flush, options.max_saturate)
    formatters.BLOCK_GATE.chosen(options.json).write(result)
    return result


def plan_command(report_path: ReportArgument, options: PlanArgs) -> None:
    """Per module, the cheapest block-scaled recipe that passes, and which must stay in bf16.

    Example: fpaudit plan report --recipe mxfp4 --recipe mxfp8-e4m3 --max-flush 0.01
    """
    from fpaudit.report.store import Report
    from fpaudit.rules.blockplan import plan

    if options.max_flush is None:
        raise UsageError(
            "plan needs --max-flush FRACTION, the flushed fraction your model tolerates per "
            "module (0.01 is a common start), or max_flush in --config"
        )
    report = Report.read(report_path)
    render.report_notes(report)
    wanted = options.recipe or report.recipes
    if not wanted:
        raise UsageError(f"{report_path} has no block statistics; scan or run with --recipe R")
    result = plan(report, list(wanted), options.max_flush, options.max_saturate)
    shown = formatters.PLAN_NAMES if options.names and not options.json else None
    (shown or formatters.PLAN.chosen(options.json)).write(result)


def diff_command(base: BaseArgument, new: NewArgument, options: DiffArgs) -> None:
    """Compare two reports in one format at one scale, per module (or op): underflow and
    overflow in each, their change, the move of amax; the largest rise of underflow first.

    Example: fpaudit diff main-report pr-report --format fp16 --by op --json
    """
    from fpaudit.report.store import Report
    from fpaudit.rules.comparison import SCALE_NAMES, compare

    log2_scale = named_scale(options.scale, SCALE_NAMES)
    if base.resolve() == new.resolve():
        raise UsageError(f"BASE and NEW are the same report ({new}); compare two reports")
    base_report, new_report = Report.read(base), Report.read(new)
    for report in (base_report, new_report):
        render.report_notes(report)
    if options.recipe is not None:
        _diff_blocks(base_report, new_report, options)
        return
    result = compare(
        base_report, new_report, options.format, log2_scale=log2_scale, by=options.by,
        sort=options.sort, headroom_bits=options.headroom_bits, include_loss=options.include_loss,
    )  # fmt: skip
    formatters.COMPARISON.chosen(options.json).write(result)


def _diff_blocks(base: Report, new: Report, options: DiffArgs) -> None:
    """diff --recipe R: the flushed and saturated fractions of R per module."""
    from fpaudit.rules.comparison import compare_blocks

    for name in ("format", "scale", "by", "sort", "headroom_bits", "include_loss"):
        if name in options.flagged:
            flag = specs.spec("diff", name).flag
            raise UsageError(
                f"{flag} does not apply to --recipe (per module, at each block's scale)"
            )
    result = compare_blocks(base, new, str(options.recipe))
    formatters.BLOCK_COMPARISON.chosen(options.json).write(result)


def export_command(report_path: ReportArgument, options: ExportArgs) -> None:
    """Write a report's dashboard metrics and per-module binade histograms as TensorBoard
    event files, one point per captured step (tensorboard --logdir DIR shows them).

    Example: fpaudit export report --tensorboard runs/fpaudit --format fp16 --top 8
    """
    from fpaudit.integrations.tensorboard import summary_writer, write_report
    from fpaudit.report.store import Report
    from fpaudit.rules.summary import reading_format

    if options.tensorboard is None:
        raise UsageError("export needs --tensorboard DIR")
    report = Report.read(report_path)
    render.report_notes(report)
    fmt = reading_format(report, options.format).name
    writer = summary_writer(options.tensorboard)  # a missing package fails before writing
    try:
        steps = write_report(report, options.tensorboard, fmt, top=options.top, writer=writer)
    finally:
        writer.close()
    render.stdout().print(
        f"Wrote {steps} step(s) of fpaudit metrics ({fmt}) to {options.tensorboard}"
    )
