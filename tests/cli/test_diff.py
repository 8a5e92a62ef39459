"""`fpaudit diff BASE NEW` and `fpaudit gate NEW --baseline BASE`, on a pair of reports whose
change is known: tests/models/residual_shrink.py scanned as it is (BASE, and BASE2, a second
identical scan) and with block 1's output multiplied by 2**-12 in forward (NEW).

The oracle is a count of each report's own bins (its Parquet tables, read with pandas),
by the rule of the format alone, not by fpaudit's analysis: fp8_e5m2's smallest subnormal
is 2**-16, so a value x rounds to zero at scale 2**k exactly when |x| * 2**k <= 2**-17
(half of it; the tie rounds to even, zero): its binade b + k is below -17, or is -17 and
x is exactly a power of two (mantissa class 0).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pandas as pd
import pytest

from fpaudit.report.store import Report

from ..conftest import MODELS, ROOT, one_error_line
from ..project.test_docs import COMMAND_PAGES, PORTABLE_NUMERICS, transcripts

MODEL = MODELS / "residual_shrink.py"
FORMAT = "fp8_e5m2"
EDGE_BINADE = -17  # fp8_e5m2: half its smallest subnormal 2**-16
SHRUNK = ("blocks.1", "blocks.1.linear")  # the block whose output NEW multiplies by 2**-12


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """BASE (``main``), BASE2 (``main2``, the same scan again) and NEW (``pr``,
    FPAUDIT_SHRINK=12), 2 steps each, scanned as docs/commands/diff.md's are: in a process
    of their own, under PORTABLE_NUMERICS (the pages quote these reports)."""
    root = tmp_path_factory.mktemp("pair")
    out = {}
    for name, folder, shrink in (("base", "main", "0"), ("base2", "main2", "0"),
                                 ("new", "pr", "12")):  # fmt: skip
        env = {**os.environ, **PORTABLE_NUMERICS, "PYTHONPATH": str(ROOT),
               "FPAUDIT_SHRINK": shrink}  # fmt: skip
        command = [sys.executable, "-m", "fpaudit", "scan", str(MODEL), "--steps", "2"]
        done = subprocess.run([*command, "--out", folder], cwd=root, env=env,
                              capture_output=True, text=True)  # fmt: skip
        assert done.returncode == 0, done.stderr
        out[name] = root / folder
    return out


def hand_count(path: Path, log2_scale: int) -> dict[str, tuple[int, int]]:
    """Per module, (underflowed, nonzero) of the backward values outside <loss>, from the
    report's own records and bins tables at 2**log2_scale in fp8_e5m2 (module docstring)."""
    records = pd.read_parquet(path / "records.parquet")
    bins = pd.read_parquet(path / "bins.parquet")
    assert (records["loss_scale"] == 1.0).all()  # scanned at loss scale 1: binades as recorded
    backward = records[(records["kind"] == "backward") & (records["module"] != "<loss>")]
    merged = bins.merge(backward[["record_id", "module", "scales_with_loss"]], on="record_id")
    shift = merged["scales_with_loss"].astype(int) * log2_scale  # the others do not move
    scaled = merged["binade"] + shift
    zeroed = (scaled < EDGE_BINADE) | ((scaled == EDGE_BINADE) & (merged["cls"] == 0))
    # a value that does not scale and rounds to zero does so at every scale: counted apart
    judged = zeroed & merged["scales_with_loss"]
    merged = merged.assign(under=merged["count"] * judged)
    sums = merged.groupby("module")[["under", "count"]].sum()
    return {str(m): (int(row.under), int(row["count"])) for m, row in sums.iterrows()}


def test_diff_ranks_the_shrunk_block_first_with_the_fractions_of_a_hand_count(
    cli, pair: dict[str, Path]
) -> None:
    result = cli("diff", pair["base"], pair["new"], "--format", FORMAT, "--json")
    assert result.code == 0, result.stderr
    diff = json.loads(result.stdout)
    log2_scale = diff["log2_scale"]
    assert diff["scale_source"] == "BASE's recommended"
    assert log2_scale == diff["base"]["recommended_log2_scale"]
    rows = diff["modules"]
    assert {row["module"] for row in rows[:2]} == set(SHRUNK)
    base, new = hand_count(pair["base"], log2_scale), hand_count(pair["new"], log2_scale)
    assert {row["module"] for row in rows} == set(base) == set(new)
    for row in rows:
        (base_under, base_nonzero), (new_under, new_nonzero) = (
            base[row["module"]],
            new[row["module"]],
        )
        assert (row["base_nonzero"], row["new_nonzero"]) == (base_nonzero, new_nonzero)
        assert row["base_underflow"] == base_under / base_nonzero
        assert row["new_underflow"] == new_under / new_nonzero
        assert row["underflow_change"] == new_under / new_nonzero - base_under / base_nonzero
    for module in SHRUNK:  # 12 binades down: at the same scale, more of it underflows
        assert new[module][0] > base[module][0]
    top = rows[0]
    assert top["underflow_change"] == max(row["underflow_change"] for row in rows) > 0
    assert next(r for r in rows if r["module"] == "blocks.1")["amax_change_binades"] == -12
    # the whole model: sums over the modules of each report
    total = [sum(counts[i] for counts in table.values()) for table in (base, new) for i in (0, 1)]
    assert diff["overall"]["base_underflow"] == total[0] / total[1]
    assert diff["overall"]["new_underflow"] == total[2] / total[3]


