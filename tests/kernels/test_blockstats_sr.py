"""Stochastic rounding (``nvfp4-sr``): expected counts, by hand, against exact rationals
built from torchao's NVFP4 scales and an enumerated E2M1 value table, and against many
seeded draws of the rounding itself.

The oracles share no code with fpaudit.kernels.blockstats: the scaled value of each element is
torchao's (``x * ((1 / tensor_scale) / block_scale)`` in fp32, its scales), its
neighbours ``lo <= |v| <= hi`` come from the table of E2M1 magnitudes, and the
expectation is summed in ``fractions.Fraction`` (exact).
"""

from __future__ import annotations

import hashlib
import json
from fractions import Fraction
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch import nn

import fpaudit
from fpaudit.kernels import blockstats
from fpaudit.numerics.recipes import RECIPES, get_recipe
from fpaudit.report.records import BlockCounts
from fpaudit.report.store import Report
from fpaudit.rules import blockplan

# E2M1's magnitudes, and 8: the next value the format would have, past the clamp at 6
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0)
U = 2.0**-53  # float64's unit roundoff


def sr_counts(x: torch.Tensor) -> BlockCounts:
    vector = blockstats.block_stats(x, get_recipe("nvfp4-sr")).numpy()
    return blockstats.summary(vector)


def test_the_hand_derived_example() -> None:
    # Block A holds the tensor's amax 2688 * 2**-20: tensor scale 2688 * 2**-20 / (448 * 6)
    # = 2**-20 exactly; A's block scale (amax / 6) / 2**-20 = 448 (E4M3's max), so its
    # multiplier is fl(2**20 / 448) = 2**11 * fl(8/7) = 2**11 * 9586981 * 2**-23 (8/7 * 2**23
    # = 9586980.57, rounded up). A's amax scales to 6 * 9586981 / 9586980.57 = 6 + 2.7e-7,
    # which fp32 (spacing 2**-21 at 6) rounds to 6 + 2**-21: past E2M1's largest value 6,
    # where unclamped it would round to 8 with p = 2**-21 / (8 - 6) = 2**-22 (saturated).
    # Block B's amax is 6 * 2**-20: block scale 1.0, multiplier 2**20, so B's elements
    # scale to exactly the v below.
    v = [6, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1, 1.25, 3.5, 5, 2**-30, -0.25, 0, 4.5]
    block_a = [2688.0] + [0.0] * 15
    x = torch.tensor([block_a + [float(value) for value in v]]) * 2.0**-20
    got = sr_counts(x)
    # flushed, p = 1 - |v| / 0.5 for |v| < 0.5: 0.125 -> 0.75, 0.25 -> 0.5, 0.375 -> 0.25,
    # 2**-30 -> 1 - 2**-29, -0.25 -> 0.5: 3 - 2**-29
    # subnormal: the rest of those (0.25 + 0.5 + 0.75 + 2**-29 + 0.5 = 2 + 2**-29), 0.5 -> 1,
    # and 2 - 2|v| on (0.5, 1): 0.625 -> 0.75, 0.75 -> 0.5, 0.875 -> 0.25: 4.5 + 2**-29
    # normal: 2|v| - 1 on (0.5, 1) (0.25 + 0.5 + 0.75), 6, 1, 1.25, 3.5, 5, 4.5 and A's
    # amax (1 - 2**-22): 8.5 - 2**-22
    assert got.flushed == 3 - 2.0**-29
    assert got.subnormal == 4.5 + 2.0**-29
    assert got.normal == 8.5 - 2.0**-22
    assert got.saturated == 2.0**-22
    assert (got.zero, got.blocks, got.poisoned, got.nonfinite) == (16, 2, 0, 0)
    # B keeps nothing of its small values with probability
    # 0.25 * 0.5 * 0.75 * 2**-29 * 0.5 = 3 * 2**-35 of having no flush; A never flushes
    assert got.blocks_flushed == 1 - 3 * 2.0**-35
    # round to nearest on the same tensor flushes 0.125, 0.25 (the tie goes to 0, even),
    # 2**-30 and -0.25: 4, where the expectation is 3 - 2**-29; it rounds 0.375, 0.5 and
    # 0.625 to 0.5 (0.75, a tie, goes to the even 1.0): 3 subnormal; 6 + 2**-21 rounds to 6
    nearest = blockstats.summary(blockstats.block_stats(x, get_recipe("nvfp4")).numpy())
    assert nearest.flushed == 4 and nearest.subnormal == 3
    assert nearest.saturated == 0


