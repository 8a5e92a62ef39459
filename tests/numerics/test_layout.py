"""fpaudit/numerics/layout.py on its own: bin indices, class bounds and value bounds, exactly.

The oracle is the IEEE fp32 bit layout itself (numpy's float32 view of an integer):
a normal value's binade is its biased exponent - 127 and its mantissa class is where
its 23 fraction bits fall among ``CLASS_LOWER_BOUNDS``.
"""

from __future__ import annotations

import bisect
import itertools

import numpy as np
import pytest

from fpaudit.numerics import layout
from fpaudit.numerics.layout import (
    BINADE_MAX,
    BINADE_MIN,
    CLASS_LOWER_BOUNDS,
    FIRST_FINITE_BIN,
    INF_BIN,
    N_BINS,
    N_CLASSES,
    NAN_BIN,
)


def _bits(value: float) -> int:
    return int(np.array([value], dtype=np.float32).view(np.int32)[0])


def test_the_bin_indices_are_zero_finite_bins_inf_nan_in_that_order() -> None:
    assert (BINADE_MIN, BINADE_MAX, N_CLASSES) == (-149, 127, 8)
    assert layout.ZERO_BIN == 0 and FIRST_FINITE_BIN == 1
    assert INF_BIN == 1 + 277 * 8 == 2217 and NAN_BIN == 2218 and N_BINS == 2219
    assert layout.WIDTH == N_BINS + 6


def test_finite_bin_and_its_inverse_cover_every_finite_bin_once() -> None:
    pairs = [(b, c) for b in range(BINADE_MIN, BINADE_MAX + 1) for c in range(N_CLASSES)]
    indices = [layout.finite_bin(b, c) for b, c in pairs]
    assert indices == list(range(FIRST_FINITE_BIN, INF_BIN))  # contiguous, binade-major
    binades, classes = layout.bin_binade_and_class(np.array(indices))
    assert list(zip(binades.tolist(), classes.tolist(), strict=True)) == pairs


def test_the_classes_partition_the_23_bit_fraction() -> None:
    bounds = [layout.class_bounds(c) for c in range(N_CLASSES)]
    assert bounds[0] == (0, 0) and bounds[1] == (1, 0x80) and bounds[-1] == (0x7FFFFF, 0x7FFFFF)
    assert bounds[4] == (0x700000, 0x7F7FFF)
    for (_, high), (low, _) in itertools.pairwise(bounds):
        assert low == high + 1
    assert all(low <= high for low, high in bounds)


@pytest.mark.parametrize("binade", [-126, -24, -1, 0, 1, 15, 127])
def test_each_normal_bins_bounds_are_the_fp32_values_at_its_class_edges(binade: int) -> None:
    for cls in range(N_CLASSES):
        low, high = layout.bin_value_bounds(binade, cls)
        for value, fraction in ((low, layout.class_bounds(cls)[0]),
                                (high, layout.class_bounds(cls)[1])):  # fmt: skip
            assert float(np.float32(value)) == value  # an fp32 value, exactly
            bits = _bits(value)
            assert (bits >> 23) - 127 == binade and bits & 0x7FFFFF == fraction
            # and the oracle puts that value back into this very bin
            assert bisect.bisect_right(CLASS_LOWER_BOUNDS, bits & 0x7FFFFF) - 1 == cls


def test_known_bounds() -> None:
    assert layout.bin_value_bounds(0, 0) == (1.0, 1.0)
    assert layout.bin_value_bounds(0, 1) == (1 + 2.0**-23, 1 + 0x80 * 2.0**-23)
    assert layout.bin_value_bounds(15, 6)[0] == 65520.0  # fp16's round-to-inf edge
    # e4m3fn's overflow edge: the first fp32 value above 464 (its tie goes down to 448)
    assert layout.bin_value_bounds(8, 3)[0] == float(
        np.nextafter(np.float32(464), np.float32(np.inf))
    )
    assert layout.bin_value_bounds(BINADE_MIN, 0) == (2.0**-149, 2.0**-149)
    assert layout.bin_value_bounds(BINADE_MAX, 7)[1] == float(np.finfo(np.float32).max)


def test_value_bounds_is_bin_value_bounds_for_every_bin() -> None:
    binades, classes = layout.bin_binade_and_class(np.arange(FIRST_FINITE_BIN, INF_BIN))
    lows, highs = layout.value_bounds(binades, classes)
    expected = [
        layout.bin_value_bounds(int(b), int(c)) for b, c in zip(binades, classes, strict=True)
    ]
    assert lows.tolist() == [low for low, _ in expected]
    assert highs.tolist() == [high for _, high in expected]
    assert (lows[1:] > highs[:-1]).all()  # the bins are ordered and do not overlap


def test_amax_from_bits_is_the_fp32_value_of_those_bits() -> None:
    rng = np.random.default_rng(0)
    values = np.abs(rng.standard_normal(1000).astype(np.float32)) * np.float32(2.0**-60)
    bits = values.view(np.int32).astype(np.int64)  # any integer dtype
    assert (layout.amax_from_bits(bits) == values.astype(np.float64)).all()
    edge = layout.amax_from_bits(np.array([0, 1, 0x00800000, 0x7F7FFFFF], dtype=np.int64))
    assert edge.tolist() == [0.0, 2.0**-149, 2.0**-126, float(np.finfo(np.float32).max)]
