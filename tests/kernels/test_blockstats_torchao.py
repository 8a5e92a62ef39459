"""Block-scaled statistics against a peer implementation, torchao 0.18, for every
recipe: ``torchao.prototype.mx_formats`` (``to_mx`` FLOOR and RCEIL, ``nvfp4_quantize``)
for MX and NVFP4; ``torchao.float8`` (``amax_to_scale``, ``to_fp8_saturated``) for
per-tensor current scaling; ``torchao.prototype.blockwise_fp8_training``'s eager
quantizers for the 1x128 and 128x128 FP8 tiles (on tiles where its unrounded scale and
fpaudit's power-of-two one coincide; see test_fp8_block_counts_equal_torchao).

torchao is a test-only dependency (the ``test`` extra); without it these tests
skip with that reason. Classes are derived from torchao's quantized values and
decoded scales only (see tests/kernels/test_blockstats.py: classes_from_quantized).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from fpaudit.numerics.recipes import get_recipe
from tests.kernels.test_blockstats import classes_from_quantized, edge_values, fpaudit_counts

pytest.importorskip(
    "torchao.prototype.mx_formats.mx_tensor", reason="torchao (the test extra) is not installed"
)
from torchao.float8.float8_utils import amax_to_scale, to_fp8_saturated
from torchao.prototype.blockwise_fp8_training.kernels import (
    torch_blockwise_scale_act_quant_lhs,
    torch_blockwise_scale_weight_quant,
)
from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4
from torchao.prototype.mx_formats.mx_tensor import ScaleCalculationMode, to_mx
from torchao.prototype.mx_formats.nvfp4_tensor import (
    nvfp4_quantize,
    per_tensor_amax_to_scale,
)

MX = {
    "mxfp8-e4m3": (torch.float8_e4m3fn, ScaleCalculationMode.FLOOR),
    "mxfp8-e4m3-rceil": (torch.float8_e4m3fn, ScaleCalculationMode.RCEIL),
    "mxfp8-e5m2": (torch.float8_e5m2, ScaleCalculationMode.FLOOR),
    "mxfp8-e5m2-rceil": (torch.float8_e5m2, ScaleCalculationMode.RCEIL),
    "mxfp4": (torch.float4_e2m1fn_x2, ScaleCalculationMode.FLOOR),
    "mxfp4-rceil": (torch.float4_e2m1fn_x2, ScaleCalculationMode.RCEIL),
}


def torchao_mx(x: torch.Tensor, name: str) -> tuple[dict[str, int], np.ndarray]:
    """Class counts and the scale-code histogram of torchao's ``to_mx``."""
    dtype, mode = MX[name]
    codes, data = to_mx(x.contiguous(), dtype, 32, mode)
    codes = codes.view(torch.uint8).to(torch.int64)
    if dtype == torch.float4_e2m1fn_x2:
        q = f4_unpacked_to_f32(unpack_uint4(data)).reshape(x.shape).double()
    else:
        q = data.to(torch.float64)
    # torchao's own decoding of a code c is 2**(c - 127); NaN for 255.
    per_block = torch.where(
        codes == 255, float("nan"), torch.exp2(codes.double() - 127)
    ).repeat_interleave(32, dim=-1)
    per_block = per_block.reshape(x.shape)
    # dequantized: a NaN scale (code 255) makes the whole block NaN
    q = torch.where(torch.isnan(per_block), float("nan"), q)
    classes = classes_from_quantized(x, q, per_block, name)
    histogram = np.bincount(codes.flatten().numpy(), minlength=256)
    return classes, histogram


def _drop_floor_code_zero_blocks(x: torch.Tensor, name: str) -> torch.Tensor:
    """Zero out blocks whose FLOOR scale code is 0 (2**-127).

    Where the rules differ: OCP MX says code 0 is 2**-127, and fpaudit divides by
    that; torchao's FLOOR path clamps the fp32 scale to 2**-126 (the smallest
    normal, a workaround for Triton), halving those blocks' elements. Those blocks
    are checked by hand in test_floor_code_zero_follows_ocp instead."""
    dtype, mode = MX[name]
    if mode != ScaleCalculationMode.FLOOR:
        return x
    codes, _ = to_mx(x.contiguous(), dtype, 32, mode)
    keep = (codes.view(torch.uint8) != 0).repeat_interleave(32, dim=-1)
    return torch.where(keep, x, torch.zeros_like(x))


