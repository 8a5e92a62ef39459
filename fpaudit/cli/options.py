"""Every command option, declared once: a typed field of the command's options class.

A command's options are one frozen dataclass (:class:`ScanArgs`, :class:`RunArgs`, ...);
each field is an option, declared by its type and an :class:`Option` that says its
built-in default, its help text and how the command line spells it. The field's name
is the library's (``max_backoffs``), its type what mypy checks every read against, and
its default the declared one. From the fields come everything else:

- :data:`SPECS`, one :class:`Spec` per option (name, TOML kind, the commands that take
  it with this meaning, default, help), which ``fpaudit/cli/commands.py`` turns into each
  command's flags, in field order, and :mod:`fpaudit.cli.config` into the TOML schema;
- the help's ``[default: X]``, the defaults the library's own option objects start from
  (:func:`default_int` and friends), and what a command holds when neither config file
  nor flag sets an option.

An option several commands share with one meaning (``force``, ``headroom_bits``) is one
module-level :class:`Option` that each class calls; the classes list their options in
the order their ``--help`` shows them.

A command's class is the half of its declaration the layers below the commands read
(the TOML schema, the flags): its name (``COMMAND``), its options, and whether a config
file may set it (it has the ``config_file`` field). :data:`COMMAND_ARGS` and
:data:`CONFIG_COMMANDS` are read from the classes; the other half, the function, the
renderer and the help's place, is the command's :class:`fpaudit.cli.commands.Command`.

Adding an option to a command is one edit: a field in its class, here, e.g.
``max_backoffs: int = Option(5, "More consecutive scale back-offs than this is a
finding")()``; then the command reads ``options.max_backoffs``. tests/cli/test_options.py
and tests/cli/test_help.py check that fields, flags, help, TOML and library agree. No typer
here: the defaults the library shares live in fpaudit.defaults.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Self

from fpaudit import defaults
from fpaudit.bounds import AT_LEAST_1, FRACTION, Bounds
from fpaudit.numerics.formats import FORMATS
from fpaudit.numerics.limits import DEFAULT_HEADROOM_BITS, MAX_HEADROOM_BITS
from fpaudit.report.records import KIND_BACKWARD, KIND_FORWARD, KIND_GRAD
from fpaudit.rules import fp8_policies, scalers

CONFIG_FIELD = "config_file"  # --config: where the command reads the rest from

_NO_DEFAULT: Any = object()
LIST_KINDS = ("patterns", "formats", "recipes")  # repeatable: a tuple of strings
_DECLARED = "fpaudit.option"  # a field's metadata key for its Option
# The TOML kinds a field's type allows ("scale" and "format": strings that name one).
_KINDS_OF_TYPE = {
    "int": ("int",),
    "float": ("float",),
    "bool": ("bool",),
    "str": ("str", "scale", "format"),
    "tuple[str, ...]": LIST_KINDS,
}


@dataclass(frozen=True)
class Spec:
    """One option: ``name`` as the library spells it, ``kind`` its TOML type
    (see :mod:`fpaudit.cli.config`), the ``commands`` that take it with this meaning,
    and its built-in ``default`` and ``help`` where it has them."""

    name: str
    kind: str
    commands: tuple[str, ...]
    default: Any = _NO_DEFAULT
    help: str = ""
    shown: str = ""  # the default as help words it, where the value alone does not say it
    # How the command line spells it (fpaudit.cli.commands builds each flag from these):
    short: str = ""  # a one-letter alias, "-n"
    off: str | None = None  # a flag's off switch; None: "--no-NAME", "": none
    path: bool = False  # a file or folder: the flag takes a PATH
    bounds: Bounds | None = None  # the values it takes, checked once the options are built

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
        if self.kind == "bool":
            return self.flag if self.value_default else (self.off_switch or "off")
        if self.default is None:
            return "none"
        if isinstance(self.default, float) and self.default.is_integer():
            return str(int(self.default))
        return str(self.default)

    def help_text(self) -> str:
        """The help with its default shown, as rich would otherwise drop it. A flag
        (``bool``) is off by default: its help says what turning it on does, and its
        default is the switch that turns it off (``--no-force``), or ``off``."""
        if not (self.has_default or self.kind == "bool" or self.shown):
            return f"{self.help}."  # required, or shared help (the command's field says more)
        return f"{self.help} [default: {self.shown_default}]."

    @property
    def off_switch(self) -> str:
        """A flag's off switch as the command line spells it; empty where it has none."""
        if self.kind != "bool" or self.off == "":
            return ""
        return self.off or "--no-" + self.flag[2:]


