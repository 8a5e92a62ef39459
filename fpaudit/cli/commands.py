"""The ``fpaudit`` command line: parse, call the library, render, exit.

Exit codes: 0 success/pass, 1 the gate failed, 2 bad input or usage, 130
interrupted. Errors are one line on stderr; ``--debug`` adds the traceback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import os
import re
import shlex
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, NoReturn, TypeVar

import typer

from fpaudit import __version__
from fpaudit.cli import config, render, render_blocks, render_run
from fpaudit.cli import options as specs  # commands name their merged options `options`
from fpaudit.cli.options import (
    CONFIG_FIELD,
    CommandOptions,
    Fp16PlanArgs,
    GateArgs,
    PlanArgs,
    PlotArgs,
    RecommendArgs,
    RunArgs,
    ScanArgs,
    ShowArgs,
    SimulateArgs,
    VerifyArgs,
)
from fpaudit.errors import (
    FpauditError,
    Interrupted,
    ModelFileError,
    MonitorFailure,
    UsageError,
)
from fpaudit.numerics import limits
from fpaudit.numerics.formats import FORMATS, Format, get_format
from fpaudit.numerics.limits import DEFAULT_HEADROOM_BITS
from fpaudit.numerics.recipes import RECIPES
from fpaudit.report.records import KIND_BACKWARD, KIND_FORWARD, KIND_GRAD
from fpaudit.report.runinfo import RunMeta

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    from fpaudit.report.store import Report
    from fpaudit.run.training import RunOutcome

# The analysis and report modules are imported inside the commands: pandas and
# pyarrow are not needed while `scan` trains, and torch not to read a report.

EXIT_OK = 0
EXIT_GATE_FAILED = 1
EXIT_ERROR = 2
EXIT_INTERRUPTED = 130  # SIGINT, as shells report it
EXIT_TERMINATED = 143  # SIGTERM

_state: dict[str, Any] = {"debug": False, "argv": [], "pid": os.getpid()}


app = typer.Typer(
    name="fpaudit",
    help="Measure where the backward pass falls out of fp16/bf16/fp8 range, and pick a loss scale.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"fpaudit {__version__}")
        raise typer.Exit(EXIT_OK)


@app.callback()
def _main(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    _state["debug"] = debug


# -- options ---------------------------------------------------------------
# A command's flags are built from its options class (fpaudit.cli.options): one
# typer option per field, from the field's Spec (fpaudit.cli.options), in field order.
ConfigOption = Annotated[
    Path | None,
    typer.Option(
        "--config",
        help="TOML file with the same options (see sample_configs/) [default: none].",
    ),
]
JsonOption = Annotated[
    bool | None, typer.Option("--json/--no-json", help=specs.help_text("show", "json"))
]
ReportArgument = Annotated[
    Path,
    typer.Argument(
        help="A report directory written by `fpaudit scan` or `fpaudit run`.", show_default=False
    ),
]
ModelFileArgument = Annotated[
    Path,
    typer.Argument(help="Python file defining model, batches and loss.", show_default=False),
]
_VALUE_TYPES: dict[str, Any] = {
    "int": int,
    "float": float,
    "bool": bool,
    "str": str,
    "scale": str,
    "format": str,
}
_Args = TypeVar("_Args", bound=CommandOptions)
L = TypeVar("L", bound="DataclassInstance")  # a library options class


def _flag(command: str, option: specs.Spec | None) -> Any:
    """The typer option of one of ``command``'s options, from its spec (``None``: the
    config file's place); ``None`` as the value means "not given", so the config file
    and the declared default show through."""
    if option is None:
        return ConfigOption
    if not option.help:
        raise ValueError(f"{command}'s {option.name!r} has no help to show")
    value = (
        list[str] if option.kind in specs.LIST_KINDS
        else Path if option.path
        else _VALUE_TYPES[option.kind]
    )  # fmt: skip
    return Annotated[value | None, typer.Option(*option.declarations, help=option.help_text())]


def _options(
    args: type[_Args],
) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Give a command its flags from ``args``'s fields and hand it one ``args``: the
    command declares its arguments and an ``options`` parameter; typer sees the
    arguments followed by one option per field (``inspect.signature`` reads
    ``__signature__``, so the help lists them in field order)."""

    def decorate(command: Callable[..., None]) -> Callable[..., None]:
        own = [
            parameter
            for parameter in inspect.signature(command, eval_str=True).parameters.values()
            if parameter.name != "options"
        ]
        names = args.option_names()
        declared = {option.name: option for option in args.specs()}
        flags = [
            inspect.Parameter(
                name,
                inspect.Parameter.KEYWORD_ONLY,
                default=None,
                annotation=_flag(args.COMMAND, declared.get(name)),
            )
            for name in names
        ]

        @functools.wraps(command)
        def parsed(*positional: Any, **given: Any) -> None:
            flags = {name: given.pop(name) for name in names}
            file = flags.get(CONFIG_FIELD)
            configured = config.options_for(args.COMMAND, file) if file is not None else {}
            command(*positional, **given, options=args.build(configured, flags))

        parameters = [*own, *flags]
        parsed.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]  # read by inspect.signature (typer); typeshed's functions lack it
        parsed.__annotations__ = {p.name: p.annotation for p in parameters}
        return parsed

    return decorate


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """Turn SIGTERM into an exception, as SIGINT is, so a killed scan keeps its steps."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise Interrupted("SIGTERM", EXIT_TERMINATED)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _no_progress() -> Iterator[None]:
    yield None


def _library_options(cls: type[L], args: ScanArgs | RunArgs, **parsed: Any) -> L:
    """``cls`` (``ScanOptions``, ``RunOptions``) built from the command's ``args``: each
    field from the option of the same name, ``selection`` from what --module/
    --exclude-module/--op/--exclude-op keep, ``recipes`` from each --recipe once, and
    ``parsed`` (what the command parses first, scan's loss scale) over them; a field none
    of these gives keeps its library default. A new option of the same name as its
    library field needs nothing here (tests/test_options.py checks every field is fed)."""
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
    return os.getpid() != int(_state["pid"])


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


def _load_cpu_kernel() -> None:
    """Build or load the CPU kernel now (saying so if it compiles), not mid-step."""
    from fpaudit.kernels import build as kernels

    built = kernels.cpu_kernel(on_build=render.kernel_build_notice)
    if built is None and kernels.failure():
        render.stderr().print(
            f"note: not using the CPU histogram kernel: {kernels.failure()}; "
            "using the pure-torch path: identical results, slower"
        )


def _headroom(value: int) -> int:
    if not 0 <= value <= limits.MAX_HEADROOM_BITS:
        raise UsageError(
            f"--headroom-bits must be between 0 and {limits.MAX_HEADROOM_BITS}, got {value}"
        )
    return value


def _reading_format(name: str | None, report: Report) -> Format:
    if name is None:
        formats = report.info.formats
        name = formats[0] if formats else "fp16"
    return get_format(name)


def _scale(text: str | None, what: str = "scale") -> int | None:
    """log2 of a power-of-two scale given as 1024, 0.5, 2^10 or 2**10; None for 'recommended'."""
    if text is None or text.strip().lower() == "recommended":
        return None
    return config.parse_scale(text, what)


# -- commands --------------------------------------------------------------
@app.command("formats")
def formats_command(json_output: JsonOption = None) -> None:
    """List the formats and their thresholds.

    Example: fpaudit formats --json
    """
    render.formats(FORMATS.values(), bool(json_output))
    if not json_output:  # `fpaudit recipes --json` lists them as JSON
        render_blocks.recipes(RECIPES.values(), False)


@app.command("recipes")
def recipes_command(json_output: JsonOption = None) -> None:
    """List the block-scaled recipes (--recipe): element format, block, scale rule.

    Example: fpaudit recipes --json
    """
    render_blocks.recipes(RECIPES.values(), bool(json_output))


@app.command("scan")
@_options(ScanArgs)
def scan_command(model_file: ModelFileArgument, options: ScanArgs) -> None:
    """Run a model file for some steps and record every backward op.

    Example: fpaudit scan sample_configs/transformer.py --steps 8 --format fp16 --out report
    """
    from fpaudit.report.files import output_lock
    from fpaudit.run.scan import ScanExited, ScanInterrupted, ScanOptions, resolve_device, scan

    formats = [get_format(name) for name in dict.fromkeys(options.format)]
    headroom = _headroom(options.headroom_bits)
    log2_loss_scale = config.parse_scale(options.loss_scale, "loss_scale")
    if options.top < 1:
        raise UsageError(f"--top must be at least 1, got {options.top}")
    loss_scale = math.ldexp(1.0, log2_loss_scale)
    scan_options = _library_options(ScanOptions, options, loss_scale=loss_scale)
    out_path = _new_report_path(options)
    if resolve_device(scan_options.device).type == "cpu":
        _load_cpu_kernel()
    meta = RunMeta(
        formats=tuple(f.name for f in formats),
        headroom_bits=headroom,
        include_loss=options.include_loss,
        argv=shlex.join(["fpaudit", *_state["argv"]]),
        config=str(options.config_file) if options.config_file else None,
        options=options.to_meta(),
    )
    from fpaudit.run import distributed

    # Under torchrun every rank runs this command; rank 0 locks, shows progress and sums up.
    lead = distributed.leads()
    lock = output_lock(out_path) if lead else contextlib.nullcontext()
    shown = str(options.out)
    with lock:
        try:
            progress = render.step_progress(scan_options.steps) if lead else _no_progress()
            with progress as advance:
                report = scan(model_file, scan_options, on_step=advance, meta=meta)
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
    if distributed.active():
        distributed.shutdown()  # every rank wrote its part: meet at a barrier, then leave
        if not lead:
            return
        from fpaudit.report.store import Report

        report = Report.read(out_path)  # every rank's part, merged
    from fpaudit.rules import analysis
    from fpaudit.rules.drift import drift
    from fpaudit.rules.recommendation import recommend

    render.report_notes(report, incomplete=False)  # e.g. fp64 values beyond fp32's range
    problems = ~report.steps["loss_finite"]
    forward_problems = int(problems.sum())
    first_nonfinite = sorted(set(report.steps.loc[problems, "first_nonfinite"]) - {""})
    for index, fmt in enumerate(formats):
        rec = recommend(report, fmt, headroom, include_loss=options.include_loss)
        scope = analysis.default_scope(report, options.include_loss)
        at_1 = analysis.module_table(report, fmt, 0, scope=scope)
        at_s = analysis.module_table(report, fmt, rec.log2_scale or 0, scope=scope)
        render.scan_summary(
            shown,
            report.info.steps_run or 0,
            report.info.steps or 0,
            at_1,
            at_s,
            rec,
            options.top,
            forward_problems,
            first_nonfinite,
            first=index == 0,
        )
        drifted = drift(report, fmt, headroom, include_loss=options.include_loss)
        if drifted.warn or len(drifted.windows) >= 10:  # long scans: say how it moved
            for line in render_run.drift_lines(drifted):
                render.stdout().print(line)
    from fpaudit.capture import autocast

    render.autocast_prediction(autocast.summary(report), every_name=False)
    _block_summaries(report, options.top)


def _block_summaries(report: Report, top: int) -> None:
    """After a scan or run with --recipe: each recipe's worst modules by flush fraction."""
    from fpaudit.rules.blockplan import block_table

    for name in report.recipes:
        table = block_table(report, name, kind=KIND_BACKWARD).sort_values(
            "flush_fraction", ascending=False, kind="stable"
        )
        render_blocks.block_table(table, name, "module", top, kind=KIND_BACKWARD)


@app.command("run", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
@_options(RunArgs)
def run_command(
    ctx: typer.Context,
    script: Annotated[
        Path,
        typer.Argument(
            help="The training script; its own arguments follow it (after --).",
            show_default=False,
        ),
    ],
    options: RunArgs,
) -> None:
    """Run an unmodified training script and audit its loop: scaler, skips, clipping, drift.

    Example: fpaudit run --max-steps 200 --out run-report -- train.py --lr 3e-4
    """
    from fpaudit.report.files import output_lock
    from fpaudit.run.training import RunOptions, run_script

    fmt = get_format(options.format) if options.format is not None else None
    headroom = _headroom(options.headroom_bits)
    drift_options = _drift_options(options)
    run_options = _library_options(RunOptions, options)
    out_path = _new_report_path(options)
    import torch

    if run_options.capture_every and not torch.cuda.is_available():
        _load_cpu_kernel()
    meta = RunMeta(headroom_bits=headroom, argv=shlex.join(["fpaudit", *_state["argv"]]),
                   config=str(options.config_file) if options.config_file else None,
                   options=options.to_meta())  # fmt: skip
    shown = str(options.out)
    with output_lock(out_path):
        outcome = run_script(script, list(ctx.args), run_options, meta=meta)
        if _forked():  # the script's os.fork() child ended its script: exit as it would
            raise typer.Exit(outcome.exit_status)
        report = outcome.report
        if fmt is None:
            fmt = get_format(report.info.amp or "fp16")
        report.update_info(formats=(fmt.name,))
        if not report.info.steps_run and outcome.interrupted is None:
            if outcome.failure is not None:
                raise outcome.failure  # nothing done, nothing to keep
            if outcome.exited:  # nothing to audit, and the script's own status
                render.error_line(f"{script} exited before an optimizer step: nothing to audit")
                _exit_as_the_script(outcome)
            raise ModelFileError(
                f"{script} finished without an optimizer step: nothing to audit (fpaudit run "
                "watches torch.optim optimizers and torch.amp.GradScaler)"
            )
        kept = None
        if outcome.interrupted is not None or outcome.failure is not None or outcome.exited:
            kept = _write_partial(
                report, out_path, options, stopping=outcome.interrupted is not None
            )
        else:
            _write(lambda: report.write(out_path, force=options.force), report)
    if kept is not None:
        if outcome.interrupted is not None:
            render.error_line(f"interrupted by {outcome.interrupted.signal_name} after "
                              f"{report.info.steps_run} step(s); {kept}")  # fmt: skip
            raise typer.Exit(outcome.interrupted.exit_code)
        if outcome.exited:
            sys.stderr.write(f"fpaudit: note: {kept}\n")
            _exit_as_the_script(outcome)
        assert outcome.failure is not None
        raise ModelFileError(f"{outcome.failure}; {kept}")
    from fpaudit.rules.drift import drift
    from fpaudit.rules.recommendation import recommend

    rec = drift_result = None
    if not report.records.empty:
        rec = recommend(report, fmt, headroom)
        drift_result = drift(report, fmt, headroom, **drift_options)
    items = list(report.info.findings)
    render.report_notes(report, incomplete=False)  # the summary says if it was interrupted
    render_run.run_summary(shown, report, items, rec, drift_result)
    _block_summaries(report, specs.default_int("scan", "top"))
    if outcome.interrupted is not None:
        render.interrupted(shown, outcome.interrupted.signal_name,
                           report.info.steps_run or 0, options.max_steps)  # fmt: skip
        raise typer.Exit(outcome.interrupted.exit_code)
    if outcome.failure is not None:
        raise outcome.failure
    if outcome.exited:
        _exit_as_the_script(outcome)


def _exit_as_the_script(outcome: RunOutcome) -> NoReturn:
    """End ``fpaudit run`` as ``python script`` ended: the script's ``sys.exit(n)`` status,
    and for ``sys.exit("text")`` the text on stderr and status 1, as Python does."""
    if outcome.exit_message is not None:
        sys.stderr.write(f"{outcome.exit_message}\n")
        sys.stderr.flush()
    raise typer.Exit(outcome.exit_status)


def _drift_options(options: RunArgs | RecommendArgs) -> dict[str, Any]:
    window_steps, binades = options.drift_window, options.drift_binades
    if window_steps is not None and window_steps < 1:
        raise UsageError(f"--drift-window must be at least 1, got {window_steps}")
    if binades < 0:
        raise UsageError(f"--drift-binades must be 0 or more, got {binades}")
    return {"window_steps": window_steps, "threshold_binades": binades}


def _show_origins(report_path: Path, options: ShowArgs) -> None:
    """``show --origins``: live origins and propagation, and predicted origins at S."""
    from fpaudit.report.store import Report
    from fpaudit.rules import origins
    from fpaudit.rules.recommendation import recommend

    log2_scale = _scale(options.scale)
    report = Report.read(report_path)
    render.report_notes(report)
    if report.origins is None:
        raise UsageError(f"{report_path} has no origins: scan it with --origins")
    fmt = _reading_format(options.format, report)
    if log2_scale is None:
        headroom = _report_headroom(report)
        log2_scale = recommend(report, fmt, headroom).log2_scale or 0
    scale = math.ldexp(1.0, log2_scale)
    live = origins.live(report.origins)
    predicted = origins.predicted(report.origins, fmt, scale)
    if options.json:
        render.print_json(
            {
                **live.to_dict(),
                "predicted": {
                    "format": fmt.name,
                    "scale": scale,
                    "origins": render.json_records(predicted),
                },
            }
        )
    else:
        render_run.origins_view(live, predicted, fmt, log2_scale, top=options.top or 10)


@app.command("show")
@_options(ShowArgs)
def show_command(report_path: ReportArgument, options: ShowArgs) -> None:
    """Per-module table of zeros, underflow, flush and overflow at a scale (or --steps).

    Example: fpaudit show report --format fp16 --scale 2^12 --top 5
    """
    from fpaudit.report.store import Report
    from fpaudit.rules import analysis
    from fpaudit.rules.recommendation import recommend

    if options.origins:
        _show_origins(report_path, options)
        return
    if options.limit < 2:
        raise UsageError(f"--limit must be at least 2, got {options.limit}")
    if options.steps:
        report = Report.read(report_path)
        render.report_notes(report)
        info = report.info
        items = list(info.findings)
        if options.json:
            render.print_json(
                {
                    "training": dict(info.training) if info.training is not None else None,
                    "scaler": dict(info.scaler) if info.scaler is not None else None,
                    "findings": [finding.to_dict() for finding in items],
                    "steps": render.json_records(report.steps),
                }
            )
        else:
            render_run.steps_view(report, options.limit, items)
        return
    if options.kind not in (KIND_BACKWARD, KIND_GRAD, KIND_FORWARD):
        raise UsageError(f"--kind must be backward, grad or forward, got {options.kind!r}")
    if options.by not in ("module", "op"):
        raise UsageError(f"--by must be module or op, got {options.by!r}")
    if options.top is not None and options.top < 1:
        raise UsageError(f"--top must be at least 1, got {options.top}")
    if options.recipe is not None:
        _show_blocks(report_path, options, options.recipe)
        return
    log2_scale = _scale(options.scale)
    report = Report.read(report_path)
    render.report_notes(report)
    fmt = _reading_format(options.format, report)
    scale_source = "given"
    if log2_scale is None:
        log2_scale = recommend(report, fmt, _report_headroom(report)).log2_scale or 0
        scale_source = "recommended"
    group = ("module",) if options.by == "module" else ("module", "node", "op")
    scope = analysis.Scope(kinds=(options.kind,), include_loss=True)
    table = analysis.range_loss(report, fmt, log2_scale, scope=scope, by=group)
    if options.top is not None:
        table = table.sort_values("underflow_fraction", ascending=False, kind="stable").head(
            options.top
        )
    if options.json:
        render.print_json(render.module_rows(table))
    else:
        render.show(
            table,
            fmt,
            log2_scale,
            kind=options.kind,
            by=options.by,
            top=options.top,
            scale_source=scale_source,
        )
        from fpaudit.capture import autocast

        render.autocast_prediction(autocast.summary(report))


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
    if options.json:
        render.print_json(render_blocks.block_rows(table))
    else:
        render_blocks.block_table(table, recipe.name, options.by, kind=options.kind)


@app.command("recommend")
@_options(RecommendArgs)
def recommend_command(report_path: ReportArgument, options: RecommendArgs) -> None:
    """Recommend a power-of-two static loss scale, and say what limited it.

    Example: fpaudit recommend report --format fp16 --headroom-bits 4 --json
    """
    from fpaudit.report.store import Report
    from fpaudit.rules.drift import drift, window_report
    from fpaudit.rules.recommendation import recommend

    drift_options = _drift_options(options)
    report = Report.read(report_path)
    render.report_notes(report)
    fmt = _reading_format(options.format, report)
    headroom = _headroom(_from_report(options, "headroom_bits", report))
    include = bool(_from_report(options, "include_loss", report))
    drifted = drift(report, fmt, headroom, include_loss=include, **drift_options)
    worst = drifted.worst if options.worst_window else None
    if options.worst_window and worst is None:
        raise UsageError(f"--worst-window: {report_path} has no window with nonzero values")
    judged = report if worst is None else window_report(report, worst.first_step, worst.last_step)
    rec = recommend(judged, fmt, headroom, include_loss=include)
    if options.json:
        render.print_json(
            {
                **rec.to_dict(),
                "window": [worst.first_step, worst.last_step] if worst is not None else None,
                "drift": drifted.to_dict(),
            }
        )
        return
    if worst is not None:
        render.stdout().print(
            f"Worst window: steps {worst.first_step}-{worst.last_step} "
            f"({worst.captured_steps} captured step(s)); the recommendation below is its own."
        )
    render.recommendation(rec)
    for line in render_run.drift_lines(drifted):
        render.stdout().print(line)


@app.command("simulate")
@_options(SimulateArgs)
def simulate_command(report_path: ReportArgument, options: SimulateArgs) -> None:
    """Replay a loss-scaler policy over a report's steps: skips, scales, underflow.

    With --policy te-delayed or msamp-delayed, replay FP8 delayed scaling per op instead.

    Example: fpaudit simulate run-report --policy deepspeed --hysteresis 2 --min-scale 1
    """
    from fpaudit.report.store import Report
    from fpaudit.rules import scalers
    from fpaudit.rules.simulation import ScalerOverrides, simulate

    if options.policy in delayed_policies():
        _simulate_delayed(report_path, options)
        return
    if options.policy not in scalers.POLICIES:
        known = (*scalers.POLICIES, *delayed_policies())
        raise UsageError(f"--policy must be one of {', '.join(known)}, got {options.policy!r}")
    for name in _FP8_SETTINGS:  # a config file may hold them for another --policy
        if name in options.flagged:
            flag = specs.spec("simulate", name).flag
            raise UsageError(f"{flag} applies to --policy te-delayed or msamp-delayed only")
    scales = {"init_scale": options.init_scale, "min_scale": options.min_scale,
              "max_scale": options.max_scale, "static_scale": options.static_scale}  # fmt: skip
    numbers = {
        name: config.parse_number(text, name) if text is not None else None
        for name, text in scales.items()
    }
    overrides = ScalerOverrides(
        init_scale=numbers["init_scale"],
        growth_factor=options.growth_factor,
        backoff_factor=options.backoff_factor,
        growth_interval=options.growth_interval,
        hysteresis=options.hysteresis,
        min_scale=numbers["min_scale"],
        max_scale=numbers["max_scale"],
    )
    if options.policy == "static":
        if numbers["init_scale"] is not None:
            raise UsageError("--policy static takes its scale from --static-scale")
        overrides = dataclasses.replace(overrides, init_scale=numbers["static_scale"])
    report = Report.read(report_path)
    render.report_notes(report)
    fmt = _reading_format(options.format, report)
    headroom = _headroom(_from_report(options, "headroom_bits", report))
    result = simulate(
        report, fmt, options.policy, overrides, numbers["static_scale"],
        headroom_bits=headroom,
    )  # fmt: skip
    if options.json:
        render.print_json(result.to_dict())
    else:
        render_run.simulation(result)


def delayed_policies() -> tuple[str, ...]:
    from fpaudit.rules import delayed

    return delayed.POLICIES


_FP8_SETTINGS = ("amax_history_len", "margin", "amax_compute_algo", "sweep", "max_overflow_steps")


def _simulate_delayed(report_path: Path, options: SimulateArgs) -> None:
    """``simulate --policy te-delayed|msamp-delayed``: FP8 delayed scaling, one or a sweep."""
    from fpaudit.report.store import Report
    from fpaudit.rules import delayed

    loss_scaler = {"init_scale": options.init_scale, "growth_factor": options.growth_factor,
                   "backoff_factor": options.backoff_factor,
                   "growth_interval": options.growth_interval, "hysteresis": options.hysteresis,
                   "min_scale": options.min_scale, "max_scale": options.max_scale,
                   "static_scale": options.static_scale}  # fmt: skip
    for name, value in loss_scaler.items():
        if value is not None:
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
        if options.json:
            render.print_json(swept.to_dict())
        else:
            render_run.fp8_sweep(swept)
        return
    if "max_overflow_steps" in options.given:
        raise UsageError("--max-overflow-steps is the gate of --sweep; add --sweep")
    settings = delayed.Settings(options.policy, options.amax_history_len, options.margin, algo)
    result = delayed.replay(report, settings, fmt)
    if options.json:
        render.print_json(result.to_dict())
    else:
        render_run.fp8_replay(result)


@app.command("plot")
@_options(PlotArgs)
def plot_command(report_path: ReportArgument, options: PlotArgs) -> None:
    """Draw a report: value histogram against the format's bands, modules x binades, scale.

    With --recipe (a scan or run with --recipe): the scale codes of every block and the
    flushed fraction per module and recipe instead.

    Example: fpaudit plot report -o report.png --format fp16 --scale recommended
    """
    from fpaudit.cli.plot import image_format, plot_report
    from fpaudit.report.store import Report

    if options.output is None:
        raise UsageError("plot needs --output FILE.png or FILE.svg (-o for short)")
    output = Path(options.output)
    image_format(output)  # a bad suffix fails before the report is read
    if options.recipe:
        from fpaudit.cli.plot import plot_blocks

        report = Report.read(report_path)
        render.report_notes(report)
        written = plot_blocks(report, output, options.recipe)
        render.stdout().print(f"Wrote {written}")
        return
    log2_scale = _scale(options.scale)
    report = Report.read(report_path)
    render.report_notes(report)
    fmt = _reading_format(options.format, report)
    headroom = _headroom(_from_report(options, "headroom_bits", report))
    written = plot_report(report, output, fmt, log2_scale, headroom_bits=headroom)
    render.stdout().print(f"Wrote {written}")


@app.command("gate")
@_options(GateArgs)
def gate_command(report_path: ReportArgument, options: GateArgs) -> None:
    """CI gate: exit 1 when underflow exceeds a fraction (or anything overflows) at a scale,
    or when the report measured nothing, holds inf/NaN, no completed step, or a run's error.

    Example: fpaudit gate report --max-underflow 0.001 --format fp16 --per-module
    """
    from fpaudit.report.store import Report
    from fpaudit.rules.gating import gate as run_gate

    if options.recipe is not None or options.max_flush is not None:
        _gate_blocks(report_path, options)
    limit = options.max_underflow
    if limit is None:
        raise UsageError(
            "gate needs --max-underflow FRACTION (for example 0.001), or max_underflow in --config"
        )
    if not (0.0 <= limit <= 1.0):
        raise UsageError(f"--max-underflow must be a fraction between 0 and 1, got {limit}")
    log2_scale = _scale(options.scale)
    if options.junit is not None:
        _outside_report(Path(options.junit), report_path, "--junit")
    report = Report.read(report_path)
    render.report_notes(report, incomplete=False)  # the verdict says if it is incomplete
    fmt = _reading_format(options.format, report)
    headroom = _headroom(_from_report(options, "headroom_bits", report))
    include = bool(_from_report(options, "include_loss", report))
    result = run_gate(
        report, fmt, limit, log2_scale=log2_scale, per_module=options.per_module,
        headroom_bits=headroom, include_loss=include, allow_incomplete=options.allow_incomplete,
        allow_nonfinite=options.allow_nonfinite, fail_unscalable=options.fail_unscalable,
        allow_errors=options.allow_errors,
    )  # fmt: skip
    if options.junit is not None:
        from fpaudit.cli import ci

        modules = ci.gate_modules(report, result, include_loss=include)
        text = ci.junit_xml(result, modules, report_path=str(report_path))
        ci.write_junit(text, Path(options.junit))
    if options.json:
        render.print_json(result.to_dict(flags=True))  # reasons name the flags
    else:
        render.gate(result)
    if os.environ.get("GITHUB_ACTIONS") == "true":
        from fpaudit.cli import ci

        stream = sys.stderr if options.json else sys.stdout  # keep --json parseable
        for line in ci.github_annotations(result, report_path=str(report_path)):
            stream.write(line + "\n")
    raise typer.Exit(EXIT_OK if result.passed else EXIT_GATE_FAILED)


def _gate_blocks(report_path: Path, options: GateArgs) -> None:
    """gate --recipe R --max-flush F: judge block statistics (per module), exit 0 or 1."""
    from fpaudit.report.store import Report
    from fpaudit.rules.blockplan import block_gate

    if options.recipe is None or options.max_flush is None:
        raise UsageError("a block gate needs both --recipe R and --max-flush FRACTION")
    report = Report.read(report_path)
    render.report_notes(report)
    result = block_gate(report, options.recipe, options.max_flush, options.max_saturate)
    _verdict(result, options.json, render_blocks.block_gate)


@app.command("plan")
@_options(PlanArgs)
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
    output = "json" if options.json else "names" if options.names else "table"
    render_blocks.plan(result, output)


@app.command("verify")
@_options(VerifyArgs)
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
    model_output = contextlib.redirect_stdout(sys.stderr) if options.json else _no_progress()
    with model_output, exits_caught():
        result = verify(
            model_file,
            log2_scale=config.parse_scale(options.scale),
            amp=options.amp,
            clip_norm=options.clip_norm,
            device=options.device,
            seed=options.seed,
        )
    _verdict(result, options.json, render.verification)


@app.command("fp16-plan")
@_options(Fp16PlanArgs)
def fp16_plan_command(model_file: ModelFileArgument, options: Fp16PlanArgs) -> None:
    """The smallest set of modules to keep out of fp16, a loss scale, verified by running it.

    Example: fpaudit fp16-plan model.py --headroom-bits 1 --max-underflow 0.001
    """
    from fpaudit.run import fp16plan

    if options.steps < 1:
        raise UsageError(f"--steps must be at least 1, got {options.steps}")
    plan = fp16plan.fp16_plan(
        model_file,
        steps=options.steps,
        headroom_bits=options.headroom_bits,
        max_underflow=options.max_underflow,
        device=options.device,
        seed=options.seed,
    )
    _verdict(plan, options.json, render_run.fp16_plan)


def _verdict(result: Any, as_json: bool, show: Callable[[Any], None]) -> NoReturn:
    """Print a pass/fail result (JSON or through ``show``) and exit 0 (passed) or 1."""
    if as_json:
        render.print_json(result.to_dict())
    else:
        show(result)
    raise typer.Exit(EXIT_OK if result.passed else EXIT_GATE_FAILED)


def _outside_report(path: Path, report_path: Path, flag: str) -> None:
    """Refuse an output file inside the report being read: it would change the report
    (and a later --force would delete it with the report)."""
    target, root = path.resolve(), report_path.resolve()
    if target == root or root in target.parents:
        raise UsageError(
            f"{flag} {path} is inside the report {report_path}; write it outside the report"
        )


def _from_report(
    options: CommandOptions, name: Literal["headroom_bits", "include_loss"], report: Report
) -> Any:
    """An option not given anywhere falls back to what the scan used, then to its default."""
    value = getattr(options, name)
    if name in options.given:
        return value
    stored = getattr(report.info, name)
    return value if stored is None else stored


def _report_headroom(report: Report) -> int:
    """The headroom the report's scan used, else the declared default."""
    stored = report.info.headroom_bits
    return DEFAULT_HEADROOM_BITS if stored is None else stored


class _Stopped(Exception):
    """A command was interrupted: typer would turn the KeyboardInterrupt into a bare 130."""

    def __init__(self, cause: KeyboardInterrupt) -> None:
        super().__init__(str(cause))
        self.cause = cause


def _stoppable(callback: Any) -> Any:
    @functools.wraps(callback)
    def command(*args: Any, **kwargs: Any) -> Any:
        try:
            return callback(*args, **kwargs)
        except KeyboardInterrupt as error:
            raise _Stopped(error) from None

    return command


for _info in app.registered_commands:
    _info.callback = _stoppable(_info.callback)


_DEFAULT_IN_HELP = re.compile(r"\s*\[default: ([^\]]*)\]")
_TYPE_LABELS = {"int": "INTEGER", "float": "NUMBER", "str": "TEXT", "Path": "PATH"}


def _readable_help(command: Any) -> Any:
    """Help that reads well: every option's ``[default: X]`` shown (escaped: rich
    takes it for markup and drops it otherwise) after the sentence; types as INTEGER,
    NUMBER, TEXT or PATH (repeatable ones with "...", flags none); arguments in
    capitals. ``command`` is typer's (click) command tree."""
    for sub in getattr(command, "commands", {}).values():
        _readable_help(sub)
    for param in command.params:
        argument = param.param_type_name == "argument"
        text = getattr(param, "help", None)
        match = _DEFAULT_IN_HELP.search(text or "")
        if text and match and not argument:
            # escaped: rich reads an unescaped [default: X] as markup and drops it
            param.help = f"{text[: match.start()]}{text[match.end() :]} \\[default: {match[1]}]"
        if argument:
            name = (param.name or "").upper()
            label = _TYPE_LABELS.get(param.bare_type(), param.bare_type().upper())
            param.metavar = name
            param.get_usage_pieces = lambda ctx, name=name: [name]
            param.display_type_rich = lambda ctx, label=label: label
        elif getattr(param, "is_flag", False):
            param.metavar = ""
        else:
            bare = param.bare_type()
            many = bare.startswith("list[")
            bare = bare[5:-1] if many else bare
            param.metavar = _TYPE_LABELS.get(bare, bare.upper()) + ("..." if many else "")
    original = command.get_help_option

    def help_option(ctx: Any) -> Any:
        option = original(ctx)
        if option is not None:
            option.metavar = ""  # a flag: no type to show
        return option

    command.get_help_option = help_option
    return command


def _command() -> Any:
    """The click command tree typer builds from ``app``, with readable help."""
    return _readable_help(typer.main.get_command(app))


def run(argv: list[str] | None = None) -> int:
    """Run the CLI on ``argv``; map every way a command can end to an exit code.

    Errors print one line on stderr (``--debug`` adds the traceback).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    _state["argv"] = argv
    _state["debug"] = "--debug" in argv
    _state["pid"] = os.getpid()  # the process that owns this command's output
    try:
        with _sigterm_raises():  # SIGTERM anywhere in a command: exit 143, as shells expect
            result = _command().main(args=argv, prog_name="fpaudit", standalone_mode=False)
    except typer.Exit as done:
        return done.exit_code
    except _Stopped as stopped:
        return _interrupted(stopped.cause)
    except FpauditError as error:
        if _state["debug"]:
            traceback.print_exc()
        render.error_line(error.as_flag())  # the library's words, its parameters as flags
        return error.exit_code
    except typer.TyperException as error:  # usage errors from the parser
        if _state["debug"]:
            traceback.print_exc()
        message = error.format_message()
        if message:  # empty when the help was shown because no arguments were given
            context = getattr(error, "ctx", None)
            hint = f" (try '{context.command_path} --help')" if context is not None else ""
            render.error_line(f"{message}{hint}")
        return EXIT_ERROR
    except (typer.Abort, KeyboardInterrupt) as error:
        return _interrupted(error.__cause__ if isinstance(error, typer.Abort) else error)
    except (Exception, MonitorFailure) as error:  # fpaudit's own code failed: a bug
        if _state["debug"]:
            traceback.print_exc()
        if isinstance(error, MonitorFailure):  # in a hook or the capture, under a user call
            what = f"fpaudit's own code failed ({error})"
        else:
            what = f"{type(error).__name__}: {error}"
        render.error_line(f"internal error: {what} (please report it; --debug shows the traceback)")
        return EXIT_ERROR
    return result if isinstance(result, int) else EXIT_OK


def _interrupted(cause: BaseException | None) -> int:
    """SIGINT or SIGTERM ended a command (typer and click wrap the exception: ``cause``)."""
    name = getattr(cause, "signal_name", "SIGINT")
    render.error_line(f"interrupted by {name}")
    return int(getattr(cause, "exit_code", EXIT_INTERRUPTED))


def main() -> None:
    """Console-script entry point."""
    code = run()
    _leave_model_threads(code)
    sys.exit(code)


def _leave_model_threads(code: int) -> None:
    """Exit now when model code left non-daemon threads running (a background
    prefetcher): Python would wait for them forever after the report is written. The
    command's output is already complete (the report renamed into place, its summary
    printed), so say so and exit with the command's code. ``fpaudit run`` waits for them
    as ``python script`` would: exiting early would change what the script does."""
    if next((a for a in _state.get("argv", []) if not a.startswith("-")), None) == "run":
        return
    left = [
        t
        for t in threading.enumerate()
        if t is not threading.main_thread() and not t.daemon and t.is_alive()
    ]
    if not left:
        return
    names = ", ".join(sorted(repr(t.name) for t in left)[:3])
    more = f" and {len(left) - 3} more" if len(left) > 3 else ""
    sys.stderr.write(
        f"fpaudit: note: model code left {len(left)} non-daemon thread(s) running "
        f"({names}{more}); exiting without waiting for them (start them with daemon=True)\n"
    )
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":  # pragma: no cover
    main()
