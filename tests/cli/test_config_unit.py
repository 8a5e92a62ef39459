"""fpaudit.cli.config called directly: number parsing, the TOML type checks, unknown keys,
top-level keys against command tables, and precedence within the file."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from fpaudit.cli import config
from fpaudit.errors import ConfigError, OptionError, UsageError
from fpaudit.numerics import limits


def _toml(tmp_path: Path, text: str | bytes) -> Path:
    path = tmp_path / "fpaudit.toml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


# -- parse_number / parse_scale ----------------------------------------------


@pytest.mark.parametrize(
    ("text", "value"),
    [("65536", 65536.0), ("1e4", 1e4), ("2^16", 65536.0), ("2**-3", 0.125), (" 2 ^ 0 ", 1.0)],
)
def test_parse_number_reads_plain_and_power_forms(text: str, value: float) -> None:
    assert config.parse_number(text, "--x") == value


def test_parse_number_reaches_the_smallest_subnormal_and_no_further() -> None:
    assert config.parse_number("2^-1074", "--x") == math.ldexp(1.0, -1074) > 0
    with pytest.raises(UsageError, match=r"^--x 2\^-1075 is out of range$"):
        config.parse_number("2^-1075", "--x")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("abc", r"^--x 'abc' is not a number; use e.g. 65536 or 2\^16$"),
        ("0", r"^--x must be a positive number, got 0$"),
        ("-3", r"^--x must be a positive number, got -3$"),
        ("inf", r"^--x must be a positive number, got inf$"),
        ("nan", r"^--x must be a positive number, got nan$"),
    ],
)
def test_parse_number_names_the_culprit(text: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        config.parse_number(text, "--x")


@pytest.mark.parametrize(
    ("text", "log2", "scale"),
    [
        ("1024", 10, 1024.0),
        ("0.5", -1, 0.5),
        ("2^10", 10, 1024.0),
        ("2**-3", -3, 0.125),
        ("1", 0, 1.0),
    ],
)
def test_parse_scale_returns_the_exponent_of_a_power_of_two(
    text: str, log2: int, scale: float
) -> None:
    assert config.parse_scale(text) == log2
    assert math.ldexp(1.0, log2) == scale


def test_parse_scale_names_the_nearest_powers_of_two() -> None:
    # The library names its parameter (scale); the CLI prints the flag (--scale).
    with pytest.raises(
        OptionError,
        match=r"^scale 1e3 is not a power of two; the nearest are 512 \(2\^9\) and "
        r"1024 \(2\^10\)$",
    ) as caught:
        config.parse_scale("1e3")
    assert caught.value.as_flag() == (
        "--scale 1e3 is not a power of two; the nearest are 512 (2^9) and 1024 (2^10)"
    )


def test_parse_scale_keeps_to_normal_fp32_scales() -> None:
    assert config.parse_scale(f"2^{limits.LOG2_SCALE_MIN}") == limits.LOG2_SCALE_MIN
    assert config.parse_scale(f"2^{limits.LOG2_SCALE_MAX}") == limits.LOG2_SCALE_MAX
    # the smallest normal fp32 number, as torch sees it
    import torch

    assert math.ldexp(1.0, limits.LOG2_SCALE_MIN) == torch.finfo(torch.float32).tiny
    assert math.ldexp(1.0, limits.LOG2_SCALE_MAX) * 2 > torch.finfo(torch.float32).max
    for outside in (limits.LOG2_SCALE_MIN - 1, limits.LOG2_SCALE_MAX + 1):
        with pytest.raises(OptionError, match=rf"^loss_scale 2\^{outside} is outside the range"):
            config.parse_scale(f"2^{outside}", "loss_scale")
        assert caught_flag(f"2^{outside}", "loss_scale").startswith(
            f"--loss-scale 2^{outside} is outside the range of an fp32 scale"
        )


def test_parse_scale_rejects_what_is_not_a_positive_number() -> None:
    with pytest.raises(OptionError, match=r"^scale 'big' is not a number; use e.g. 1024"):
        config.parse_scale("big")
    with pytest.raises(OptionError, match=r"^scale must be a positive number, got -2$"):
        config.parse_scale("-2")
    assert caught_flag("big") == "--scale 'big' is not a number; use e.g. 1024 or 2^10"
    assert caught_flag("-2") == "--scale must be a positive number, got -2"


def caught_flag(text: str, what: str = "scale") -> str:
    """What the CLI prints for ``parse_scale(text, what)``'s error."""
    with pytest.raises(OptionError) as caught:
        config.parse_scale(text, what)
    return caught.value.as_flag()


# -- load: the file itself ---------------------------------------------------


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match=rf"^config file {path} does not exist$"):
        config.load(path)


def test_invalid_toml_is_named(tmp_path: Path) -> None:
    path = _toml(tmp_path, "steps = = 2\n")
    with pytest.raises(ConfigError, match=rf"^{path}: invalid TOML: "):
        config.load(path)


def test_a_file_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    path = _toml(tmp_path, b"steps = 2\n\xff\xfe\n")
    with pytest.raises(ConfigError, match=rf"^cannot read config file {path}: "):
        config.load(path)


def test_no_file_sets_nothing() -> None:
    assert config.options_for("scan", None) == {}


# -- load: keys and types ------------------------------------------------------


def test_dashes_and_underscores_name_the_same_option(tmp_path: Path) -> None:
    path = _toml(tmp_path, "headroom-bits = 3\n[run]\nmax-backoffs = 7\n")
    assert config.load(path) == {"headroom_bits": 3, "run": {"max_backoffs": 7}}
    assert config.options_for("run", path) == {"headroom_bits": 3, "max_backoffs": 7}