@dataclass(frozen=True)
class Option:
    """An option as a field declares it, less what the field says itself: its name and
    type (the TOML ``kind`` follows from the type, ``int``, ``float``, ``bool`` or
    ``str``, unless given: ``scale``, ``format``, or a list kind for a tuple). Calling it
    gives the field; :class:`Spec` is what it becomes once the class names it."""

    default: Any = _NO_DEFAULT
    help: str = ""
    kind: str = ""
    shown: str = ""
    short: str = ""
    off: str | None = None
    path: bool = False
    bounds: Bounds | None = None

    def __call__(self) -> Any:
        if self.has_default:
            start = self.default
        elif self.kind in LIST_KINDS:
            start = ()
        else:  # a flag is off, anything else unset (required, or the report's own)
            start = False if self.kind == "bool" else None
        return dataclasses.field(default=start, metadata={_DECLARED: self})

    @property
    def has_default(self) -> bool:
        return self.default is not _NO_DEFAULT


def flag(help: str, *, off: str | None = None, default: bool | None = None) -> Option:
    """A flag (``bool``): off unless given; its help says what turning it on does.
    ``default=False`` says so explicitly, as a JSON-or-table switch does."""
    return Option(_NO_DEFAULT if default is None else default, help, kind="bool", off=off)


def _kind(field: dataclasses.Field[Any], option: Option, command: str) -> str:
    """The TOML kind of ``field``: declared, or its type's, checked against its type."""
    base = re.sub(r"\s*\|\s*None$", "", str(field.type))
    allowed = _KINDS_OF_TYPE.get(base)
    if allowed is None:
        raise TypeError(f"{command}'s {field.name!r}: an option of type {field.type} is not one")
    kind = option.kind or allowed[0]
    if kind not in allowed or (base == "tuple[str, ...]" and not option.kind):
        raise TypeError(f"{command}'s {field.name!r}: kind {kind!r} does not fit {field.type}")
    if field.default is None and not str(field.type).endswith("| None"):
        raise TypeError(f"{command}'s {field.name!r} starts unset (None): its type must allow it")
    return kind


def _field_value(name: str, value: Any) -> Any:
    """A list as a tuple (the objects are frozen), a path flag as the text a config
    file would give (``config_file`` stays the path it is)."""
    if isinstance(value, list):
        return tuple(value)
    return str(value) if isinstance(value, Path) and name != CONFIG_FIELD else value


@dataclass(frozen=True, kw_only=True)
class CommandOptions:
    """What a command was told: its declared defaults, then the config file, then the flags.

    ``given`` names the options the config file or a flag set, ``flagged`` those set on
    the command line; both let a command tell "left at its default" from "asked for"."""

    COMMAND: ClassVar[str]
    given: frozenset[str] = frozenset()
    flagged: frozenset[str] = frozenset()

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        """The declared options, in help order (``config_file`` is --config's place)."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.name not in ("given", "flagged"))

    @classmethod
    def specs(cls) -> tuple[Spec, ...]:
        """Each option field as its :class:`Spec`, for this command alone, in field order."""
        found = []
        for field in dataclasses.fields(cls):
            option = field.metadata.get(_DECLARED)
            if option is None:
                continue
            found.append(
                Spec(
                    field.name,
                    _kind(field, option, cls.COMMAND),
                    (cls.COMMAND,),
                    option.default,
                    option.help,
                    option.shown,
                    option.short,
                    option.off,
                    option.path,
                    option.bounds,
                )
            )
        return tuple(found)

    @classmethod
    def build(cls, configured: Mapping[str, Any], flags: Mapping[str, Any]) -> Self:
        """From the config file's values and the flags given (``None``: not given)."""
        flags = {name: value for name, value in flags.items() if value is not None}
        values = {**configured, **flags}
        for option in cls.specs():
            if option.bounds is not None and option.name in values:
                option.bounds.check(option.name, values[option.name])
        return cls(
            **{name: _field_value(name, value) for name, value in values.items()},
            given=frozenset(values) - {CONFIG_FIELD},
            flagged=frozenset(flags) - {CONFIG_FIELD},
        )

    def to_meta(self) -> dict[str, Any]:
        """The options as a report's metadata keeps them: JSON values, by name."""
        meta: dict[str, Any] = {}
        for name in self.option_names():
            if name == CONFIG_FIELD:
                continue
            value = getattr(self, name)
            meta[name] = list(value) if isinstance(value, tuple) else value
        return meta


