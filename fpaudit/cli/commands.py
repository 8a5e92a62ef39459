"""The ``fpaudit`` command line: parse, call the library, render, exit.

The commands live by what they do: :mod:`fpaudit.cli.commands_run` (``scan``, ``run``,
``verify``, ``fp16-plan``: they run the user's code) and :mod:`fpaudit.cli.commands_report`
(``show``, ``recommend``, ``simulate``, ``plot``, ``gate``, ``plan``: they read a report;
``formats`` and ``recipes``). This module declares each command once, a
:class:`Command` in :data:`DECLARED` (options class, function, renderer, in the order
``--help`` lists them), is the typer app that registers them, and :func:`run` maps every
way a command ends to an exit code, the one place that does.

Exit codes: 0 success/pass, 1 the gate failed, 2 bad input or usage, 130
interrupted. Errors are one line on stderr; ``--debug`` adds the traceback.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import re
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Annotated, Any

import typer

from fpaudit import __version__, _threads
from fpaudit._process import Owner
from fpaudit.cli import (
    commands_report,
    commands_run,
    render,
    render_blocks,
    render_fp16plan,
    render_run,
    render_show,
    render_simulate,
)
from fpaudit.cli.common import (
    EXIT_ERROR,
    EXIT_GATE_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_TERMINATED,
    Judged,
    state,
    with_options,
)
from fpaudit.cli.options import (
    CONFIG_COMMANDS,
    CommandOptions,
    DiffArgs,
    ExportArgs,
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
from fpaudit.errors import Ended, FpauditError, Interrupted, MonitorFailure

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
    state.debug = debug


@dataclass(frozen=True)
class Command:
    """One command, declared once: its options class ``args`` (its name, its options,
    whether a config file may set it: :mod:`fpaudit.cli.options`), the ``function`` that
    parses, calls the library and renders (it takes the arguments it declares and one
    ``options: args``, which :func:`~fpaudit.cli.common.with_options` builds from the
    flags and the config file), and the ``renderer``, the module that draws what it
    prints (``render_CMD.py`` where it has one of its own). Its place in
    :data:`DECLARED` is its place in ``--help``. ``formats`` and ``recipes`` take no
    options class, only ``--json`` (``args`` None, ``name`` given)."""

    args: type[CommandOptions] | None
    function: Callable[..., object]
    renderer: ModuleType
    name: str = ""  # args.COMMAND where it has args
    passes_arguments: bool = False  # run: what follows the script is the script's own

    def __post_init__(self) -> None:
        if (self.args is None) == (self.name == ""):
            raise ValueError(f"{self.function.__name__}: a name only where it has no args")

    @property
    def command(self) -> str:
        return self.args.COMMAND if self.args is not None else self.name

    @property
    def config(self) -> bool:
        """A config file may set it (the command is in ``CONFIG_COMMANDS``)."""
        return self.args is not None and self.args.COMMAND in CONFIG_COMMANDS

    @property
    def settings(self) -> dict[str, Any]:
        """What typer's ``app.command`` takes besides the name."""
        if not self.passes_arguments:
            return {}
        return {"context_settings": {"allow_extra_args": True, "ignore_unknown_options": True}}

    @property
    def callback(self) -> Callable[..., object]:
        """The function as typer calls it: with its flags, where it has options."""
        if self.args is None:
            return self.function
        return with_options(self.args)(self.function)


# The commands, in the order --help lists them: options class, function, renderer.
DECLARED: tuple[Command, ...] = (
    Command(None, commands_report.formats_command, render, name="formats"),
    Command(None, commands_report.recipes_command, render_blocks, name="recipes"),
    Command(ScanArgs, commands_run.scan_command, render),
    Command(RunArgs, commands_run.run_command, render_run, passes_arguments=True),
    Command(ShowArgs, commands_report.show_command, render_show),
    Command(RecommendArgs, commands_report.recommend_command, render),
    Command(SimulateArgs, commands_report.simulate_command, render_simulate),
    Command(PlotArgs, commands_report.plot_command, render),  # the image: plot.py, when drawn
    Command(GateArgs, commands_report.gate_command, render),
    Command(DiffArgs, commands_report.diff_command, render),
    Command(PlanArgs, commands_report.plan_command, render_blocks),
    Command(ExportArgs, commands_report.export_command, render),
    Command(VerifyArgs, commands_run.verify_command, render),
    Command(Fp16PlanArgs, commands_run.fp16_plan_command, render_fp16plan),
)
# name, function as typer calls it, typer's settings: what the app registers
COMMANDS: tuple[tuple[str, Callable[..., object], dict[str, Any]], ...] = tuple(
    (command.command, command.callback, command.settings) for command in DECLARED
)


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


