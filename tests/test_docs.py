"""The README is the manual: every command and flag is in it, every help text has an example."""

from __future__ import annotations

import re

import pytest
import typer

from fpaudit.cli.commands import app

from .conftest import ROOT

README = (ROOT / "README.md").read_text()
COMMANDS = typer.main.get_command(app).commands  # type: ignore[attr-defined]


def _section(name: str) -> str:
    match = re.search(rf"^### `fpaudit {name}.*?(?=^### |^## )", README, re.M | re.S)
    assert match, f"README has no '### `fpaudit {name}`' section"
    return match.group(0)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_has_a_readme_section_listing_its_flags(name: str) -> None:
    section = _section(name)
    for param in COMMANDS[name].params:
        long_flags = [o for o in getattr(param, "opts", []) if o.startswith("--")]
        if name in ("show", "recommend", "gate") and long_flags == ["--config"]:
            continue  # documented once, under "Config files"
        for flag in long_flags:
            assert flag in section, f"{flag} of `fpaudit {name}` is not in its README section"


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_help_text_has_an_example(name: str) -> None:
    assert f"Example: fpaudit {name}" in (COMMANDS[name].help or "")


def test_readme_documents_the_two_quick_start_commands_and_ci_runs_the_test_one() -> None:
    assert "make demo" in README and "make test" in README
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_changelog_mentions_every_command() -> None:
    changelog = (ROOT / "CHANGELOG.md").read_text()
    for name in COMMANDS:
        assert f"fpaudit {name}" in changelog
