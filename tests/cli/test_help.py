"""`--help` helps: every default shown, readable types, one example, and the
scan page's excerpt (docs/commands/scan.md) is what `fpaudit scan --help` prints."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import typer

from fpaudit.cli import config
from fpaudit.cli.commands import app

from ..conftest import ROOT

COMMANDS = sorted(typer.main.get_command(app).commands)  # type: ignore[attr-defined]
# Options with no default to show: given or not (None means "not given"), or required.
# Every option shows its default, a flag too (the switch that is on unless given);
# only a required option has none.
REQUIRED = {("plot", "--output"), ("verify", "--scale"), ("export", "--tensorboard")}
# Required only in one mode of a command (gate --recipe, gate --baseline), or checked by the
# command itself.
REQUIRED_WHEN = {
    ("gate", "--max-flush"),
    ("plan", "--max-flush"),
    ("gate", "--max-underflow"),
    ("gate", "--max-increase"),
}


def _help(cli, monkeypatch: pytest.MonkeyPatch, *args: str) -> str:
    monkeypatch.setenv("COLUMNS", "100")
    result = cli(*args, "--help")
    assert result.code == 0, result.stderr
    return "\n".join(line.rstrip() for line in result.stdout.splitlines()).strip("\n")


def _rows(text: str) -> dict[str, str]:
    """Each option's row (its wrapped continuation lines joined), by long flag."""
    rows: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        inner = line.strip("│ ").strip()
        flag = re.match(r"│ (?:\* +)?(--[a-z-]+)", line)  # a row starts at the box's edge
        if flag:
            current = flag.group(1)
            rows[current] = inner
        elif current and line.startswith("│") and inner:
            rows[current] += " " + inner
        elif not line.startswith("│"):
            current = None
    return rows


@pytest.mark.parametrize("name", COMMANDS)
def test_every_option_shows_its_default_and_a_readable_type(
    cli, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    text = _help(cli, monkeypatch, name)
    assert "<" not in re.sub(r"<loss>", "", text) and "{" not in text  # no <int>, {model_file}
    assert " ." not in text and "[default]" not in text and "(default" not in text
    assert f"Example: fpaudit {name}" in text
    command = typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]
    rows = _rows(text)
    for param in command.params:
        flags = [o for o in param.opts if o.startswith("--")]
        if param.param_type_name == "argument" or not flags:
            continue
        row = re.sub(r"\s+", " ", rows[flags[0]])
        if getattr(param, "is_flag", False):
            assert re.match(r"--[a-z-]+ (-[a-z] )?(--[a-z-]+ )?[A-Z(]", row), row  # no type
            off = [o for o in param.secondary_opts if o.startswith("--")]
            assert row.endswith(f"[default: {off[0] if off else 'off'}]"), f"{name}: {row}"
            continue
        assert re.search(r" (INTEGER|NUMBER|TEXT|PATH)(\.\.\.)? ", row), row
        if (name, flags[0]) in REQUIRED:
            assert "(required)" in row, row
        elif (name, flags[0]) in REQUIRED_WHEN:
            assert re.search(r"\(required( (with|unless) --[a-z-]+)?\)", row), row
        else:
            assert re.search(r"\[default: [^\]]+\]", row), f"{name} {flags[0]}: {row}"