class _OutputFailed(Exception):
    """Printing the result failed (typer would exit 1 quietly on a closed pipe)."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


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
        except OSError as error:
            if _stdout_failed(error):
                raise _OutputFailed(error) from None
            raise

    return command


for _name, _callback, _settings in COMMANDS:
    app.command(_name, **_settings)(_stoppable(_callback))


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
    state.argv = argv
    state.debug = "--debug" in argv
    state.owner = Owner()  # the process that owns this command's output
    try:
        with _sigterm_raises():  # SIGTERM anywhere in a command: exit 143, as shells expect
            result = _command().main(args=argv, prog_name="fpaudit", standalone_mode=False)
    except typer.Exit as done:
        return done.exit_code
    except _Stopped as stopped:
        return _interrupted(stopped.cause)
    except Ended as ended:  # stopped, the script's own exit, a forked child: its words
        render.ending(ended)
        return ended.exit_code
    except FpauditError as error:
        if state.debug:
            traceback.print_exc()
        render.error_line(error.as_flag())  # the library's words, its parameters as flags
        return error.exit_code
    except typer.TyperException as error:  # usage errors from the parser
        if state.debug:
            traceback.print_exc()
        message = error.format_message()
        if message:  # empty when the help was shown because no arguments were given
            context = getattr(error, "ctx", None)
            hint = f" (try '{context.command_path} --help')" if context is not None else ""
            render.error_line(f"{message}{hint}")
        return EXIT_ERROR
    except (typer.Abort, KeyboardInterrupt) as error:
        return _interrupted(error.__cause__ if isinstance(error, typer.Abort) else error)
    except _OutputFailed as failed:  # the result could not be printed: the environment's
        render.error_line(_stdout_words(failed.error))
        return EXIT_ERROR
    except (Exception, MonitorFailure) as error:  # fpaudit's own code failed: a bug
        return _internal_error(error)
    if isinstance(result, Judged):  # a verdict: passed or failed
        return EXIT_OK if result.passed else EXIT_GATE_FAILED
    return result if isinstance(result, int) else EXIT_OK


def _internal_error(error: BaseException) -> int:
    """fpaudit's own code failed: one line, the traceback with --debug."""
    if state.debug:
        traceback.print_exc()
    if isinstance(error, MonitorFailure):  # in a hook or the capture, under a user call
        what = f"fpaudit's own code failed ({error})"
    else:
        what = f"{type(error).__name__}: {error}"
    render.error_line(f"internal error: {what} (please report it; --debug shows the traceback)")
    return EXIT_ERROR


def _stdout_failed(error: OSError) -> bool:
    """True when ``error`` came from printing the result (a full disk, /dev/full, a
    closed pipe): the innermost frame of fpaudit or rich that raised it prints. Standard
    output is then pointed at /dev/null, so that Python's own flush at exit is quiet."""
    frames = [
        frame
        for frame in traceback.extract_tb(error.__traceback__)
        if f"{os.sep}rich{os.sep}" in frame.filename or _PACKAGE in frame.filename
    ]
    if not frames:
        return False
    last = frames[-1].filename
    if _PACKAGE in last and not os.path.basename(last).startswith("render"):
        return False
    _quiet_stdout()
    return True


def _quiet_stdout() -> None:
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _stdout_words(error: OSError) -> str:
    """The one line for standard output that cannot be written."""
    reason = error.strerror or str(error)
    if error.errno == errno.EPIPE:
        return f"standard output was closed before fpaudit wrote its result ({reason})"
    return f"cannot write the result to standard output: {reason}"


def _interrupted(cause: BaseException | None) -> int:
    """SIGINT or SIGTERM ended a command (typer and click wrap the exception: ``cause``)."""
    name = getattr(cause, "signal_name", "SIGINT")
    render.error_line(f"interrupted by {name}")
    return int(getattr(cause, "exit_code", EXIT_INTERRUPTED))


def main() -> None:
    """Console-script entry point."""
    if _command_name(sys.argv[1:]) == "run":  # (a script's threads are its own business)
        sys.exit(_flushed(run()))
    with _threads.watching():
        code = _flushed(run())
        _leave_model_threads(code)
    sys.exit(code)


def _flushed(code: int) -> int:
    """``code``, once what is buffered for standard output is written; if it cannot be
    (a closed pipe, a full disk), one line and exit 2."""
    try:
        sys.stdout.flush()
    except OSError as error:
        _quiet_stdout()
        render.error_line(_stdout_words(error))
        return EXIT_ERROR
    return code


def _command_name(argv: list[str]) -> str | None:
    return next((a for a in argv if not a.startswith("-")), None)


def _leave_model_threads(code: int) -> None:
    """Exit now when model code left non-daemon threads running (a background
    prefetcher): Python would wait for them forever after the report is written. The
    command's output is already complete (the report renamed into place, its summary
    printed), so say so and exit with the command's code. ``fpaudit run`` waits for them
    as ``python script`` would: exiting early would change what the script does."""
    left = _threads.left_by_model()  # (not torch's compile workers)
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