# -- the values some options take ------------------------------------------------------
KINDS = (KIND_BACKWARD, KIND_GRAD, KIND_FORWARD)  # the kinds of values show reads
GROUPINGS = ("module", "op")  # show --by


def _policies() -> tuple[str, ...]:
    """simulate's policies: the loss scalers', then FP8 delayed scaling's."""
    return scalers.POLICIES + fp8_policies.POLICIES


def _diff_sorts() -> tuple[str, ...]:
    """diff's --sort: the comparison's own (pandas: loaded only when one is checked)."""
    from fpaudit.rules import comparison

    return comparison.SORTS


# -- options several commands share with one meaning --------------------------------
RECIPES_HELP = "Block-scaled recipe, e.g. mxfp8-e4m3, mxfp4, nvfp4 (repeatable; fpaudit recipes)"
_POLICYS = "the policy's"
# "torch, apex, deepspeed, megatron or static": the scaler registry's names, in order
_POLICY_CHOICES = ", ".join(scalers.POLICIES[:-1]) + " or " + scalers.POLICIES[-1]
FORCE = flag("Overwrite an existing report")
REPLACE_PARTIAL = flag(
    "Let an interrupted run's report replace one with more completed steps", off="--keep-complete"
)
WINDOW = Option(defaults.WINDOW, "Merge the records of W consecutive captured steps")
MODULE = Option(
    help="Capture only modules matching this glob (repeatable)",
    kind="patterns",
    shown="every module",
)
EXCLUDE_MODULE = Option(
    help="Skip modules matching this glob (repeatable)",
    kind="patterns",
    shown="none",
)
EXCLUDE_OP = Option(
    help="Skip aten ops matching this glob (repeatable)",
    kind="patterns",
    shown="none",
)
# --format's help names every format of the registry in words: "fp16, bf16, ... or fp8_e5m2"
FORMAT_NAMES = " or ".join((", ".join(list(FORMATS)[:-1]), list(FORMATS)[-1]))
DEVICE = Option(defaults.DEVICE, "auto, cpu, cuda or cuda:N")
SEED = Option(defaults.SEED, "Seed for torch, numpy and random")
REPORT_FORMAT = Option(
    None, FORMAT_NAMES, kind="format", shown="the report's first",
    short="-f",
)  # fmt: skip
HEADROOM_BITS = Option(
    DEFAULT_HEADROOM_BITS, "Binades kept free below the format's max",
    bounds=Bounds(minimum=0, maximum=MAX_HEADROOM_BITS),
)  # fmt: skip
# recommend and gate: unset, the report's own setting (scan --include-loss) holds
INCLUDE_LOSS = flag("Let the loss seed and <loss> ops limit the scale", off="--exclude-loss")
DRIFT_WINDOW = Option(
    None, "Steps per window for the drift check", shown="the run in ten windows",
    bounds=AT_LEAST_1,
)  # fmt: skip
DRIFT_BINADES = Option(
    defaults.DRIFT_BINADES, "Warn when per-window recommendations span more binades than this",
    bounds=Bounds(minimum=0),
)  # fmt: skip
JSON = flag("Print JSON instead of a table", default=False)
RECIPES = Option(help=RECIPES_HELP, kind="recipes", shown="none")
TENSORBOARD = Option(
    None, "Write each captured step's metrics and histograms to TensorBoard files in DIR",
    path=True, shown="off",
)  # fmt: skip


