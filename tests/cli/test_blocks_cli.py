"""Block-scaled statistics end to end: capture, report, scan/show/gate/plan --recipe."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import fpaudit
from fpaudit.kernels import blockstats
from fpaudit.numerics.recipes import RECIPES, get_recipe
from fpaudit.report.schema import SCHEMA_VERSION
from fpaudit.report.store import Report
from fpaudit.rules import blockplan
from tests.conftest import MODELS, one_error_line

PAIR = MODELS / "block_pair.py"


@pytest.fixture
def pair_reports(cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """Scans of the interleaved and the sorted pair, 2 steps each."""
    out = {}
    for layout in ("interleaved", "sorted"):
        monkeypatch.setenv("FPAUDIT_PAIR", layout)
        target = tmp_path / layout
        result = cli(
            "scan", PAIR, "--steps", 2, "--recipe", "mxfp8-e4m3",
            "--recipe", "fp8-tensor-e4m3", "--out", target,
        )  # fmt: skip
        assert result.code == 0, result.stderr
        out[layout] = target
    return out


def _grad_row(report: Report, recipe: str) -> dict[str, object]:
    table = blockplan.block_table(report, recipe, ("module", "kind", "op"), kind="grad")
    rows = table[(table["kind"] == "grad") & (table["op"] == "w")]
    assert len(rows) == 1
    return rows.iloc[0].to_dict()


def test_scan_reports_the_interleaved_and_sorted_pair(pair_reports: dict[str, Path]) -> None:
    # The gradient of w is the pair (see tests/models/block_pair.py); 2 steps of 64.
    # MXFP8-E4M3: interleaved, each block holds 1.0, X = 2**-8, 2**-20 -> 2**-12 <= 2**-10:
    # 32 flushed per step -> 64 of 128 = 50%. Sorted: the tiny block has its own scale: 0%.
    # Per-tensor E4M3: 2**-20 * 448 = 1.75 * 2**-12 <= 2**-10: 50% in both layouts.
    interleaved = Report.read(pair_reports["interleaved"])
    ordered = Report.read(pair_reports["sorted"])
    assert interleaved.meta["schema_version"] == SCHEMA_VERSION == 6
    assert interleaved.recipes == ["mxfp8-e4m3", "fp8-tensor-e4m3"]
    row = _grad_row(interleaved, "mxfp8-e4m3")
    assert (row["flushed"], row["nonzero"], row["flush_fraction"]) == (64, 128, 0.5)
    assert (row["blocks"], row["blocks_flushed"]) == (4, 4)  # 2 blocks per step
    assert _grad_row(ordered, "mxfp8-e4m3")["flush_fraction"] == 0.0
    assert _grad_row(interleaved, "fp8-tensor-e4m3")["flush_fraction"] == 0.5
    assert _grad_row(ordered, "fp8-tensor-e4m3")["flush_fraction"] == 0.5
    # one row per step, key and recipe: counts merge over steps by summing
    blocks = interleaved.blocks
    assert blocks is not None
    per_step = blocks[(blocks["kind"] == "grad") & (blocks["recipe"] == "mxfp8-e4m3")]
    assert list(per_step["step"]) == [0, 1] and list(per_step["flushed"]) == [32, 32]


def test_show_gate_and_plan_on_the_pair(cli, pair_reports: dict[str, Path]) -> None:
    interleaved, ordered = pair_reports["interleaved"], pair_reports["sorted"]
    shown = cli(
        "show", interleaved, "--recipe", "mxfp8-e4m3", "--by", "op", "--kind", "grad", "--json"
    )  # fmt: skip
    assert shown.code == 0, shown.stderr
    rows = json.loads(shown.stdout)
    grad = [r for r in rows if r["kind"] == "grad" and r["op"] == "w"]
    assert grad[0]["flush_fraction"] == 0.5
    table = cli("show", interleaved, "--recipe", "mxfp8-e4m3")
    assert table.code == 0 and "50%" in table.stdout
    # the gate: the root module flushes 50% (its backward outputs hold the pair too)
    failed = cli("gate", interleaved, "--recipe", "mxfp8-e4m3", "--max-flush", "0.1")
    assert failed.code == 1 and "FAIL" in failed.stdout and "(root)" in failed.stdout
    passed = cli("gate", ordered, "--recipe", "mxfp8-e4m3", "--max-flush", "0.1")
    assert passed.code == 0 and "PASS" in passed.stdout
    per_tensor = cli("gate", ordered, "--recipe", "fp8-tensor-e4m3", "--max-flush", "0.1")
    assert per_tensor.code == 1
    # the plan: the pair's only parameter is a vector multiplied elementwise, no matrix
    # multiply: frameworks quantize only GEMM operands, so nothing is a candidate
    plan = cli(
        "plan", ordered, "--recipe", "fp8-tensor-e4m3", "--recipe", "mxfp8-e4m3",
        "--max-flush", "0.1", "--json",
    )  # fmt: skip
    assert plan.code == 0, plan.stderr
    planned = json.loads(plan.stdout)
    assert planned["recipes"] == ["mxfp8-e4m3", "fp8-tensor-e4m3"]  # cost order
    assert (planned["modules"], planned["not_candidates"]) == ([], [""])
    kept = cli("plan", interleaved, "--max-flush", "0.1", "--names")  # the report's recipes
    assert kept.code == 0 and kept.stdout == ""
    text = cli("plan", interleaved, "--max-flush", "0.1")
    assert "No candidate" in text.stdout and "Not candidates" in text.stdout
    assert "(root)" in text.stdout


def test_gate_and_plan_count_a_parameter_gradient_once(cli, pair_reports: dict[str, Path]):
    # the pair is recorded twice: as MulBackward0's output (kind backward) and as w's
    # gradient (kind grad). gate --recipe judges the backward values, as show
    # --recipe does by default: their counts are the sums of blocks.parquet's backward rows
    report = Report.read(pair_reports["interleaved"])
    assert report.blocks is not None
    rows = report.blocks[(report.blocks["recipe"] == "mxfp8-e4m3")
                         & (report.blocks["module"] != "<loss>")]  # fmt: skip
    backward = rows[rows["kind"] == "backward"]
    assert set(rows["kind"]) == {"backward", "grad"}
    counted = ["flushed", "subnormal", "normal", "saturated", "poisoned"]
    gate = cli("gate", pair_reports["interleaved"], "--recipe", "mxfp8-e4m3",
               "--max-flush", "1", "--max-saturate", "1", "--json")  # fmt: skip
    assert gate.code == 0, gate.stderr
    result = json.loads(gate.stdout)
    assert result["nonzero"] == int(backward[counted].to_numpy().sum())
    assert result["flushed"] == int(backward["flushed"].sum())
    assert result["nonzero"] < int(rows[counted].to_numpy().sum())  # not both kinds


def test_bad_block_inputs_are_one_line(cli, pair_reports: dict[str, Path], tmp_path: Path) -> None:
    report = pair_reports["sorted"]
    assert "unknown recipe 'mxfp9'" in one_error_line(
        cli("scan", PAIR, "--recipe", "mxfp9", "--out", tmp_path / "x")
    )
    assert "no block statistics for recipe 'nvfp4'" in one_error_line(
        cli("gate", report, "--recipe", "nvfp4", "--max-flush", "0.1")
    )
    assert "needs both --recipe" in one_error_line(cli("gate", report, "--max-flush", "0.1"))
    assert "--max-flush must be a fraction" in one_error_line(
        cli("gate", report, "--recipe", "mxfp8-e4m3", "--max-flush", "2")
    )
    assert "plan needs --max-flush" in one_error_line(cli("plan", report))


def test_a_gate_that_measured_nothing_fails(pair_reports: dict[str, Path]) -> None:
    report = Report.read(pair_reports["sorted"])
    assert report.blocks is not None
    nothing = report.blocks.copy()
    for column in ("flushed", "subnormal", "normal", "saturated", "poisoned"):
        nothing[column] = 0
    report.blocks = nothing
    result = blockplan.block_gate(report, "mxfp8-e4m3", max_flush=1.0)
    assert not result.passed and not result.measured


def test_blocks_survive_a_round_trip_and_old_reports_still_read(
    pair_reports: dict[str, Path], tmp_path: Path
) -> None:
    report = Report.read(pair_reports["interleaved"])
    again = Report.read(report.write(tmp_path / "copy"))
    assert again.blocks is not None and report.blocks is not None
    assert again.blocks.drop(columns=["scale_codes", "dynamic_range"]).equals(
        report.blocks.drop(columns=["scale_codes", "dynamic_range"])
    )
    assert all(
        (a == b).all()
        for a, b in zip(again.blocks["scale_codes"], report.blocks["scale_codes"], strict=True)
    )
    # a version 2 report (no block statistics) reads, with no recipes
    plain = Report(report.info, report.records, report.bins, report.steps)
    written = plain.write(tmp_path / "v2")
    meta = json.loads((written / "meta.json").read_text())
    meta["schema_version"] = 2
    meta.pop("recipes", None)
    (written / "meta.json").write_text(json.dumps(meta))
    old = Report.read(written)
    assert old.blocks is None and old.recipes == []


def test_recipes_from_a_config_file(cli, tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text('[scan]\nrecipe = ["mxfp4", "nvfp4"]\nsteps = 1\n')
    result = cli("scan", PAIR, "--config", config, "--out", tmp_path / "r")
    assert result.code == 0, result.stderr
    assert Report.read(tmp_path / "r").recipes == ["mxfp4", "nvfp4"]


def test_the_library_records_what_a_twin_computes() -> None:
    # A real backward seeded with 2**-10 (scaled gradients), audited with recipes; the
    # oracle is a twin model without hooks, whose parameter gradients go through
    # block_stats directly.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 70), nn.Tanh(), nn.Linear(70, 3))
    twin = nn.Sequential(nn.Linear(40, 70), nn.Tanh(), nn.Linear(70, 3))
    twin.load_state_dict(model.state_dict())
    x = torch.randn(16, 40) * 1e-3
    recipes = ["mxfp4", "fp8-block-128x128:col"]
    with fpaudit.audit(model, recipes=recipes) as audit:
        loss = model(x).sum()
        loss.backward(torch.tensor(2.0**-10))
        audit.step(loss=loss)
    twin(x).sum().backward(torch.tensor(2.0**-10))
    report = audit.report
    assert report.blocks is not None
    grads = report.blocks[report.blocks["kind"] == "grad"]
    for name, param in twin.named_parameters():
        module, _, op = name.rpartition(".")
        for recipe in recipes:
            assert param.grad is not None
            expected = blockstats.summary(
                blockstats.block_stats(param.grad, get_recipe(recipe)).numpy()
            ).to_dict()
            row = grads[(grads["module"] == module) & (grads["op"] == op)]
            row = row[row["recipe"] == recipe].iloc[0]
            assert {k: int(row[k]) for k in expected} == expected


def test_plot_draws_the_block_statistics(cli, pair_reports: dict[str, Path]) -> None:
    pytest.importorskip("matplotlib")
    target = pair_reports["interleaved"].parent / "blocks.png"
    result = cli(
        "plot", pair_reports["interleaved"], "--recipe", "mxfp8-e4m3",
        "--recipe", "fp8-tensor-e4m3", "-o", target,
    )  # fmt: skip
    assert result.code == 0, result.stderr
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_on_a_hand_built_table(pair_reports: dict[str, Path]) -> None:
    # Three modules, three recipes (cost order mxfp4 < mxfp8-e4m3 < fp8-block-1x128),
    # limits: flush <= 2%, saturate <= 0%. "limited by" is what stopped the module from
    # being one step cheaper: the recipe just below the chosen one.
    #   a: mxfp4 flushes 5 of 100 (5% > 2%), mxfp8 1 of 100 (1%)
    #      -> mxfp8-e4m3, limited by mxfp4 (just below): "flush 5% (mxfp4)"
    #   b: mxfp4 0 flushed but 3 of 100 saturated, mxfp8 flushes 50%, fp8-block 50%
    #      -> no recipe passes: bf16, limited by the most expensive recipe tried (just
    #      below bf16): "flush 50% (fp8-block-1x128)", not mxfp4's saturation
    #   c: mxfp4 flushes 10 of 100 (10%), mxfp8 flushes 0 but saturates 1 of 100 (1% > 0%),
    #      fp8-block 0 and 0 -> fp8-block-1x128, limited by mxfp8-e4m3 (just below):
    #      "saturate 1% (mxfp8-e4m3)", not mxfp4's 10% flush (the cheapest failure)
    report = Report.read(pair_reports["sorted"])
    rows = []
    for module, recipe, flushed, saturated in [
        ("a", "mxfp4", 5, 0), ("a", "mxfp8-e4m3", 1, 0), ("a", "fp8-block-1x128", 0, 0),
        ("b", "mxfp4", 0, 3), ("b", "mxfp8-e4m3", 50, 0), ("b", "fp8-block-1x128", 50, 0),
        ("c", "mxfp4", 10, 0), ("c", "mxfp8-e4m3", 0, 1), ("c", "fp8-block-1x128", 0, 0),
    ]:  # fmt: skip
        row = {name: 0 for name in blockstats.COUNT_COLUMNS}
        row.update(flushed=flushed, saturated=saturated, normal=100 - flushed - saturated)
        row.update(module=module, recipe=recipe, kind="operand", step=0, rank=0)
        rows.append(row)
    import pandas as pd

    report.blocks = pd.DataFrame(rows)
    report.update_info(recipes=("mxfp4", "mxfp8-e4m3", "fp8-block-1x128"))
    result = blockplan.plan(report, ["fp8-block-1x128", "mxfp8-e4m3", "mxfp4"], 0.02, 0.0)
    assert result.recipes == ["mxfp4", "mxfp8-e4m3", "fp8-block-1x128"]
    by_module = {m.module: m for m in result.modules}
    assert (by_module["a"].recipe, by_module["a"].flush_fraction) == ("mxfp8-e4m3", 0.01)
    assert by_module["a"].limiting == "flush 5% (mxfp4)"
    assert (by_module["b"].recipe, by_module["b"].limiting) == (
        "bf16",
        "flush 50% (fp8-block-1x128)",
    )
    # a kept module shows no recipe's numbers: no recipe applies to it
    assert (by_module["b"].flush_fraction, by_module["b"].saturate_fraction) == (None, None)
    # b, the one kept, is ruled out by one limit alone for no recipe: mxfp4 by saturation
    # (0 flushed <= 2%, 3% saturated > 0%), so mxfp4-rceil (same E2M1 x 32, round-up
    # scale: never saturates) is the alternative; mxfp8 and fp8-block by flushing alone
    # (50% > 2%, nothing saturated)
    assert [(s.limit, s.recipe, s.needed, s.alternatives) for s in result.single_limits] == [
        ("max_saturate", "mxfp4", 0.03, ["mxfp4-rceil"]),
        ("max_flush", "mxfp8-e4m3", 0.5, []),
        ("max_flush", "fp8-block-1x128", 0.5, []),
    ]
    assert (by_module["c"].recipe, by_module["c"].limiting) == (
        "fp8-block-1x128",
        "saturate 1% (mxfp8-e4m3)",
    )
    assert result.keep == ["b"]
    # the cheapest recipe passing leaves nothing to name
    only_a = blockplan.plan(report, ["mxfp8-e4m3", "fp8-block-1x128"], 0.02, 0.0)
    assert [(m.recipe, m.limiting) for m in only_a.modules if m.module == "a"] == [
        ("mxfp8-e4m3", "")
    ]


def test_damaged_block_tables_are_one_line(cli, pair_reports: dict[str, Path]) -> None:
    report = pair_reports["sorted"]
    meta_file = report / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps({**meta, "recipes": "mxfp8-e4m3"}))
    assert "recipes has the wrong type" in one_error_line(cli("show", report))
    meta_file.write_text(json.dumps(meta))
    (report / "blocks.parquet").unlink()
    assert "blocks.parquet is missing" in one_error_line(
        cli("show", report, "--recipe", "mxfp8-e4m3")
    )


BLOCK_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_blocks.py"


def _padded_to_blocks(x: torch.Tensor, width: int = 32) -> tuple[torch.Tensor, int]:
    """``x`` as ``(-1, last)`` with the last dimension zero-padded to a multiple of ``width``
    (torchao's to_mx needs whole blocks; zeros never change a block's maximum)."""
    flat = x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)
    pad = -flat.shape[1] % width
    return torch.nn.functional.pad(flat, (0, pad)), pad * flat.shape[0]


def test_run_records_the_block_statistics_torchao_computes(cli, tmp_path: Path) -> None:
    # `fpaudit run --recipe` on an unmodified script; the script saves its own gradients
    # (after backward, before the step: where fpaudit records them), and torchao's to_mx
    # quantizes them: per step and parameter, every class count must agree.
    pytest.importorskip("torchao.prototype.mx_formats.mx_tensor", reason="torchao not installed")
    from tests.kernels.test_blockstats_torchao import torchao_mx

    grads, out = tmp_path / "grads", tmp_path / "run"
    grads.mkdir()
    result = cli(
        "run", "--recipe", "mxfp8-e4m3", "--capture-every", 1, "--out", out,
        "--", BLOCK_SCRIPT, "--grads", grads,
    )  # fmt: skip
    assert result.code == 0, result.stderr
    assert "mxfp8-e4m3: flushed" in result.stdout  # the run's summary shows the recipe
    report = Report.read(out)
    assert report.recipes == ["mxfp8-e4m3"] and report.blocks is not None
    blocks = report.blocks
    rows = blocks[blocks["kind"] == "grad"]
    assert sorted(set(rows["step"])) == [0, 1, 2]
    # backward op outputs too, and the operands of the Linears' backward GEMMs
    assert set(blocks["kind"]) == {"backward", "grad", "operand"}
    flushed = 0
    for step in range(3):
        saved = torch.load(grads / f"step{step}.pt")
        assert len(saved) == 4
        for name, grad in saved.items():
            module, _, op = name.rpartition(".")
            padded, padding = _padded_to_blocks(grad)
            expected, _ = torchao_mx(padded, "mxfp8-e4m3")
            expected["zero"] -= padding
            row = rows[(rows["step"] == step) & (rows["module"] == module) & (rows["op"] == op)]
            assert len(row) == 1
            assert {k: int(row.iloc[0][k]) for k in expected} == expected, (step, name)
            flushed += expected["flushed"]
    # the alternating inputs: the small half of each 32-block of layer 0's weight gradient
    # (2**-20 below the large half, past E4M3's 2**17 range) flushes: 16 of 32 in each of
    # 32 x 64 / 32 = 64 blocks -> 1024 per step, 3 steps -> at least 3072
    assert flushed >= 3072
    # the report commands read a run's block statistics as they read a scan's
    shown = cli("show", out, "--recipe", "mxfp8-e4m3", "--by", "op", "--kind", "grad", "--json")
    assert shown.code == 0, shown.stderr
    weight = [r for r in json.loads(shown.stdout) if r["kind"] == "grad" and r["op"] == "weight"]
    assert {r["module"] for r in weight} == {"0", "2"}
    gate = cli("gate", out, "--recipe", "mxfp8-e4m3", "--max-flush", "0.1")
    assert gate.code == 1 and "FAIL" in gate.stdout
    plan = cli("plan", out, "--max-flush", "0.1", "--names")
    assert plan.code == 0 and "0\n" in plan.stdout


def test_run_recipes_from_a_config_file_and_bad_names(cli, tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text('[run]\nrecipe = ["mxfp4", "nvfp4"]\ncapture-every = 1\n')
    result = cli("run", "--config", config, "--out", tmp_path / "r", "--", BLOCK_SCRIPT)
    assert result.code == 0, result.stderr
    assert Report.read(tmp_path / "r").recipes == ["mxfp4", "nvfp4"]
    line = one_error_line(
        cli("run", "--recipe", "mxfp9", "--out", tmp_path / "x", "--", BLOCK_SCRIPT)
    )
    assert "unknown recipe 'mxfp9'; known: mxfp4" in line
    assert not (tmp_path / "x").exists()  # refused before the script ran


def test_the_recipes_command_lists_every_recipe_with_its_thresholds(cli) -> None:
    """E2M1: smallest subnormal 0.5 (0.1 x 2^0), so round to nearest sends |x| <= 0.25
    (the tie included) to 0; E4M3: subnormal 2^-9, to 0 at or below 2^-10; E5M2:
    2^-16 and 2^-17. Stochastic rounding flushes nothing for certain, and may flush any
    magnitude below the smallest subnormal."""
    result = cli("recipes", "--json")
    assert result.code == 0, result.stderr
    rows = {row["recipe"]: row for row in json.loads(result.stdout)}
    assert list(rows) == list(RECIPES)  # cheapest first
    assert [r["cost"] for r in rows.values()] == sorted(r["cost"] for r in rows.values())
    assert rows["nvfp4"]["element_flush_at"] == 0.25 and rows["nvfp4"]["rounding"] == "nearest"
    assert rows["nvfp4"]["element_may_flush_below"] is None
    assert rows["nvfp4-sr"]["element_flush_at"] is None
    assert rows["nvfp4-sr"]["element_may_flush_below"] == 0.5
    assert rows["mxfp8-e4m3"]["element_flush_at"] == 2.0**-10
    assert rows["mxfp8-e5m2"]["element_flush_at"] == 2.0**-17
    assert (
        rows["mxfp8-e4m3"]["element_max"] == 448.0 and rows["fp8-block-1x128"]["block"] == "1x128"
    )
    table = cli("recipes")
    assert table.code == 0
    (sr,) = [line for line in table.stdout.splitlines() if "nvfp4-sr" in line]
    assert "< 2^-1" in sr and " SR " in sr


def test_diff_recipe_compares_flushed_fractions_per_module(
    cli, pair_reports: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    interleaved, ordered = pair_reports["interleaved"], pair_reports["sorted"]
    result = cli("diff", ordered, interleaved, "--recipe", "mxfp8-e4m3", "--json")
    assert result.code == 0, result.stderr
    diff = json.loads(result.stdout)
    (root,) = [row for row in diff["modules"] if row["module"] == ""]
    # mxfp8-e4m3 scales each 32-block so its amax lands at 2**8; e4m3 rounds below 2**-10 to
    # zero. Interleaved: each block holds 16 x 1.0 and 16 x 2**-20 -> 2**-12: 16 of 32 flush,
    # 0.5. Sorted: the 2**-20 block is scaled up on its own: none flush, 0.
    assert (root["base_flush"], root["new_flush"], root["flush_change"]) == (0.0, 0.5, 0.5)
    table = cli("diff", ordered, interleaved, "--recipe", "mxfp8-e4m3")
    assert table.code == 0 and table.stdout.startswith("mxfp8-e4m3: flushed 0% -> ")
    missing = cli("diff", ordered, interleaved, "--recipe", "nvfp4")
    assert "have no block statistics of nvfp4" in one_error_line(missing)
    mixed = cli("diff", ordered, interleaved, "--recipe", "mxfp8-e4m3", "--by", "op")
    assert "--by does not apply to --recipe" in one_error_line(mixed)
    # docs/commands/diff.md quotes the table (exact values: the same on every machine)
    from tests.project.test_docs import COMMAND_PAGES, transcripts

    monkeypatch.chdir(ordered.parent)
    monkeypatch.delenv("COLUMNS", raising=False)
    (quoted,) = [t for t in transcripts(COMMAND_PAGES / "diff.md") if "--recipe" in t[0]]
    assert cli(*quoted[0][1:]).stdout.rstrip("\n") == quoted[1]