def test_the_gate_against_the_baseline_fails_naming_the_shrunk_block(
    cli, pair: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    args = ("gate", pair["new"], "--baseline", pair["base"], "--max-increase", "0.0001",
            "--per-module", "--format", FORMAT)  # fmt: skip
    result = cli(*args, "--junit", tmp_path / "junit.xml")
    assert result.code == 1, result.stdout + result.stderr
    first, *reasons = [line for line in result.stdout.splitlines() if not line.startswith("::")]
    assert first.startswith("FAIL: ")
    for module in SHRUNK:
        assert any(line.startswith(f"  module {module}: underflow ") for line in reasons), module
        assert f"::error title=fpaudit gate::{pair['new']}: module {module}: " in result.stdout
    assert any(line.startswith("  overall: underflow ") for line in reasons)
    verdict = json.loads(cli(*args, "--json").stdout)
    regressed = {change["module"] for change in verdict["regressions"]}
    assert set(SHRUNK) <= regressed and "(all modules)" in regressed
    # every regression is a rise over 0.0001 of the diff's own numbers
    diff = json.loads(cli("diff", pair["base"], pair["new"], "--format", FORMAT, "--json").stdout)
    risen = {row["module"] for row in diff["modules"] if row["underflow_change"] > 0.0001}
    assert regressed == risen | {"(all modules)"}
    suite = ET.parse(tmp_path / "junit.xml").getroot().find("testsuite")
    assert suite is not None
    failed = {c.get("name") for c in suite.iter("testcase") if c.find("failure") is not None}
    assert failed == risen | {"overall"}
    # without --per-module only the whole model is judged
    overall = json.loads(cli(*args[:-3], "--format", FORMAT, "--json").stdout)
    assert [change["module"] for change in overall["regressions"]] == ["(all modules)"]


def test_two_identical_scans_diff_to_zero_and_pass(cli, pair: dict[str, Path]) -> None:
    for fmt in ("fp16", FORMAT):
        diff = json.loads(
            cli("diff", pair["base"], pair["base2"], "--format", fmt, "--json").stdout
        )
        assert diff["overall"]["underflow_change"] == 0.0
        assert all(row["underflow_change"] == 0.0 for row in diff["modules"])
        assert all(row["amax_change_binades"] == 0 for row in diff["modules"])
        assert all(row["present"] == "both" for row in diff["modules"])
        gate = cli("gate", pair["base2"], "--baseline", pair["base"], "--max-increase", "0",
                   "--per-module", "--format", fmt)  # fmt: skip
        assert gate.code == 0 and gate.stdout.startswith("PASS: "), gate.stdout


def test_the_table_starts_with_the_summary_and_lists_every_module(cli, pair) -> None:
    result = cli("diff", pair["base"], pair["new"], "--format", FORMAT)
    assert result.code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"{FORMAT} at S = 2^") and "steps: BASE 2, NEW 2." in lines[0]
    body = "\n".join(lines[1:])
    assert body.index("blocks.1") < body.index("blocks.0")  # sorted by the rise of underflow
    order = json.loads(cli("diff", pair["base"], pair["new"], "--sort", "order", "--json").stdout)
    modules = [row["module"] for row in order["modules"]]
    network = Report.read(pair["new"]).info.modules  # network order, every module
    assert modules == [module for module in network if module in set(modules)]


def test_diff_by_op_and_a_given_scale(cli, pair: dict[str, Path]) -> None:
    ops = json.loads(cli("diff", pair["base"], pair["new"], "--by", "op", "--scale", "1",
                         "--format", FORMAT, "--json").stdout)  # fmt: skip
    assert ops["log2_scale"] == 0 and ops["scale_source"] == "given"
    assert {"module", "node", "op"} <= set(ops["modules"][0])
    assert ops["modules"][0]["module"] in SHRUNK


def test_bad_input_is_one_line(cli, pair: dict[str, Path], tmp_path: Path) -> None:
    new = pair["new"]
    cases = {
        "--baseline": ("gate", new, "--baseline", tmp_path, "--max-increase", "0.1"),
        "is the report being gated": ("gate", new, "--baseline", new, "--max-increase", "0.1"),
        "--max-increase": ("gate", new, "--baseline", pair["base"], "--max-increase", "-0.1"),
        "'--max-increase'": ("gate", new, "--baseline", pair["base"], "--max-increase", "lots"),
        "needs --max-increase": ("gate", new, "--baseline", pair["base"]),
        "needs --baseline": ("gate", new, "--max-increase", "0.1"),
        "same report (": ("diff", new, new),
        "does not exist": ("diff", tmp_path / "nothing", new),
        "does not apply to a block gate": (
            "gate",
            new,
            "--baseline",
            pair["base"],
            "--max-increase",
            "0.1",
            "--recipe",
            "mxfp4",
            "--max-flush",
            "0.1",
        ),
    }
    for named, args in cases.items():
        assert named in one_error_line(cli(*args)), args


def test_a_baseline_that_measured_nothing_fails_the_gate(cli, pair, tmp_path: Path) -> None:
    import torch

    from ..reports import report_from

    report_from({"blocks.0": torch.zeros(8)}).write(tmp_path / "empty")
    result = cli("gate", pair["new"], "--baseline", tmp_path / "empty", "--max-increase", "1")
    assert result.code == 1
    assert "  the baseline: measured nothing" in result.stdout


def test_the_diff_and_gate_pages_quote_what_fpaudit_prints(
    cli, pair: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(pair["new"].parent)  # the pages name the reports main and pr
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.delenv("GITHUB_ACTIONS", raising=False)
    checked = []
    for page in ("diff", "gate"):
        for args, output in transcripts(COMMAND_PAGES / f"{page}.md"):
            if "pr" in args[2:4]:  # gate's other transcripts quote other reports
                assert cli(*args[1:]).stdout.rstrip("\n") == output, args
                checked.append((page, args[1]))
    assert checked == [("diff", "diff"), ("gate", "gate"), ("gate", "gate")]