# -- the commands, each option in its help row's place ------------------------------
@dataclass(frozen=True, kw_only=True)
class ScanArgs(CommandOptions):
    COMMAND: ClassVar[str] = "scan"
    steps: int = Option(defaults.SCAN_STEPS, "Training steps to run", short="-n")()
    device: str = DEVICE()
    format: tuple[str, ...] = Option(
        ("fp16",), "Format(s) to summarise; repeat for several", kind="formats", shown="fp16",
        short="-f",
    )()  # fmt: skip
    headroom_bits: int = HEADROOM_BITS()
    include_loss: bool = INCLUDE_LOSS()
    out: str = Option("fpaudit-report", "Report directory", short="-o", path=True)()
    config_file: Path | None = None
    seed: int = SEED()
    loss_scale: str = Option("1", "Run backward with this power-of-two loss scale", kind="scale")()
    top: int = Option(8, "Modules in the summary table", bounds=AT_LEAST_1)()
    force: bool = FORCE()
    every: int = Option(
        defaults.SCAN_EVERY, "Capture every K-th step only; the others run unaudited"
    )()
    window: int = WINDOW()
    module: tuple[str, ...] = MODULE()
    exclude_module: tuple[str, ...] = EXCLUDE_MODULE()
    op: tuple[str, ...] = Option(
        help="Capture only aten ops matching this glob, e.g. 'aten.mm.*' (repeatable)",
        kind="patterns",
        shown="every op",
    )()
    exclude_op: tuple[str, ...] = EXCLUDE_OP()
    amp: str | None = Option(
        None, "Live mode: run forward under torch.autocast in fp16 or bf16", shown="off"
    )()
    shadow: bool = flag(
        "With --amp: re-run low-precision backward ops in fp32 to count lost values"
    )()
    forward: bool = flag("Also record forward op outputs (a phase of their own)")()
    origins: bool = flag(
        "Note, per op call forward and backward, whether it made inf/NaN (implies "
        "--forward); see show --origins"
    )()
    replace_partial: bool = REPLACE_PARTIAL()
    recipe: tuple[str, ...] = RECIPES()
    compile: bool = flag(
        "Compile the model (torch.compile, Inductor); audit what its backward stores"
    )()
    tensorboard: str | None = TENSORBOARD()


@dataclass(frozen=True, kw_only=True)
class RunArgs(CommandOptions):
    COMMAND: ClassVar[str] = "run"
    out: str = Option("fpaudit-run", "Report directory", short="-o", path=True)()
    force: bool = FORCE()
    max_steps: int | None = Option(None, "Stop the script after N optimizer steps")()
    capture_every: int = Option(
        defaults.RUN_CAPTURE_EVERY, "Record every backward op on every K-th step; 0: never"
    )()
    capture_after_skip: int = Option(
        defaults.RUN_CAPTURE_AFTER_SKIP,
        "Capture the step after a skip (past calibration), forward too, at most N times; 0: never",
        bounds=Bounds(minimum=0),
    )()
    window: int = WINDOW()
    format: str | None = REPORT_FORMAT()
    headroom_bits: int = HEADROOM_BITS()
    module: tuple[str, ...] = MODULE()
    exclude_module: tuple[str, ...] = EXCLUDE_MODULE()
    op: tuple[str, ...] = Option(
        help="Capture only aten ops matching this glob (repeatable)",
        kind="patterns",
        shown="every op",
    )()
    exclude_op: tuple[str, ...] = EXCLUDE_OP()
    max_backoffs: int = Option(
        defaults.RUN_MAX_BACKOFFS, "More consecutive scale back-offs than this is a finding"
    )()
    max_skip_rate: float = Option(
        defaults.RUN_MAX_SKIP_RATE, "A higher skip rate after calibration is a finding, 0..1"
    )()
    drift_window: int | None = DRIFT_WINDOW()
    drift_binades: int = DRIFT_BINADES()
    replace_partial: bool = REPLACE_PARTIAL()
    config_file: Path | None = None
    recipe: tuple[str, ...] = RECIPES()
    tensorboard: str | None = TENSORBOARD()


