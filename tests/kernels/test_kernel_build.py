"""The CPU kernel's cache: one build per environment, said once; a damaged library is
found before it is loaded; no compiler is said in one line.

Unit tests run against a scratch ``TORCH_EXTENSIONS_DIR`` with torch's build step
replaced by a recorder (what they test is which directory is built, when, and what is
said); the end-to-end test copies the suite's own build (so ninja only relinks) and
runs real scans in child processes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fpaudit.kernels import build
from fpaudit.report.store import Report

from ..conftest import ROOT, SAMPLES


@pytest.fixture
def scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """A scratch extension cache, a fresh kernel state, and torch's build step replaced
    by one that writes a library of 4096 bytes and counts its calls; importing a library
    is recorded instead of done (the libraries are not real)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setenv(build.ENV, "auto")
    monkeypatch.setattr(build, "_module", None)
    monkeypatch.setattr(build, "_failure", None)
    seen: dict[str, Any] = {"built": [], "imported": [], "said": []}

    def load(name: str, **_: Any) -> types.SimpleNamespace:
        library = build._build_directory() / f"{name}.so"
        library.write_bytes(bytes(range(256)) * 16)
        seen["built"].append(library)
        return types.SimpleNamespace(__file__=str(library))

    def imported(library: Path) -> types.SimpleNamespace:
        seen["imported"].append(library)
        return types.SimpleNamespace(__file__=str(library))

    monkeypatch.setattr("torch.utils.cpp_extension.load", load)
    monkeypatch.setattr(build, "_import", imported)
    yield seen


