"""The commands that run the user's code: ``scan``, ``run``, ``verify`` and ``fp16-plan``.

Each maps its options to the library's (:func:`library_options`), runs, writes the
report (a stopped or failed run keeps its completed steps), and prints what the
library's summary (:mod:`fpaudit.rules.summary`) says.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shlex
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar

import typer

from fpaudit.cli import config, render, render_blocks, render_fp16plan, render_run
from fpaudit.cli import options as specs
from fpaudit.cli.common import (
    EXIT_ERROR,
    EXIT_OK,
    ModelFileArgument,
    no_progress,
    state,
    verdict,
)
from fpaudit.cli.options import Fp16PlanArgs, RunArgs, ScanArgs, VerifyArgs
from fpaudit.errors import Interrupted, ModelFileError, UsageError
from fpaudit.numerics.formats import Format, get_format
from fpaudit.report.outputs import loop_words, symlink_loop
from fpaudit.report.records import KIND_BACKWARD
from fpaudit.report.runinfo import RunMeta

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    from fpaudit.integrations.tensorboard import LiveWriter
    from fpaudit.report.store import Report
    from fpaudit.run.scan import ScanFailed
    from fpaudit.run.training import RunOutcome

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


# bytes a report adds below --out: its staging sibling's longer name (fpaudit.report.outputs)
# and the longest file inside it (rank prefixes, origins.parquet, a lock)
_INSIDE_REPORT = 96


def _path_max() -> int:
    """The longest path the system opens (PATH_MAX, 4096 on Linux)."""
    try:
        return int(os.pathconf("/", "PC_PATH_MAX"))
    except (OSError, ValueError, AttributeError):
        return 4096


def _new_report_path(options: ScanArgs | RunArgs) -> Path:
    """--out as an absolute path (model code may chdir), checked before any work: a name
    for a new directory in an existing directory, and no report there unless --force."""
    given = str(options.out)
    if not given.strip() or Path(given).name in ("", ".", ".."):
        raise UsageError(
            f"--out {given!r} names no new directory; give the report a name, for example "
            "--out fpaudit-report"
        )
    out_path = Path(os.path.abspath(given))
    loop = symlink_loop(out_path)
    if loop is not None:
        raise UsageError(f"--out {given}: {loop_words(loop)}")
    length = len(os.fsencode(out_path))
    if length + _INSIDE_REPORT > _path_max():
        raise UsageError(
            f"--out: the path {given[:40]}... is {length} bytes long; with the report's files "
            f"inside it, this system allows {_path_max() - _INSIDE_REPORT}"
        )
    for parent in out_path.parents:
        if parent.exists():
            if not parent.is_dir():
                # the wording of fpaudit.report.outputs.make_parent: one rule for output folders
                raise UsageError(
                    f"--out: cannot create folder {out_path.parent}: a file is in the way "
                    f"({parent})"
                )
            try:
                longest = os.pathconf(parent, "PC_NAME_MAX")
            except (OSError, ValueError):
                longest = 255
            for part in out_path.relative_to(parent).parts:
                if len(os.fsencode(part)) > longest:
                    raise UsageError(
                        f"--out: the name {part[:40]}... is {len(os.fsencode(part))} bytes "
                        f"long; this filesystem allows {longest}"
                    )
            break
    if out_path.exists() and not options.force:
        raise UsageError(f"{given} already exists; pass --force to overwrite it")
    return out_path


def _forked() -> bool:
    """True in a child that model code forked (os.fork, a DataLoader worker that came
    back here): it never writes the report, never unlocks, never prints a summary."""
    return not state.owner.here()


def _write_partial(
    report: Report, out_path: Path, options: ScanArgs | RunArgs, *, stopping: bool = False
) -> str | None:
    """Write a report of an interrupted or failed run, unless it would replace a report
    that completed more steps (--replace-partial allows it). None when written, else
    why the existing report was kept."""
    from fpaudit.report.files import steps_in
    from fpaudit.run import distributed

    done = report.info.steps_run or 0
    existing = steps_in(out_path) if out_path.exists() else None
    if existing is not None and done < existing and not options.replace_partial:
        return (
            f"kept the existing report {options.out} ({existing} completed step(s)): this "
            f"run completed {done}; pass --replace-partial to replace it anyway"
        )
    try:
        _write(lambda: distributed.write_report(report, out_path, force=options.force), report)
    except typer.Exit:
        if not stopping:  # a Ctrl-C during the write of a stopped run: already stopping
            raise
    return None


def _write(write: Any, report: Report) -> None:
    """Run ``write``; a Ctrl-C or SIGTERM during it waits for the end (the write defers
    them) and is then raised with the report safely written: say so before stopping."""
    try:
        write()
    except KeyboardInterrupt as error:
        if report.path is None:
            raise
        stopped = error if isinstance(error, Interrupted) else Interrupted()
        render.error_line(
            f"interrupted by {stopped.signal_name} while writing the report; it was written "
            f"whole to {report.path}"
        )
        raise typer.Exit(stopped.exit_code) from None


def _dashboard(
    directory: str | None, fmt: str | None, *, skips_at_end: bool = False
) -> LiveWriter | None:
    """--tensorboard DIR: the live writer (a missing package or an unwritable DIR is one
    line, before the run); a write that fails later is a warning and the run goes on."""
    if directory is None:
        return None
    from fpaudit.integrations.tensorboard import LiveWriter

    return LiveWriter(directory, fmt, skips_at_end=skips_at_end, warn=render.warning_line)


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
    from fpaudit.run import distributed
    from fpaudit.run.scan import ScanOptions, resolve_device

    formats = [get_format(name) for name in dict.fromkeys(options.format)]
    loss_scale = math.ldexp(1.0, config.parse_scale(options.loss_scale, "loss_scale"))
    scan_options = library_options(ScanOptions, options, loss_scale=loss_scale)
    out_path = _new_report_path(options)
    if resolve_device(scan_options.device).type == "cpu":
        _load_cpu_kernel()
    meta = _meta(
        options, formats=tuple(f.name for f in formats), headroom_bits=options.headroom_bits,
        include_loss=options.include_loss,
    )  # fmt: skip
    # Under torchrun every rank runs this command; rank 0 locks, shows progress and sums up.
    lead = distributed.leads()
    # --tensorboard: rank 0 writes its own steps' metrics as they close
    live = _dashboard(options.tensorboard, formats[0].name) if lead else None
    try:
        report = _scan_and_write(model_file, scan_options, options, out_path, meta, live)
    finally:
        if live is not None and not _forked():  # a child model code forked never writes
            live.close()
    if distributed.active():
        distributed.shutdown()  # every rank wrote its part: meet at a barrier, then leave
        if not lead:
            return
        from fpaudit.report.store import Report

        report = Report.read(out_path)  # every rank's part, merged
        ended = report.meta.get("batches_ended_on")
        if ended:  # a one-shot generator shorter on some ranks: all stopped together
            sys.stderr.write(
                f"fpaudit: note: the batches of rank {', '.join(map(str, ended))} ended after "
                f"{report.info.steps_run} step(s); every rank stopped there\n"
            )
    _scan_summary(report, formats, options)


def _scan_and_write(
    model_file: Path,
    scan_options: Any,
    options: ScanArgs,
    out_path: Path,
    meta: RunMeta,
    live: LiveWriter | None,
) -> Report:
    """Scan and write the report (the lead rank locks and shows progress; ``live``: the
    dashboard each captured step goes to); a stopped scan keeps its completed steps and
    exits, a scan whose model code exited keeps them and fails."""
    from fpaudit.report.files import output_lock
    from fpaudit.run import distributed
    from fpaudit.run.scan import ScanExited, ScanFailed, ScanInterrupted, scan

    lead = distributed.leads()
    lock = output_lock(out_path) if lead else contextlib.nullcontext()
    on_captured = live.write_step if live is not None else None
    shown = str(options.out)
    with lock:
        try:
            progress = render.step_progress(scan_options.steps) if lead else no_progress()
            with progress as advance:
                report = scan(
                    model_file, scan_options, on_step=advance, on_captured=on_captured, meta=meta
                )
        except ScanInterrupted as stopped:  # keep the completed steps
            if _forked():
                raise typer.Exit(stopped.exit_code) from None
            kept = _write_partial(stopped.report, out_path, options, stopping=True)
            done = stopped.report.info.steps_run or 0
            if kept is None:
                render.interrupted(shown, stopped.signal_name, done, scan_options.steps)
            else:
                render.error_line(f"interrupted by {stopped.signal_name} after {done} of "
                                  f"{scan_options.steps} step(s); {kept}")  # fmt: skip
            raise typer.Exit(stopped.exit_code) from None
        except ScanFailed as failed:  # torchrun: a rank failed; each keeps its steps apart
            if _forked():
                raise typer.Exit(EXIT_ERROR) from None
            _write_alone(failed, out_path, options)
        except ScanExited as exited:  # model code called sys.exit/os._exit
            if _forked():
                raise typer.Exit(EXIT_ERROR) from None
            kept = _write_partial(exited.report, out_path, options)
            done = exited.report.info.steps_run or 0
            raise ModelFileError(
                f"{exited}; "
                + (kept or f"the {done} completed step(s) are in {shown}, marked incomplete")
            ) from None
        if _forked():
            raise typer.Exit(EXIT_OK)
        _write(lambda: distributed.write_report(report, out_path, force=options.force), report)
    return report


def _write_alone(failed: ScanFailed, out_path: Path, options: ScanArgs) -> NoReturn:
    """Under torchrun, after a rank failed: write this rank's completed steps alone to
    ``OUT.rankN`` (the ranks cannot meet to write one report: the failed one is gone)
    and fail with the failing rank's words. SIGINT and SIGTERM (torchrun stops every
    rank once one exits) no longer interrupt: this rank is ending, within seconds."""
    for number in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(ValueError):  # not the main thread: nothing to hold
            signal.signal(number, signal.SIG_IGN)
    report, done = failed.report, failed.report.info.steps_run or 0
    own = out_path.with_name(f"{out_path.name}.rank{int(os.environ.get('RANK', '0'))}")
    shown = f"{options.out}.rank{int(os.environ.get('RANK', '0'))}"
    try:
        report.write(own, force=options.force)
        kept = f"this rank's {done} completed step(s) are in {shown}, marked incomplete"
    except Exception as problem:  # the failure is the news; the write a note in its line
        kept = f"this rank's {done} completed step(s) could not be written to {shown} ({problem})"
    error = failed.error
    raise type(error)(*error.wording.parts, f"; {kept}")


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
    from fpaudit.report.files import output_lock
    from fpaudit.rules.summary import run_format
    from fpaudit.run.training import RunOptions, run_script

    fmt = get_format(options.format) if options.format is not None else None
    run_options = library_options(RunOptions, options)
    out_path = _new_report_path(options)
    import torch

    if run_options.capture_every and not torch.cuda.is_available():
        _load_cpu_kernel()
    meta = _meta(options, headroom_bits=options.headroom_bits)
    # --tensorboard: skips are read when the run ends (one transfer), written then
    live = _dashboard(options.tensorboard, fmt.name if fmt else None, skips_at_end=True)
    with output_lock(out_path):
        on_captured = live.write_step if live is not None else None
        try:
            outcome = run_script(
                script, list(ctx.args), run_options, meta=meta, on_captured=on_captured
            )
        except BaseException:
            if live is not None and not _forked():
                live.close()  # what was written stays readable
            raise
        if live is not None and not _forked():
            live.close(outcome.report)
        if _forked():  # the script's os.fork() child ended its script: exit as it would
            raise typer.Exit(outcome.exit_status)
        report = outcome.report
        fmt = fmt or run_format(report)
        report.update_info(formats=(fmt.name,))
        if not report.info.steps_run and outcome.interrupted is None:
            _nothing_run(script, outcome)
        kept = None
        if outcome.interrupted is not None or outcome.failure is not None or outcome.exited:
            kept = _write_partial(
                report, out_path, options, stopping=outcome.interrupted is not None
            )
        else:
            _write(lambda: report.write(out_path, force=options.force), report)
    if kept is not None:
        _kept_instead(report, outcome, kept)
    _run_summary(report, fmt, options)
    if outcome.interrupted is not None:
        render.interrupted(str(options.out), outcome.interrupted.signal_name,
                           report.info.steps_run or 0, options.max_steps)  # fmt: skip
        raise typer.Exit(outcome.interrupted.exit_code)
    if outcome.failure is not None:
        raise outcome.failure
    if outcome.exited:
        _exit_as_the_script(outcome)


def _nothing_run(script: Path, outcome: RunOutcome) -> NoReturn:
    """End a run that made no optimizer step: its error, the script's own status, or
    "nothing to audit"."""
    if outcome.failure is not None:
        raise outcome.failure  # nothing done, nothing to keep
    if outcome.exited:  # nothing to audit, and the script's own status
        render.error_line(f"{script} exited before an optimizer step: nothing to audit")
        _exit_as_the_script(outcome)
    raise ModelFileError(
        f"{script} finished without an optimizer step: nothing to audit (fpaudit run "
        "watches torch.optim optimizers and torch.amp.GradScaler)"
    )


def _kept_instead(report: Report, outcome: RunOutcome, kept: str) -> NoReturn:
    """End a stopped or failed run whose report was not written over a fuller one."""
    if outcome.interrupted is not None:
        render.error_line(f"interrupted by {outcome.interrupted.signal_name} after "
                          f"{report.info.steps_run} step(s); {kept}")  # fmt: skip
        raise typer.Exit(outcome.interrupted.exit_code)
    if outcome.exited:
        sys.stderr.write(f"fpaudit: note: {kept}\n")
        _exit_as_the_script(outcome)
    assert outcome.failure is not None
    raise ModelFileError(f"{outcome.failure}; {kept}")


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


def _exit_as_the_script(outcome: RunOutcome) -> NoReturn:
    """End ``fpaudit run`` as ``python script`` ended: the script's ``sys.exit(n)`` status,
    and for ``sys.exit("text")`` the text on stderr and status 1, as Python does."""
    if outcome.exit_message is not None:
        sys.stderr.write(f"{outcome.exit_message}\n")
        sys.stderr.flush()
    raise typer.Exit(outcome.exit_status)


def verify_command(model_file: ModelFileArgument, options: VerifyArgs) -> None:
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
    verdict(result, options.json, render.verification)


def fp16_plan_command(model_file: ModelFileArgument, options: Fp16PlanArgs) -> None:
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
    verdict(plan, options.json, render_fp16plan.fp16_plan)
