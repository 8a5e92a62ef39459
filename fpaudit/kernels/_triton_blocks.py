"""Triton kernel for block-scaled statistics on CUDA (:mod:`fpaudit.kernels.blockstats`).

It covers the rules whose scale depends on its block alone: ``mx-floor`` and
``mx-rceil`` (E8M0 scales; any element format: E4M3, E5M2, E2M1) and ``pow2-floor``
(1x128 and 128x128), rowwise and columnwise: :func:`block_stats_add` takes the
blocks as :func:`blockstats._blocks` lays them out (fp32 ``[n_blocks, k]``) and
adds the whole statistics vector (layout of :mod:`fpaudit.kernels.blockstats`) to an int64
device buffer with atomics; no host sync. ``nvfp4`` and the per-tensor rules
(``amax``, ``amax-pow2``), whose scales need the whole tensor's maximum, keep the
pure-torch path on CUDA. The tests run it in Triton's interpreter against the
pure-torch reference (``tests/kernels/test_triton_kernel.py``); ``benchmarks/gpu_check.py``
compares it on a GPU with the CPU kernel.

Each program takes ``ROWS`` blocks and, per block: its maximum |x| bits, the scale
(code, out-of-range flag and the multiplier's log2) as ``blockstats.scales_from_amax``
computes it, then every element's class, the flushed flag and the dynamic range.

Exactness does not lean on the GPU's fp32 division or denormal handling (Triton's
``/`` on fp32 may lower to an approximate division, and libdevice may flush
subnormals):

* values are rebuilt in fp64 from their bits (``mantissa * 2**exponent``, always an
  fp64 normal), and every multiplier of these rules is a power of two, so the scaled
  value ``x * m`` is exact in fp64. fp32 would round it only below ``2**-126``, far
  under every element format's flush edge, so each threshold comparison agrees with
  the reference's fp32 product;
* the scale's quotients (``amax / elem_max``, ``elem_max / amax``) are fp64
  divisions (IEEE on GPUs) rounded once to fp32: for a division, rounding the
  correctly rounded fp64 quotient to fp32 gives the correctly rounded fp32 quotient.
  A quotient below fp32's normal range is rounded to a subnormal by hand (the
  ``2**52`` trick rounds to nearest even).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fpaudit.numerics.recipes import Recipe

RULES = {"mx-floor": 0, "mx-rceil": 1, "pow2-floor": 2}  # the rules this kernel covers
TILE = 2048  # elements per program (ROWS blocks of the block size, rounded up to 2**k)


@triton.jit
def _pow2_f64(exponent):
    """2**exponent as fp64 (exponent int64 in [-1022, 1023])."""
    return ((exponent + 1023) << 52).to(tl.float64, bitcast=True)


@triton.jit
def _exact_f64(bits):
    """Non-negative finite fp32 bits (int64) as the exact fp64 value."""
    biased = bits >> 23
    mantissa = (bits & 0x7FFFFF) | tl.where(biased != 0, 1 << 23, 0)
    return mantissa.to(tl.float64) * _pow2_f64(tl.maximum(biased, 1) - 150)


@triton.jit
def _log2_parts(bits):
    """floor(log2 x) and the 23 fraction bits of the normalised significand of x > 0
    (finite fp32 bits, int32): as frexp, so ranges compare exactly."""
    biased = bits >> 23
    fraction = bits & 0x7FFFFF
    normalised = fraction.to(tl.float32).to(tl.int32, bitcast=True)  # exact, normal
    subnormal = biased == 0
    exponent = tl.where(subnormal, (normalised >> 23) - 127 - 149, biased - 127)
    return exponent, tl.where(subnormal, normalised & 0x7FFFFF, fraction)


@triton.jit
def _block_kernel(
    x_ptr,
    out_ptr,
    n_blocks,
    k,
    padding,
    ELEMENT_MAX: tl.constexpr,  # the element format's constants (exact in fp32)
    ZERO_EDGE: tl.constexpr,  # scaled <= this flushes
    BELOW_NORMAL: tl.constexpr,  # scaled < this (and above ZERO_EDGE) is subnormal
    OVERFLOW_EDGE: tl.constexpr,
    RULE: tl.constexpr,
    EMAX_POW2: tl.constexpr,
    INCLUSIVE: tl.constexpr,
    ROWS: tl.constexpr,
    K: tl.constexpr,
    SCALE_OFFSET: tl.constexpr,
    RANGE_OFFSET: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    columns = tl.arange(0, K)
    row_ok = rows < n_blocks
    inside = row_ok[:, None] & (columns[None, :] < k)
    values = tl.load(x_ptr + rows[:, None] * k + columns[None, :], mask=inside, other=0.0)
    bits = values.to(tl.int32, bitcast=True) & 0x7FFFFFFF

    # the block's scale, from its largest |x| bits (NaN bits exceed inf's)
    amax_bits = tl.max(bits, axis=1)
    nan = amax_bits > 0x7F800000
    finite_nonzero = (amax_bits < 0x7F800000) & (amax_bits != 0)
    zero_multiplier = amax_bits < 0  # all False; pow2-floor sets it for an inf maximum
    if RULE == 0:  # mx-floor
        unbiased = (amax_bits >> 23) - 127 - EMAX_POW2
        out_of_range = finite_nonzero & (unbiased < -127)
        code = tl.where(nan, 255, tl.minimum(tl.maximum(unbiased, -127), 128) + 127)
        log2_multiplier = 127 - tl.minimum(code, 254)
    elif RULE == 1:  # mx-rceil: the fp32 quotient amax / elem_max, its exponent rounded up
        amax = _exact_f64(tl.where(finite_nonzero, amax_bits, 0).to(tl.int64))
        quotient = amax / ELEMENT_MAX
        tiny = quotient < 2.0**-126  # an fp32 subnormal (or 0): round it to 2**-149 steps
        steps = (tl.where(tiny, quotient, 0.0) * 2.0**149 + 2.0**52) - 2.0**52  # to nearest even
        fraction_tiny = steps.to(tl.int32)
        descale = quotient.to(tl.float32).to(tl.int32, bitcast=True)
        biased = descale >> 23
        fraction = descale & 0x7FFFFF
        ceil = tl.minimum(tl.maximum(biased - 127 + (fraction > 0).to(tl.int32), -127), 127)
        half = 1 << 22
        rounded_up_to_normal = fraction_tiny == 1 << 23  # the quotient rounds to 2**-126
        exponent = tl.where(
            tiny,
            tl.where(rounded_up_to_normal | (fraction_tiny > half), -126, -127),
            ceil,
        )
        out_of_range = finite_nonzero & tiny & ~rounded_up_to_normal & (fraction_tiny < half)
        code = exponent + 127
        code = tl.where(amax_bits == 0x7F800000, 254, code)
        code = tl.where(descale >= 0x7F800000, 254, code)  # a finite amax overflowing
        code = tl.where(nan, 255, code)
        log2_multiplier = tl.where(code == 0, 0, tl.where(code == 254, -127, 127 - code))
    else:  # pow2-floor: elem_max / amax in fp32, overflow clamped, rounded down to 2**e
        amax = _exact_f64(tl.where(finite_nonzero, amax_bits, 1).to(tl.int64))
        quotient = ELEMENT_MAX / amax
        # fp32 rounds to inf from the midpoint of its largest value and 2**128 (a tie
        # goes to the even 2**128)
        overflow = finite_nonzero & (quotient >= (2 - 2.0**-24) * 2.0**127)
        quotient = tl.minimum(quotient, (2 - 2.0**-23) * 2.0**127)
        multiplier = quotient.to(tl.float32).to(tl.int32, bitcast=True)
        out_of_range = overflow
        biased = tl.where(overflow, 254, multiplier >> 23)
        biased = tl.where(amax_bits == 0, 127, biased)  # an all-zero block multiplies by 1
        zero_multiplier = amax_bits == 0x7F800000  # elem_max / inf = 0
        code = tl.where(zero_multiplier, 254, tl.minimum(tl.maximum(254 - biased, 0), 254))
        code = tl.where(nan, 255, code)
        log2_multiplier = biased - 127
    poisoned_block = nan  # every rule's multiplier is finite unless the block holds a NaN

    # each element, scaled exactly in fp64 (see the module)
    zero = inside & (bits == 0)
    nonfinite = inside & (bits >= 0x7F800000)
    live = inside & (bits != 0) & (bits < 0x7F800000)
    factor = _pow2_f64(log2_multiplier.to(tl.int64))
    factor = tl.where(zero_multiplier, 0.0, factor)
    scaled = _exact_f64(tl.where(live, bits, 0).to(tl.int64)) * factor[:, None]
    counted = live & ~poisoned_block[:, None]
    flushed = counted & (scaled <= ZERO_EDGE)
    subnormal = counted & (scaled > ZERO_EDGE) & (scaled < BELOW_NORMAL)
    if INCLUSIVE:
        saturated = counted & (scaled >= OVERFLOW_EDGE)
    else:
        saturated = counted & (scaled > OVERFLOW_EDGE)
    normal = counted & ~flushed & ~subnormal & ~saturated
    poisoned = live & poisoned_block[:, None]

    n_zero = tl.sum(tl.sum(zero.to(tl.int64), axis=1), axis=0)
    n_zero -= tl.where(pid == 0, padding, 0).to(tl.int64)
    flushed_rows = tl.sum(flushed.to(tl.int32), axis=1) > 0
    tl.atomic_add(out_ptr + 0, n_zero)
    tl.atomic_add(out_ptr + 1, tl.sum(tl.sum(flushed.to(tl.int64), axis=1), axis=0))
    tl.atomic_add(out_ptr + 2, tl.sum(tl.sum(subnormal.to(tl.int64), axis=1), axis=0))
    tl.atomic_add(out_ptr + 3, tl.sum(tl.sum(normal.to(tl.int64), axis=1), axis=0))
    tl.atomic_add(out_ptr + 4, tl.sum(tl.sum(saturated.to(tl.int64), axis=1), axis=0))
    tl.atomic_add(out_ptr + 5, tl.sum(tl.sum(nonfinite.to(tl.int64), axis=1), axis=0))
    tl.atomic_add(out_ptr + 6, tl.sum(tl.sum(poisoned.to(tl.int64), axis=1), axis=0))
    tl.atomic_add(out_ptr + 7, tl.sum(row_ok.to(tl.int64), axis=0))
    tl.atomic_add(out_ptr + 8, tl.sum((row_ok & flushed_rows).to(tl.int64), axis=0))
    tl.atomic_add(out_ptr + 9, tl.sum((row_ok & out_of_range).to(tl.int64), axis=0))
    ones = tl.full([ROWS], 1, tl.int64)
    tl.atomic_add(out_ptr + SCALE_OFFSET + code, ones, mask=row_ok)

    # dynamic range: floor(log2(top / bottom)) over the block's finite nonzero values
    top = tl.max(tl.where(live, bits, 0), axis=1)
    bottom = tl.min(tl.where(live, bits, 0x7FFFFFFF), axis=1)
    has_values = row_ok & (top != 0)
    top_exponent, top_fraction = _log2_parts(tl.where(has_values, top, 1))
    bottom_exponent, bottom_fraction = _log2_parts(tl.where(has_values, bottom, 1))
    ranges = top_exponent - bottom_exponent - (top_fraction < bottom_fraction).to(tl.int32)
    tl.atomic_add(out_ptr + RANGE_OFFSET + ranges, ones, mask=has_values)


def covers(recipe: Recipe) -> bool:
    """True when this kernel computes ``recipe``'s statistics (else the torch path)."""
    return recipe.scale_rule in RULES and not recipe.per_tensor


