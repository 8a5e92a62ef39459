"""Block-scaled statistics: hand-derived numbers, and torch casts as the oracle.

The torchao oracle is in test_blockstats_torchao.py. An oracle derives each
element's class from quantized values and scales only: zero
(x == 0), flushed (x != 0, q == 0), subnormal (0 < |q| < smallest normal),
saturated (|q| is the element maximum and |x| / scale, in float64, lies past the
rounding edge), poisoned (x finite, q NaN), normal (the rest). fpaudit's counts
must equal these exactly.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

from fpaudit.kernels import blockstats
from fpaudit.numerics.recipes import E2M1, E4M3, E5M2, RECIPES, get_recipe
from fpaudit.report.records import BlockCounts

from ..conftest import compiled_cpu_kernel


def classes_from_quantized(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, recipe_name: str
) -> dict[str, int]:
    """Per-class counts from quantized element values ``q`` (element units) and each
    element's dequantization scale (float64)."""
    element = get_recipe(recipe_name).element
    x64 = x.double()
    finite = torch.isfinite(x64)
    nonzero = finite & (x64 != 0)
    poisoned = nonzero & torch.isnan(q)
    live = nonzero & ~poisoned
    flushed = live & (q == 0)
    subnormal = live & (q != 0) & (q.abs() < element.smallest_normal)
    past = (x64.abs() / scale) >= element.overflow_edge
    if not element.overflow_edge_inclusive:
        past &= (x64.abs() / scale) != element.overflow_edge
    saturated = live & (q.abs() == element.max_finite) & past
    normal = live & ~flushed & ~subnormal & ~saturated
    return {
        "zero": int((finite & (x64 == 0)).sum()),
        "flushed": int(flushed.sum()),
        "subnormal": int(subnormal.sum()),
        "normal": int(normal.sum()),
        "saturated": int(saturated.sum()),
        "nonfinite": int((~finite).sum()),
        "poisoned": int(poisoned.sum()),
    }


def fpaudit_counts(x: torch.Tensor, name: str) -> tuple[dict[str, int], np.ndarray]:
    vector = blockstats.block_stats(x, get_recipe(name)).numpy()
    counts = blockstats.summary(vector).to_dict()
    classes = {k: counts[k] for k in blockstats.CLASSES}
    return classes, blockstats.scale_codes(vector)


def edge_values(rows: int = 64) -> torch.Tensor:
    """Blocks of 32 built to hit every edge: maxima at every binade, ties around the
    element formats' rounding edges, fp32 subnormals, signed zeros."""
    generator = torch.Generator().manual_seed(1)
    out = torch.empty(rows, 8, 32)
    for row in range(rows):
        for block in range(8):
            # block maximum at a binade from -140 to 127 (fp32 subnormals included)
            top = -140 + (row * 8 + block) % 268
            magnitude = torch.exp2(top - torch.rand(32, generator=generator) * 40)
            values = magnitude * torch.where(torch.rand(32, generator=generator) < 0.5, -1, 1)
            values[0] = 2.0**top * (1 + (block % 8) / 8)  # mantissas of the maximum
            # ties of every element format at the floor scale of this maximum
            # (E4M3 at X = 2**(top - 8), E5M2 at 2**(top - 15), E2M1 at 2**(top - 2))
            shift = top - (8, 15, 2)[block % 3]
            for i, tie in enumerate((2.0**-10, 2.0**-6 - 2.0**-10, 464.0, 0.25, 0.75, 7.0, 6.5)):
                values[1 + i] = min(math.ldexp(tie, shift), 3e38)
            values[9] = 0.0
            values[10] = -0.0
            values[11] = 2.0**-149 * (row + 1)
            out[row, block] = values
    return out.reshape(rows, 256)


