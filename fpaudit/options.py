"""Every command option, declared once.

A :class:`Spec` names an option as the library does (``max_backoffs``), its TOML kind,
the commands that take it, and, where it has one, its built-in default and help text.
From these come the TOML schema (:data:`fpaudit.config.COMMAND_OPTIONS`), the help's
``[default: X]`` and the defaults the commands and library option objects start from.

Adding an option: one ``Spec`` here (plus its flag in the command's signature in
``fpaudit/cli.py``); tests/test_help.py checks that help, TOML and library agree.
No typer here: library modules read their defaults from this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fpaudit.limits import DEFAULT_HEADROOM_BITS

# The commands a config file may have a table for, in the order messages list them.
CONFIG_COMMANDS = ("scan", "run", "show", "recommend", "plot", "simulate", "gate", "plan")

_NO_DEFAULT: Any = object()


@dataclass(frozen=True)
class Spec:
    """One option: ``name`` as the library spells it, ``kind`` its TOML type
    (see :mod:`fpaudit.config`), the ``commands`` that take it with this meaning,
    and its built-in ``default`` and ``help`` where it has them."""

    name: str
    kind: str
    commands: tuple[str, ...]
    default: Any = _NO_DEFAULT
    help: str = ""

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def has_default(self) -> bool:
        return self.default is not _NO_DEFAULT

    def help_text(self) -> str:
        """The help with its default shown, as rich would otherwise drop it."""
        if not self.has_default:
            return f"{self.help}."
        return f"{self.help} [default: {_shown(self.default)}]."


def _shown(value: Any) -> str:
    return "none" if value is None else str(value)


ALL_REPORT_COMMANDS = ("show", "recommend", "plot", "simulate", "gate")
_OUTPUT = ("scan", "run")
_LIVE = ("scan", "verify", "fp16-plan")  # commands that run a model file

SPECS: tuple[Spec, ...] = (
    # -- scan and run share the output and selection groups ------------------
    Spec("out", "str", ("scan",), default="fpaudit-report", help="Report directory"),
    Spec("out", "str", ("run",), default="fpaudit-run", help="Report directory"),
    Spec("force", "bool", _OUTPUT, help="Overwrite an existing report"),
    Spec(
        "replace_partial",
        "bool",
        _OUTPUT,
        help="Let an interrupted run's report replace one with more completed steps",
    ),
    Spec(
        "window",
        "int",
        _OUTPUT,
        default=1,
        help="Merge the records of W consecutive captured steps",
    ),
    Spec(
        "module", "patterns", _OUTPUT, help="Capture only modules matching this glob (repeatable)"
    ),
    Spec(
        "exclude_module", "patterns", _OUTPUT, help="Skip modules matching this glob (repeatable)"
    ),
    Spec("op", "patterns", _OUTPUT),
    Spec("exclude_op", "patterns", _OUTPUT, help="Skip aten ops matching this glob (repeatable)"),
    # -- scan ------------------------------------------------------------------
    Spec("steps", "int", ("scan",), default=10, help="Training steps to run"),
    Spec("device", "str", _LIVE, default="auto", help="auto, cpu, cuda or cuda:N"),
    Spec("format", "formats", ("scan",)),
    Spec("seed", "int", _LIVE, default=0, help="Seed for torch, numpy and random"),
    Spec("loss_scale", "scale", ("scan",)),
    Spec(
        "every",
        "int",
        ("scan",),
        default=1,
        help="Capture every K-th step only; the others run unaudited",
    ),
    Spec("amp", "str", ("scan",)),
    Spec("shadow", "bool", ("scan",)),
    Spec("forward", "bool", ("scan",)),
    Spec("recipe", "recipes", ("scan", "plot", "plan")),
    # -- run -------------------------------------------------------------------
    Spec(
        "max_steps",
        "int",
        ("run",),
        default=None,
        help="Stop the script after N optimizer steps",
    ),
    Spec(
        "capture_every",
        "int",
        ("run",),
        default=10,
        help="Record every backward op on every K-th step; 0: never",
    ),
    Spec(
        "max_backoffs",
        "int",
        ("run",),
        default=5,
        help="More consecutive scale back-offs than this is a finding",
    ),
    Spec(
        "max_skip_rate",
        "float",
        ("run",),
        default=0.02,
        help="A higher skip rate after calibration is a finding, 0..1",
    ),
    # -- shared by several commands ----------------------------------------------
    Spec("format", "format", ("run", *ALL_REPORT_COMMANDS)),
    Spec(
        "headroom_bits",
        "int",
        ("scan", "run", "recommend", "plot", "simulate", "gate"),
        default=DEFAULT_HEADROOM_BITS,
        help="Binades kept free below the format's max",
    ),
    Spec("include_loss", "bool", ("scan", "recommend", "gate")),
    Spec("top", "int", ("scan",), default=8, help="Modules in the summary table"),
    Spec("top", "int", ("show",)),
    Spec("origins", "bool", ("scan", "show")),
    Spec("drift_window", "int", ("run", "recommend")),
    Spec("drift_binades", "int", ("run", "recommend")),
    Spec("scale", "scale", ("show", "plot", "gate")),
    Spec("json", "bool", ("show", "recommend", "simulate", "gate", "plan")),
    Spec("recipe", "str", ("show", "gate")),
    Spec("max_flush", "float", ("gate", "plan")),
    Spec("max_saturate", "float", ("gate", "plan")),
    # -- show ------------------------------------------------------------------
    Spec("kind", "str", ("show",)),
    Spec("by", "str", ("show",)),
    Spec("steps", "bool", ("show",)),
    Spec("limit", "int", ("show",)),
    # -- recommend ---------------------------------------------------------------
    Spec("worst_window", "bool", ("recommend",)),
    # -- plot ------------------------------------------------------------------
    Spec("output", "str", ("plot",)),
    # -- simulate ----------------------------------------------------------------
    Spec("policy", "str", ("simulate",)),
    Spec("init_scale", "scale", ("simulate",)),
    Spec("growth_factor", "float", ("simulate",)),
    Spec("backoff_factor", "float", ("simulate",)),
    Spec("growth_interval", "int", ("simulate",)),
    Spec("hysteresis", "int", ("simulate",)),
    Spec("min_scale", "scale", ("simulate",)),
    Spec("max_scale", "scale", ("simulate",)),
    Spec("static_scale", "scale", ("simulate",)),
    Spec("amax_history_len", "int", ("simulate",)),
    Spec("margin", "int", ("simulate",)),
    Spec("amax_compute_algo", "str", ("simulate",)),
    Spec("sweep", "bool", ("simulate",)),
    Spec("max_overflow_steps", "int", ("simulate",)),
    # -- gate ------------------------------------------------------------------
    Spec("max_underflow", "float", ("gate",)),
    Spec("per_module", "bool", ("gate",)),
    Spec("allow_incomplete", "bool", ("gate",)),
    Spec("allow_nonfinite", "bool", ("gate",)),
    Spec("junit", "str", ("gate",)),
    # -- plan ------------------------------------------------------------------
    Spec("names", "bool", ("plan",)),
)


def spec(command: str, name: str) -> Spec:
    """The spec of ``command``'s option ``name``."""
    for option in SPECS:
        if option.name == name and command in option.commands:
            return option
    raise KeyError(f"{command} has no option {name!r}")


