"""What every command module shares: exit codes, the session's state, the arguments and
flags typer sees (built from the options classes of :mod:`fpaudit.cli.options`), and
the small steps several commands take (a verdict's exit, a scale, a report's setting).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Protocol, TypeVar, runtime_checkable

import typer

from fpaudit._process import Owner
from fpaudit.cli import config
from fpaudit.cli import options as specs
from fpaudit.cli.options import CONFIG_FIELD, CommandOptions
from fpaudit.errors import UsageError

if TYPE_CHECKING:
    from fpaudit.report.store import Report

EXIT_OK = 0
EXIT_GATE_FAILED = 1
EXIT_ERROR = 2
EXIT_INTERRUPTED = 130  # SIGINT, as shells report it
EXIT_TERMINATED = 143  # SIGTERM


@dataclass
class Session:
    """One command's session: ``--debug``, its command line (a report keeps it) and the
    process that owns its output (a forked child never writes it). :func:`fpaudit.cli.commands.run`
    starts a new one per command; it is the one mutable state the CLI keeps."""

    debug: bool = False
    argv: list[str] = field(default_factory=list)
    owner: Owner = field(default_factory=Owner)


state = Session()

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


def with_options(
    args: type[_Args],
) -> Callable[[Callable[..., object]], Callable[..., object]]:
    """Give a command its flags from ``args``'s fields and hand it one ``args``: the
    command declares its arguments and an ``options`` parameter; typer sees the
    arguments followed by one option per field (``inspect.signature`` reads
    ``__signature__``, so the help lists them in field order). Building ``args`` checks
    each value against its declared bounds."""

    def decorate(command: Callable[..., object]) -> Callable[..., object]:
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
        def parsed(*positional: Any, **given: Any) -> object:
            flags = {name: given.pop(name) for name in names}
            file = flags.get(CONFIG_FIELD)
            configured = config.options_for(args.COMMAND, file) if file is not None else {}
            return command(*positional, **given, options=args.build(configured, flags))

        parameters = [*own, *flags]
        parsed.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]  # read by inspect.signature (typer); typeshed's functions lack it
        parsed.__annotations__ = {p.name: p.annotation for p in parameters}
        return parsed

    return decorate


@contextlib.contextmanager
def no_progress() -> Iterator[None]:
    yield None


def scale(text: str | None, what: str = "scale") -> int | None:
    """log2 of a power-of-two scale given as 1024, 0.5, 2^10 or 2**10; None for 'recommended'."""
    if text is None or text.strip().lower() == "recommended":
        return None
    return config.parse_scale(text, what)


def named_scale(text: str | None, names: tuple[str, ...]) -> int | str | None:
    """A scale given as a power of two (log2 of it) or by one of ``names`` (the name, for
    the library to resolve); None when not given."""
    if text is None:
        return None
    name = text.strip().lower()
    return name if name in names else config.parse_scale(text, "scale")


@runtime_checkable
class Judged(Protocol):
    """A verdict a command returns (the gate's, verify's, fp16-plan's):
    :func:`fpaudit.cli.commands.run` exits 0 when it passed, 1 when it failed."""

    @property
    def passed(self) -> bool: ...


def outside_report(path: Path, report_path: Path, flag: str) -> None:
    """Refuse an output file inside the report being read: it would change the report
    (and a later --force would delete it with the report)."""
    from fpaudit.report.outputs import loop_words, symlink_loop

    loop = symlink_loop(Path(os.path.abspath(path)))
    if loop is not None:
        raise UsageError(f"{flag} {path}: {loop_words(loop)}")
    target, root = path.resolve(), report_path.resolve()
    if target == root or root in target.parents:
        raise UsageError(
            f"{flag} {path} is inside the report {report_path}; write it outside the report"
        )


def from_report(
    options: CommandOptions, name: Literal["headroom_bits", "include_loss"], report: Report
) -> Any:
    """An option not given anywhere falls back to what the scan used, then to its default
    (a report's stored headroom is checked against the same bounds when it is read)."""
    value = getattr(options, name)
    if name in options.given:
        return value
    stored = getattr(report.info, name)
    return value if stored is None else stored