def test_floor_code_zero_follows_ocp() -> None:
    # A block whose maximum is 2**-119 (E4M3): floor scale 2**(-119 - 8) = 2**-127,
    # code 0. OCP: elements are x / 2**-127, so 2**-119 -> 2**8 = 256 (normal) and
    # 2**-128 -> 2**-1 (normal); 2**-137 -> 2**-10, the tie below E4M3's smallest
    # subnormal 2**-9: flushed. torchao divides by 2**-126 instead (its Triton
    # workaround), which would also flush 2**-136; this is fpaudit's documented rule.
    x = torch.zeros(32)
    x[0], x[1], x[2], x[3] = 2.0**-119, 2.0**-128, 2.0**-137, 2.0**-136
    counts = blockstats.summary(blockstats.block_stats(x, get_recipe("mxfp8-e4m3")).numpy())
    assert isinstance(counts, BlockCounts)
    # 2**-136 / 2**-127 = 2**-9: the smallest subnormal
    assert (counts.normal, counts.flushed, counts.subnormal, counts.zero) == (
        2,
        1,
        1,
        28,
    )
    assert counts.scales_out_of_range == 0  # 2**-127 is representable


def test_interleaved_and_sorted_pair() -> None:
    """Half 1.0 and half 2**-20, 64 values.

    MXFP8-E4M3 (floor): a block holding 1.0 gets X = 2**(0 - 8) = 2**-8, so
    2**-20 / 2**-8 = 2**-12 <= 2**-10 (half E4M3's smallest subnormal 2**-9): flushed.
    Interleaved: both blocks hold 1.0 -> 32 of 64 flushed = 50%. Sorted: the 2**-20
    block gets X = 2**(-20 - 8), its values become 2**8: 0 flushed.
    Per-tensor E4M3: multiplier 448 / 1.0 = 448; 2**-20 * 448 = 1.75 * 2**-12 <= 2**-10:
    flushed either way -> 50% and 50%.
    """
    interleaved = torch.ones(64)
    interleaved[1::2] = 2.0**-20
    ordered = interleaved.sort().values

    def flushed(x: torch.Tensor, name: str) -> int:
        return blockstats.summary(blockstats.block_stats(x, get_recipe(name)).numpy()).flushed

    assert flushed(interleaved, "mxfp8-e4m3") == 32
    assert flushed(ordered, "mxfp8-e4m3") == 0
    assert flushed(interleaved, "fp8-tensor-e4m3") == 32
    assert flushed(ordered, "fp8-tensor-e4m3") == 32


def cast_classes(x: torch.Tensor, multiplier: torch.Tensor, name: str) -> dict[str, int]:
    """A second oracle for fp32-scaled FP8 recipes: the scaled fp32 value cast with
    torch, saturating like Transformer Engine. torchao's eager quantizers are the peer
    oracle (test_blockstats_torchao.py), but its tile scales are not rounded to a power
    of two, so it agrees with fpaudit's block rule only on tiles whose ``448 / amax`` is
    one; this oracle takes fpaudit's documented rounded-down multiplier on any tensor."""
    element = get_recipe(name).element
    scaled = x * multiplier
    q = scaled.clamp(-element.max_finite, element.max_finite).to(element.dtype).double()
    return classes_from_quantized(x, q, 1 / multiplier.double(), name)


