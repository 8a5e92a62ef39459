"""Each command's typed options object is its specs: the same names, the defaults
derived from them, and the flags typer shows built from them, in the object's order."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import typer

from fpaudit import options
from fpaudit.cli import app
from fpaudit.command_options import (
    COMMAND_ARGS,
    CONFIG_FIELD,
    CommandOptions,
    GateArgs,
    RunArgs,
    ScanArgs,
    SimulateArgs,
)

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
    # a config command reads the rest of its options from --config; verify and fp16-plan not
    assert (CONFIG_FIELD in args.option_names()) == (args.COMMAND in options.CONFIG_COMMANDS)


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


def test_a_declared_default_change_moves_the_options_object() -> None:
    """The field default is read from the spec, not restated: 10 steps, from the spec."""
    assert options.spec("scan", "steps").default == 10
    assert ScanArgs().steps == 10
    assert [f.default for f in dataclasses.fields(ScanArgs) if f.name == "steps"] == [10]


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
