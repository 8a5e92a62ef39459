"""Each command's typed options object is where its options are declared: its specs,
the flags typer shows and the TOML schema are built from its fields, in field order."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
import typer
from typer.testing import CliRunner

from fpaudit.cli import formatters, options
from fpaudit.cli.commands import app
from fpaudit.cli.common import with_options
from fpaudit.cli.options import (
    COMMAND_ARGS,
    CONFIG_FIELD,
    CommandOptions,
    GateArgs,
    RunArgs,
    ScanArgs,
    SimulateArgs,
)
from fpaudit.numerics.limits import DEFAULT_HEADROOM_BITS
from fpaudit.run.scan import ScanOptions

IDS = [args.COMMAND for args in COMMAND_ARGS]


@pytest.mark.parametrize("args", COMMAND_ARGS, ids=IDS)
def test_the_fields_are_the_commands_specs_and_start_at_their_defaults(
    args: type[CommandOptions],
) -> None:
    declared = {s.name: s for s in options.SPECS if args.COMMAND in s.commands}
    names = set(args.option_names()) - {CONFIG_FIELD}
    assert names == set(declared), args.COMMAND
    started = args()
    for name, spec in declared.items():
        expected = spec.default if spec.has_default else False if spec.kind == "bool" else None
        if spec.kind in options.LIST_KINDS and not spec.has_default:
            expected = ()
        assert getattr(started, name) == expected, (args.COMMAND, name)


@pytest.mark.parametrize("args", COMMAND_ARGS, ids=IDS)
def test_typer_shows_one_flag_per_field_in_field_order(args: type[CommandOptions]) -> None:
    command = typer.main.get_command(app).commands[args.COMMAND]  # type: ignore[attr-defined]
    shown = [p.name for p in command.params if p.param_type_name == "option"]
    assert shown == list(args.option_names())
    for param in command.params:
        if param.name in (CONFIG_FIELD, "help") or param.param_type_name != "option":
            continue
        spec = options.spec(args.COMMAND, param.name)
        assert tuple(param.opts + param.secondary_opts) == tuple(
            d for decl in spec.declarations for d in decl.split("/")
        ), (args.COMMAND, param.name)
        assert param.help == spec.help_text()


def test_the_field_is_the_one_declaration_of_default_help_and_flag() -> None:
    """10 steps: the field's default, which the spec, the help and the library all read."""
    (steps,) = [f for f in dataclasses.fields(ScanArgs) if f.name == "steps"]
    assert steps.default == 10 and ScanArgs().steps == 10
    spec = options.spec("scan", "steps")
    assert spec.default == 10 and spec.kind == "int" and spec.commands == ("scan",)
    assert spec.help_text() == "Training steps to run [default: 10]."
    assert spec.declarations == ("--steps", "-n")
    assert options.default_int("scan", "steps") == ScanOptions().steps == 10


def test_a_command_is_declared_once_and_the_app_registers_it_so() -> None:
    import inspect
    import sys

    from fpaudit.cli.commands import DECLARED

    registered = typer.main.get_command(app).commands  # type: ignore[attr-defined]
    # the help lists the commands in the order they are declared
    assert list(registered) == [command.command for command in DECLARED]
    # every options class is one command's, and nothing else lists them
    declared = [command.args for command in DECLARED if command.args is not None]
    assert sorted(a.COMMAND for a in declared) == sorted(a.COMMAND for a in COMMAND_ARGS)
    assert len(set(declared)) == len(declared) == len(COMMAND_ARGS)
    for command in DECLARED:
        parameters = inspect.signature(command.function, eval_str=True).parameters
        if command.args is None:  # formats, recipes: --json alone
            assert "options" not in parameters, command.command
            continue
        assert parameters["options"].annotation is command.args, command.command
        # --config where (and only where) a config file may set the command
        shown = {p.name for p in registered[command.command].params}
        assert (CONFIG_FIELD in shown) == command.config, command.command
        # the renderer is one the command's module draws with, itself or through the
        # formatters it picks (fpaudit.cli.formatters)
        module = sys.modules[command.function.__module__]
        drawn_with = [*vars(module).values(), *vars(formatters).values()]
        assert command.renderer in drawn_with, command.command


def test_a_renderer_of_its_own_is_named_for_its_command() -> None:
    from fpaudit.cli.commands import DECLARED

    own = {command.renderer.__name__ for command in DECLARED}
    modules = sorted(p.stem for p in (Path(options.__file__).parent).glob("render_*.py"))
    shared = {"render_blocks"}  # block statistics: recipes, and show/gate/diff/plan --recipe
    named = {f"render_{command.command.replace('-', '')}" for command in DECLARED}
    for module in set(modules) - shared:
        assert module in named and f"fpaudit.cli.{module}" in own, module


def test_the_config_tables_are_listed_in_the_classes_order() -> None:
    # the order docs/reliability.md (row 40) and every unknown-key message show them in
    assert options.CONFIG_COMMANDS == (
        "scan", "run", "show", "recommend", "plot", "simulate", "gate", "plan",
    )  # fmt: skip