def test_a_command_table_wins_over_the_top_level(tmp_path: Path) -> None:
    path = _toml(tmp_path, "headroom_bits = 3\n[scan]\nheadroom_bits = 6\n")
    assert config.options_for("scan", path) == {"headroom_bits": 6}
    assert config.options_for("plot", path) == {"headroom_bits": 3}


def test_a_top_level_key_another_command_does_not_take_is_left_out(tmp_path: Path) -> None:
    path = _toml(tmp_path, "max_backoffs = 2\nseed = 1\n")
    assert config.options_for("run", path) == {"max_backoffs": 2}
    assert config.options_for("scan", path) == {"seed": 1}
    assert config.options_for("show", path) == {}


def test_an_unknown_key_in_a_table_lists_that_tables_keys(tmp_path: Path) -> None:
    path = _toml(tmp_path, "[plan]\nbogus = 1\n")
    known = ", ".join(sorted(config.COMMAND_OPTIONS["plan"]))
    with pytest.raises(ConfigError) as caught:
        config.load(path)
    assert str(caught.value) == f"{path}: unknown key 'bogus' in [plan]; known: {known}"


def test_an_unknown_table_is_an_unknown_key(tmp_path: Path) -> None:
    path = _toml(tmp_path, "[scna]\nsteps = 1\n")
    with pytest.raises(ConfigError, match=rf"^{path}: unknown key 'scna'; known: "):
        config.load(path)


def test_a_typo_in_a_table_other_commands_use_is_still_caught(tmp_path: Path) -> None:
    # load checks every table, not only the one the running command reads
    path = _toml(tmp_path, "[gate]\nmax_underflow = 0.1\n[plot]\noutptu = 'x.png'\n")
    with pytest.raises(ConfigError, match=r"unknown key 'outptu' in \[plot\]"):
        config.options_for("gate", path)


@pytest.mark.parametrize(
    ("table", "line", "expected"),
    [
        ("scan", "steps = true", "[scan] steps must be an integer, got True"),
        ("scan", "steps = 1.5", "[scan] steps must be an integer, got 1.5"),
        ("run", "max_skip_rate = true", "[run] max_skip_rate must be a number, got True"),
        ("run", 'max_skip_rate = "0.1"', "[run] max_skip_rate must be a number, got '0.1'"),
        ("scan", "force = 1", "[scan] force must be true or false, got 1"),
        ("scan", "device = 0", "[scan] device must be a string, got 0"),
        (
            "show",
            "scale = true",
            '[show] scale must be a number or a string such as "2^12", got True',
        ),
        ("scan", "recipe = [1]", "[scan] recipe must be a recipe name or a list of them, got [1]"),
        ("run", "module = 3", "[run] module must be a glob pattern or a list of them, got 3"),
        ("scan", "format = []", "[scan] format must be a format name or a list of them, got []"),
        ("show", "format = 16", "[show] format must be a format name or a list of them, got 16"),
    ],
)
def test_each_kind_rejects_a_value_of_the_wrong_type(
    tmp_path: Path, table: str, line: str, expected: str
) -> None:
    path = _toml(tmp_path, f"[{table}]\n{line}\n")
    with pytest.raises(ConfigError) as caught:
        config.load(path)
    assert str(caught.value) == f"{path}: {expected}"


def test_values_are_normalised_to_what_the_commands_take(tmp_path: Path) -> None:
    path = _toml(
        tmp_path,
        "[run]\nmax_skip_rate = 1\nmodule = 'encoder.*'\n"
        "[scan]\nformat = 'bf16'\nloss_scale = 1024\nrecipe = 'mxfp4'\n"
        "[show]\nscale = 0.5\n",
    )
    run = config.options_for("run", path)
    assert run == {"max_skip_rate": 1.0, "module": ["encoder.*"]}
    assert isinstance(run["max_skip_rate"], float)
    assert config.options_for("scan", path) == {
        "format": ["bf16"],
        "loss_scale": "1024",
        "recipe": ["mxfp4"],
    }
    assert config.options_for("show", path) == {"scale": "0.5"}


def test_a_single_format_command_takes_the_first_of_a_list(tmp_path: Path) -> None:
    path = _toml(tmp_path, "format = ['bf16', 'fp16']\n")
    assert config.options_for("scan", path) == {"format": ["bf16", "fp16"]}
    for command in ("run", "show", "recommend", "plot", "simulate", "gate"):
        assert config.options_for(command, path) == {"format": "bf16"}


def test_a_table_value_is_not_a_top_level_key(tmp_path: Path) -> None:
    # a command name at the top level must be a table
    path = _toml(tmp_path, "scan = 3\n")
    with pytest.raises(ConfigError, match=r"unknown key 'scan'"):
        config.load(path)


# -- library errors name parameters; the CLI names flags ---------------------


def test_library_option_errors_name_the_parameter_and_the_cli_the_flag() -> None:
    from fpaudit.errors import OptionError
    from fpaudit.run.scan import ScanOptions
    from fpaudit.run.training import RunOptions

    with pytest.raises(OptionError) as caught:
        ScanOptions(steps=0)
    assert str(caught.value) == "steps must be at least 1, got 0"
    assert caught.value.as_flag() == "--steps must be at least 1, got 0"
    with pytest.raises(OptionError) as caught:
        RunOptions(max_skip_rate=2.0)
    assert str(caught.value) == "max_skip_rate must be between 0 and 1, got 2.0"
    assert caught.value.as_flag() == "--max-skip-rate must be between 0 and 1, got 2.0"