def block_stats_add(
    blocks: torch.Tensor,
    recipe: Recipe,
    padding: int,
    out: torch.Tensor,
    scale_offset: int,
    range_offset: int,
) -> None:
    """Add the statistics vector of ``blocks`` (contiguous fp32 ``[n_blocks, k]``, as
    :func:`blockstats._blocks` gives them, ``padding`` of them zeros added) under
    ``recipe`` (see :func:`covers`) to ``out`` (contiguous int64, on the same device):
    the 10 counts, the scale codes from ``scale_offset`` and the ranges from
    ``range_offset`` (blockstats' layout, which it passes in: blockstats imports this
    module, not the other way round)."""
    if not covers(recipe):
        raise ValueError(f"the Triton block kernel does not cover recipe {recipe.name!r}")
    if not (blocks.dtype == torch.float32 and blocks.dim() == 2 and blocks.is_contiguous()):
        raise ValueError("block_stats_add needs contiguous 2-D float32 blocks")
    if not (out.dtype == torch.int64 and out.is_contiguous() and out.dim() == 1):
        raise ValueError("block_stats_add needs a contiguous 1-D int64 vector")
    n_blocks, k = blocks.shape
    if n_blocks == 0:
        return
    # plain int arithmetic: triton.next_power_of_2 and triton.cdiv are ConstexprFunctions,
    # each about 1.7 µs a call from Python, twice a recorded tensor
    width = 1 << (k - 1).bit_length()  # the smallest power of two >= k (k >= 1)
    rows = max(1, TILE // width)
    element = recipe.element
    _block_kernel[(-(-n_blocks // rows),)](
        blocks,
        out,
        n_blocks,
        k,
        padding,
        ELEMENT_MAX=float(element.max_finite),
        ZERO_EDGE=float(element.round_to_zero_edge),
        BELOW_NORMAL=float(element.smallest_normal - element.smallest_subnormal / 2),
        OVERFLOW_EDGE=float(element.overflow_edge),
        RULE=RULES[recipe.scale_rule],
        EMAX_POW2=recipe.element_max_pow2,
        INCLUSIVE=bool(element.overflow_edge_inclusive),
        ROWS=rows,
        K=width,
        SCALE_OFFSET=scale_offset,
        RANGE_OFFSET=range_offset,
        num_warps=4 if width * rows <= 2048 else 8,
    )