def _run(seen: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Any:
    """One process's first use of the kernel (the module state reset as in a new process)."""
    monkeypatch.setattr(build, "_module", None)
    monkeypatch.setattr(build, "_failure", None)
    return build.cpu_kernel(on_build=lambda: seen["said"].append(build.build_reason()))


def test_two_environments_sharing_a_checkout_each_build_once_and_say_so_once(
    scratch: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Two venvs with an editable install of one checkout differ in their prefix and
    include paths: each gets its own build, built once and said once; a second run in
    either builds nothing and says nothing."""
    first_prefix = sys.prefix
    first = build._build_directory()
    assert _run(scratch, monkeypatch) is not None
    assert scratch["built"] == [first / f"{build._name()}.so"]
    assert scratch["said"] == [build.BUILD_NOTE]
    assert _run(scratch, monkeypatch) is not None  # the same environment again
    assert len(scratch["built"]) == 1 and scratch["imported"] == scratch["built"]

    # the second environment: another prefix, its own include paths (its headers)
    other = tmp_path / "venv-b"
    monkeypatch.setattr(sys, "prefix", str(other))
    from torch.utils import cpp_extension

    paths = cpp_extension.include_paths()
    monkeypatch.setattr(cpp_extension, "include_paths", lambda *a, **k: [str(other), *paths])
    second = build._build_directory()
    assert second != first
    assert _run(scratch, monkeypatch) is not None
    assert _run(scratch, monkeypatch) is not None
    assert scratch["built"] == [first / f"{first.name}.so", second / f"{second.name}.so"]
    assert scratch["said"] == [build.BUILD_NOTE, build.BUILD_NOTE]

    monkeypatch.setattr(sys, "prefix", first_prefix)  # back in the first: still built
    monkeypatch.setattr(cpp_extension, "include_paths", lambda *a, **k: paths)
    assert build._build_directory() == first
    assert _run(scratch, monkeypatch) is not None
    assert len(scratch["built"]) == 2 and len(scratch["said"]) == 2


def test_the_build_name_follows_everything_that_changes_the_build(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    here = build._name()
    assert build._name() == here  # the same environment keeps its name
    compiler = tmp_path / "g++-other"
    compiler.write_text("#!/bin/sh\n")
    compiler.chmod(0o755)
    changes = {
        "prefix": lambda m: m.setattr(sys, "prefix", str(tmp_path)),
        "compiler": lambda m: m.setenv("CXX", str(compiler)),
        "flags": lambda m: m.setattr(build, "CFLAGS", ("-O2", "-fopenmp")),
        "headers": lambda m: m.setattr(
            "torch.utils.cpp_extension.include_paths", lambda *a, **k: [str(tmp_path)]
        ),
    }
    for what, change in changes.items():
        with monkeypatch.context() as patched:
            change(patched)
            assert build._name() != here, what
    assert build._name() == here


def test_a_library_cut_short_is_removed_and_rebuilt_never_loaded(
    scratch: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _run(scratch, monkeypatch) is not None
    library = scratch["built"][0]
    assert build._mismatch(library) is None
    with open(library, "r+b") as file:
        file.truncate(2048)  # a full disk during the link, a partial cache restore
    assert build._mismatch(library) == "2048 bytes, built 4096"
    assert _run(scratch, monkeypatch) is not None
    assert scratch["imported"] == []  # never loaded: rebuilt, then torch's load imported it
    assert scratch["built"] == [library, library]
    assert scratch["said"][1] == (
        f"the cached CPU kernel {library} does not match its build (2048 bytes, built 4096); "
        "rebuilding it, about a minute"
    )
    library.write_bytes(b"\x7fELF" + bytes(4092))  # the same size, other bytes
    assert build._mismatch(library) == "its SHA-256 differs from the build's"
    monkeypatch.setattr(build, "_module", None)
    assert not build.is_built()


def test_a_damaged_library_that_cannot_be_removed_is_skipped_with_one_reason(
    scratch: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _run(scratch, monkeypatch) is not None
    library = scratch["built"][0]
    library.write_bytes(b"garbage")

    unlink = Path.unlink

    def refuse(self: Path, *args: Any, **kwargs: Any) -> None:
        if self == library:  # (a read-only cache: only the library matters here)
            raise PermissionError(13, "Permission denied")
        unlink(self, *args, **kwargs)

    monkeypatch.setattr(Path, "unlink", refuse)
    assert _run(scratch, monkeypatch) is None
    assert build.failure() == (
        f"cannot use the cached kernel {library}: it does not match its build (7 bytes, "
        "built 4096) and cannot be removed (Permission denied)"
    )
    assert scratch["imported"] == [] and len(scratch["built"]) == 1


def test_no_compiler_is_said_before_any_build_starts(
    scratch: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    assert _run(scratch, monkeypatch) is None
    assert scratch["built"] == [] and scratch["said"] == []
    assert build.failure() == (
        f"no C++ compiler found (CXX={tmp_path / 'no-such-c++'} is not an executable on PATH)"
    )


# -- end to end: a real library cut to half its size ------------------------------------
def _scan(out: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, **env, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "fpaudit", "scan", str(SAMPLES / "mlp.py"), "--steps", "1",
         "--out", str(out), "--device", "cpu"],
        env=environment, capture_output=True, text=True, cwd=ROOT, timeout=600,
    )  # fmt: skip


def _directory(extensions: Path | None) -> Path:
    code = "from fpaudit.kernels import build; print(build._build_directory())"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if extensions is not None:
        env["TORCH_EXTENSIONS_DIR"] = str(extensions)
    found = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    return Path(found.stdout.strip())


def test_a_cached_kernel_cut_to_half_its_size_is_rebuilt_not_loaded(tmp_path: Path) -> None:
    """Before: every scan died of SIGBUS loading it, nothing said. Now: one line, the
    library relinked, the scan's counts those of the pure-torch path; the next run says
    nothing and rebuilds nothing."""
    extensions = tmp_path / "ext"
    directory = _directory(extensions)
    built = _directory(None)  # the suite's own build: copied, so ninja only relinks
    if any(built.glob("*.so.fpaudit-record")):
        shutil.copytree(
            built, directory, ignore=shutil.ignore_patterns("lock", "*.flock"), dirs_exist_ok=True
        )
    env = {"TORCH_EXTENSIONS_DIR": str(extensions), build.ENV: "cpp"}  # cpp: no fallback
    first = _scan(tmp_path / "first", **env)  # builds (or finds the copy)
    assert first.returncode == 0, first.stderr
    (library,) = directory.glob("*.so")
    size = library.stat().st_size
    with open(library, "r+b") as file:
        file.truncate(size // 2)

    damaged = _scan(tmp_path / "damaged", **env)
    assert damaged.returncode == 0, damaged.stderr  # not -7 (SIGBUS)
    said = [line for line in damaged.stderr.splitlines() if "kernel" in line]
    assert said == [
        f"the cached CPU kernel {library} does not match its build ({size // 2} bytes, "
        f"built {size}); rebuilding it, about a minute (FPAUDIT_KERNEL=torch skips it)"
    ], damaged.stderr
    assert library.stat().st_size == size

    plain = _scan(tmp_path / "torch", **{**env, build.ENV: "torch"})
    assert plain.returncode == 0, plain.stderr
    mine, theirs = Report.read(tmp_path / "damaged"), Report.read(tmp_path / "torch")
    assert mine.records["elements"].tolist() == theirs.records["elements"].tolist()
    assert mine.bins.equals(theirs.bins)

    stamp = library.stat().st_mtime_ns
    again = _scan(tmp_path / "again", **env)
    assert again.returncode == 0, again.stderr
    assert "kernel" not in again.stderr, again.stderr
    assert library.stat().st_mtime_ns == stamp  # loaded, not rebuilt
