"""The commands that run the user's code: ``scan``, ``run``, ``verify`` and ``fp16-plan``.

Each maps its options to the library's (:func:`library_options`), makes one library
call (``scan`` and ``run``: :mod:`fpaudit.run.jobs`, which writes the report: locks,
partial and distributed writes, forked children), and prints what the library's
summary (:mod:`fpaudit.rules.summary`) says. How a command ends otherwise is the
library's typed exception, which :mod:`fpaudit.cli.commands` maps to an exit status.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from fpaudit.cli import config, formatters, render, render_blocks, render_run
from fpaudit.cli import options as specs
from fpaudit.cli.common import Judged, ModelFileArgument, no_progress, state
from fpaudit.cli.options import Fp16PlanArgs, RunArgs, ScanArgs, VerifyArgs
from fpaudit.errors import UsageError
from fpaudit.numerics.formats import Format, get_format
from fpaudit.report.records import KIND_BACKWARD
from fpaudit.report.runinfo import RunMeta

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    from fpaudit.integrations.tensorboard import LiveWriter
    from fpaudit.report.store import Report
    from fpaudit.run.jobs import ReportTarget

# The analysis and report modules are imported inside the commands: pandas and
# pyarrow are not needed while `scan` trains, and torch not to read a report.

L = TypeVar("L", bound="DataclassInstance")  # a library options class


def library_options(cls: type[L], args: ScanArgs | RunArgs, **parsed: Any) -> L:
    """``cls`` (``ScanOptions``, ``RunOptions``) built from the command's ``args``: each
    field from the option of the same name, ``selection`` from what --module/
    --exclude-module/--op/--exclude-op keep, ``recipes`` from each --recipe once, and
    ``parsed`` (what the command parses first, scan's loss scale) over them; a field none
    of these gives keeps its library default. A new option of the same name as its
    library field needs nothing here (tests/cli/test_options.py checks every field is fed)."""
    from fpaudit.capture.audit import Selection

    selection = Selection(
        modules=tuple(args.module),
        exclude_modules=tuple(args.exclude_module),
        ops=tuple(args.op),
        exclude_ops=tuple(args.exclude_op),
    )
    wanted = {field.name for field in dataclasses.fields(cls)}
    same = {name: getattr(args, name) for name in args.option_names() if name in wanted}
    captured = {"selection": selection, "recipes": tuple(dict.fromkeys(args.recipe))}
    return cls(**{**same, **captured, **parsed})


def _target(options: ScanArgs | RunArgs) -> ReportTarget:
    """--out checked before any work (an absolute path: model code may chdir)."""
    from fpaudit.run.jobs import report_target

    return report_target(options.out, force=options.force, replace_partial=options.replace_partial)


def _dashboard(
    directory: str | None, fmt: str | None, *, skips_at_end: bool = False
) -> Callable[[], LiveWriter] | None:
    """--tensorboard DIR: what makes the live writer (a missing package or an unwritable
    DIR is one line, before the run); a write that fails later is a warning and the run
    goes on."""
    if directory is None:
        return None
    from fpaudit.integrations.tensorboard import LiveWriter

    return lambda: LiveWriter(directory, fmt, skips_at_end=skips_at_end, warn=render.warning_line)


def _load_cpu_kernel() -> None:
    """Build or load the CPU kernel now (saying so if it compiles), not mid-step."""
    from fpaudit.kernels import build as kernels

    built = kernels.cpu_kernel(on_build=lambda: render.kernel_build_notice(kernels.build_reason()))
    if built is None and kernels.failure():
        render.stderr().print(
            f"note: not using the CPU histogram kernel: {kernels.failure()}; "
            "using the pure-torch path: identical results, slower"
        )


def _meta(options: ScanArgs | RunArgs, **settings: Any) -> RunMeta:
    """What the report keeps of the command: its settings, command line and options."""
    return RunMeta(
        **settings,
        argv=shlex.join(["fpaudit", *state.argv]),
        config=str(options.config_file) if options.config_file else None,
        options=options.to_meta(),
    )


def scan_command(model_file: ModelFileArgument, options: ScanArgs) -> None:
    """Run a model file for some steps and record every backward op.

    Example: fpaudit scan sample_configs/transformer.py --steps 8 --format fp16 --out report
    """
    from fpaudit.run.jobs import scan_to_report
    from fpaudit.run.scan import ScanOptions, resolve_device

    formats = [get_format(name) for name in dict.fromkeys(options.format)]
    loss_scale = math.ldexp(1.0, config.parse_scale(options.loss_scale, "loss_scale"))
    scan_options = library_options(ScanOptions, options, loss_scale=loss_scale)
    target = _target(options)
    if resolve_device(scan_options.device).type == "cpu":
        _load_cpu_kernel()
    meta = _meta(
        options, formats=tuple(f.name for f in formats), headroom_bits=options.headroom_bits,
        include_loss=options.include_loss,
    )  # fmt: skip
    # --tensorboard: rank 0 writes its own steps' metrics as they close
    done = scan_to_report(
        model_file, scan_options, target, meta=meta, progress=render.step_progress,
        dashboard=_dashboard(options.tensorboard, formats[0].name),
    )  # fmt: skip
    if done is None:  # under torchrun, a rank other than 0: rank 0 sums up
        return
    if done.batches_ended_on:  # a one-shot generator shorter on some ranks: all stopped together
        render.batches_ended(done.batches_ended_on, done.report.info.steps_run)
    _scan_summary(done.report, formats, options)


def _scan_summary(report: Report, formats: list[Format], options: ScanArgs) -> None:
    """What a scan says at the end, per format, from the library's summary."""
    from fpaudit.capture import autocast
    from fpaudit.rules.summary import scan_summary

    render.report_notes(report, incomplete=False)  # e.g. fp64 values beyond fp32's range
    summary = scan_summary(
        report, formats, options.headroom_bits, include_loss=options.include_loss
    )
    for index, each in enumerate(summary.formats):
        render.scan_summary(
            str(options.out),
            summary.steps_run,
            summary.captured,
            each.at_1,
            each.at_scale,
            each.recommendation,
            options.top,
            summary.forward_problems,
            list(summary.first_nonfinite),
            first=index == 0,
        )
        if each.show_drift:  # long scans: say how it moved
            for line in render_run.drift_lines(each.drift):
                render.stdout().print(line)
    render.autocast_prediction(autocast.summary(report), every_name=False)
    _block_summaries(report, options.top)


def _block_summaries(report: Report, top: int) -> None:
    """After a scan or run with --recipe: each recipe's worst modules by flush fraction."""
    from fpaudit.rules.summary import worst_blocks

    for name in report.recipes:
        table = worst_blocks(report, name, KIND_BACKWARD)
        render_blocks.block_table(table, name, "module", top, kind=KIND_BACKWARD)


ScriptArgument = Annotated[
    Path,
    typer.Argument(
        help="The training script; its own arguments follow it (after --).",
        show_default=False,
    ),
]


def run_command(ctx: typer.Context, script: ScriptArgument, options: RunArgs) -> None:
    """Run an unmodified training script and audit its loop: scaler, skips, clipping, drift.

    Example: fpaudit run --max-steps 200 --out run-report -- train.py --lr 3e-4
    """
    from fpaudit.run.jobs import run_to_report
    from fpaudit.run.training import RunOptions

    fmt = get_format(options.format) if options.format is not None else None
    run_options = library_options(RunOptions, options)
    target = _target(options)
    import torch

    if run_options.capture_every and not torch.cuda.is_available():
        _load_cpu_kernel()
    meta = _meta(options, headroom_bits=options.headroom_bits)
    # --tensorboard: skips are read when the run ends (one transfer), written then
    dashboard = _dashboard(options.tensorboard, fmt.name if fmt else None, skips_at_end=True)
    done = run_to_report(
        script, list(ctx.args), run_options, target, fmt=fmt, meta=meta, dashboard=dashboard
    )
    if done.while_writing is not None:
        render.ending(done.while_writing)
    _run_summary(done.report, done.format, options)
    if done.ending is not None:
        raise done.ending


def _run_summary(report: Report, fmt: Format, options: RunArgs) -> None:
    """What a run says at the end, from the library's summary."""
    from fpaudit.rules.summary import run_summary

    summary = run_summary(
        report, fmt, options.headroom_bits,
        window_steps=options.drift_window, threshold_binades=options.drift_binades,
    )  # fmt: skip
    # the summary says if it was interrupted; a compiled backward's notes: one line
    render.report_notes(report, incomplete=False, one_compiled_line=True)
    render_run.run_summary(
        str(options.out), report, list(summary.findings), summary.recommendation, summary.drift,
        summary.nonfinite_steps, summary.skips,
    )  # fmt: skip
    _block_summaries(report, specs.default_int("scan", "top"))


def verify_command(model_file: ModelFileArgument, options: VerifyArgs) -> Judged:
    """One fp32 step against one mixed-precision step: which parameters stop learning.

    Example: fpaudit verify sample_configs/mlp.py --scale 2^16 --amp fp16 --clip-norm 1.0
    """
    from fpaudit.run.modelfile import exits_caught
    from fpaudit.run.verify import verify

    if options.scale is None:
        raise UsageError(
            "verify needs --scale S, the loss scale of the mixed step (for example 2^16)"
        )
    # With --json, what model code prints goes to stderr: stdout holds only the JSON.
    model_output = contextlib.redirect_stdout(sys.stderr) if options.json else no_progress()
    with model_output, exits_caught():
        result = verify(
            model_file,
            log2_scale=config.parse_scale(options.scale),
            amp=options.amp,
            clip_norm=options.clip_norm,
            device=options.device,
            seed=options.seed,
        )
    formatters.VERIFICATION.chosen(options.json).write(result)
    return result


def fp16_plan_command(model_file: ModelFileArgument, options: Fp16PlanArgs) -> Judged:
    """The smallest set of modules to keep out of fp16, a loss scale, verified by running it.

    Example: fpaudit fp16-plan model.py --headroom-bits 1 --max-underflow 0.001
    """
    from fpaudit.run import fp16plan

    plan = fp16plan.fp16_plan(
        model_file,
        steps=options.steps,
        headroom_bits=options.headroom_bits,
        max_underflow=options.max_underflow,
        device=options.device,
        seed=options.seed,
    )
    formatters.FP16_PLAN.chosen(options.json).write(plan)
    return plan
