"""The histogram layout: which bin a value goes to. Plain Python and numpy, no torch.

Every value is put in one bin: zero, inf, NaN, or a finite nonzero bin given
by its *binade* (``floor(log2(|x|))``, -149..127 for fp32, subnormals
included) and its *mantissa class*, an interval of the 23-bit normalised
fraction ``g`` in ``|x| = (1 + g / 2**23) * 2**binade``.

Why classes and not just binades: scaling by ``S = 2**k`` moves a value from
binade ``b`` to binade ``b + k`` and keeps ``g``, so whether ``(x * S)``
rounds to zero or overflows in a format depends only on ``(b + k, g)``, and
within one binade only on where ``g`` sits relative to a few breakpoints.
The class lower bounds below are the union of those breakpoints over every
supported format (``tests/kernels/test_histogram.py`` re-derives them with
``formats.fate``), so counts per (binade, class) give exact underflow, flush
and overflow counts at *every* power-of-two scale:

====================  =========================================================
class lower bound     why it is a breakpoint
====================  =========================================================
``0``                 ``g == 0``: exactly a power of two. The round-to-zero
                      edge of fp16/fp8 (half the smallest subnormal) is a power
                      of two, and the tie rounds to zero.
``1``                 first value above the power of two.
``0x81``              bf16 at scales where ``x * S`` lands in fp32's subnormal
                      range: the product is first rounded to fp32's
                      ``2**-149`` grid, so up to ``g = 0x80`` it still rounds
                      down onto bf16's round-to-zero edge ``2**-134``.
``0x680001``          e4m3fn: above 464 = 1.8125 * 2**8 (tie goes to 448).
``0x700000``          e5m2: 61440 = 1.875 * 2**15 rounds up to overflow.
``0x7F8000``          bf16: (2 - 2**-8) * 2**127 rounds up to overflow.
``0x7FF000``          fp16: 65520 = (2 - 2**-11) * 2**15 rounds up to inf.
``0x7FFFFF``          bf16: fp32 rounds ``(2 - 2**-23) * 2**-127`` up to the
                      smallest normal ``2**-126``, so it is not flushed.
====================  =========================================================

The layout is part of the report schema: it is stored in every report's
metadata and checked on read.
"""

from __future__ import annotations

import math

import numpy as np

BINADE_MIN = -149  # fp32's smallest subnormal is 2**-149
BINADE_MAX = 127
N_BINADES = BINADE_MAX - BINADE_MIN + 1
CLASS_LOWER_BOUNDS = (0, 0x1, 0x81, 0x680001, 0x700000, 0x7F8000, 0x7FF000, 0x7FFFFF)
N_CLASSES = len(CLASS_LOWER_BOUNDS)
FRACTION_BITS = 23
FRACTION_MASK = (1 << FRACTION_BITS) - 1

ZERO_BIN = 0
FIRST_FINITE_BIN = 1
INF_BIN = FIRST_FINITE_BIN + N_BINADES * N_CLASSES
NAN_BIN = INF_BIN + 1
N_BINS = NAN_BIN + 1

# Columns of a histogram table row: the N_BINS counts, the finite amax bits, then
# what the shadow (fp32 re-run) and the forward phase add.
AMAX_COLUMN = N_BINS
SHADOW_CALLS_COLUMN = N_BINS + 1  # outputs re-run in fp32 (--shadow)
SHADOW_NONZERO_COLUMN = N_BINS + 2  # nonzero elements of those fp32 shadow outputs
LOST_COLUMN = N_BINS + 3  # nonzero in the shadow, zero in the real output
OVERFLOWED_COLUMN = N_BINS + 4  # finite in the shadow, inf/NaN in the real output
FIRST_NONFINITE_COLUMN = N_BINS + 5  # NEVER - (op number of its first non-finite output), max
WIDTH = N_BINS + 6
SHADOW_COLUMNS = slice(SHADOW_CALLS_COLUMN, OVERFLOWED_COLUMN + 1)
NEVER = 2**62  # so that an all-zero row means "no non-finite output seen"


def finite_bin(binade: int, cls: int) -> int:
    """Index of the bin holding binade ``binade`` and mantissa class ``cls``."""
    return FIRST_FINITE_BIN + (binade - BINADE_MIN) * N_CLASSES + cls


def bin_binade_and_class(bins: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Binade and mantissa class of finite nonzero bin indices (vectorised)."""
    offset = np.asarray(bins, dtype=np.int64) - FIRST_FINITE_BIN
    return offset // N_CLASSES + BINADE_MIN, offset % N_CLASSES


def class_bounds(cls: int) -> tuple[int, int]:
    """Inclusive range of 23-bit fractions in mantissa class ``cls``."""
    upper = CLASS_LOWER_BOUNDS[cls + 1] - 1 if cls + 1 < N_CLASSES else FRACTION_MASK
    return CLASS_LOWER_BOUNDS[cls], upper


def bin_value_bounds(binade: int, cls: int) -> tuple[float, float]:
    """Smallest and largest magnitude (both inclusive) that a finite bin can hold."""
    low, high = class_bounds(cls)
    scale = math.ldexp(1.0, binade - FRACTION_BITS)
    return ((1 << FRACTION_BITS) + low) * scale, ((1 << FRACTION_BITS) + high) * scale


def value_bounds(binade: np.ndarray, cls: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``bin_value_bounds`` for arrays of bins, exactly (float64 holds every bound)."""
    lows = np.array([class_bounds(c)[0] for c in range(N_CLASSES)], dtype=np.float64)
    highs = np.array([class_bounds(c)[1] for c in range(N_CLASSES)], dtype=np.float64)
    cls = np.asarray(cls, dtype=np.int64)
    exponent = np.asarray(binade, dtype=np.int64) - FRACTION_BITS
    return (
        np.ldexp(2.0**FRACTION_BITS + lows[cls], exponent),
        np.ldexp(2.0**FRACTION_BITS + highs[cls], exponent),
    )


def amax_from_bits(bits: np.ndarray) -> np.ndarray:
    """Turn bit patterns of |x| (< 2**31, any integer dtype) into float64 magnitudes, exactly."""
    return np.asarray(bits, dtype=np.int32).view(np.float32).astype(np.float64)