@pytest.mark.parametrize("name", list(MX))
@pytest.mark.parametrize("source", ["normal", "lognormal", "edges"])
def test_mx_counts_equal_torchao(name: str, source: str) -> None:
    if source == "normal":
        x = torch.randn(48, 256)
    elif source == "lognormal":
        x = torch.exp2(torch.randn(48, 256) * 12) * torch.randn(48, 256).sign()
    else:
        x = edge_values()
    x = _drop_floor_code_zero_blocks(x, name)
    expected, expected_codes = torchao_mx(x, name)
    got, got_codes = fpaudit_counts(x, name)
    assert got == expected
    assert np.array_equal(got_codes, expected_codes)
    assert sum(got.values()) == x.numel()


@pytest.mark.parametrize("name", list(MX))
def test_mx_nonfinite_and_adversarial_layout(name: str) -> None:
    x = torch.randn(8, 128) * 1e3
    x[0, 3] = float("inf")  # block 0: inf makes its scale 2**(128 - emax)
    x[1, 40] = float("nan")  # block 5: a NaN scale poisons the block
    x[2, 64:96] = torch.exp2(torch.arange(32.0) - 140)  # one block of fp32 subnormals + normals
    x[3, ::2] = 2.0**-30  # interleaved tiny values under large neighbours
    x = _drop_floor_code_zero_blocks(x, name)
    expected, expected_codes = torchao_mx(x, name)
    got, got_codes = fpaudit_counts(x, name)
    assert got == expected
    assert got["poisoned"] == 31  # the NaN's 31 finite block mates
    assert np.array_equal(got_codes, expected_codes)


@pytest.mark.parametrize("name", list(MX))
def test_mx_partial_blocks_are_padded_with_zeros(name: str) -> None:
    x = torch.randn(6, 70) * torch.exp2(torch.randint(-20, 20, (6, 1)).float())
    padded = torch.nn.functional.pad(x, (0, 26))  # 70 -> 96 = 3 blocks of 32
    padded = _drop_floor_code_zero_blocks(padded, name)
    x = padded[:, :70]
    expected, codes = torchao_mx(padded, name)
    expected["zero"] -= 6 * 26  # the padding is not counted
    got, got_codes = fpaudit_counts(x, name)
    assert got == expected
    assert np.array_equal(got_codes, codes)


@pytest.mark.parametrize("source", ["normal", "lognormal", "edges", "nonfinite"])
def test_nvfp4_counts_equal_torchao(source: str) -> None:
    if source == "normal":
        x = torch.randn(32, 256)
    elif source == "lognormal":
        x = torch.exp2(torch.randn(32, 256) * 6) * torch.randn(32, 256).sign()
    elif source == "edges":
        x = edge_values(32) * 2.0**-100  # keep the tensor's amax finite after scaling
    else:
        x = torch.randn(32, 256)
        x[3, 7] = float("nan")
    tensor_scale = per_tensor_amax_to_scale(x.abs().amax())
    scales, data = nvfp4_quantize(x, 16, tensor_scale)
    q = f4_unpacked_to_f32(unpack_uint4(data)).reshape(x.shape).double()
    block = scales.to(torch.float64).repeat_interleave(16, dim=-1).reshape(x.shape)
    dequant_scale = block * float(tensor_scale)
    # torchao's fp4 data of a NaN-scaled block is NaN's encoding clamped: mark it
    q = torch.where(torch.isnan(dequant_scale), float("nan"), q)
    expected = classes_from_quantized(x, q, dequant_scale, "nvfp4")
    got, codes = fpaudit_counts(x, "nvfp4")
    assert got == expected
    torchao_codes = scales.view(torch.uint8).to(torch.int64).flatten().numpy()
    assert np.array_equal(codes, np.bincount(torchao_codes, minlength=256))


def test_interleaved_and_sorted_pair_agree_with_torchao() -> None:
    # half 1.0, half 2**-20 (see tests/kernels/test_blockstats.py for the arithmetic):
    # torchao flushes 32 of 64 interleaved, 0 sorted, as fpaudit does.
    interleaved = torch.ones(64)
    interleaved[1::2] = 2.0**-20
    ordered = interleaved.sort().values
    results = []
    for x in (interleaved.reshape(2, 32), ordered.reshape(2, 32)):
        expected = torchao_mx(x, "mxfp8-e4m3")[0]
        assert expected == fpaudit_counts(x, "mxfp8-e4m3")[0]
        results.append(expected["flushed"])
    assert results == [32, 0]