@dataclass(frozen=True, kw_only=True)
class ShowArgs(CommandOptions):
    COMMAND: ClassVar[str] = "show"
    format: str | None = REPORT_FORMAT()
    scale: str = Option(
        "1", "Power-of-two scale (1024, 2^10) or 'recommended'", kind="scale", short="-s"
    )()
    top: int | None = Option(
        None, "Only the N rows with the highest underflow fraction", shown="all",
        bounds=AT_LEAST_1,
    )()  # fmt: skip
    kind: str = Option(
        KIND_BACKWARD,
        "backward (op outputs), grad (parameter gradients) or forward (--forward scans)",
        bounds=Bounds(choices=lambda: KINDS),
    )()
    by: str = Option(
        "module", "module, or op (module, autograd node and aten op)",
        bounds=Bounds(choices=lambda: GROUPINGS),
    )()  # fmt: skip
    steps: bool = flag(
        "The steps table instead: scale, skips, clipping, findings (fpaudit run)", default=False
    )()
    limit: int = Option(40, "With --steps: rows shown, first and last", bounds=Bounds(minimum=2))()
    origins: bool = flag(
        "The ops that made inf/NaN (scan --origins), and those predicted at --scale",
        off="",
        default=False,
    )()
    skips: bool = flag(
        "Each skipped step's origin and the run's skip verdict (fpaudit run)",
        off="",
        default=False,
    )()
    recipe: str | None = Option(
        help="Block statistics of this recipe instead (from a scan or run with that recipe), "
        "per module or op",
        shown="none: the underflow table",
    )()
    json: bool = JSON()
    config_file: Path | None = None


@dataclass(frozen=True, kw_only=True)
class RecommendArgs(CommandOptions):
    COMMAND: ClassVar[str] = "recommend"
    format: str | None = REPORT_FORMAT()
    headroom_bits: int = HEADROOM_BITS()
    include_loss: bool = INCLUDE_LOSS()
    worst_window: bool = flag(
        "Recommend from the window of steps with the smallest scale, and judge underflow there",
        off="--whole-run",
        default=False,
    )()
    drift_window: int | None = DRIFT_WINDOW()
    drift_binades: int = DRIFT_BINADES()
    json: bool = JSON()
    config_file: Path | None = None


@dataclass(frozen=True, kw_only=True)
class PlotArgs(CommandOptions):
    COMMAND: ClassVar[str] = "plot"
    output: str | None = Option(
        help="The image to write: FILE.png or FILE.svg (required)", short="-o", path=True
    )()
    format: str | None = REPORT_FORMAT()
    scale: str = Option(
        "recommended", "Power-of-two scale (4096, 2^12) or 'recommended'", kind="scale",
        short="-s",
    )()  # fmt: skip
    headroom_bits: int = HEADROOM_BITS()
    recipe: tuple[str, ...] = RECIPES()
    config_file: Path | None = None


@dataclass(frozen=True, kw_only=True)
class SimulateArgs(CommandOptions):
    COMMAND: ClassVar[str] = "simulate"
    policy: str = Option("torch", _POLICY_CHOICES, bounds=Bounds(choices=_policies))()
    format: str | None = REPORT_FORMAT()
    # the loss-scaler settings: unset, the policy's own
    init_scale: str | None = Option(
        None, "Initial scale, e.g. 65536 or 2^16", kind="scale",
        shown="the policy's; torch: the run's",
    )()  # fmt: skip
    growth_factor: float | None = Option(None, "Scale multiplier on growth", shown=_POLICYS)()
    backoff_factor: float | None = Option(None, "Scale multiplier on overflow", shown=_POLICYS)()
    growth_interval: int | None = Option(None, "Clean steps before a growth", shown=_POLICYS)()
    hysteresis: int | None = Option(
        None, "Overflows tolerated before backing off", shown=_POLICYS
    )()
    min_scale: str | None = Option(None, "Floor of the scale", kind="scale", shown=_POLICYS)()
    max_scale: str | None = Option(None, "Cap of the scale", kind="scale", shown=_POLICYS)()
    static_scale: str | None = Option(
        None, "The static scale to compare with", kind="scale", shown="the recommended one"
    )()
    headroom_bits: int = HEADROOM_BITS()
    # FP8 delayed scaling: fpaudit.rules.delayed reads its defaults from these
    amax_history_len: int = Option(
        defaults.DELAYED_HISTORY_LENGTH, "FP8 delayed scaling: amax history length H"
    )()
    margin: int = Option(defaults.DELAYED_MARGIN, "FP8 delayed scaling: margin in binades")()
    amax_compute_algo: str = Option(
        defaults.DELAYED_AMAX_COMPUTE_ALGO, "FP8 delayed scaling: max or most_recent"
    )()
    sweep: bool = flag(
        "FP8 delayed scaling: replay H in 1..1024 x margin 0..2, recommend",
        off="",
        default=False,
    )()
    max_overflow_steps: int = Option(0, "--sweep's gate: overflow steps allowed")()
    json: bool = JSON()
    config_file: Path | None = None


