"""Exact per-block statistics of one tensor under one block-scaled recipe.

:func:`block_stats` turns a tensor into one int64 vector (on the tensor's
device, no host sync) that counts, for a :class:`~fpaudit.numerics.recipes.Recipe`:

* every element in exactly one class: ``zero`` (it was 0), ``flushed``
  (nonzero, quantized to 0), ``subnormal`` (quantized to a nonzero subnormal of
  the element format), ``normal``, ``saturated`` (it would round beyond the
  element format's largest value, and is clamped), ``nonfinite`` (inf or NaN
  already) and ``poisoned`` (finite, but its block's scale is NaN: the block
  held a NaN, or an inf under NVFP4);
* ``blocks``, ``blocks_flushed`` (blocks with at least one flushed element) and
  ``scales_out_of_range`` (a nonzero finite block whose ideal scale left the
  scale format: E8M0 below ``2**-127``; NVFP4's E4M3 block scale below
  ``2**-6`` or above 448; an fp32 multiplier that overflowed);
* a histogram of the blocks' scale codes (E8M0 biased exponents; E4M3 bit
  patterns for NVFP4; for fp32 scales the biased exponent of the dequantization
  scale, ``floor``);
* a histogram of each block's dynamic range,
  ``floor(log2(block_amax / block_min_nonzero))`` over its finite nonzero values.

Vectors add exactly, so steps, calls and ranks merge by summing.

The arithmetic is the reference implementations' (see :mod:`fpaudit.numerics.recipes`),
in the same fp32 operations, so the scaled value is bit for bit the one they
cast; that value is then classified with exact thresholds of the element format
(round to nearest, ties to even), which is what the cast does. A partial block
is padded with zeros (padding never changes a block's maximum) and the padding
is not counted.

A recipe with stochastic rounding (``nvfp4-sr``) gets :func:`expected_block_stats`
instead: the same vector in float64, whose flushed, subnormal, normal, saturated and
blocks_flushed entries are expected counts over the rounding's random draws.

Known limitations: tensors are read as fp32 (fp64 values beyond fp32 count as
inf). Expected counts are float64 (CPU and CUDA; MPS has no float64).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from fpaudit.numerics.recipes import E8M0_BIAS, Recipe
from fpaudit.report.records import (
    BLOCK_COUNT_COLUMNS,
    BLOCK_HISTOGRAM_COLUMNS,
    BLOCK_HISTOGRAM_WIDTHS,
    BLOCK_KEY_COLUMNS,
    BlockCounts,
    Window,
)

if TYPE_CHECKING:
    import torch

COUNT_COLUMNS = BLOCK_COUNT_COLUMNS  # the report's columns, in this order
CLASSES = COUNT_COLUMNS[:7]  # zero, flushed, subnormal, normal, saturated, nonfinite, poisoned
BLOCK_COUNTS = COUNT_COLUMNS[7:]  # blocks, blocks_flushed, scales_out_of_range
N_SCALE_CODES = BLOCK_HISTOGRAM_WIDTHS["scale_codes"]
N_RANGES = BLOCK_HISTOGRAM_WIDTHS["dynamic_range"]
SCALE_OFFSET = len(COUNT_COLUMNS)
RANGE_OFFSET = SCALE_OFFSET + N_SCALE_CODES
WIDTH = RANGE_OFFSET + N_RANGES
_FP32_MAX_BITS = 0x7F7FFFFF


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """2**exponent as fp32, exactly, for integer exponents in [-149, 127]."""
    import torch

    exponent = exponent.to(torch.int32)
    normal = torch.bitwise_left_shift(exponent.clamp(min=-126) + 127, 23)
    tiny = torch.bitwise_left_shift(torch.ones_like(exponent), (exponent + 149).clamp(0, 22))
    return torch.where(exponent >= -126, normal, tiny).view(torch.float32)


def _fields(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The biased exponent and the fraction bits of non-negative fp32 values."""
    import torch

    bits = values.view(torch.int32)
    return torch.bitwise_right_shift(bits, 23) & 0xFF, bits & 0x7FFFFF