@pytest.mark.parametrize("name", ["fp8-block-1x128", "fp8-block-128x128"])
@pytest.mark.parametrize("source", ["normal", "lognormal", "edges"])
def test_fp8_block_counts_equal_torch_cast(name: str, source: str) -> None:
    if source == "normal":
        x = torch.randn(256, 384)
    elif source == "lognormal":
        x = torch.exp2(torch.randn(256, 384) * 10) * torch.randn(256, 384).sign()
    else:
        x = edge_values(256)[:, :256].reshape(256, 256)
    rows, cols = get_recipe(name).block
    tiles = x.reshape(x.shape[0] // rows, rows, x.shape[1] // cols, cols)
    amax = tiles.abs().amax(dim=(1, 3), keepdim=True)
    # a true fp32 division (torch's ``448.0 / amax`` is ``amax.reciprocal() * 448``)
    multiplier = torch.where(amax > 0, torch.tensor(448.0) / amax, torch.ones_like(amax))
    multiplier = torch.where(torch.isinf(multiplier), torch.finfo(torch.float32).max, multiplier)
    exponent = torch.frexp(multiplier)[1] - 1  # power of two, rounded down
    multiplier = torch.ldexp(torch.ones_like(multiplier), exponent).expand_as(tiles)
    expected = cast_classes(tiles, multiplier, name)
    got, _ = fpaudit_counts(x, name)
    assert got == expected


@pytest.mark.parametrize("name", ["fp8-tensor-e4m3", "fp8-tensor-e5m2", "fp8-tensor-e4m3-pow2"])
def test_fp8_tensor_counts_equal_torch_cast(name: str) -> None:
    x = torch.exp2(torch.randn(64, 100) * 8) * torch.randn(64, 100).sign()
    element = get_recipe(name).element
    multiplier = torch.tensor(element.max_finite) / x.abs().amax()
    if name.endswith("pow2"):
        multiplier = torch.tensor(2.0 ** (torch.frexp(multiplier)[1].item() - 1))
    got, codes = fpaudit_counts(x, name)
    assert got == cast_classes(x, multiplier, name)
    assert codes.sum() == 1  # one scale per tensor


def test_e2m1_thresholds_by_hand() -> None:
    # E2M1 values: 0, 0.5, 1, 1.5, 2, 3, 4, 6. Rounding edges: <= 0.25 -> 0 (tie to
    # even 0); 0.75 ties to 1.0 (even), not 0.5; >= 7 past 6 (6 = 1.1b * 2**2 is odd).
    assert (E2M1.round_to_zero_edge, E2M1.smallest_normal, E2M1.max_finite) == (0.25, 1.0, 6.0)
    assert (E2M1.overflow_edge, E2M1.overflow_edge_inclusive) == (7.0, True)
    assert (E4M3.overflow_edge, E4M3.overflow_edge_inclusive) == (464.0, False)
    assert (E5M2.overflow_edge, E5M2.overflow_edge_inclusive) == (61440.0, True)


def test_dynamic_range_and_block_counts() -> None:
    # block 0: max 3.0, smallest nonzero 2**-5 -> log2(3 / 2**-5) = 6.58 -> 6
    # block 1: all zero -> no range; block 2: 1.0 and 1.0 -> 0; inf is ignored.
    x = torch.zeros(96)
    x[0], x[1] = 3.0, 2.0**-5
    x[64], x[65], x[66] = 1.0, 1.0, float("inf")
    vector = blockstats.block_stats(x, get_recipe("mxfp8-e4m3")).numpy()
    ranges = blockstats.dynamic_ranges(vector)
    assert ranges[6] == 1 and ranges[0] == 1 and ranges.sum() == 2
    assert blockstats.summary(vector).blocks == 3


def test_stats_merge_by_summing() -> None:
    a, b = torch.randn(4, 64), torch.randn(4, 64) * 1e-6
    recipe = get_recipe("mxfp4")
    both = blockstats.block_stats(torch.cat([a, b]), recipe)
    assert torch.equal(both, blockstats.block_stats(a, recipe) + blockstats.block_stats(b, recipe))


def test_every_recipe_accounts_for_every_element() -> None:
    x = torch.randn(3, 5, 200) * torch.exp2(torch.randint(-60, 60, (3, 5, 1)).float())
    for name in [*RECIPES, "mxfp8-e4m3:col", "fp8-block-128x128:col"]:
        counts = blockstats.summary(blockstats.block_stats(x, get_recipe(name)).numpy())
        assert sum(getattr(counts, c) for c in blockstats.CLASSES) == x.numel(), name


def test_columnwise_is_rowwise_of_the_transpose() -> None:
    x = torch.randn(64, 96) * torch.exp2(torch.randint(-30, 30, (64, 1)).float())
    col = blockstats.block_stats(x, get_recipe("mxfp8-e4m3:col"))
    row = blockstats.block_stats(x.t().contiguous(), get_recipe("mxfp8-e4m3"))
    assert torch.equal(col, row)
    assert not math.isclose(
        float(col[1]), float(blockstats.block_stats(x, get_recipe("mxfp8-e4m3"))[1])
    )


@pytest.mark.parametrize("name", [*RECIPES, "mxfp8-e4m3:col", "fp8-block-128x128:col"])
def test_finite_path_equals_general_path(name: str) -> None:
    # The CPU path for finite blocks counts thresholds; the general path classifies
    # every element. Wide magnitudes (fp32 products that underflow to 0), all-zero
    # blocks and rows, and a partial block.
    wide = torch.exp2(torch.randn(130, 300) * 30) * torch.randn(130, 300).sign()
    wide[::3] = 0
    wide[:, 5:40] = 0
    recipe = get_recipe(name)
    for x in (wide, torch.randn(257, 129), torch.zeros(3, 64)):
        fast = blockstats.block_stats(x, recipe)
        assert torch.equal(fast, blockstats.block_stats(x, recipe, general=True))


def _three_paths(x: torch.Tensor, name: str) -> None:
    """The compiled CPU kernel, the pure-torch finite path and the general path agree."""
    compiled_cpu_kernel()  # skips (with the reason) where it does not build; fails in CI
    recipe = get_recipe(name)
    compiled = blockstats.block_stats(x, recipe)
    assert torch.equal(compiled, blockstats.block_stats(x, recipe, compiled=False)), name
    assert torch.equal(compiled, blockstats.block_stats(x, recipe, general=True)), name
    assert int(compiled[: len(blockstats.CLASSES)].sum()) == x.numel()


ALL_NAMES = [*RECIPES, *(f"{n}:col" for n, r in RECIPES.items() if not r.per_tensor)]


@pytest.mark.parametrize("name", ALL_NAMES)
def test_compiled_kernel_equals_torch_paths(name: str) -> None:
    generator = torch.Generator().manual_seed(7)
    patterns = torch.randint(-(2**31), 2**31 - 1, (37, 300), generator=generator)
    bits = patterns.to(torch.int32).view(torch.float32)  # every binade, inf, NaN, subnormals
    wide = torch.exp2(torch.randn(130, 300, generator=generator) * 30)
    wide = wide * torch.randn(130, 300, generator=generator).sign()
    wide[::3] = 0
    wide[:, 5:40] = 0
    wide[7, 100] = float("inf")  # one inf and one NaN block among finite ones
    wide[9, 200] = float("nan")
    subnormals = torch.exp2(-torch.arange(100, 149, dtype=torch.float32)).repeat(3, 5)
    subnormals[0, ::2] = -0.0
    for x in (
        edge_values(),  # ties of every element format, fp32 subnormals, +-0
        edge_values()[:, :250],  # partial blocks
        bits,
        wide,
        subnormals,
        torch.randn(257, 129, generator=generator),
        torch.zeros(3, 64),
        torch.tensor(float("nan")),
        torch.full((2, 40), float("inf")),
    ):
        _three_paths(x, name)


def test_compiled_kernel_on_other_dtypes_and_layouts() -> None:
    x = torch.randn(64, 96) * torch.exp2(torch.randint(-40, 40, (64, 1)).float())
    permuted = torch.randn(4, 40, 3, 32).permute(0, 2, 1, 3)  # as attention's gradients
    names = ("mxfp8-e4m3", "mxfp4:col", "nvfp4", "fp8-block-128x128", "fp8-tensor-e5m2")
    for tensor in (x.t(), x[:, ::3], x.half(), x.bfloat16(), x.double(), permuted):
        for name in (*names, "fp8-block-1x128", "fp8-tensor-e4m3-pow2"):
            _three_paths(tensor, name)


# The rules whose scale needs the tensor's maximum (a pass of its own in the kernel).
TENSOR_SCALED = ["nvfp4", *(name for name, r in RECIPES.items() if r.per_tensor)]


@pytest.mark.parametrize("name", TENSOR_SCALED)
def test_compiled_kernel_on_tensor_scale_edges(name: str) -> None:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(40, 48, generator=generator)
    with_inf = x.clone()
    with_inf[3, 5] = float("inf")  # nvfp4: tensor scale inf, finite blocks' multiplier 0
    wide = torch.exp2(torch.randn(70_001, generator=generator) * 20)  # split across threads
    wide[::5] = 0
    wide[1::7] *= -1
    for tensor in (
        x * 2.0**-130,  # fp32 subnormal maximum: the multiplier overflows fp32
        x * 2.0**120,  # the block scales leave E4M3 below 2**-6
        with_inf,
        wide,  # 70001 values: a single block read by several threads, a ragged tail
        torch.full((4, 32), -0.0),  # nvfp4: tensor scale 0, every block scale 0/0
        torch.tensor([2.0**-149, 0.0, -(2.0**-149)]),
    ):
        _three_paths(tensor, name)


def test_permuted_rows_read_in_place_with_the_same_counts() -> None:
    # (batch, heads, seq, head_dim) gradients arrive permuted; reading the rows in stride
    # order gives the contiguous copy's counts, for row blocks and for one scale per tensor.
    permuted = torch.randn(4, 40, 3, 32).permute(0, 2, 1, 3)
    for name in ("mxfp8-e4m3", "nvfp4", "fp8-block-1x128", "fp8-tensor-e4m3"):
        recipe = get_recipe(name)
        blocks, padding = blockstats._blocks(permuted, recipe)
        # a view, no copy, unless 32-value rows are padded to 128
        assert (blocks.data_ptr() == permuted.data_ptr()) == (padding == 0), name
        same = blockstats.block_stats(permuted.contiguous(), recipe)
        assert torch.equal(blockstats.block_stats(permuted, recipe), same), name


@pytest.mark.parametrize("compiled", [True, False])
def test_fp32_multiplier_is_one_true_division(compiled: bool) -> None:
    # A block maximum of 1.75 * 2**126: 448 / amax = 2**-118 exactly (the fp32 division
    # of Transformer Engine), so pow2-floor keeps 2**-118: code 254 - (127 - 118) = 245.
    # torch's ``448.0 / amax`` is ``amax.reciprocal() * 448``: the reciprocal is an fp32
    # subnormal, rounded, and the product falls just below 2**-118 (code 246).
    x = torch.zeros(128)
    x[0] = 1.75 * 2.0**126
    assert float(448.0 / x[:1]) < 2.0**-118 == float(torch.tensor(448.0) / x[:1])
    vector = blockstats.block_stats(x, get_recipe("fp8-block-1x128"), compiled=compiled)
    codes = blockstats.scale_codes(vector.numpy())
    assert codes[245] == 1 and codes.sum() == 1


def test_gate_and_plan_judge_saturation_alike_by_default() -> None:
    """One default for --max-saturate: 0 in gate and plan (a clamped value is a loss)."""
    import inspect

    from torch import nn

    import fpaudit
    from fpaudit.rules import blockplan

    gate_default = inspect.signature(blockplan.block_gate).parameters["max_saturate"].default
    plan_default = inspect.signature(blockplan.plan).parameters["max_saturate"].default
    assert gate_default == plan_default == 0.0
    # A layer whose values saturate under MXFP8-E4M3's floor scale: each 32-block's
    # maximum is 1.9 * 2**k, so it scales to 1.9 * 2**8 = 486.4 > 464: clamped to 448.
    layer = nn.Linear(32, 32, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.eye(32))
    x = torch.full((4, 32), 0.5)
    x[:, 0] = 1.9
    with fpaudit.audit(layer, recipes=["mxfp8-e4m3"]) as audit:
        loss = layer(x).sum()
        loss.backward()
        audit.step(loss=loss)
    report = audit.report
    gated = blockplan.block_gate(report, "mxfp8-e4m3", max_flush=1.0)
    assert not gated.passed  # the default judges saturation
    (offender,) = gated.offenders
    # the JSON form: the offender's numbers under its keys, as gate --recipe --json prints
    assert gated.to_dict()["offenders"] == [offender.to_dict()]
    assert list(offender.to_dict()) == [
        "module", "flush_fraction", "saturate_fraction", "flushed", "saturated", "nonzero"
    ]  # fmt: skip
    overall = blockplan.block_gate(report, "mxfp8-e4m3", max_flush=1.0, per_module=False)
    assert [o.module for o in overall.offenders] == ["(all modules)"]
    assert overall.offenders[0].saturated == gated.saturated > 0
    assert blockplan.block_gate(report, "mxfp8-e4m3", 1.0, max_saturate=1.0).passed
    planned = blockplan.plan(report, ["mxfp8-e4m3"], max_flush=1.0)
    assert planned.max_saturate == 0.0 and planned.keep  # nothing passes: stays in bf16


def test_window_merges_block_rows_exactly() -> None:
    """--window W: the block rows of W consecutive steps sum into one row (numbered by
    the window's first step), as the histogram records; a filling window is kept."""
    from torch import nn

    import fpaudit

    def scan(window: int) -> Any:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(40, 70), nn.Tanh(), nn.Linear(70, 3))
        audit = fpaudit.audit(model, recipes=["mxfp4", "fp8-block-1x128"], window=window)
        for step in range(5):
            with audit:
                model.zero_grad(set_to_none=True)
                loss = model(torch.randn(16, 40) * 2.0 ** (-step * 8)).sum()
                loss.backward()
                audit.step(loss=loss)
        return audit.report.blocks

    keys = ["kind", "module", "op", "output", "dtype", "recipe"]
    counts = list(blockstats.COUNT_COLUMNS)
    single, merged = scan(1), scan(2)
    assert sorted(set(single["step"])) == [0, 1, 2, 3, 4]
    assert sorted(set(merged["step"])) == [0, 2, 4]  # windows 0-1, 2-3 and 4 (filling)
    window_of = single["step"] // 2 * 2
    expected = single.assign(step=window_of).groupby(["step", *keys])[counts].sum()
    got = merged.set_index(["step", *keys])[counts].sort_index()
    assert len(got) == len(expected)
    assert got.equals(expected.sort_index().astype(got.dtypes.to_dict()))
    for column in blockstats.BLOCK_HISTOGRAM_COLUMNS:
        for (step, *key), group in single.assign(step=window_of).groupby(["step", *keys]):
            row = merged[(merged["step"] == step)]
            for name, value in zip(keys, key, strict=True):
                row = row[row[name] == value]
            assert np.array_equal(np.sum(np.stack(group[column].to_list()), 0), row[column].iloc[0])


