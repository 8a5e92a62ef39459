"""Block-scaled statistics against a peer implementation: torchao 0.18's
``torchao.prototype.mx_formats`` (``to_mx`` FLOOR and RCEIL, ``nvfp4_quantize``).

torchao is a test-only dependency (the ``test`` extra); without it these tests
skip with that reason. Classes are derived from torchao's quantized values and
decoded scales only (see tests/test_blockstats.py: classes_from_quantized).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.test_blockstats import classes_from_quantized, edge_values, fpaudit_counts

pytest.importorskip(
    "torchao.prototype.mx_formats.mx_tensor", reason="torchao (the test extra) is not installed"
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
    # half 1.0, half 2**-20 (see tests/test_blockstats.py for the arithmetic):
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