def _blocks(tensor: torch.Tensor, recipe: Recipe) -> tuple[torch.Tensor, int]:
    """The tensor as fp32 blocks ``[n_blocks, block_elements]`` and the padding added."""
    import torch
    import torch.nn.functional as F

    rows, cols = recipe.block
    if (
        rows == 1  # not per tensor (its block is 0 x 0)
        and recipe.orientation == "rowwise"
        and tensor.dtype == torch.float32
        and tensor.dim() > 0
        and tensor.shape[-1] % cols == 0
        and tensor.is_contiguous()
    ):  # the usual case, whole blocks of fp32 rows in place: what the steps below give
        return tensor.detach().view(-1, cols), 0
    x = tensor.detach().to(torch.float32)
    if recipe.per_tensor:  # any order of the values: the strides' order reads them in place
        return _by_stride(x, x.dim()).reshape(1, -1), 0
    if recipe.block[0] == 1 and recipe.orientation == "rowwise" and x.dim() > 1:
        # Any order of the rows gives the same statistics: a permuted tensor (attention's
        # gradients are) becomes a view instead of a copy.
        x = _by_stride(x, x.dim() - 1)
    flat = x.reshape(1, -1) if x.dim() == 0 else x.reshape(-1, x.shape[-1])
    if recipe.orientation == "columnwise":
        flat = flat.t()
    pad_rows = -flat.shape[0] % rows
    pad_cols = -flat.shape[1] % cols
    if pad_rows or pad_cols:
        flat = F.pad(flat, (0, pad_cols, 0, pad_rows))
    n_rows, n_cols = flat.shape
    if rows == 1:
        blocks = flat.reshape(-1, cols)
    else:
        blocks = (
            flat.reshape(n_rows // rows, rows, n_cols // cols, cols)
            .permute(0, 2, 1, 3)
            .reshape(-1, rows * cols)
        )
    return blocks, n_rows * n_cols - tensor.numel()


def _by_stride(x: torch.Tensor, leading: int) -> torch.Tensor:
    """``x`` with its first ``leading`` dimensions in decreasing stride order (a view)."""
    strides = x.stride()
    order = sorted(range(leading), key=lambda d: -strides[d])
    return x.permute([*order, *range(leading, x.dim())])


def block_scales(
    blocks: torch.Tensor, absolute: torch.Tensor, recipe: Recipe
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per block: the fp32 multiplier applied to its elements, the scale code,
    whether the scale left its format's range, and the block's maximum |x| (NaN if
    it holds a NaN), all of shape ``[n_blocks]``."""
    return scales_from_amax(absolute.amax(dim=1), recipe)  # NaN if the block holds one


def scales_from_amax(
    amax: torch.Tensor, recipe: Recipe
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """As :func:`block_scales`, from each block's maximum |x| (fp32 ``[n_blocks]``)."""
    import torch

    block_amax = amax
    finite_nonzero = torch.isfinite(amax) & (amax > 0)
    element = recipe.element
    rule = recipe.scale_rule
    if rule == "mx-floor":  # OCP: X = 2**(floor(log2(amax)) - emax), clamped
        biased, _ = _fields(amax)
        unbiased = biased - E8M0_BIAS - recipe.element_max_pow2
        out_of_range = finite_nonzero & (unbiased < -E8M0_BIAS)
        code = (unbiased.clamp(-E8M0_BIAS, E8M0_BIAS + 1) + E8M0_BIAS).masked_fill(
            torch.isnan(amax), 255
        )
        multiplier = _pow2(E8M0_BIAS - code.clamp(max=254))
        multiplier = multiplier.masked_fill(code == 255, float("nan"))
    elif rule == "mx-rceil":  # X = 2**ceil(log2(amax / elem_max)), exact round-up
        descale = amax / element.max_finite
        biased, fraction = _fields(descale)
        ceil = biased - E8M0_BIAS + (fraction > 0).to(biased.dtype)
        # An fp32 subnormal descale rounds up to 2**-126 above 2**-127, else to code 0.
        subnormal = biased == 0
        half = 1 << 22  # the fraction of 2**-127
        tiny_exponent = torch.where(fraction > half, -E8M0_BIAS + 1, -E8M0_BIAS)
        exponent = torch.where(subnormal, tiny_exponent, ceil.clamp(-E8M0_BIAS, E8M0_BIAS))
        code = exponent + E8M0_BIAS
        out_of_range = finite_nonzero & subnormal & (fraction < half)
        code = code.masked_fill(torch.isinf(descale), 254).masked_fill(torch.isnan(descale), 255)
        # Transformer Engine's exp2f_rcp (and torchao): code 0 multiplies by 1, inf by 2**-127.
        multiplier = torch.where(code == 0, torch.ones_like(amax), _pow2(E8M0_BIAS - code))
        multiplier = multiplier.masked_fill(code == 254, 2.0**-127)
        multiplier = multiplier.masked_fill(code == 255, float("nan"))
    elif rule == "nvfp4":
        e4m3_max = 448.0
        tensor_scale = amax.amax() / (e4m3_max * element.max_finite)
        scaled = (amax / element.max_finite) / tensor_scale
        smallest = 2.0**-6  # E4M3's smallest normal (torchao's E4M3_EPS)
        out_of_range = finite_nonzero & ((scaled < smallest) | (scaled > e4m3_max))
        scale_e4m3 = scaled.clamp(smallest, e4m3_max).to(torch.float8_e4m3fn)
        code = scale_e4m3.view(torch.uint8).to(torch.int64)
        multiplier = (1.0 / tensor_scale) / scale_e4m3.to(torch.float32)
    else:  # fp32 multiplier elem_max / amax, as Transformer Engine computes it
        if rule == "amax" or rule == "amax-pow2":
            amax = amax.amax().expand(amax.shape)
            finite_nonzero = torch.isfinite(amax) & (amax > 0)
        # A true fp32 division, as Transformer Engine's; ``float / tensor`` in torch is
        # ``reciprocal() * float``, two roundings, which can differ in the last bit.
        multiplier = amax.new_full((), element.max_finite) / amax
        out_of_range = finite_nonzero & torch.isinf(multiplier)
        fp32_max = torch.tensor(_FP32_MAX_BITS, dtype=torch.int32, device=amax.device)
        multiplier = torch.where(torch.isinf(multiplier), fp32_max.view(torch.float32), multiplier)
        multiplier = multiplier.masked_fill(amax == 0, 1.0)
        if rule != "amax":  # power of two, rounded down: keep the exponent bits
            multiplier = (multiplier.view(torch.int32) & ~0x7FFFFF).view(torch.float32)
        biased, fraction = _fields(multiplier)
        code = (2 * E8M0_BIAS - biased - (fraction > 0).to(biased.dtype)).clamp(0, 254)
        code = code.masked_fill(torch.isnan(amax), 255)
        multiplier = multiplier.masked_fill(torch.isnan(amax), float("nan"))
    return multiplier, code.to(torch.int64), out_of_range, block_amax


def block_stats(
    tensor: torch.Tensor, recipe: Recipe, *, general: bool = False, compiled: bool = True
) -> torch.Tensor:
    """The statistics vector (int64 ``[WIDTH]``, on the tensor's device): see the module.

    On the CPU the compiled kernel (:mod:`fpaudit.kernels.build`, ``FPAUDIT_KERNEL``)
    computes every count in one pass over the values (two for nvfp4 and the
    per-tensor rules, whose scales need the tensor's maximum first). Without
    it (or with ``compiled=False``), blocks whose maximum and scale are all finite
    (the usual case) take a pure-torch path of a few passes (threshold counts); any
    inf, NaN or degenerate scale, any other device, or ``general`` takes the
    general path, which needs no host sync. On CUDA the Triton block kernel
    (:mod:`fpaudit.kernels._triton_blocks`: MX and pow2-floor recipes) takes one pass where
    Triton is available; nvfp4 and per-tensor recipes take the general path. All give
    the same counts (the tests check)."""
    import torch

    if recipe.expected:
        return expected_block_stats(tensor, recipe, general=general, compiled=compiled)
    device = tensor.device
    if tensor.numel() == 0:
        return torch.zeros(WIDTH, dtype=torch.int64, device=device)
    blocks, padding = _blocks(tensor, recipe)
    if compiled and not general and device.type == "cpu" and recipe.scale_rule in _KERNEL_RULES:
        from fpaudit.kernels import build as kernels

        kernel = kernels.cpu_kernel()
        if kernel is not None:
            return _compiled_stats(kernel, blocks.contiguous(), recipe, padding)
    if compiled and not general and device.type == "cuda":
        done = _device_stats(blocks, recipe, padding)
        if done is not None:
            return done
    absolute = blocks.abs()
    multiplier, code, out_of_range, amax = block_scales(blocks, absolute, recipe)
    fast = not general and device.type == "cpu"
    if fast:  # a CPU "sync" only reads memory; finite block maxima: finite elements
        fast = bool(torch.isfinite(multiplier).all()) and bool(torch.isfinite(amax).all())
    if fast:
        counts, ranges = _finite_stats(absolute, amax, multiplier, recipe, padding)
    else:
        counts, ranges = _general_stats(blocks, absolute, multiplier, recipe, padding)
    blocks_row = torch.stack([torch.tensor(blocks.shape[0], device=device), out_of_range.sum()])
    scale_codes = torch.bincount(code, minlength=N_SCALE_CODES)
    # blocks without a finite nonzero value went to bin N_RANGES: dropped
    range_counts = torch.bincount(ranges.to(torch.int64), minlength=N_RANGES + 1)[:N_RANGES]
    return torch.cat(
        [counts[:7], blocks_row[:1], counts[7:], blocks_row[1:], scale_codes, range_counts]
    ).to(torch.int64)


def block_stats_add(tensor: torch.Tensor, recipe: Recipe, total: torch.Tensor) -> None:
    """Add :func:`block_stats` of ``tensor`` to ``total`` (``[WIDTH]``, int64, or float64
    for expected counts, on the tensor's device) in place.

    On the CPU kernel's path the kernel adds into ``total`` itself: no vector is
    allocated, converted or added per call (a recorder adds every captured tensor)."""
    import torch

    if (
        total.dtype == torch.int64
        and not recipe.expected
        and tensor.device.type == "cpu"
        and recipe.scale_rule in _KERNEL_RULES
        and tensor.numel() > 0
    ):
        from fpaudit.kernels import build as kernels

        kernel = kernels.cpu_kernel()
        if kernel is not None:
            blocks, padding = _blocks(tensor, recipe)
            _compiled_stats(kernel, blocks.contiguous(), recipe, padding, total)
            return
    total += block_stats(tensor, recipe).to(total.dtype)


def expected_block_stats(
    tensor: torch.Tensor, recipe: Recipe, *, general: bool = False, compiled: bool = True
) -> torch.Tensor:
    """:func:`block_stats` under stochastic rounding of the elements (float64 ``[WIDTH]``).

    The scale of each block, and so the scaled fp32 value ``v`` of each element, is
    the round-to-nearest recipe's. An element then rounds to the representable
    magnitude above ``|v|`` with probability ``(|v| - lo) / (hi - lo)``, else to the
    one below; each draw is independent. So, with ``s`` the element format's smallest
    subnormal and ``n`` its smallest normal (E2M1: 0.5 and 1.0), over the live
    (finite, nonzero, finite-scale) elements:

    * expected flushed: ``sum(1 - |v| / s)`` over ``|v| < s`` (an fp32 product of 0
      flushes for sure);
    * expected normal from the last subnormal interval: ``sum((|v| - (n - s)) / s)``
      over ``n - s < |v| < n``; the rest of ``[s, n)`` is subnormal;
    * expected saturated: the clamp at the largest value ``m`` keeps the rounding from
      going past it; an element counts as saturated with the probability that it would
      have rounded past ``m`` to the next value ``m'`` the format would have (E2M1: 6,
      8): ``sum((|v| - m) / (m' - m))`` over ``m < |v| < m'``, plus every ``|v| >= m'``;
    * expected normal: every other live element, less the above;
    * expected blocks with a flushed element: ``sum over blocks of
      1 - prod(1 - p_flush)``.

    zero, nonfinite, poisoned, blocks, scales out of range and both histograms do
    not depend on the rounding: they are the round-to-nearest recipe's counts.
    Sums are float64 in torch's order: within ``k * 2**-53`` of the exact sum of ``k``
    terms, relative (the tests compare with exact rationals). ``general`` and
    ``compiled`` choose the path of the round-to-nearest counts (see :func:`block_stats`)."""
    import dataclasses

    import torch

    nearest = dataclasses.replace(recipe, rounding="nearest")
    vector = block_stats(tensor, nearest, general=general, compiled=compiled).to(torch.float64)
    if tensor.numel() == 0:
        return vector
    blocks, _ = _blocks(tensor, recipe)
    absolute = blocks.abs()
    multiplier, _, _, _ = block_scales(blocks, absolute, recipe)
    scaled = (absolute * multiplier.unsqueeze(1)).to(torch.float64)  # the fp32 product
    live = torch.isfinite(blocks) & (blocks != 0) & torch.isfinite(multiplier).unsqueeze(1)
    element = recipe.element
    step = element.smallest_subnormal  # the spacing below the smallest normal
    last_subnormal = element.smallest_normal - step
    zero = torch.zeros((), dtype=torch.float64, device=scaled.device)
    below = live & (scaled < step)
    p_flush = torch.where(below, 1.0 - scaled / step, zero)
    rising = live & (scaled > last_subnormal) & (scaled < element.smallest_normal)
    p_normal = torch.where(rising, (scaled - last_subnormal) / step, zero)
    p_subnormal = torch.where(below, scaled / step, zero) + torch.where(
        live & (scaled >= step) & (scaled < element.smallest_normal), 1.0 - p_normal, zero
    )
    top, beyond = (
        element.max_finite,
        element.max_finite + 2.0 ** (element.max_exp - element.mantissa_bits),
    )
    past = live & (scaled > top) & (scaled < beyond)
    p_saturated = torch.where(past, (scaled - top) / (beyond - top), zero)
    saturated = p_saturated.sum() + (live & (scaled >= beyond)).sum().to(torch.float64)
    flushed, subnormal = p_flush.sum(), p_subnormal.sum()
    normal = live.sum().to(torch.float64) - flushed - subnormal - saturated
    blocks_flushed = (1.0 - torch.prod(1.0 - p_flush, dim=1)).sum()
    index = {name: i for i, name in enumerate(COUNT_COLUMNS)}
    for name, value in (
        ("flushed", flushed),
        ("subnormal", subnormal),
        ("normal", normal),
        ("saturated", saturated),
        ("blocks_flushed", blocks_flushed),
    ):
        vector[index[name]] = value
    return vector


# the kernel's rule ids; amax-pow2 is pow2-floor over one block
_KERNEL_RULES = {
    "mx-floor": 0,
    "mx-rceil": 1,
    "pow2-floor": 2,
    "amax-pow2": 2,
    "nvfp4": 3,
    "amax": 4,
}


def _device_stats(blocks: torch.Tensor, recipe: Recipe, padding: int) -> torch.Tensor | None:
    """The vector from the Triton block kernel (:mod:`fpaudit.kernels._triton_blocks`), or None
    where it is unavailable, does not cover ``recipe``, or failed (a warning, once)."""
    import warnings

    import torch

    from fpaudit.kernels import build as kernels

    kernel = kernels.device_block_kernel()
    if kernel is None or not kernel.covers(recipe):
        return None
    out = torch.zeros(WIDTH, dtype=torch.int64, device=blocks.device)
    try:
        kernel.block_stats_add(
            blocks.contiguous(), recipe, padding, out, SCALE_OFFSET, RANGE_OFFSET
        )
    except Exception as error:  # Triton too old for the kernel, no compiler, ...
        kernels.device_block_kernel_failed(error)
        warnings.warn(
            f"fpaudit: the Triton block-statistics kernel failed "
            f"({kernels.device_block_failure()}); using the pure-torch path",
            stacklevel=3,
        )
        return None
    return out


def _compiled_stats(
    kernel: Any,
    blocks: torch.Tensor,
    recipe: Recipe,
    padding: int,
    total: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`block_stats` with the CPU kernel, every scale rule: one pass where a
    block's scale depends on that block alone, a first pass for the tensor's maximum
    where it does not (nvfp4, per-tensor). Added to ``total`` (int64 ``[WIDTH]``) in
    place and returned when given, else a new vector."""
    element = recipe.element
    arguments = (
        blocks,
        _KERNEL_RULES[recipe.scale_rule],
        element.max_finite,
        recipe.element_max_pow2,
        element.round_to_zero_edge,
        element.smallest_normal - element.smallest_subnormal / 2,
        element.overflow_edge,
        element.overflow_edge_inclusive,
        padding,
    )
    if total is None:
        return kernel.block_stats(*arguments)  # type: ignore[no-any-return]  # compiled
    kernel.block_stats_add(*arguments, total)
    return total


def _finite_stats(
    absolute: torch.Tensor,
    amax: torch.Tensor,
    multiplier: torch.Tensor,
    recipe: Recipe,
    padding: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts (zero..poisoned, blocks_flushed) and block dynamic ranges, all finite.

    Threshold counts, one comparison and one count each: ``flushed`` is
    ``scaled <= edge`` less the zeros (counted from x: a tiny nonzero x can make an
    fp32 product of 0, which is flushed, not zero). A block flushes something iff
    its smallest nonzero value, scaled, is at or below the edge (the fp32 product
    is monotonic), so blocks need no per-element counts."""
    import torch

    element = recipe.element
    scaled = absolute * multiplier.unsqueeze(1)
    zero = torch.count_nonzero(absolute == 0)
    flushed = torch.count_nonzero(scaled <= element.round_to_zero_edge) - zero
    below_normal = element.smallest_normal - element.smallest_subnormal / 2
    subnormal = torch.count_nonzero(scaled < below_normal) - zero - flushed
    edge = element.overflow_edge
    saturated = torch.count_nonzero(
        (scaled >= edge) if element.overflow_edge_inclusive else (scaled > edge)
    )
    normal = scaled.numel() - zero - flushed - subnormal - saturated
    # Smallest nonzero per block from the bits: (bits - 1) & 0x7FFFFFFF sends 0 to the top.
    bits = absolute.view(torch.int32) - 1
    bits &= 0x7FFFFFFF
    bottom_bits = bits.amin(dim=1) + 1
    has_values = bottom_bits != 0x7FFFFFFF + 1  # wraps: an all-zero block
    bottom = bottom_bits.view(torch.float32)
    blocks_flushed = torch.count_nonzero(
        has_values & (bottom * multiplier <= element.round_to_zero_edge)
    )
    nothing = torch.zeros((), dtype=zero.dtype, device=zero.device)
    counts = torch.stack(
        [zero - padding, flushed, subnormal, normal, saturated, nothing, nothing, blocks_flushed]
    )
    ranges = _log2_ratio(amax, bottom.masked_fill(~has_values, 1.0))
    return counts, ranges.masked_fill(~has_values, N_RANGES)


def _log2_ratio(top: torch.Tensor, bottom: torch.Tensor) -> torch.Tensor:
    """floor(log2(top / bottom)) exactly: ea - eb - (ma < mb), a = ma * 2**ea, ma in [0.5, 1)."""
    import torch

    top_mantissa, top_exponent = torch.frexp(top)
    bottom_mantissa, bottom_exponent = torch.frexp(bottom)
    return top_exponent - bottom_exponent - (top_mantissa < bottom_mantissa).to(torch.int32)


def _general_stats(
    blocks: torch.Tensor,
    absolute: torch.Tensor,
    multiplier: torch.Tensor,
    recipe: Recipe,
    padding: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`_finite_stats`, for any values and scales (inf, NaN, NaN scales)."""
    import torch

    scaled = absolute * multiplier.unsqueeze(1)
    element = recipe.element
    finite = torch.isfinite(blocks)
    nonzero = finite & (blocks != 0)
    poisoned = nonzero & ~torch.isfinite(multiplier).unsqueeze(1)
    live = nonzero & ~poisoned
    flushed = live & (scaled <= element.round_to_zero_edge)
    edge = element.overflow_edge
    saturated = live & ((scaled >= edge) if element.overflow_edge_inclusive else (scaled > edge))
    # Below the midpoint of the largest subnormal and the smallest normal (the tie
    # rounds up to the normal: its last bit is even).
    below_normal = scaled < element.smallest_normal - element.smallest_subnormal / 2
    subnormal = live & ~flushed & below_normal
    n_live = live.sum()
    n_flushed, n_subnormal, n_saturated = flushed.sum(), subnormal.sum(), saturated.sum()
    counts = torch.stack(
        [
            (finite & (blocks == 0)).sum() - padding,
            n_flushed,
            n_subnormal,
            n_live - n_flushed - n_subnormal - n_saturated,
            n_saturated,
            (~finite).sum(),
            poisoned.sum(),
            flushed.any(dim=1).sum(),
        ]
    )
    has_values = nonzero.any(dim=1)
    top = absolute.masked_fill(~nonzero, 0.0).amax(dim=1).masked_fill(~has_values, 1.0)
    bottom = absolute.masked_fill(~nonzero, float("inf")).amin(dim=1)
    ranges = _log2_ratio(top, bottom.masked_fill(~has_values, 1.0))
    return counts, ranges.masked_fill(~has_values, N_RANGES)


def empty() -> np.ndarray:
    return np.zeros(WIDTH, dtype=np.int64)


def summary(vector: np.ndarray) -> BlockCounts:
    """The named counts of a statistics vector (host side): ints, or floats for the
    expected counts of :func:`expected_block_stats`."""
    return BlockCounts(*(vector[i].item() for i in range(len(COUNT_COLUMNS))))


def scale_codes(vector: np.ndarray) -> np.ndarray:
    return vector[SCALE_OFFSET:RANGE_OFFSET]


def dynamic_ranges(vector: np.ndarray) -> np.ndarray:
    return vector[RANGE_OFFSET:]


@dataclass
class _Vectors:
    """One key's statistics vectors (a row per recipe) merged over a window: they add."""

    vectors: np.ndarray

    def merge(self, other: _Vectors) -> None:
        self.vectors += other.vectors


class BlockRecorder:
    """Per record key, the summed statistics vectors of every requested recipe.

    ``add`` queues device work only; ``close_step`` makes one transfer per device
    and keeps the step's rows on the host. Counts add exactly, so a record key
    called many times in a step, and steps and ranks later, merge by summing.
    """

    def __init__(self, recipes: tuple[Recipe, ...], window: int = 1) -> None:
        self.recipes = recipes
        self.window = window  # merge this many consecutive closed steps into one row each
        self._expected = any(recipe.expected for recipe in recipes)  # float64 vectors
        # Each key's running total, zeroed and reused step after step (allocating one per
        # key per step cost more than a small tensor's statistics); ``_open``: the keys
        # added in the open step, in the order they came.
        self._totals: dict[Any, torch.Tensor] = {}
        self._open: dict[Any, torch.Tensor] = {}
        # the window filling, on the host: keyed by record key alone (the statistics are of
        # the values as held; unlike the records, two loss scales do not split a row)
        self._window: Window[Any, _Vectors] = Window(window)
        self._rank = 0
        self._rows: dict[str, list[Any]] = {
            name: [] for name in (*BLOCK_KEY_COLUMNS, *COUNT_COLUMNS, *BLOCK_HISTOGRAM_COLUMNS)
        }

    def add(self, key: Any, tensor: torch.Tensor) -> None:
        import torch

        total = self._open.get(key)
        if total is None:
            total = self._totals.get(key)
            if total is None or total.device != tensor.device:
                # int64 counts stay exact in float64 (below 2**53), beside expected counts
                dtype = torch.float64 if self._expected else torch.int64
                shape = (len(self.recipes), WIDTH)
                total = self._totals[key] = torch.zeros(shape, dtype=dtype, device=tensor.device)
            self._open[key] = total
        for row, recipe in enumerate(self.recipes):
            block_stats_add(tensor, recipe, total[row])

    def discard_open(self) -> None:
        """Drop the open step's statistics (a step discarded before it closed): nothing
        of it reaches a row, nor the next step's totals."""
        open_rows, self._open = self._open, {}
        for total in open_rows.values():
            total.zero_()

    def close_step(self, step: int, rank: int, keep: bool = True) -> None:
        """Move the open step's statistics to host rows (dropped unless ``keep``).

        With ``window`` W > 1, W consecutive closed steps (kept or not, as the
        records count them) sum into one row per key, numbered by the window's first
        step, as the histogram records of ``--window`` are."""
        open_rows, self._open = self._open, {}
        host_rows: dict[Any, np.ndarray] = {}
        if keep:
            import torch

            by_device: dict[Any, list[Any]] = {}
            for key, device_vectors in open_rows.items():
                by_device.setdefault(device_vectors.device, []).append(key)
            for keys in by_device.values():  # one transfer per device
                host = torch.stack([open_rows[key] for key in keys]).cpu().numpy()
                host_rows.update(zip(keys, host, strict=True))
        for total in open_rows.values():  # the stack copied them: ready for the next step
            total.zero_()
        if self.window == 1:
            for key, vectors in host_rows.items():
                self._add_rows(step, rank, key, vectors)
            return
        cells = ((key, _Vectors(vectors.copy())) for key, vectors in host_rows.items())
        full = self._window.add_step(step, cells)
        self._rank = rank
        for key, cell in (full or {}).items():
            self._add_rows(self._window.first, rank, key, cell.vectors)

    def _add_rows(self, step: int, rank: int, key: Any, host: np.ndarray) -> None:
        for recipe, vector in zip(self.recipes, host, strict=True):
            row = {
                "rank": rank,
                "step": step,
                "kind": key.kind,
                "module": key.module,
                "node": key.node,
                "op": key.op,
                "output": key.output,
                "dtype": key.dtype,
                "recipe": recipe.name,
                **summary(vector).to_dict(),
                "scale_codes": scale_codes(vector).astype(np.int64),
                "dynamic_range": dynamic_ranges(vector).astype(np.int64),
            }
            for name, values in self._rows.items():
                values.append(row[name])

    def columns(self) -> dict[str, list[Any]]:
        """The rows so far; a window still filling is included as it stands."""
        columns = {name: list(values) for name, values in self._rows.items()}
        if self._window.cells:
            rows, self._rows = self._rows, columns
            try:
                for key, cell in self._window.cells.items():
                    self._add_rows(self._window.first, self._rank, key, cell.vectors)
            finally:
                self._rows = rows
        return columns