def test_ranks_merge_block_rows_exactly() -> None:
    """Two ranks' parts (hand-built: one audited model each, the second as rank 1) merge
    into one report whose block table is the sum of block_stats over both ranks' values."""
    from torch import nn

    import fpaudit
    from fpaudit.report.store import _merge_ranks
    from fpaudit.rules import blockplan

    recipe = get_recipe("mxfp8-e4m3")
    parts, grads = [], []
    for rank, scale in enumerate((1.0, 2.0**-30)):
        torch.manual_seed(rank)
        layer = nn.Linear(64, 32, bias=False)
        with fpaudit.audit(layer, recipes=[recipe.name]) as audit:
            loss = layer(torch.randn(8, 64) * scale).sum()
            loss.backward()
            audit.step(loss=loss)
        part = audit.report
        assert part.blocks is not None and layer.weight.grad is not None
        part.blocks["rank"] = rank
        part.records["rank"] = rank
        part.steps["rank"] = rank
        parts.append(part)
        grads.append(layer.weight.grad)
    merged = _merge_ranks(parts, parts[0].info, parts[0].path)
    table = blockplan.block_table(merged, recipe, ("module", "kind", "op"), kind="grad")
    row = table[(table["kind"] == "grad") & (table["op"] == "weight")].iloc[0]
    expected = blockstats.summary(
        sum(blockstats.block_stats(g, recipe) for g in grads).numpy()
    ).to_dict()
    assert {k: int(row[k]) for k in expected} == expected
    assert sorted(set(merged.blocks["rank"])) == [0, 1]