# -- FP8 with fp32 scales: per-tensor current scaling and DeepSeek-style blocks ----------------
#
# torchao's float8 training path is the peer here: ``amax_to_scale`` (the multiplier
# ``fp8_max / max(amax, 1e-12)``, divided in float64 and rounded once to fp32) and
# ``to_fp8_saturated`` (the fp32 product ``x * scale`` clamped to +-fp8_max, then cast to
# nearest, ties to even), which is what ``hp_tensor_and_scale_to_float8`` applies; and its
# eager blockwise quantizers ``torch_blockwise_scale_act_quant_lhs`` (1 x 128 tiles) and
# ``torch_blockwise_scale_weight_quant`` (128 x 128), the same division and clamped cast
# per tile. fpaudit divides in fp32 once: for fp32 inputs that equals torchao's float64
# division rounded to fp32 (a quotient of 24-bit numbers rounded to 53 then 24 bits is
# correctly rounded). Where the rules differ, below.

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _code_of_scale(multiplier: torch.Tensor) -> torch.Tensor:
    """fpaudit's scale code of an fp32 multiplier ``s``: ``127 - ceil(log2 s)`` (the
    E8M0 code of the descale ``1 / s`` rounded up), clamped to [0, 254]."""
    mantissa, exponent = torch.frexp(multiplier.double())  # s = m * 2**e, m in [0.5, 1)
    return (127 - exponent + (mantissa == 0.5).to(exponent.dtype)).clamp(0, 254)


def torchao_fp8_tensor(
    x: torch.Tensor, name: str, torchao_rounds_alike: bool = True
) -> tuple[dict[str, int], int]:
    """Class counts and the scale code of torchao's per-tensor current scaling.

    ``-pow2``: torchao's unrounded scale, then rounded down to a power of two exactly
    (its fp32 exponent, ``2**(e - 1)`` from ``frexp``), the rounding fpaudit and torchao
    both document. torchao's own ``round_scales_to_power_of_2=True`` computes
    ``exp2(floor(log2(s)))`` with an fp32 ``log2``, which rounds up for a scale within a
    few ulps below a power of two (test_torchao_pow2_rounding_differs_below_a_power_of_two);
    the tests assert it agrees on their tensors (``torchao_rounds_alike``)."""
    dtype = FP8[name.split("-")[2]]
    amax = x.abs().amax()
    multiplier = amax_to_scale(amax, dtype)
    if name.endswith("-pow2"):
        pow2 = torch.ldexp(torch.tensor(1.0), torch.frexp(multiplier)[1] - 1)
        exact = torch.where(multiplier > 0, pow2, multiplier)  # 0 (inf amax) and NaN stay
        if torchao_rounds_alike:
            rounded = amax_to_scale(amax, dtype, round_scales_to_power_of_2=True)
            torch.testing.assert_close(rounded, exact, rtol=0, atol=0, equal_nan=True)
        multiplier = exact
    q = to_fp8_saturated(x * multiplier, dtype).double()
    classes = classes_from_quantized(x, q, 1 / multiplier.double(), name)
    return classes, int(_code_of_scale(multiplier))


FP8_TENSOR = ["fp8-tensor-e4m3", "fp8-tensor-e5m2", "fp8-tensor-e4m3-pow2", "fp8-tensor-e5m2-pow2"]


def fp8_edges(name: str, k: int, rows: int = 8) -> torch.Tensor:
    """Values at the element format's edges under the multiplier ``2**-k``: the tensor's
    (or block's) maximum is ``elem_max * 2**k``, so the multiplier is a power of two
    under every rule and each value below lands exactly where it is placed.

    E4M3 (smallest subnormal 2**-9, smallest normal 2**-6): 2**-10 ties to 0 (even);
    3 * 2**-10 ties up to 2**-8; 2**-6 - 2**-10 ties up to 2**-6 (normal);
    2**-6 + 2**-10 ties down to 2**-6. E5M2 (2**-16, 2**-14): the same at 2**-17,
    3 * 2**-17, 2**-14 - 2**-17, 2**-14 + 2**-17. Then +-0, fp32's smallest
    subnormal, a larger fp32 subnormal, and random magnitudes down to 2**-60 below
    the maximum (fp32 subnormals where the maximum is small)."""
    element = get_recipe(name).element
    tiny = 2.0 ** -(9 if element.max_finite == 448.0 else 16) / 2  # half the smallest subnormal
    normal = element.smallest_normal
    generator = torch.Generator().manual_seed(k + 1000)
    x = torch.exp2(-torch.rand(rows, 128, generator=generator) * 60 + k)
    x = (
        x
        * element.max_finite
        * torch.where(torch.rand(rows, 128, generator=generator) < 0.5, -1, 1)
    )
    ties = [tiny, 3 * tiny, normal - tiny, normal + tiny, 0.0, -0.0]
    x[:, 1 : 1 + len(ties)] = torch.tensor([math.ldexp(t, k) for t in ties])
    x[:, 7], x[:, 8] = 2.0**-149, -(2.0**-127)
    x[:, 0] = math.ldexp(element.max_finite, k) * torch.where(torch.arange(rows) % 2 == 0, 1, -1)
    return x


