"""Every command's terminal output and ``--json`` on the bundled samples, pinned byte for byte.

The reports are built once per session from ``sample_configs/`` with tiny step counts;
each command's stdout, stderr and exit code are compared with a file under
``tests/golden/``. Refactors that should change nothing a user sees (issue 53) must
leave these files as they are. ``FPAUDIT_UPDATE_GOLDEN=1`` rewrites them (review the
diff: a change there is a change users see).

Normalised, and only this (``_normalise``): the session's temporary folder (a path
that differs per run) becomes ``<tmp>``, the repository's folder ``<root>``; a JSON
``"seconds": N`` (wall-clock time, not a result) becomes ``<s>``; and every step's
``seconds`` in the reports is pinned to 0.125 (``_pin_seconds``) because ``show --steps``
prints them. The created timestamp and the fpaudit, torch and Python versions of
meta.json are not printed by these commands, so nothing else is touched.

Each written report's ``meta.json`` (the JSON edge of the report's run info) is pinned
too, with its own narrow normalisation (``_normalised_meta``): the environment entries
(versions, time created, the machine's processor name) and the files' checksums (the
steps table holds wall-clock seconds) become ``<env>`` and ``<sha256>``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import pytest

from ..conftest import ROOT, SAMPLES

GOLDEN = ROOT / "tests" / "golden"
UPDATE = os.environ.get("FPAUDIT_UPDATE_GOLDEN") == "1"


@dataclass(frozen=True)
class Ran:
    code: int
    stdout: str
    stderr: str


def _invoke(args: list[str]) -> Ran:
    """``fpaudit ARGS`` in-process, its stdout and stderr captured (COLUMNS pinned, so
    rich lays tables out the same on every terminal)."""
    import io

    from fpaudit.cli.commands import run

    out, err = io.StringIO(), io.StringIO()
    columns = os.environ.pop("COLUMNS", None)  # the pipe width, whatever the terminal
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), _as_a_process():
            code = run(args)
    finally:
        if columns is not None:
            os.environ["COLUMNS"] = columns
    return Ran(code, out.getvalue(), err.getvalue())


@contextlib.contextmanager
def _as_a_process() -> Iterator[None]:
    """Warnings as a fresh ``python`` process tells them: Python's default filters and
    each warning written to stderr (pytest's warnings plugin records them instead, so a
    script's own warning would be missing from its output only under pytest)."""
    with warnings.catch_warnings():
        warnings.resetwarnings()
        warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning,
                         ResourceWarning):  # fmt: skip
            warnings.filterwarnings("ignore", category=category, append=True)

        def to_stderr(message: Warning | str, category: type[Warning], filename: str,
                      lineno: int, file: TextIO | None = None, line: str | None = None) -> None:  # fmt: skip
            sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))

        warnings.showwarning = to_stderr
        yield


@dataclass(frozen=True)
class Samples:
    tmp: Path
    mlp: Path  # scan mlp.py, fp16 and bf16
    mlp_scaled: Path  # the same at --loss-scale 2^8, for diff and gate --baseline
    blocks: Path  # scan mlp.py --recipe mxfp8-e4m3 --origins (the optional tables)
    transformer: Path  # scan transformer.py (a gate that fails)
    run: Path  # run train_loop.py --bugs, 12 steps (scaler, findings, skipped steps)
    built: dict[str, Ran]  # the writing commands' own output


REPORTS = ("mlp", "mlp_scaled", "blocks", "transformer", "run")


@pytest.fixture(scope="session")
def samples(tmp_path_factory: pytest.TempPathFactory) -> Samples:
    tmp = tmp_path_factory.mktemp("golden")
    mlp, scaled, blocks, transformer, run = (tmp / name for name in REPORTS)
    writers = {
        "scan_mlp": ["scan", str(SAMPLES / "mlp.py"), "--steps", "1", "--out", str(mlp),
                     "--format", "fp16", "--format", "bf16"],
        "scan_mlp_scaled": ["scan", str(SAMPLES / "mlp.py"), "--steps", "1", "--out", str(scaled),
                            "--loss-scale", "2^8"],
        "scan_blocks": ["scan", str(SAMPLES / "mlp.py"), "--steps", "1", "--out", str(blocks),
                        "--recipe", "mxfp8-e4m3", "--origins"],
        "scan_transformer": ["scan", str(SAMPLES / "transformer.py"), "--steps", "1",
                             "--out", str(transformer)],
        "run_train_loop": ["run", "--out", str(run), "--", str(SAMPLES / "train_loop.py"),
                           "--steps", "12", "--bugs"],
    }  # fmt: skip
    built = {}
    for name, args in writers.items():
        built[name] = _invoke(args)
        assert built[name].code == 0, built[name]
    for report in (mlp, scaled, blocks, transformer, run):
        _pin_seconds(report)
    return Samples(tmp, mlp, scaled, blocks, transformer, run, built)


def _pin_seconds(report: Path) -> None:
    """Set every step's wall-clock ``seconds`` (``show --steps`` prints them, and their
    widths lay its table out) to 0.125, rewriting steps.parquet with pyarrow alone (not
    fpaudit's writer, which these tests pin) and its checksum in meta.json."""
    import hashlib

    import pyarrow as pa
    import pyarrow.parquet as pq

    file = report / "steps.parquet"
    table = pq.read_table(file)
    index = table.schema.get_field_index("seconds")
    pinned = pa.array([0.125] * table.num_rows, type=pa.float64())
    table = table.set_column(index, table.schema.field(index), pinned)
    pq.write_table(table, file, compression="zstd")
    meta_file = report / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta["files"]["steps.parquet"]["sha256"] = hashlib.sha256(file.read_bytes()).hexdigest()
    meta_file.write_text(json.dumps(meta, indent=2, sort_keys=True, allow_nan=False) + "\n")