def test_saturation_is_the_chance_of_rounding_past_the_clamp() -> None:
    # Block A as above (tensor scale 2**-20; its amax saturates with p = 2**-22). Block B's amax 6 * (1 + 2**-5) * 2**-20:
    # block scale (amax / 6) / 2**-20 = 1.03125, which E4M3 (spacing 2**-3 at 1) rounds
    # down to 1.0, so the multiplier is 2**20 and the amax scales to v = 6.1875, past E2M1's
    # largest value 6: unclamped it would round to 8 with p = 0.1875 / (8 - 6) = 0.09375.
    block_a = [2688.0] + [0.0] * 15
    block_b = [6 * (1 + 2**-5)] + [1.0] * 15  # v = 6.1875, and 15 normal values of 1.0
    x = torch.tensor([block_a + block_b]) * 2.0**-20
    got = sr_counts(x)
    assert got.saturated == 0.09375 + 2.0**-22
    # A's amax, B's ones, B's amax kept at 6
    assert got.normal == (1 - 2.0**-22) + 15 + (1 - 0.09375)
    # round to nearest keeps 6.1875 at 6 (below the edge 7): not saturated
    nearest = blockstats.summary(blockstats.block_stats(x, get_recipe("nvfp4")).numpy())
    assert nearest.saturated == 0