def test_an_option_shared_with_one_meaning_is_one_spec_of_every_command_that_takes_it() -> None:
    (headroom,) = [s for s in options.SPECS if s.name == "headroom_bits" and "scan" in s.commands]
    assert headroom.commands == ("scan", "run", "recommend", "plot", "simulate", "gate")
    assert headroom.default == DEFAULT_HEADROOM_BITS
    # the same name with another meaning is a spec of its own: fp16-plan keeps 1 binade
    assert options.spec("fp16-plan", "headroom_bits").default == 1
    assert len({(c, s.name) for s in options.SPECS for c in s.commands}) == sum(
        len(s.commands) for s in options.SPECS
    )  # no command declares a name twice


@dataclass(frozen=True, kw_only=True)
class _NewArgs(options.CommandOptions):
    """A command with one option more than it had: the single edit adding an option is."""

    COMMAND: ClassVar[str] = "scan"
    steps: int = options.Option(10, "Training steps to run", short="-n")()
    max_grad_zeros: float | None = options.Option(None, "Fail above this zero fraction")()
    keep: bool = options.flag("Keep the report", off="--drop")()
    recipe: tuple[str, ...] = options.RECIPES()


def test_adding_a_field_is_all_an_option_needs() -> None:
    """Its spec (kind from its type), its flag and help, its start value and its
    metadata follow from the one field; typer shows it through the CLI's builder."""
    specs = {s.name: s for s in _NewArgs.specs()}
    assert specs["max_grad_zeros"].kind == "float" and specs["keep"].kind == "bool"
    assert specs["recipe"].kind == "recipes"
    assert specs["max_grad_zeros"].help_text() == "Fail above this zero fraction [default: none]."
    assert specs["keep"].declarations == ("--keep/--drop",)
    started = _NewArgs()
    assert (started.max_grad_zeros, started.keep, started.recipe) == (None, False, ())
    built = _NewArgs.build({}, {"max_grad_zeros": 0.5, "recipe": ["nvfp4"]})
    assert built.to_meta() == {"steps": 10, "max_grad_zeros": 0.5, "keep": False,
                               "recipe": ["nvfp4"]}  # fmt: skip
    assert built.flagged == {"max_grad_zeros", "recipe"}
    told: list[_NewArgs] = []
    new = typer.Typer()

    @new.command()
    @with_options(_NewArgs)
    def scan(options: _NewArgs) -> None:
        told.append(options)

    done = CliRunner().invoke(new, ["--max-grad-zeros", "0.25", "--drop"])
    assert done.exit_code == 0, done.output
    assert told[0].max_grad_zeros == 0.25 and told[0].keep is False
    assert told[0].flagged == {"max_grad_zeros", "keep"}
    params = {p.name: p for p in typer.main.get_command(new).params}
    assert params["max_grad_zeros"].help == "Fail above this zero fraction [default: none]."
    assert params["keep"].opts + params["keep"].secondary_opts == ["--keep", "--drop"]


@pytest.mark.parametrize(
    ("annotation", "declared", "why"),
    [
        ("tuple[str, ...]", options.Option(help="Globs"), "does not fit"),  # which list kind?
        ("int", options.Option(None, "Unset until the report says"), "must allow it"),
        ("int", options.Option(1, "A number", kind="scale"), "does not fit"),
        ("list[int]", options.Option(help="Numbers"), "is not one"),
    ],
)
def test_a_field_that_cannot_be_an_option_fails_where_it_is_declared(
    annotation: str, declared: options.Option, why: str
) -> None:
    namespace = {"__annotations__": {"COMMAND": "ClassVar[str]", "bad": annotation},
                 "COMMAND": "scan", "bad": declared()}  # fmt: skip
    bad = dataclass(frozen=True, kw_only=True)(type("Bad", (options.CommandOptions,), namespace))
    with pytest.raises(TypeError, match=why):
        bad.specs()


def test_build_takes_flags_over_the_config_file_and_says_what_was_given() -> None:
    built = GateArgs.build(
        {"max_underflow": 0.5, "per_module": True},  # the config file
        {"max_underflow": 0.25, "scale": None, "junit": Path("out/junit.xml")},  # flags
    )
    assert built.max_underflow == 0.25 and built.per_module is True
    assert built.scale is None  # not given: the spec's default (the recommended scale)
    assert built.junit == "out/junit.xml"  # a path flag holds the text a config file would
    assert built.given == {"max_underflow", "per_module", "junit"}
    assert built.flagged == {"max_underflow", "junit"}


def test_repeated_options_are_tuples_and_the_meta_keeps_json_lists() -> None:
    built = ScanArgs.build({"module": ["enc.*"]}, {"format": ["bf16", "fp16"]})
    assert built.module == ("enc.*",) and built.format == ("bf16", "fp16")
    meta = built.to_meta()
    assert meta["module"] == ["enc.*"] and meta["format"] == ["bf16", "fp16"]
    assert CONFIG_FIELD not in meta and "given" not in meta
    assert set(meta) == set(ScanArgs.option_names()) - {CONFIG_FIELD}


