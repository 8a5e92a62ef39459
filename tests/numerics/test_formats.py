"""Formats: thresholds pinned by hand, and the rounding model against torch's casts."""

from __future__ import annotations

import math

import pytest
import torch

from fpaudit.errors import UsageError
from fpaudit.numerics.formats import (
    FORMATS,
    FP32,
    SATURATING_CAST_SINCE,
    Fate,
    Format,
    fate,
    get_format,
)


def test_spellings_are_exactly_the_cli_ones() -> None:
    assert list(FORMATS) == ["fp16", "bf16", "fp8_e4m3fn", "fp8_e5m2"]


@pytest.mark.parametrize(
    ("name", "dtype"),
    [("fp16", torch.float16), ("bf16", torch.bfloat16), ("fp8_e4m3fn", torch.float8_e4m3fn),
     ("fp8_e5m2", torch.float8_e5m2), ("fp32", torch.float32)],
)  # fmt: skip
def test_the_written_out_formats_are_torch_finfo(name: str, dtype: torch.dtype) -> None:
    written = FP32 if name == "fp32" else FORMATS[name]
    assert Format.from_dtype(name, dtype, written.overflow_result) == written
    assert written.dtype is dtype


# (mantissa bits, log2 smallest normal, smallest subnormal, round-to-zero edge,
#  max finite, overflow edge, tie at the edge overflows?)
PINNED = {
    # fp16: 10 fraction bits; subnormal 2**-14 * 2**-10 = 2**-24; edge 2**-25;
    # max (2 - 2**-10) * 2**15 = 65504; next would be 65536, halfway 65520;
    # 65504's last mantissa bit is 1 (odd), so the tie goes up: inclusive.
    "fp16": (10, -14, 2.0**-24, 2.0**-25, 65504.0, 65520.0, True),
    # bf16: 7 fraction bits; subnormal 2**-126 * 2**-7 = 2**-133; max (2 - 2**-7) * 2**127.
    "bf16": (
        7,
        -126,
        2.0**-133,
        2.0**-134,
        (2 - 2.0**-7) * 2.0**127,
        (2 - 2.0**-8) * 2.0**127,
        True,
    ),
    # e4m3fn: 3 bits; subnormal 2**-6 * 2**-3 = 2**-9; max 1.75 * 2**8 = 448 (mantissa 110, even):
    # halfway to 480 is 464 and the tie rounds to even 448: exclusive.
    "fp8_e4m3fn": (3, -6, 2.0**-9, 2.0**-10, 448.0, 464.0, False),
    # e5m2: 2 bits; subnormal 2**-14 * 2**-2 = 2**-16; max 1.75 * 2**15 = 57344 (mantissa 11, odd).
    "fp8_e5m2": (2, -14, 2.0**-16, 2.0**-17, 57344.0, 61440.0, True),
}


@pytest.mark.parametrize("name", list(PINNED))
def test_thresholds_pinned_by_hand(name: str) -> None:
    fmt = FORMATS[name]
    bits, min_exp, subnormal, to_zero, max_finite, edge, inclusive = PINNED[name]
    assert fmt.mantissa_bits == bits
    assert fmt.min_normal_exp == min_exp
    assert fmt.smallest_normal == 2.0**min_exp
    assert fmt.smallest_subnormal == subnormal
    assert fmt.round_to_zero_edge == to_zero
    assert fmt.max_finite == max_finite
    assert fmt.overflow_edge == edge
    assert fmt.overflow_edge_inclusive is inclusive


def test_unknown_format_names_the_known_ones() -> None:
    with pytest.raises(
        UsageError, match=r"unknown format 'fp9'; known: fp16, bf16, fp8_e4m3fn, fp8_e5m2"
    ):
        get_format("fp9")


def _torch_fate(name: str, value: float) -> Fate:
    fmt = FORMATS[name]
    y = torch.tensor(value, dtype=torch.float32)
    cast = y.to(fmt.dtype).float()
    if cast == 0:
        return Fate.UNDERFLOW
    saturated = fmt.overflow_result == "saturate" and abs(value) > fmt.overflow_edge
    if not torch.isfinite(cast) or saturated:
        return Fate.OVERFLOW
    return Fate.SUBNORMAL if abs(value) < fmt.smallest_normal else Fate.NORMAL


def _split(value: float) -> tuple[int, int]:
    mantissa, exponent = math.frexp(value)
    return exponent - 1, int((mantissa * 2 - 1) * 2**23)


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("fp16", 2.0**-25, Fate.UNDERFLOW),  # the tie rounds to even zero
        ("fp16", 2.0**-25 * (1 + 2.0**-23), Fate.SUBNORMAL),  # just above rounds up to 2**-24
        ("fp16", 2.0**-14, Fate.NORMAL),
        ("fp16", 2.0**-14 * (1 - 2.0**-24), Fate.SUBNORMAL),
        ("fp16", 65519.99609375, Fate.NORMAL),  # largest fp32 below 65520
        ("fp16", 65520.0, Fate.OVERFLOW),
        ("bf16", (2 - 2.0**-8) * 2.0**127, Fate.OVERFLOW),
        ("bf16", (2 - 2.0**-7) * 2.0**127, Fate.NORMAL),
        ("fp8_e4m3fn", 464.0, Fate.NORMAL),  # tie to even 448
        ("fp8_e4m3fn", 464.03125, Fate.OVERFLOW),
        ("fp8_e4m3fn", 2.0**-10, Fate.UNDERFLOW),
        ("fp8_e5m2", 61440.0, Fate.OVERFLOW),
        ("fp8_e5m2", 61439.99609375, Fate.NORMAL),
        ("fp8_e5m2", 2.0**-17, Fate.UNDERFLOW),
    ],
)
def test_fate_of_edge_values_matches_torch(name: str, value: float, expected: Fate) -> None:
    assert _torch_fate(name, value) == expected
    binade, fraction = _split(value)
    assert fate(FORMATS[name], binade, fraction) == expected