def test_report_readers_say_run_reports_work_too(cli, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("show", "recommend", "gate", "simulate", "plot"):
        text = re.sub(r"[│\s]+", " ", _help(cli, monkeypatch, name))
        assert "written by `fpaudit scan` or `fpaudit run`" in text, name


def test_the_docs_excerpt_is_what_scan_help_prints(cli, monkeypatch: pytest.MonkeyPatch) -> None:
    page = (ROOT / "docs" / "commands" / "scan.md").read_text()
    match = re.search(r"```text\n\$ fpaudit scan --help\n(.*?)\n```", page, re.S)
    assert match, "docs/commands/scan.md has no `$ fpaudit scan --help` excerpt"
    assert match.group(1) == _help(cli, monkeypatch, "scan")
    assert "[default: 10]" in match.group(1)


def test_help_toml_and_library_defaults_come_from_one_declaration(
    cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each declared default is shown by every command that takes it, is the library
    option object's default, and each declared option is in the TOML schema."""
    from fpaudit.cli import config, options
    from fpaudit.run.scan import ScanOptions
    from fpaudit.run.training import RunOptions

    library = {"scan": ScanOptions(), "run": RunOptions()}
    fields = {name: {f.name for f in dataclasses.fields(o)} for name, o in library.items()}
    in_library: set[tuple[str, str]] = set()
    group = typer.main.get_command(app)
    checked = 0
    for spec in options.SPECS:
        for command in spec.commands:
            if command in config.COMMAND_OPTIONS:
                assert config.COMMAND_OPTIONS[command][spec.name] == spec.kind
            if not spec.has_default and not spec.help:
                continue
            assert command in group.commands, command  # type: ignore[attr-defined]
            row = re.sub(r"\s+", " ", _rows(_help(cli, monkeypatch, command))[spec.flag])
            if spec.kind == "bool":  # a flag: off unless given, its help says what it turns on
                assert not spec.value_default, (command, spec)
                assert row.endswith(f"{spec.help}. [default: {spec.off_switch or 'off'}]"), row
                checked += 1
                continue
            if not spec.has_default and not spec.shown:  # required: the row says so
                assert row.endswith(f"{spec.help}.") and "required" in spec.help, row
                continue
            shown = spec.shown or (
                "none"
                if spec.default is None
                else str(int(spec.default))
                if isinstance(spec.default, float) and spec.default.is_integer()
                else str(spec.default)
            )
            # as _readable_help renders "HELP [default: X]." so that rich keeps the default
            assert row.endswith(f"{spec.help}. [default: {shown}]"), row
            if spec.name in fields.get(command, ()):
                # a scale is declared as the flag spells it ("1"); the library holds 2**k
                value = (
                    math.ldexp(1.0, config.parse_scale(spec.default))
                    if spec.kind == "scale"
                    else spec.default
                )
                assert getattr(library[command], spec.name) == value, (command, spec)
                in_library.add((command, spec.name))
            checked += 1
    assert checked >= 60
    # the library reads its defaults from the declarations; pinned by hand here:
    # TE's DelayedScaling defaults amax_history_len=1024, margin=0
    from fpaudit.report import records
    from fpaudit.rules import delayed, drift
    from fpaudit.run import fp16plan

    assert (drift.DEFAULT_DRIFT_BINADES, delayed.DEFAULT_HISTORY_LENGTH) == (2, 1024)
    assert delayed.DEFAULT_MARGIN == 0 and delayed.Settings("te-delayed").margin == 0
    assert (fp16plan.DEFAULT_STEPS, fp16plan.DEFAULT_HEADROOM_BITS) == (4, 1)
    assert fp16plan.DEFAULT_MAX_UNDERFLOW == 0.001
    assert options.default("show", "kind") == records.KIND_BACKWARD
    assert in_library >= {
        ("scan", "steps"), ("scan", "device"), ("scan", "seed"), ("scan", "every"),
        ("scan", "window"), ("run", "max_steps"), ("run", "capture_every"), ("run", "window"),
        ("run", "max_backoffs"), ("run", "max_skip_rate"),
    }  # fmt: skip
    # and no TOML option is declared outside the specs
    declared = {(c, s.name) for s in options.SPECS for c in s.commands}
    for command, names in config.COMMAND_OPTIONS.items():
        for name in names:
            assert (command, name) in declared


@pytest.mark.parametrize(
    "command", ["show", "recommend", "simulate", "plot", "gate", "plan", "scan", "run"]
)
def test_every_option_of_a_config_command_takes_its_help_and_default_from_its_spec(
    command: str,
) -> None:
    """No option of a command a config file may set restates its help or default: each
    flag's help is its spec's, and the command starts from the specs' defaults."""
    from fpaudit.cli import options

    click_command = typer.main.get_command(app).commands[command]  # type: ignore[attr-defined]
    seen = set()
    for param in click_command.params:
        if param.param_type_name != "option" or param.name in ("config_file", "help"):
            continue
        spec = options.spec(command, param.name)
        assert spec.help, (command, param.name)  # every flag's wording is declared
        assert param.help == spec.help_text(), (command, param.name)
        seen.add(param.name)
    assert seen == set(config.COMMAND_OPTIONS[command]), command
