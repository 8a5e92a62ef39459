"""The docs are the manual: every command and flag is on its page in docs/commands/, every
help text has an example, every relative link resolves, and the README stays a front page."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer

from fpaudit.cli.commands import app

from ..conftest import ROOT, SAMPLES

README = ROOT / "README.md"
DOCS = ROOT / "docs"
COMMAND_PAGES = DOCS / "commands"
COMMANDS = typer.main.get_command(app).commands  # type: ignore[attr-defined]
CONFIG_PAGE = COMMAND_PAGES / "config.md"


def command_section(name: str) -> str:
    """The `### `fpaudit NAME ...`` section of docs/commands/NAME.md (to the next `##`/`###`
    heading or the end of the page): each command's reference lives on its own page."""
    page = COMMAND_PAGES / f"{name}.md"
    assert page.is_file(), f"`fpaudit {name}` has no page docs/commands/{name}.md"
    match = re.search(
        rf"^### `fpaudit {re.escape(name)}\b.*?(?=^### |^## |\Z)", page.read_text(), re.M | re.S
    )
    assert match, f"docs/commands/{name}.md has no '### `fpaudit {name}`' section"
    return match.group(0)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_has_a_docs_section_listing_its_flags(name: str) -> None:
    section = command_section(name)
    for param in COMMANDS[name].params:
        long_flags = [o for o in getattr(param, "opts", []) if o.startswith("--")]
        if name in ("show", "recommend", "gate") and long_flags == ["--config"]:
            continue  # documented once, on the config page (checked below)
        for flag in long_flags:
            assert flag in section, f"{flag} of `fpaudit {name}` is not in its docs section"


def test_config_files_are_documented_once_for_every_command_that_takes_them() -> None:
    text = CONFIG_PAGE.read_text()
    assert "### Config files" in text and "`--config FILE.toml`" in text
    match = re.search(r"\(on every command but (.*?)\)", text, re.S)
    assert match, "the config page does not say which commands take --config"
    for name, command in COMMANDS.items():
        takes = any("--config" in getattr(p, "opts", []) for p in command.params)
        assert takes == (f"`{name}`" not in match.group(1)), name
        assert takes == (f"`[{name}]`" in text), f"[{name}] table"


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_help_text_has_an_example(name: str) -> None:
    assert f"Example: fpaudit {name}" in (COMMANDS[name].help or "")


def test_the_readme_links_every_command_page() -> None:
    readme = README.read_text()
    for name in COMMANDS:
        assert f"(docs/commands/{name}.md)" in readme, name
    pages = {p.stem for p in COMMAND_PAGES.glob("*.md")}
    assert pages == {*COMMANDS, "config"}, "a page in docs/commands/ names no command"


def test_the_readme_is_a_front_page() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 400, f"README.md has {len(lines)} lines; the reference goes in docs/"
    for phrase in ("this round", "before this", "previous round"):
        assert phrase not in README.read_text().lower(), phrase


def test_readme_documents_the_two_quick_start_commands_and_ci_runs_the_test_one() -> None:
    readme = README.read_text()
    assert "make demo" in readme and "make test" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_changelog_mentions_every_command() -> None:
    changelog = (ROOT / "CHANGELOG.md").read_text()
    for name in COMMANDS:
        assert f"fpaudit {name}" in changelog


# -- links ------------------------------------------------------------------------------------