@pytest.mark.parametrize("name", FP8_TENSOR)
@pytest.mark.parametrize("source", ["normal", "lognormal", "edges", "small", "large", "nonfinite"])
def test_fp8_tensor_counts_equal_torchao(name: str, source: str) -> None:
    generator = torch.Generator().manual_seed(15)
    if source == "normal":
        x = torch.randn(64, 100, generator=generator)
    elif source == "lognormal":
        x = torch.exp2(torch.randn(64, 100, generator=generator) * 8)
        x = x * torch.randn(64, 100, generator=generator).sign()
    elif source == "edges":
        x = fp8_edges(name, 0)
    elif source == "small":  # maximum 2**-48 * elem_max, just above torchao's 1e-12 floor
        x = fp8_edges(name, -48)
    elif source == "large":  # maximum elem_max * 2**100, multiplier 2**-100
        x = fp8_edges(name, 100)
    else:  # an inf makes the multiplier 0 (everything flushes), a NaN poisons the tensor
        x = torch.randn(64, 100, generator=generator)
        x[5, 5] = float("inf") if "e4m3" in name else float("nan")
    expected, code = torchao_fp8_tensor(x, name)
    got, codes = fpaudit_counts(x, name)
    assert got == expected
    assert sum(got.values()) == x.numel()
    if source != "nonfinite":
        assert codes.sum() == 1 and codes[code] == 1  # one scale per tensor


def test_torchao_pow2_rounding_differs_below_a_power_of_two() -> None:
    # amax = 448 * 2**-10 * (1 + 2**-23): the fp32 multiplier 448 / amax is
    # 2**10 * (1 - 2**-23) = 1023.99988, just below 2**10. Rounded down: 2**9.
    # torchao's exp2(floor(log2(s))) takes an fp32 log2 = 10 - 1.7e-7, which rounds
    # to 10.0 (fp32 spacing near 10 is 2**-20 = 9.5e-7): 2**10, a power of two up.
    # The value 2**-19 then lands on 2**-10 under fpaudit's 2**9 (the tie: flushed)
    # and on 2**-9 under torchao's 2**10 (E4M3's smallest subnormal).
    x = torch.zeros(128)
    x[0] = 448 * 2.0**-10 * (1 + 2.0**-23)
    x[1] = 2.0**-19
    multiplier = amax_to_scale(x.abs().amax(), torch.float8_e4m3fn)
    assert multiplier.item() == 2.0**10 * (1 - 2.0**-23)
    rounded = amax_to_scale(x.abs().amax(), torch.float8_e4m3fn, round_scales_to_power_of_2=True)
    assert rounded.item() == 2.0**10
    got, _ = fpaudit_counts(x, "fp8-tensor-e4m3-pow2")
    assert (got["flushed"], got["subnormal"], got["normal"]) == (1, 0, 1)
    # torchao's unrounded scale with the exact rounding agrees with fpaudit
    assert torchao_fp8_tensor(x, "fp8-tensor-e4m3-pow2", torchao_rounds_alike=False)[0] == got


def test_torchao_amax_floor_differs_below_1e_12() -> None:
    # torchao clamps the amax to 1e-12 before dividing; fpaudit divides by the amax
    # itself (Transformer Engine's rule: 448 / 2**-60 = 448 * 2**60, finite in fp32).
    # fpaudit: 2**-60 -> 448 and 2**-70 -> 448 * 2**-10 = 0.4375, both normal.
    # torchao: 2**-60 * 448e12 = 3.9e-4 and 2**-70 * 448e12 = 3.8e-7, both below
    # 2**-10 = 9.8e-4: both flushed. The oracle tests therefore keep every block's and
    # tensor's maximum at or above 448 * 2**-48 = 1.6e-12.
    x = torch.zeros(64)
    x[0], x[1] = 2.0**-60, 2.0**-70
    got, _ = fpaudit_counts(x, "fp8-tensor-e4m3")
    assert (got["normal"], got["flushed"]) == (2, 0)
    assert torchao_fp8_tensor(x, "fp8-tensor-e4m3")[0]["flushed"] == 2


