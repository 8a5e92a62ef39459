"""One rule for output locations: every command creates the parent folders of what it
writes (like `mkdir -p`), and a parent that cannot be created is one line, exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from ..conftest import SAMPLES, one_error_line

ZOO = Path(__file__).resolve().parents[1] / "scripts" / "transparency"


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fpaudit.cli.commands import run

    out = tmp_path_factory.mktemp("outputs") / "deep" / "er" / "report"
    assert run(["scan", str(SAMPLES / "quadratic.py"), "--steps", "1", "--out", str(out)]) == 0
    return out


def test_scan_creates_the_reports_parent_folders(report: Path) -> None:
    assert (report / "meta.json").is_file()


def test_run_creates_the_reports_parent_folders(cli, tmp_path: Path) -> None:
    out = tmp_path / "a" / "b" / "run"
    result = cli("run", "--max-steps", "2", "--out", out, "--", ZOO / "keywords.py")
    assert result.code == 0, result.stderr
    assert (out / "meta.json").is_file()


def test_plot_and_gate_junit_create_their_parent_folders(cli, report: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    image = tmp_path / "c" / "d" / "plot.png"
    assert cli("plot", report, "-o", image).code == 0
    assert image.stat().st_size > 0
    junit = tmp_path / "e" / "f" / "junit.xml"
    assert cli("gate", report, "--max-underflow", "1", "--junit", junit).code in (0, 1)
    assert junit.read_text().startswith("<?xml")


@pytest.mark.parametrize(
    ("command", "flag"),
    [
        (["scan", str(SAMPLES / "quadratic.py"), "--steps", "1", "--out"], "--out"),
        (["run", "--out"], "--out"),
        (["plot", "{report}", "-o"], "--output"),  # named as --help names it
        (["gate", "{report}", "--max-underflow", "1", "--junit"], "--junit"),
    ],
    ids=["scan", "run", "plot", "gate"],
)
def test_a_parent_that_cannot_be_created_is_one_line(
    cli, report: Path, tmp_path: Path, command: list[str], flag: str
) -> None:
    if command[0] == "plot":
        pytest.importorskip("matplotlib")
    blocker = tmp_path / "file"
    blocker.write_text("a file, not a folder\n")
    target = blocker / "sub" / "out.png"
    args = [a.replace("{report}", str(report)) for a in command] + [str(target)]
    if command[0] == "run":
        args += ["--", str(ZOO / "keywords.py")]
    line = one_error_line(cli(*args))
    assert f"{flag}: cannot create folder {blocker / 'sub'}" in line, line


# -- the one atomic writer (reports stage a directory the same way) ---------------------------
def test_write_atomically_replaces_and_leaves_only_the_target(tmp_path: Path) -> None:
    from fpaudit.report.outputs import write_atomically

    target = tmp_path / "a" / "b.txt"  # the folder is created, like mkdir -p
    write_atomically(target, lambda handle: handle.write(b"old"), option="-o")
    write_atomically(target, lambda handle: handle.write(b"new"), option="-o")
    assert target.read_bytes() == b"new"
    assert [p.name for p in target.parent.iterdir()] == ["b.txt"]


@pytest.mark.parametrize(
    "interruption", [KeyboardInterrupt, OSError(28, "No space left on device")]
)
def test_an_interrupted_write_keeps_the_old_file_and_no_staging(
    tmp_path: Path, interruption: BaseException | type[BaseException]
) -> None:
    from fpaudit.errors import UsageError
    from fpaudit.report.outputs import write_atomically

    target = tmp_path / "junit.xml"
    target.write_bytes(b"old")

    def half(handle: object) -> None:
        handle.write(b"half")  # type: ignore[attr-defined]  # a BinaryIO
        raise interruption

    expected = KeyboardInterrupt if interruption is KeyboardInterrupt else UsageError
    with pytest.raises(expected) as caught:
        write_atomically(target, half, option="--junit")
    if expected is UsageError:
        assert str(caught.value) == f"--junit: cannot write {target} (No space left on device)"
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["junit.xml"]


@pytest.mark.parametrize("length", [200, 255])
def test_staging_names_fit_a_long_target_name(tmp_path: Path, length: int) -> None:
    from fpaudit.report.outputs import (
        STAGING_SUFFIX,
        hidden_sibling,
        staging_prefix,
        write_atomically,
    )

    target = tmp_path / ("n" * length)
    # mkstemp adds 8 random characters between prefix and suffix
    assert len(staging_prefix(target)) + 8 + len(STAGING_SUFFIX) <= 255
    assert hidden_sibling(target, ".old") != hidden_sibling(tmp_path / ("n" * (length - 1)), ".old")
    write_atomically(target, lambda handle: handle.write(b"x"), option="-o")
    assert target.read_bytes() == b"x"