def test_bf16_double_rounding_through_fp32_subnormals() -> None:
    # x = (1 + 2**-16) * 2**-20 times S = 2**-114 is (1 + 2**-16) * 2**-134: below fp32's
    # normal range, so the fp32 product keeps 15 fraction bits: (2**15 + 0.5) * 2**-149 is a
    # tie and rounds to even 2**15 * 2**-149 = 2**-134, bf16's round-to-zero tie: zero.
    x = torch.tensor((1 + 2.0**-16) * 2.0**-20, dtype=torch.float32)
    assert (x * torch.tensor(2.0**-114)).to(torch.bfloat16).item() == 0.0
    assert fate(FORMATS["bf16"], -134, 0x80) == Fate.UNDERFLOW
    assert fate(FORMATS["bf16"], -134, 0x81) == Fate.SUBNORMAL


def test_round_is_nearest_even() -> None:
    fp16 = FORMATS["fp16"]
    # 1 + 2**-11 is halfway between 1 and 1 + 2**-10: even (1) wins; 1 + 3 * 2**-11 goes up.
    assert fp16.round(2**11 + 1, -11) == (2**10, -10)
    assert fp16.round(2**11 + 3, -11) == (2**10 + 2, -10)
    assert fp16.round(1, -26) == (0, 0)
    assert fp16.round(1, 16) is None


def test_fp8_e4m3fn_overflow_is_overflow_whatever_torch_casts_it_to() -> None:
    """torch's eager cast ``aten._to_copy`` to float8_e4m3fn past 464 gives NaN up to
    torch 2.12 (2.10.0, 2.11.0, 2.12.1 checked) and saturates to 448 from 2.13.0
    (2.13.0, 2.14.1, 2.15.0 checked). fpaudit's count does not lean on either: both
    are overflow, from its own arithmetic."""
    release = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    cast = torch.tensor([500.0, 1e6]).to(torch.float8_e4m3fn).float()
    if release < (2, 13):
        assert torch.isnan(cast).all(), cast
    else:
        assert cast.tolist() == [448.0, 448.0]
    assert fate(FORMATS["fp8_e4m3fn"], *_split(500.0)) == Fate.OVERFLOW
    assert fate(FORMATS["fp8_e4m3fn"], *_split(1e6)) == Fate.OVERFLOW


def test_a_recipes_scale_codes_read_as_its_scale_format_says() -> None:
    from fpaudit.numerics.recipes import E8M0_BIAS, RECIPES

    # E8M0 codes carry a bias of 127 (code 127 is 2^0); nvfp4's codes are E4M3 bits
    biases = {name: recipe.scale_code_bias for name, recipe in RECIPES.items()}
    assert {name for name, bias in biases.items() if bias == 0} == {"nvfp4", "nvfp4-sr"}
    assert E8M0_BIAS == 127 and biases["mxfp8-e4m3"] == 127


@pytest.mark.parametrize("name", list(FORMATS))
def test_the_overflow_note_is_torchs_cast_past_the_edge(name: str) -> None:
    fmt = FORMATS[name]
    past = torch.tensor([fmt.max_finite * 4.0]).to(fmt.dtype).float().item()
    if math.isinf(past):
        assert fmt.overflow_note is None
        return
    # no inf: this torch saturates or, before the release the note names, gives NaN
    since = SATURATING_CAST_SINCE.get(name)
    release = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    if since is not None and release < tuple(int(p) for p in since.split(".")):
        assert math.isnan(past)
    else:
        assert past == fmt.max_finite
    assert fmt.overflow_result == "saturate"
    releases = f" (torch {since} on; NaN before)" if since else ""
    assert fmt.overflow_note == (
        f"{name} has no inf: torch's cast saturates at {fmt.max_finite:g}{releases}."
    )


@pytest.mark.parametrize("name", list(FORMATS))
def test_fp32_range_is_fp32s_finfo_exponents(name: str) -> None:
    fmt, fp32 = FORMATS[name], torch.finfo(torch.float32)
    info = torch.finfo(fmt.dtype)
    same = (
        info.smallest_normal == fp32.smallest_normal
        and math.frexp(info.max)[1] == (math.frexp(fp32.max)[1])
    )
    assert fmt.fp32_range == same
    assert fmt.fp32_range == (name == "bf16")


def test_a_formats_limits_are_its_thresholds_under_their_json_names() -> None:
    fp16 = FORMATS["fp16"]
    assert fp16.limits.to_dict() == {
        "format": "fp16", "dtype": "float16", "smallest_subnormal": 2.0**-24,
        "round_to_zero_edge": 2.0**-25, "smallest_normal": 2.0**-14, "max_finite": 65504.0,
        "overflow_edge": 65520.0, "overflow_edge_inclusive": True, "overflow_result": "inf",
    }  # fmt: skip