def _torchao_scaled(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's scaled fp32 values |v| (before rounding) and its RN-quantized values."""
    pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor", reason="no torchao")
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4
    from torchao.prototype.mx_formats.nvfp4_tensor import (
        nvfp4_quantize,
        per_tensor_amax_to_scale,
    )

    tensor_scale = per_tensor_amax_to_scale(x.abs().amax())
    scales, data = nvfp4_quantize(x, 16, tensor_scale)
    block = scales.to(torch.float32).reshape(x.shape[0], -1)
    # torchao's own fp32 arithmetic (nvfp4_quantize): x * ((1 / tensor_scale) / block_scale)
    reciprocal = (1.0 / tensor_scale) / block
    v = (x.reshape(x.shape[0], -1, 16) * reciprocal.unsqueeze(-1)).reshape(x.shape).abs()
    q = f4_unpacked_to_f32(unpack_uint4(data)).reshape(x.shape)
    return v, q


def _exact_expectation(v: torch.Tensor, x: torch.Tensor) -> dict[str, Fraction]:
    """Expected class counts from each |v|'s neighbours in the E2M1 value table."""
    totals = dict.fromkeys(("flushed", "subnormal", "normal", "saturated"), Fraction(0))
    no_flush_per_block: list[Fraction] = []
    flat_v, flat_x = v.reshape(-1, 16).tolist(), x.reshape(-1, 16).tolist()
    for block_v, block_x in zip(flat_v, flat_x, strict=True):
        keep = Fraction(1)
        for value, original in zip(block_v, block_x, strict=True):
            if original == 0:
                continue
            magnitude = Fraction(value)
            if magnitude >= 8:
                totals["saturated"] += 1
                continue
            lo = max(Fraction(t) for t in E2M1_VALUES if t <= magnitude)
            hi = min(Fraction(t) for t in E2M1_VALUES if t >= magnitude)
            up = (magnitude - lo) / (hi - lo) if hi != lo else Fraction(0)
            for result, chance in ((lo, 1 - up), (hi, up)):
                name = (
                    "flushed"
                    if result == 0
                    else "subnormal"
                    if result == Fraction(1, 2)
                    else "saturated"
                    if result == 8
                    else "normal"
                )
                totals[name] += chance
                if name == "flushed":
                    keep *= 1 - chance
        no_flush_per_block.append(keep)
    totals["blocks_flushed"] = sum((1 - k for k in no_flush_per_block), Fraction(0))
    return totals


@pytest.mark.parametrize("source", ["normal", "lognormal"])
def test_expected_counts_equal_exact_rationals_from_torchao(source: str) -> None:
    if source == "normal":
        x = torch.randn(16, 64)
    else:  # magnitudes over many binades: blocks with values far below their maximum
        x = torch.exp2(torch.randn(16, 64) * 4) * torch.randn(16, 64).sign()
    v, q = _torchao_scaled(x)
    # v is torchao's value: rounded to nearest (clamped to 6) it gives torchao's fp4 data
    table = torch.tensor(E2M1_VALUES[:-1])
    nearest = table[(v.clamp(max=6).unsqueeze(-1) - table).abs().argmin(dim=-1)]
    ties = (v.unsqueeze(-1) - table).abs() == (v.unsqueeze(-1) - table).abs().min(-1, True).values
    unambiguous = ties.sum(-1) == 1  # a tie goes to the even neighbour: left to the RN tests
    assert torch.equal(nearest[unambiguous], q.abs()[unambiguous])
    exact = _exact_expectation(v, x)
    got = sr_counts(x)
    k = x.numel()
    # float64 sums of k terms in [0, 1], each term within one rounding: error at most
    # 2 * k * u * k (the classical bound gamma_k times the sum of |terms| <= k)
    bound = 2 * k * k * U
    for name in ("flushed", "subnormal", "saturated"):
        assert abs(Fraction(getattr(got, name)) - exact[name]) <= bound, name
    assert abs(Fraction(got.normal) - exact["normal"]) <= 3 * bound  # live - the others
    assert abs(Fraction(got.blocks_flushed) - exact["blocks_flushed"]) <= bound
    assert exact["flushed"] > 1  # the tensors do flush in expectation
    # each element's probabilities sum to 1: the expected classes add up to the count
    live = int((x != 0).sum())
    assert sum(exact[n] for n in ("flushed", "subnormal", "normal", "saturated")) == live


def test_the_mean_of_many_seeded_draws_approaches_the_expectation() -> None:
    x = torch.exp2(torch.randn(8, 64) * 3) * torch.randn(8, 64).sign()
    v, _ = _torchao_scaled(x)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    magnitude = v.double().flatten()
    upper = torch.bucketize(magnitude, table).clamp(max=len(table) - 1)  # first >= |v|
    hi = table[upper]
    lo = table[(upper - (hi != magnitude).long()).clamp(min=0)]
    up = torch.where(hi > lo, (magnitude - lo) / (hi - lo), torch.zeros_like(magnitude))
    draws = 4000
    generator = torch.Generator().manual_seed(7)
    rounded_up = torch.rand(draws, magnitude.numel(), generator=generator, dtype=torch.float64)
    result = torch.where(rounded_up < up, hi, lo)
    live = (x.flatten() != 0).unsqueeze(0)
    flushed = ((result == 0) & live).sum(dim=1).double()
    subnormal = ((result == 0.5) & live).sum(dim=1).double()
    got = sr_counts(x)
    # the count of one draw is a sum of independent Bernoullis: variance sum p(1 - p);
    # the mean of 4000 draws is within 5 standard errors (a chance of ~6e-7 to fail)
    for name, counts, chance in (
        ("flushed", flushed, (lo == 0).double() * (1 - up)),
        ("subnormal", subnormal, None),
    ):
        if chance is None:  # subnormal: rounding to 0.5 from either side
            chance = torch.where(lo == 0.5, 1 - up, 0.0) + torch.where(hi == 0.5, up, 0.0)
            chance = torch.where(hi == lo, (hi == 0.5).double(), chance)
        spread = float((chance * (1 - chance)).sum().sqrt())
        assert abs(float(counts.mean()) - getattr(got, name)) <= 5 * spread / draws**0.5, name
        assert getattr(got, name) > 10  # the test has something to measure


def test_nvfp4_sr_is_listed_and_costs_between_nvfp4_and_mxfp8() -> None:
    recipe = RECIPES["nvfp4-sr"]
    assert recipe.expected and not RECIPES["nvfp4"].expected
    assert (recipe.block, recipe.scale_rule, recipe.element.name) == ((1, 16), "nvfp4", "fp4_e2m1")
    assert RECIPES["nvfp4"].cost < recipe.cost < RECIPES["mxfp8-e4m3"].cost
    assert get_recipe("nvfp4-sr:col").rounding == "stochastic"


def _sr_report() -> Report:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.Tanh(), nn.Linear(48, 2))
    x = torch.exp2(torch.randn(8, 32) * 4)
    with fpaudit.audit(model, recipes=["nvfp4", "nvfp4-sr"]) as audit:
        loss = model(x).sum()
        loss.backward()
        audit.step(loss=loss)
    return audit.report