def _commands(s: Samples) -> dict[str, list[str]]:
    mlp, blocks, tr, run = str(s.mlp), str(s.blocks), str(s.transformer), str(s.run)
    return {
        "formats": ["formats"],
        "recipes": ["recipes"],
        "show": ["show", mlp],
        "show_json": ["show", mlp, "--json"],
        "show_bf16_top": ["show", mlp, "--format", "bf16", "--scale", "recommended", "--top", "3"],
        "show_steps": ["show", run, "--steps"],
        "show_steps_json": ["show", run, "--steps", "--json"],
        "show_origins": ["show", blocks, "--origins"],
        "show_origins_json": ["show", blocks, "--origins", "--json"],
        "show_blocks": ["show", blocks],
        "show_transformer": ["show", tr],
        "show_run": ["show", run],
        "show_run_json": ["show", run, "--json"],
        "recommend": ["recommend", mlp],
        "recommend_json": ["recommend", mlp, "--json"],
        "recommend_run": ["recommend", run],
        "recommend_run_json": ["recommend", run, "--json"],
        "gate_pass": ["gate", mlp, "--max-underflow", "1"],
        "gate_pass_json": ["gate", mlp, "--max-underflow", "1", "--json"],
        "gate_fail": ["gate", tr, "--max-underflow", "0", "--per-module"],
        "gate_fail_json": ["gate", tr, "--max-underflow", "0", "--per-module", "--json"],
        "gate_run": ["gate", run, "--max-underflow", "0.001"],
        "gate_baseline": ["gate", str(s.mlp_scaled), "--baseline", mlp],
        "diff": ["diff", mlp, str(s.mlp_scaled)],
        "diff_json": ["diff", mlp, str(s.mlp_scaled), "--json"],
        "simulate": ["simulate", run],
        "simulate_json": ["simulate", run, "--json"],
        "simulate_static": ["simulate", mlp, "--policy", "static", "--static-scale", "2^10"],
        "plan": ["plan", blocks, "--max-flush", "0.001"],
        "plan_json": ["plan", blocks, "--max-flush", "0.001", "--json"],
        "fp16_plan": ["fp16-plan", str(SAMPLES / "mlp.py"), "--steps", "1"],
        "fp16_plan_json": ["fp16-plan", str(SAMPLES / "mlp.py"), "--steps", "1", "--json"],
    }


_SECONDS_JSON = re.compile(r'("(?:seconds|wall_seconds|elapsed)": )[0-9.e+-]+')


def _normalise(text: str, s: Samples) -> str:
    """The narrow normalisation the module docstring lists, nothing more."""
    text = text.replace(str(s.tmp), "<tmp>").replace(str(ROOT), "<root>")
    return _SECONDS_JSON.sub(r"\1<s>", text)


def _rendered(ran: Ran, s: Samples) -> str:
    return (
        f"exit {ran.code}\n--- stdout\n{_normalise(ran.stdout, s)}"
        f"--- stderr\n{_normalise(ran.stderr, s)}"
    )


def _check(name: str, ran: Ran, s: Samples) -> None:
    _check_text(name, _rendered(ran, s))


_ENVIRONMENT = ("fpaudit_version", "torch_version", "python_version", "created", "device_name")


def _timeless(value: object) -> object:
    """``value`` with every ``seconds`` entry (the autocast probe's time) as ``<s>``."""
    if isinstance(value, dict):
        return {k: "<s>" if k == "seconds" else _timeless(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_timeless(v) for v in value]
    return value


def _normalised_meta(report: Path, s: Samples) -> str:
    meta = json.loads((report / "meta.json").read_text())
    for key in _ENVIRONMENT:
        if key in meta:
            meta[key] = "<env>"
    for entry in meta.get("files", {}).values():
        entry["sha256"] = "<sha256>"
    meta = _timeless(meta)
    text = json.dumps(meta, indent=2, sort_keys=True) + "\n"
    return text.replace(str(s.tmp), "<tmp>").replace(str(ROOT), "<root>")


def _check_text(name: str, text: str) -> None:
    file = GOLDEN / f"{name}.txt"
    if UPDATE:
        GOLDEN.mkdir(exist_ok=True)
        file.write_text(text)
        return
    assert file.exists(), f"{file} missing: run with FPAUDIT_UPDATE_GOLDEN=1 and review it"
    assert text == file.read_text(), f"{name}: output differs from {file}"


def test_every_report_keeps_its_meta_json(samples: Samples) -> None:
    """What each writer stamps on its report, as meta.json holds it."""
    for name in REPORTS:
        _check_text(f"meta_{name}", _normalised_meta(samples.tmp / name, samples))


def test_every_command_prints_what_it_printed(samples: Samples) -> None:
    """One test over every command (a failure names the first that differs): the
    reports are built once, and each command's output is one golden file."""
    for name, ran in samples.built.items():
        _check(name, ran, samples)
    for name, args in _commands(samples).items():
        _check(name, _invoke(args), samples)


def test_no_golden_file_is_left_unchecked(samples: Samples) -> None:
    """A golden file whose command was dropped would pin nothing: every file is one of the
    commands above."""
    names = set(samples.built) | set(_commands(samples))
    names |= {f"meta_{name}" for name in REPORTS}
    if UPDATE:
        return
    stale = sorted(p.stem for p in GOLDEN.glob("*.txt") if p.stem not in names)
    assert not stale, f"golden files without a command: {stale}"
