"""Every command option, declared once.

A :class:`Spec` names an option as the library does (``max_backoffs``), its TOML kind,
the commands that take it, and, where it has one, its built-in default and help text.
From these come the TOML schema (:data:`fpaudit.config.COMMAND_OPTIONS`), the help's
``[default: X]`` and the defaults the commands and library option objects start from.

A default the value alone does not say (``None`` meaning "the report's first") is worded
by ``shown``; a flag (``bool``) is off by default and its help shows no default; a required
option declares none. :func:`merge_defaults` is what a command starts from.

A spec also says how the command line spells the option (``short``, ``off``, ``path``):
``fpaudit/cli.py`` builds each flag from it. Adding an option: one ``Spec`` here and a typed
field in the command's class in :mod:`fpaudit.command_options` (its default read from the
spec); tests/test_command_options.py and tests/test_help.py check that fields, help, TOML
and library agree. No typer here: library modules read their defaults from this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fpaudit.limits import DEFAULT_HEADROOM_BITS
from fpaudit.records import KIND_BACKWARD

# The commands a config file may have a table for, in the order messages list them.
CONFIG_COMMANDS = ("scan", "run", "show", "recommend", "plot", "simulate", "gate", "plan")

_NO_DEFAULT: Any = object()
LIST_KINDS = ("patterns", "formats", "recipes")  # repeatable: a tuple of strings


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
    shown: str = ""  # the default as help words it, where the value alone does not say it
    # How the command line spells it (fpaudit.cli builds each flag from these):
    short: str = ""  # a one-letter alias, "-n"
    off: str | None = None  # a flag's off switch; None: "--no-NAME", "": none
    path: bool = False  # a file or folder: the flag takes a PATH
    # The library's name for it where that differs (Selection's "modules" for --module):
    # messages the library words with that name are shown with this flag (fpaudit.errors.flag).
    library: str = ""

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def declarations(self) -> tuple[str, ...]:
        """The flag as the command line declares it: ``--force/--no-force``, ``-n``."""
        flag = self.flag
        if self.kind == "bool" and self.off != "":
            flag += "/" + (self.off or "--no-" + self.flag[2:])
        return (flag, self.short) if self.short else (flag,)

    @property
    def value_default(self) -> Any:
        """What a command holds when neither config file nor flag sets the option: the
        declared default, else off (a flag), none (a list) or ``None`` (unset, required)."""
        if self.has_default:
            return self.default
        if self.kind == "bool":
            return False
        return () if self.kind in LIST_KINDS else None

    @property
    def has_default(self) -> bool:
        return self.default is not _NO_DEFAULT

    @property
    def shown_default(self) -> str:
        """The default as the help shows it: ``shown``, else the value (``none``, ``0``)."""
        if self.shown:
            return self.shown
        if self.default is None:
            return "none"
        if isinstance(self.default, float) and self.default.is_integer():
            return str(int(self.default))
        return str(self.default)

    def help_text(self) -> str:
        """The help with its default shown, as rich would otherwise drop it. A flag
        (``bool``) is off by default; its help says what turning it on does."""
        if not self.has_default or self.kind == "bool":
            return f"{self.help}."
        return f"{self.help} [default: {self.shown_default}]."


ALL_REPORT_COMMANDS = ("show", "recommend", "plot", "simulate", "gate")
_OUTPUT = ("scan", "run")
_LIVE = ("scan", "verify", "fp16-plan")  # commands that run a model file
_POLICYS = "the policy's"
RECIPES_HELP = "Block-scaled recipe, e.g. mxfp8-e4m3, mxfp4, nvfp4 (repeatable; fpaudit recipes)"

SPECS: tuple[Spec, ...] = (
    # -- scan and run share the output and selection groups ------------------
    Spec(
        "out",
        "str",
        ("scan",),
        default="fpaudit-report",
        help="Report directory",
        short="-o",
        path=True,
    ),
    Spec(
        "out",
        "str",
        ("run",),
        default="fpaudit-run",
        help="Report directory",
        short="-o",
        path=True,
    ),
    Spec("force", "bool", _OUTPUT, help="Overwrite an existing report"),
    Spec(
        "replace_partial",
        "bool",
        _OUTPUT,
        help="Let an interrupted run's report replace one with more completed steps",
        off="--keep-complete",
    ),
    Spec(
        "window",
        "int",
        _OUTPUT,
        default=1,
        help="Merge the records of W consecutive captured steps",
    ),
    Spec(
        "module",
        "patterns",
        _OUTPUT,
        help="Capture only modules matching this glob (repeatable)",
        library="modules",
    ),
    Spec(
        "exclude_module",
        "patterns",
        _OUTPUT,
        help="Skip modules matching this glob (repeatable)",
        library="exclude_modules",
    ),
    Spec(
        "op",
        "patterns",
        ("scan",),
        help="Capture only aten ops matching this glob, e.g. 'aten.mm.*' (repeatable)",
        library="ops",
    ),
    Spec(
        "op",
        "patterns",
        ("run",),
        help="Capture only aten ops matching this glob (repeatable)",
        library="ops",
    ),
    Spec(
        "exclude_op",
        "patterns",
        _OUTPUT,
        help="Skip aten ops matching this glob (repeatable)",
        library="exclude_ops",
    ),
    # -- scan ------------------------------------------------------------------
    Spec("steps", "int", ("scan",), default=10, help="Training steps to run", short="-n"),
    Spec("device", "str", _LIVE, default="auto", help="auto, cpu, cuda or cuda:N"),
    Spec(
        "format",
        "formats",
        ("scan",),
        default=("fp16",),
        help="Format(s) to summarise; repeat for several",
        shown="fp16",
        short="-f",
    ),
    Spec("seed", "int", _LIVE, default=0, help="Seed for torch, numpy and random"),
    Spec(
        "loss_scale",
        "scale",
        ("scan",),
        default="1",
        help="Run backward with this power-of-two loss scale",
    ),
    Spec(
        "every",
        "int",
        ("scan",),
        default=1,
        help="Capture every K-th step only; the others run unaudited",
    ),
    Spec(
        "amp",
        "str",
        ("scan",),
        default=None,
        help="Live mode: run forward under torch.autocast in fp16 or bf16",
        shown="off",
    ),
    Spec(
        "shadow",
        "bool",
        ("scan",),
        help="With --amp: re-run low-precision backward ops in fp32 to count lost values",
    ),
    Spec(
        "forward", "bool", ("scan",), help="Also record forward op outputs (a phase of their own)"
    ),
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
    Spec(
        "format",
        "format",
        ("run", *ALL_REPORT_COMMANDS),
        default=None,
        help="fp16, bf16, fp8_e4m3fn or fp8_e5m2",
        shown="the report's first",
        short="-f",
    ),
    Spec(
        "headroom_bits",
        "int",
        ("scan", "run", "recommend", "plot", "simulate", "gate"),
        default=DEFAULT_HEADROOM_BITS,
        help="Binades kept free below the format's max",
    ),
    # recommend and gate: unset, the report's own setting (scan --include-loss) holds
    Spec(
        "include_loss",
        "bool",
        ("scan", "recommend", "gate"),
        help="Let the loss seed and <loss> ops limit the scale",
        off="--exclude-loss",
    ),
    Spec("top", "int", ("scan",), default=8, help="Modules in the summary table"),
    Spec(
        "top",
        "int",
        ("show",),
        default=None,
        help="Only the N rows with the highest underflow fraction",
        shown="all",
    ),
    Spec(
        "origins",
        "bool",
        ("scan",),
        help="Note, per op call forward and backward, whether it made inf/NaN (implies "
        "--forward); see show --origins",
    ),
    Spec(
        "origins",
        "bool",
        ("show",),
        default=False,
        help="The ops that made inf/NaN (scan --origins), and those predicted at --scale",
        off="",
    ),
    Spec(
        "drift_window",
        "int",
        ("run", "recommend"),
        default=None,
        help="Steps per window for the drift check",
        shown="the run in ten windows",
    ),
    Spec(
        "drift_binades",
        "int",
        ("run", "recommend"),
        default=2,
        help="Warn when per-window recommendations span more binades than this",
    ),
    Spec(
        "json",
        "bool",
        ("show", "recommend", "simulate", "gate", "plan", "verify", "fp16-plan"),
        default=False,
        help="Print JSON instead of a table",
    ),
    # -- show ------------------------------------------------------------------
    Spec(
        "scale",
        "scale",
        ("show",),
        default="1",
        help="Power-of-two scale (1024, 2^10) or 'recommended'",
        short="-s",
    ),
    Spec(
        "kind",
        "str",
        ("show",),
        default=KIND_BACKWARD,
        help="backward (op outputs), grad (parameter gradients) or forward (--forward scans)",
    ),
    Spec(
        "by",
        "str",
        ("show",),
        default="module",
        help="module, or op (module, autograd node and aten op)",
    ),
    Spec(
        "steps",
        "bool",
        ("show",),
        default=False,
        help="The steps table instead: scale, skips, clipping, findings (fpaudit run)",
    ),
    Spec("limit", "int", ("show",), default=40, help="With --steps: rows shown, first and last"),
    Spec(
        "recipe",
        "str",
        ("show",),
        help="Block statistics of this recipe instead (from a scan or run with that recipe), "
        "per module or op",
    ),
    # -- recommend ---------------------------------------------------------------
    Spec(
        "worst_window",
        "bool",
        ("recommend",),
        default=False,
        help="Recommend from the window of steps with the smallest scale, and judge "
        "underflow there",
        off="--whole-run",
    ),
    # -- plot ------------------------------------------------------------------
    Spec(
        "output",
        "str",
        ("plot",),
        help="The image to write: FILE.png or FILE.svg (required)",
        short="-o",
        path=True,
    ),
    Spec(
        "scale",
        "scale",
        ("plot",),
        default="recommended",
        help="Power-of-two scale (4096, 2^12) or 'recommended'",
        short="-s",
    ),
    Spec(
        "recipe", "recipes", ("scan", "run", "plot", "plan"), help=RECIPES_HELP, library="recipes"
    ),
    # -- simulate ----------------------------------------------------------------
    Spec(
        "policy",
        "str",
        ("simulate",),
        default="torch",
        help="torch, apex, deepspeed, megatron or static",
    ),
    # the loss-scaler settings: unset, the policy's own
    Spec(
        "init_scale",
        "scale",
        ("simulate",),
        default=None,
        help="Initial scale, e.g. 65536 or 2^16",
        shown="the policy's; torch: the run's",
    ),
    Spec(
        "growth_factor",
        "float",
        ("simulate",),
        default=None,
        help="Scale multiplier on growth",
        shown=_POLICYS,
    ),
    Spec(
        "backoff_factor",
        "float",
        ("simulate",),
        default=None,
        help="Scale multiplier on overflow",
        shown=_POLICYS,
    ),
    Spec(
        "growth_interval",
        "int",
        ("simulate",),
        default=None,
        help="Clean steps before a growth",
        shown=_POLICYS,
    ),
    Spec(
        "hysteresis",
        "int",
        ("simulate",),
        default=None,
        help="Overflows tolerated before backing off",
        shown=_POLICYS,
    ),
    Spec(
        "min_scale", "scale", ("simulate",), default=None, help="Floor of the scale", shown=_POLICYS
    ),
    Spec(
        "max_scale", "scale", ("simulate",), default=None, help="Cap of the scale", shown=_POLICYS
    ),
    Spec(
        "static_scale",
        "scale",
        ("simulate",),
        default=None,
        help="The static scale to compare with",
        shown="the recommended one",
    ),
    # FP8 delayed scaling: fpaudit.delayed reads its defaults from these
    Spec(
        "amax_history_len",
        "int",
        ("simulate",),
        default=1024,
        help="FP8 delayed scaling: amax history length H",
    ),
    Spec("margin", "int", ("simulate",), default=0, help="FP8 delayed scaling: margin in binades"),
    Spec(
        "amax_compute_algo",
        "str",
        ("simulate",),
        default="max",
        help="FP8 delayed scaling: max or most_recent",
    ),
    Spec(
        "sweep",
        "bool",
        ("simulate",),
        default=False,
        help="FP8 delayed scaling: replay H in 1..1024 x margin 0..2, recommend",
        off="",
    ),
    Spec(
        "max_overflow_steps",
        "int",
        ("simulate",),
        default=0,
        help="--sweep's gate: overflow steps allowed",
    ),
    # -- gate ------------------------------------------------------------------
    Spec(
        "max_underflow",
        "float",
        ("gate",),
        help="Largest acceptable underflow fraction, 0..1 (required)",
    ),
    Spec(
        "scale",
        "scale",
        ("gate",),
        default=None,
        help="Power-of-two scale to judge",
        shown="the recommended one",
        short="-s",
    ),
    Spec(
        "per_module",
        "bool",
        ("gate",),
        default=False,
        help="Apply the limit to every module, not just overall",
        off="--overall",
    ),
    Spec(
        "allow_incomplete",
        "bool",
        ("gate",),
        default=False,
        help="Judge a report whose run was interrupted instead of failing it",
        off="--require-complete",
    ),
    Spec(
        "allow_nonfinite",
        "bool",
        ("gate",),
        default=False,
        help="Judge a report whose backward values or loss hold inf/NaN instead of failing it",
        off="--require-finite",
    ),
    Spec(
        "junit",
        "str",
        ("gate",),
        help="Also write the verdict as JUnit XML: one test case per module",
        path=True,
    ),
    Spec(
        "recipe",
        "str",
        ("gate",),
        help="Judge this block-scaled recipe's statistics with --max-flush",
    ),
    Spec(
        "max_flush",
        "float",
        ("gate",),
        help="With --recipe: largest flushed fraction, 0..1 (required with --recipe)",
    ),
    Spec(
        "max_saturate",
        "float",
        ("gate",),
        default=0.0,
        help="With --recipe: largest saturated fraction",
    ),
    # -- plan ------------------------------------------------------------------
    Spec(
        "max_flush",
        "float",
        ("plan",),
        help="Largest acceptable flushed fraction per module, 0..1 (required)",
    ),
    Spec(
        "max_saturate",
        "float",
        ("plan",),
        default=0.0,
        help="Largest saturated fraction per module",
    ),
    Spec(
        "names",
        "bool",
        ("plan",),
        default=False,
        help="Print only the modules that must stay in bf16, one a line",
        off="--table",
    ),
    # -- verify (no config file) -----------------------------------------------
    Spec(
        "scale",
        "scale",
        ("verify",),
        help="Power-of-two loss scale for the mixed step (1024, 2^10) (required)",
        short="-s",
    ),
    Spec("amp", "str", ("verify",), default="fp16", help="fp16 or bf16"),
    Spec(
        "clip_norm",
        "float",
        ("verify",),
        default=None,
        help="Clip unscaled gradients to this total norm",
    ),
    # -- fp16-plan (no config file) --------------------------------------------
    Spec("steps", "int", ("fp16-plan",), default=4, help="fp32 steps to scan"),
    Spec(
        "headroom_bits",
        "int",
        ("fp16-plan",),
        default=1,
        help="Keep amax * S at most 65504 / 2^H",
    ),
    Spec(
        "max_underflow",
        "float",
        ("fp16-plan",),
        default=0.001,
        help="Largest backward underflow fraction at S",
    ),
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


def merge_defaults(command: str) -> dict[str, Any]:
    """What ``command`` starts from before its config file and flags: every option's
    declared default, ``None`` where it has none (required, or unset until the report
    or policy says)."""
    return {
        option.name: option.default if option.has_default else None
        for option in SPECS
        if command in option.commands
    }


def help_text(command: str, name: str) -> str:
    """``command``'s help for ``name``, ending in its ``[default: X]``."""
    return spec(command, name).help_text()