def toml_schema() -> dict[str, dict[str, str]]:
    """Command -> option -> TOML kind, for every command a config file may set."""
    schema: dict[str, dict[str, str]] = {command: {} for command in CONFIG_COMMANDS}
    for option in SPECS:
        for command in option.commands:
            if command not in schema:
                continue  # verify and fp16-plan take no config file
            if option.name in schema[command]:
                raise ValueError(f"{command} declares {option.name!r} twice")
            schema[command][option.name] = option.kind
    return schema


def default(command: str, name: str) -> Any:
    """``command``'s built-in default for ``name``."""
    option = spec(command, name)
    if not option.has_default:
        raise KeyError(f"{command}'s {name!r} has no declared default")
    return option.default


def default_int(command: str, name: str) -> int:
    value = default(command, name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{command}'s {name!r} default is not an integer: {value!r}")
    return value


def default_str(command: str, name: str) -> str:
    value = default(command, name)
    if not isinstance(value, str):
        raise TypeError(f"{command}'s {name!r} default is not a string: {value!r}")
    return value


def default_float(command: str, name: str) -> float:
    value = default(command, name)
    if not isinstance(value, float):
        raise TypeError(f"{command}'s {name!r} default is not a number: {value!r}")
    return value


def defaults(command: str) -> dict[str, Any]:
    """Every declared default of ``command``'s options, by name."""
    return {
        option.name: option.default
        for option in SPECS
        if command in option.commands and option.has_default
    }


def help_text(command: str, name: str) -> str:
    """``command``'s help for ``name``, ending in its ``[default: X]``."""
    return spec(command, name).help_text()