def with_block_amaxes(
    x: torch.Tensor, block: tuple[int, int], exponents: torch.Tensor
) -> torch.Tensor:
    """``x`` with each ``block``'s maximum |x| set to exactly ``448 * 2**k`` (``k`` from
    ``exponents``, one per block): each block divided by its own maximum (the maximum
    becomes exactly 1, the rest at most 1), then multiplied by 448 and by ``2**k``. Then
    ``448 / amax = 2**-k`` is a power of two: torchao's unrounded scale and fpaudit's
    rounded-down one are the same number."""
    rows, cols = block
    r, c = x.shape
    tiles = x.reshape(r // rows, rows, c // cols, cols)
    amax = tiles.abs().amax(dim=(1, 3), keepdim=True)
    k = exponents.reshape(r // rows, 1, c // cols, 1)
    return ((tiles / amax * 448.0) * torch.exp2(k.float())).reshape(r, c)


def torchao_fp8_block(x: torch.Tensor, name: str) -> tuple[dict[str, int], np.ndarray]:
    """Class counts and scale-code histogram of torchao's eager blockwise quantizers
    (``x`` 2-D, its sides multiples of the tile)."""
    if name == "fp8-block-1x128":
        data, descale = torch_blockwise_scale_act_quant_lhs(x.contiguous(), 128)
        per_element = descale.repeat_interleave(128, dim=-1)
    else:
        data, descale = torch_blockwise_scale_weight_quant(x.contiguous(), 128)
        per_element = descale.repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)
    # torchao returns the descale 1 / s (fp32); s itself is a power of two here
    multiplier = 1 / descale
    classes = classes_from_quantized(x, data.double(), per_element.double(), name)
    codes = _code_of_scale(multiplier).flatten().numpy()
    return classes, np.bincount(codes, minlength=256)


FP8_BLOCK = {"fp8-block-1x128": (1, 128), "fp8-block-128x128": (128, 128)}


@pytest.mark.parametrize("name", list(FP8_BLOCK))
@pytest.mark.parametrize("source", ["normal", "lognormal", "edges", "nonfinite"])
def test_fp8_block_counts_equal_torchao(name: str, source: str) -> None:
    """Where the rules coincide: torchao's tile multiplier is ``448 / amax`` unrounded;
    fpaudit's (DeepSeek-V3, Transformer Engine ``Float8BlockScaling``) rounds it down to a
    power of two, so the block maximum lands in (224, 448] instead of on 448. The two are
    the same number when ``448 / amax`` is a power of two, so every tile's maximum here is
    ``448 * 2**k`` (k from -48, above torchao's 1e-12 amax floor, to 100). Otherwise
    fpaudit's multiplier is up to 2x smaller than torchao's: fpaudit flushes more of a
    tile's small values and never saturates, which tests/kernels/test_blockstats.py checks against
    plain torch casts with the rounded-down multiplier."""
    block = FP8_BLOCK[name]
    generator = torch.Generator().manual_seed(31)
    shape = (256, 384)
    n_blocks = (shape[0] // block[0]) * (shape[1] // block[1])
    exponents = torch.randint(-48, 101, (n_blocks,), generator=generator)
    if source == "normal":
        x = torch.randn(shape, generator=generator)
    elif source == "lognormal":
        x = torch.exp2(torch.randn(shape, generator=generator) * 20)
        x = x * torch.randn(shape, generator=generator).sign()
    else:
        x = torch.randn(shape, generator=generator)
    x = with_block_amaxes(x, block, exponents)
    if source == "edges":
        # the ties, signed zeros and fp32 subnormals of fp8_edges, in every tile, at
        # the tile's own k (rows 1..6 of each 1x128 tile; the first row of each 128x128)
        rows = range(shape[0]) if block[0] == 1 else range(0, shape[0], 128)
        ties = [2.0**-10, 3 * 2.0**-10, 2.0**-6 - 2.0**-10, 2.0**-6 + 2.0**-10, 0.0, -0.0]
        k = exponents.reshape(shape[0] // block[0], shape[1] // 128)
        for row in rows:
            for tile in range(shape[1] // 128):
                kk = int(k[row // block[0], tile])
                at = tile * 128 + 64
                x[row, at : at + 6] = torch.tensor([math.ldexp(t, kk) for t in ties])
                x[row, at + 6], x[row, at + 7] = 2.0**-149, -(2.0**-130)
                # the tile's maximum may have been overwritten: put it back
                x[row, tile * 128] = math.ldexp(-448.0, kk)
    if source == "nonfinite":  # an inf tile (multiplier 0: all flushed) and a NaN tile
        x[0, 5] = float("inf")
        x[block[0], 128 + 7] = float("nan")
    expected, expected_codes = torchao_fp8_block(x, name)
    got, got_codes = fpaudit_counts(x, name)
    assert got == expected
    assert sum(got.values()) == x.numel()
    if source != "nonfinite":
        assert np.array_equal(got_codes, expected_codes)


@pytest.mark.parametrize("name", list(FP8_BLOCK))
def test_fp8_block_partial_tiles_are_padded_with_zeros(name: str) -> None:
    # torchao's quantizers take whole tiles only (1x128 reshapes the tensor to (-1, 128);
    # 128x128 asserts nothing but reshapes to whole tiles). fpaudit pads a partial tile
    # with zeros; zeros move no maximum, so torchao on the zero-padded tensor is the
    # oracle, less the padding's zeros.
    block = FP8_BLOCK[name]
    generator = torch.Generator().manual_seed(47)
    padded_shape = (256, 256)
    n_blocks = (256 // block[0]) * (256 // 128)
    exponents = torch.randint(-48, 101, (n_blocks,), generator=generator)
    x = torch.exp2(torch.randn(padded_shape, generator=generator) * 10)
    x = x * torch.randn(padded_shape, generator=generator).sign()
    rows = 200 if block[0] == 128 else 256
    x[rows:] = 0.0
    x[:, 200:] = 0.0
    # amaxes of the visible part: set on the padded tensor, whose padding is zero
    x = with_block_amaxes(x, block, exponents)
    visible = x[:rows, :200].contiguous()
    expected, codes = torchao_fp8_block(x, name)
    expected["zero"] -= x.numel() - visible.numel()
    got, got_codes = fpaudit_counts(visible, name)
    assert got == expected
    assert np.array_equal(got_codes, codes)


def test_show_recipe_module_rows_count_one_kind(cli, tmp_path, monkeypatch) -> None:
    # tests/models/block_pair.py: the backward op output (kind backward) and w's gradient
    # (kind grad) are the same 64 values, PAIR, each step. show --recipe sums one kind:
    # 2 steps x torchao's to_mx counts of PAIR, not 4 x (issue 25: nonzero 256, blocks 8).
    import pandas as pd

    from tests.conftest import MODELS
    from tests.models.block_pair import PAIR

    monkeypatch.delenv("FPAUDIT_PAIR", raising=False)
    out = tmp_path / "report"
    scanned = cli("scan", MODELS / "block_pair.py", "--steps", 2, "--recipe", "mxfp8-e4m3",
                  "--out", out)  # fmt: skip
    assert scanned.code == 0, scanned.stderr
    peer = torchao_mx(PAIR, "mxfp8-e4m3")[0]
    blocks = pd.read_parquet(out / "blocks.parquet")
    for kind in ("backward", "grad"):
        args = ["--kind", kind] if kind != "backward" else []  # backward is the default
        shown = cli("show", out, "--recipe", "mxfp8-e4m3", *args, "--json")
        assert shown.code == 0, shown.stderr
        rows = {row["module"]: row for row in json.loads(shown.stdout)}
        of_kind = blocks[blocks["kind"] == kind]
        assert set(rows) == set(of_kind["module"])
        for module, group in of_kind.groupby("module"):
            for column in ("flushed", "subnormal", "saturated", "blocks", "blocks_flushed"):
                assert rows[module][column] == group[column].sum(), (kind, module, column)
        root = rows[""]
        assert root["nonzero"] == 2 * (64 - peer["zero"]) == 128
        assert root["flushed"] == 2 * peer["flushed"] == 64  # 32 of each step's 64
        assert root["blocks"] == 2 * 2  # 64 values = 2 blocks of 32, per step