def test_the_objects_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        RunArgs().max_steps = 3  # type: ignore[misc]


def test_fp8_settings_from_a_config_file_are_given_but_not_flagged() -> None:
    built = SimulateArgs.build({"margin": 1}, {"policy": "torch"})
    assert "margin" in built.given and "margin" not in built.flagged
    assert built.margin == 1 and built.amax_history_len == 1024  # 1024: the spec's default


def test_a_flag_of_a_config_command_given_in_the_config_file_reaches_the_command(
    cli, tmp_path: Path
) -> None:
    """End to end: --config's table sets an option, a flag overrides another."""
    config_file = tmp_path / "fpaudit.toml"
    config_file.write_text('[plot]\noutput = "x.gif"\n')
    result = cli("plot", str(tmp_path / "no-report"), "--config", str(config_file))
    assert result.code == 2
    assert "x.gif" in result.stderr and "Traceback" not in result.stderr


def test_every_library_option_is_fed_from_its_commands_options() -> None:
    """A field of ScanOptions/RunOptions set on the command reaches the library: each one
    given a value other than its default comes out with that value, so adding an option
    under its library name needs no line in cli.py."""
    from fpaudit.capture.audit import Selection
    from fpaudit.cli.commands_run import library_options
    from fpaudit.run.training import RunOptions

    scan_args = ScanArgs(steps=3, device="cpu", seed=7, every=2, window=2, module=("a",),
                         exclude_module=("b",), op=("aten.mm*",), exclude_op=("aten.add*",),
                         amp="bf16", shadow=True, forward=True, origins=True,
                         recipe=("mxfp4", "nvfp4", "mxfp4"), compile=True)  # fmt: skip
    built = library_options(ScanOptions, scan_args, loss_scale=8.0)  # scan parses --loss-scale
    assert built == ScanOptions(
        steps=3, device="cpu", loss_scale=8.0, seed=7, every=2, window=2,
        selection=Selection(("a",), ("b",), ("aten.mm*",), ("aten.add*",)), amp="bf16",
        shadow=True, forward=True, origins=True, recipes=("mxfp4", "nvfp4"), compile=True,
    )  # fmt: skip
    default = ScanOptions()
    unfed = [f.name for f in dataclasses.fields(ScanOptions)
             if getattr(built, f.name) == getattr(default, f.name)]  # fmt: skip
    assert unfed == []

    run_args = RunArgs(max_steps=4, capture_every=3, window=2, module=("a",), max_backoffs=2,
                       max_skip_rate=0.5, recipe=("mxfp4",), capture_after_skip=0)  # fmt: skip
    ran = library_options(RunOptions, run_args)
    assert ran == RunOptions(max_steps=4, capture_every=3, window=2,
                             selection=Selection(modules=("a",)), max_backoffs=2,
                             max_skip_rate=0.5, recipes=("mxfp4",),
                             capture_after_skip=0)  # fmt: skip
    default_run = RunOptions()
    unfed = [f.name for f in dataclasses.fields(RunOptions)
             if getattr(ran, f.name) == getattr(default_run, f.name)]  # fmt: skip
    assert unfed == ["watch_grad_reads"]  # a library switch no command turns off


def test_every_option_spelled_otherwise_is_a_declared_flag() -> None:
    # errors.LIBRARY_NAMES words a library parameter (modules) as its flag (--module):
    # each entry must be an option some command declares, or a message names no flag.
    from fpaudit.cli.options import SPECS
    from fpaudit.errors import LIBRARY_NAMES, flag

    declared = {spec.name for spec in SPECS}
    assert set(LIBRARY_NAMES) <= declared, set(LIBRARY_NAMES) - declared
    assert flag("modules") == "--module" and flag("exclude_ops") == "--exclude-op"
    assert flag("max_steps") == "--max-steps" and flag("-o") == "-o"


def test_the_library_and_the_command_line_check_a_bound_from_one_declaration() -> None:
    """A bound is declared once, as a :class:`fpaudit.bounds.Bounds`: ``--max-underflow``'s
    CLI declaration is the object ``gate`` checks with; scan's ``--steps``, ``--every``
    and ``--window`` have none in the CLI, as ``ScanOptions`` checks them for both."""
    from fpaudit import bounds
    from fpaudit.cli import options
    from fpaudit.errors import OptionError
    from fpaudit.rules.gating import gate
    from fpaudit.run.scan import ScanOptions

    assert options.spec("scan", "steps").bounds is None  # ScanOptions checks it, once
    assert options.spec("gate", "max_underflow").bounds is bounds.FRACTION
    for name in ("steps", "every", "window"):
        with pytest.raises(OptionError) as caught:
            ScanOptions(**{name: 0})
        assert str(caught.value) == f"{name} must be at least 1, got 0"
    with pytest.raises(OptionError) as caught:
        gate(None, "fp16", max_underflow=1.5)  # type: ignore[arg-type]  # checked first
    assert str(caught.value) == "max_underflow must be a fraction between 0 and 1, got 1.5"
