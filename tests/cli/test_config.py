"""The TOML config reader, called directly."""

from __future__ import annotations

from pathlib import Path

import pytest

from fpaudit.cli import config
from fpaudit.errors import ConfigError


def _toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "fpaudit.toml"
    path.write_text(text)
    return path


def test_a_top_level_key_goes_to_the_commands_whose_kind_it_suits(tmp_path: Path) -> None:
    # `steps` is scan's step count (an integer) and show's --steps flag (a bool)
    path = _toml(tmp_path, "steps = 2\n")
    assert config.options_for("scan", path) == {"steps": 2}
    assert config.options_for("show", path) == {}
    flag = _toml(tmp_path, "steps = true\n")
    assert config.options_for("show", flag) == {"steps": True}
    assert config.options_for("scan", flag) == {}


def test_a_top_level_key_that_suits_no_command_names_every_meaning(tmp_path: Path) -> None:
    path = _toml(tmp_path, 'steps = "x"\n')
    with pytest.raises(ConfigError) as caught:
        config.load(path)
    assert str(caught.value) == (
        f"{path}: steps must be an integer (for scan); or true or false (for show), got 'x'"
    )


def test_a_key_of_one_kind_keeps_its_own_message(tmp_path: Path) -> None:
    path = _toml(tmp_path, 'seed = "x"\n')
    with pytest.raises(ConfigError, match=r"seed must be an integer, got 'x'$"):
        config.load(path)


def test_the_unknown_key_message_lists_every_table(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        config.load(_toml(tmp_path, "bogus = 1\n"))
    for command in config.COMMAND_OPTIONS:
        assert f"[{command}]" in str(caught.value)
    assert "[gate]" in str(caught.value)