def test_a_report_stores_expected_counts_and_reads_older_int_counts(tmp_path: Path) -> None:
    report = _sr_report()
    again = Report.read(report.write(tmp_path / "r"))
    assert again.blocks is not None and report.blocks is not None
    sr = again.blocks[again.blocks["recipe"] == "nvfp4-sr"]
    assert sr["flushed"].dtype == np.float64
    assert not np.array_equal(sr["flushed"], np.round(sr["flushed"]))  # fractional: expected
    nearest = blockplan.block_table(again, "nvfp4")
    assert nearest.flushed.dtype == np.int64  # exact counts stay ints
    expected = blockplan.block_table(again, "nvfp4-sr")
    assert (expected["nonzero"].to_numpy() == nearest.nonzero.to_numpy()).all()
    # a version 3 report: int64 block counts, read as float64
    path = tmp_path / "v3"
    plain = _sr_report()
    assert plain.blocks is not None
    plain.blocks = plain.blocks[plain.blocks["recipe"] == "nvfp4"].reset_index(drop=True)
    plain.update_info(recipes=("nvfp4",))
    plain.write(path)
    blocks_file = path / "blocks.parquet"
    table = pq.read_table(blocks_file)
    for name in blockstats.COUNT_COLUMNS:
        index = table.schema.get_field_index(name)
        table = table.set_column(index, name, table.column(name).cast(pa.int64()))
    pq.write_table(table, blocks_file)
    meta = json.loads((path / "meta.json").read_text())
    meta["files"]["blocks.parquet"]["sha256"] = hashlib.sha256(blocks_file.read_bytes()).hexdigest()
    meta["schema_version"] = 3
    (path / "meta.json").write_text(json.dumps(meta))
    old = Report.read(path)
    assert old.blocks is not None and old.blocks["flushed"].dtype == np.float64
    assert blockplan.block_table(old, "nvfp4").equals(blockplan.block_table(again, "nvfp4"))


def test_show_gate_and_plan_say_expected(cli, tmp_path: Path) -> None:
    path = _sr_report().write(tmp_path / "r")
    shown = cli("show", path, "--recipe", "nvfp4-sr")
    assert shown.code == 0, shown.stderr
    assert "nvfp4-sr: expected flushed" in shown.stdout and "expected counts" in shown.stdout
    gate = cli("gate", path, "--recipe", "nvfp4-sr", "--max-flush", "0.5", "--json")
    assert gate.code in (0, 1), gate.stderr
    verdict = json.loads(gate.stdout)
    assert verdict["expected"] is True and verdict["flushed"] != int(verdict["flushed"])
    text = cli("gate", path, "--recipe", "nvfp4-sr", "--max-flush", "0")
    assert text.code == 1 and "nvfp4-sr: expected flushed" in text.stdout
    nearest = cli("gate", path, "--recipe", "nvfp4", "--max-flush", "0")
    assert "expected" not in nearest.stdout
    plan = cli("plan", path, "--recipe", "nvfp4-sr", "--max-flush", "0")
    assert plan.code == 0, plan.stderr
    assert "expected flush" in plan.stdout and "nvfp4-sr: stochastic rounding" in plan.stdout