@dataclass(frozen=True, kw_only=True)
class GateArgs(CommandOptions):
    COMMAND: ClassVar[str] = "gate"
    max_underflow: float | None = Option(
        help="Largest acceptable underflow fraction, 0..1 (required unless --baseline)",
        bounds=FRACTION,
    )()
    baseline: str | None = Option(
        help="A report to gate against (what main measured): fail on a rise of underflow "
        "over it at the same scale (with --max-increase)",
        path=True,
        shown="none",
    )()
    max_increase: float | None = Option(
        help="With --baseline: largest acceptable rise of the underflow fraction over the "
        "baseline's, absolute, 0..1 (required with --baseline)",
        bounds=FRACTION,
    )()
    format: str | None = REPORT_FORMAT()
    scale: str | None = Option(
        None, "Power-of-two scale to judge (4096, 2^12), or 'recommended' (the report's), "
        "'baseline' (the baseline's recommended), 'trained' (a run's own scales)", kind="scale",
        shown="the baseline's recommended one with --baseline, a run's own scales for a "
        "`fpaudit run` report, else the recommended one",
        short="-s",
    )()  # fmt: skip
    per_module: bool = flag(
        "Apply the limit to every module, not just overall", off="--overall", default=False
    )()
    headroom_bits: int = HEADROOM_BITS()
    include_loss: bool = INCLUDE_LOSS()
    allow_incomplete: bool = flag(
        "Judge a report whose run was interrupted instead of failing it",
        off="--require-complete",
        default=False,
    )()
    allow_nonfinite: bool = flag(
        "Judge a report whose backward values or loss hold inf/NaN instead of failing it",
        off="--require-finite",
        default=False,
    )()
    fail_unscalable: bool = flag(
        "Also fail on values that do not scale with the loss and underflow or overflow at "
        "every scale (shown apart; no loss scale fixes them)",
        off="--ignore-unscalable",
        default=False,
    )()
    allow_errors: bool = flag(
        "Judge a run report with error findings (fpaudit run's misuse rules) instead of failing it",
        off="--require-no-errors",
        default=False,
    )()
    junit: str | None = Option(
        help="Also write the verdict as JUnit XML: one test case per module",
        path=True,
        shown="none",
    )()
    recipe: str | None = Option(
        help="Judge this block-scaled recipe's statistics with --max-flush", shown="none"
    )()
    max_flush: float | None = Option(
        help="With --recipe: largest flushed fraction, 0..1 (required with --recipe)"
    )()
    max_saturate: float = Option(0.0, "With --recipe: largest saturated fraction")()
    json: bool = JSON()
    config_file: Path | None = None


@dataclass(frozen=True, kw_only=True)
class DiffArgs(CommandOptions):  # no config file
    COMMAND: ClassVar[str] = "diff"
    format: str | None = Option(
        None, FORMAT_NAMES, kind="format",
        shown="NEW's first that BASE has too", short="-f",
    )()  # fmt: skip
    scale: str | None = Option(
        None, "Power-of-two scale both are read at (4096, 2^12), or a recommended one: "
        "'base' (or 'recommended'), 'new'",
        kind="scale", shown="BASE's recommended one", short="-s",
    )()  # fmt: skip
    by: str = Option(
        "module", "module, or op (module, autograd node and aten op)",
        bounds=Bounds(choices=lambda: GROUPINGS),
    )()  # fmt: skip
    sort: str = Option(
        "underflow",
        "underflow (its increase), overflow (its increase), amax (its largest move) or order "
        "(the model's)",
        bounds=Bounds(choices=_diff_sorts),
    )()
    headroom_bits: int | None = Option(
        None, "Binades kept free below the format's max, for each recommended scale",
        shown="each report's own", bounds=Bounds(minimum=0, maximum=MAX_HEADROOM_BITS),
    )()  # fmt: skip
    include_loss: bool = flag("Let the loss seed and <loss> ops count", default=False)()
    recipe: str | None = Option(
        help="Diff this block-scaled recipe's flushed and saturated fractions per module "
        "instead (both reports scanned with it)",
        shown="none: the underflow table",
    )()
    json: bool = JSON()