MANUAL = [README, *sorted(DOCS.rglob("*.md")), *sorted((ROOT / "benchmarks").rglob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCED = re.compile(r"^```.*?^```", re.M | re.S)  # a code block, fences included


def _without_code(text: str) -> str:
    return re.sub(r"`[^`\n]*`", "", FENCED.sub("", text))


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but `-` and `_` dropped,
    spaces to `-`, a repeated anchor numbered."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} (.+)$", FENCED.sub("", page.read_text()), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def test_anchor_slugs_follow_github() -> None:
    page = COMMAND_PAGES / "scan.md"
    assert "fpaudit-scan-modelpy" in anchors(page)  # "### `fpaudit scan MODEL.py`"


@pytest.mark.parametrize("page", MANUAL, ids=[str(p.relative_to(ROOT)) for p in MANUAL])
def test_every_relative_link_resolves(page: Path) -> None:
    for target in LINK.findall(_without_code(page.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        assert resolved.exists(), f"{page.relative_to(ROOT)}: {target} points to nothing"
        assert ROOT in resolved.parents or resolved == ROOT, target
        if anchor:
            assert resolved.suffix == ".md", target
            assert anchor in anchors(resolved), f"{page.relative_to(ROOT)}: no #{anchor} in {path}"


# -- quoted output ----------------------------------------------------------------------------


def transcripts(page: Path) -> Iterator[tuple[list[str], str]]:
    """Each `$ fpaudit ...` line of the page's console blocks, with the lines it printed."""
    for block in re.findall(r"^```console\n(.*?)\n```", page.read_text(), re.M | re.S):
        for part in re.split(r"^\$ ", block, flags=re.M)[1:]:
            command, _, output = part.replace("\\\n", " ").partition("\n")  # \ continues
            yield shlex.split(command), output.rstrip("\n")


# The CPU's own vector width (AVX2, AVX-512, AMX) and thread count change the last bits of
# float reductions, and so a few values near a binade edge; the README's numbers are measured
# with torch's portable kernels, one thread and MKL's reproducible mode, the same on any x86.
PORTABLE_NUMERICS = {
    "ATEN_CPU_CAPABILITY": "default",
    "MKL_CBWR": "COMPATIBLE",
    "ONEDNN_MAX_CPU_ISA": "SSE41",
    "OMP_NUM_THREADS": "1",
}


@pytest.mark.slow
def test_the_worked_example_is_what_fpaudit_prints(cli, tmp_path: Path, monkeypatch) -> None:
    """The README's worked example (`make demo`'s scan of the sample transformer) and the
    command pages that quote the same report print exactly what they quote, the scan run
    under PORTABLE_NUMERICS (a process of its own: torch reads them when it loads)."""
    monkeypatch.chdir(tmp_path)
    env = {**os.environ, **PORTABLE_NUMERICS, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "fpaudit", "scan", str(SAMPLES / "transformer.py")]
    scan = subprocess.run([*command, "--steps", "4"], env=env, capture_output=True, text=True)
    assert scan.returncode == 0, scan.stderr
    quoted = re.search(r"^```text\n(Scanned 4 step\(s\).*?)\n```", README.read_text(), re.M | re.S)
    assert quoted, "README.md quotes no scan output"
    assert scan.stdout.rstrip("\n") == quoted.group(1)
    checked = []
    for page in (README, *(COMMAND_PAGES / f"{name}.md" for name in ("gate", "show", "export"))):
        for args, output in transcripts(page):
            if args[:1] == ["fpaudit"] and args[2:3] == ["fpaudit-report"]:
                done = cli(*args[1:])
                assert done.stdout.rstrip("\n") == output, (page.name, args)
                checked.append((page.name, args[1]))
    assert sorted(set(checked)) == [
        ("README.md", "gate"), ("export.md", "export"), ("gate.md", "gate"), ("show.md", "show")
    ]  # fmt: skip


def test_the_verify_page_quotes_what_fpaudit_prints(cli, monkeypatch) -> None:
    monkeypatch.chdir(ROOT)  # the page's paths are relative to the repository
    quoted = [t for t in transcripts(COMMAND_PAGES / "verify.md") if "|" not in t[0]]
    assert [args[1] for args, _ in quoted] == ["verify"]
    for args, output in quoted:
        assert cli(*args[1:]).stdout.rstrip("\n") == output


def test_the_formats_and_recipes_pages_quote_what_fpaudit_prints(cli) -> None:
    (formats,) = [t for t in transcripts(COMMAND_PAGES / "formats.md") if t[0][1] == "formats"]
    (recipes,) = [t for t in transcripts(COMMAND_PAGES / "recipes.md") if t[0][1] == "recipes"]
    printed = cli("recipes").stdout.rstrip("\n")
    assert printed == recipes[1]
    # formats prints its own table and note, then the recipes table (the page says so)
    assert cli("formats").stdout.rstrip("\n") == f"{formats[1]}\n{printed}"


def test_the_export_page_lists_every_metric_as_declared() -> None:
    from fpaudit.rules.metrics import METRICS

    page = (COMMAND_PAGES / "export.md").read_text()
    rows = re.findall(r"^\| `(fpaudit/[^`]+)` \| (.+) \|$", page, re.M)
    assert rows == [(m.name, m.meaning) for m in METRICS]


def test_the_architecture_recipes_name_files_and_names_that_exist() -> None:
    """docs/architecture.md's "where a new thing goes" lists every place a new thing
    touches: each file it names exists (under fpaudit/, or from the root), and each
    `module.NAME` or `NAME` it pins in a file of fpaudit/ is defined there."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    recipes = text.split("## Where a new thing goes", 1)[1]
    files = set(re.findall(r"`((?:[a-z_]+/)*[a-z_]+\.(?:py|md))`", recipes))
    places = (ROOT / "fpaudit", ROOT, ROOT / "docs", ROOT / "tests")
    missing = [f for f in sorted(files) if not any((place / f).exists() for place in places)]
    assert missing == []
    # `rules/scalers.py`'s `REGISTRY`: a name pinned to the file named before it
    pinned = re.findall(r"`((?:[a-z_]+/)+[a-z_]+\.py)`'s `([A-Z_]+|[A-Za-z]+)`", recipes)
    assert pinned, "the recipes pin names to files"
    for path, name in pinned:
        source = (ROOT / "fpaudit" / path).read_text()
        assert re.search(rf"^(class |def )?{name}\b", source, re.M), (path, name)