@dataclass(frozen=True, kw_only=True)
class PlanArgs(CommandOptions):
    COMMAND: ClassVar[str] = "plan"
    recipe: tuple[str, ...] = RECIPES()
    max_flush: float | None = Option(
        help="Largest acceptable flushed fraction per module, 0..1; no default fits every "
        "model, as with gate's --max-underflow: 0.01 is a common start (required)"
    )()
    max_saturate: float = Option(0.0, "Largest saturated fraction per module")()
    names: bool = flag(
        "Print only the modules that must stay in bf16, one a line",
        off="--table",
        default=False,
    )()
    json: bool = JSON()
    config_file: Path | None = None


@dataclass(frozen=True, kw_only=True)
class VerifyArgs(CommandOptions):  # no config file
    COMMAND: ClassVar[str] = "verify"
    scale: str | None = Option(
        help="Power-of-two loss scale for the mixed step (1024, 2^10) (required)",
        kind="scale",
        short="-s",
    )()
    amp: str = Option("fp16", "fp16 or bf16")()
    clip_norm: float | None = Option(None, "Clip unscaled gradients to this total norm")()
    device: str = DEVICE()
    seed: int = SEED()
    json: bool = JSON()


@dataclass(frozen=True, kw_only=True)
class Fp16PlanArgs(CommandOptions):  # no config file
    COMMAND: ClassVar[str] = "fp16-plan"
    steps: int = Option(defaults.FP16_PLAN_STEPS, "fp32 steps to scan", bounds=AT_LEAST_1)()
    headroom_bits: int = Option(
        defaults.FP16_PLAN_HEADROOM_BITS, "Keep amax * S at most 65504 / 2^H"
    )()
    max_underflow: float = Option(
        defaults.FP16_PLAN_MAX_UNDERFLOW, "Largest backward underflow fraction at S"
    )()
    device: str = DEVICE()
    seed: int = SEED()
    json: bool = JSON()


@dataclass(frozen=True, kw_only=True)
class ExportArgs(CommandOptions):  # no config file
    COMMAND: ClassVar[str] = "export"
    tensorboard: str | None = Option(
        help="Write TensorBoard event files to DIR (required)", path=True
    )()
    format: str | None = REPORT_FORMAT()
    top: int = Option(
        defaults.METRICS_TOP, "Modules with a series of their own: the N losing the most",
        bounds=AT_LEAST_1,
    )()  # fmt: skip


# Every command's options class, in the order the classes stand above (Python keeps a
# class's subclasses in definition order): no list to keep in step with them.
COMMAND_ARGS: tuple[type[CommandOptions], ...] = tuple(CommandOptions.__subclasses__())
# The commands a config file may have a table for: those whose class has --config's
# field, in the same order (the order the config file's messages list them).
CONFIG_COMMANDS: tuple[str, ...] = tuple(
    args.COMMAND for args in COMMAND_ARGS if CONFIG_FIELD in args.option_names()
)


def _merged(each: list[Spec]) -> tuple[Spec, ...]:
    """One spec per option and meaning: the commands' own specs, those that agree in
    everything but the command joined, in the order they first appear."""
    joined: dict[Spec, list[str]] = {}
    for one in each:
        key = dataclasses.replace(one, commands=())
        joined.setdefault(key, []).extend(one.commands)
    return tuple(dataclasses.replace(key, commands=tuple(c)) for key, c in joined.items())


SPECS: tuple[Spec, ...] = _merged([s for args in COMMAND_ARGS for s in args.specs()])


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


def help_text(command: str, name: str) -> str:
    """``command``'s help for ``name``, ending in its ``[default: X]``."""
    return spec(command, name).help_text()
