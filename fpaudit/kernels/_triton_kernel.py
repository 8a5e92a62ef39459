"""fpaudit's GPU histogram kernel (Triton): one read of every value, exact bins, finite amax.

Imported only when a GPU tensor is binned and Triton is installed (CUDA builds of
torch bring it). The bins are those of ``fpaudit.numerics.layout`` and identical to
``histogram.bin_indices`` (the pure-torch reference); the tests check that on edge
values and random bit patterns by running this kernel in Triton's interpreter
(``TRITON_INTERPRET=1``) on the CPU, and ``benchmarks/gpu_check.py`` checks it on
a GPU against the torch path.

Each program reads one block of values in their own dtype (fp16 widens to fp32 in
registers, exactly; bf16's bits are shifted into fp32's, so no conversion can flush its
subnormals) and:

* counts zeros, infs and NaNs with three reductions;
* histograms the finite nonzero values into a window of ``WINDOW - 1`` bins that
  starts at the block's smallest bin (``tl.histogram``; the cost of that grows with
  the number of bins, which is why the window is not all 2219 bins), then adds the
  window to the table with one atomic per nonzero bin;
* adds any value beyond the window (a block spanning more than 63 binades) with
  an atomic of its own;
* raises the row's amax with one ``atomic_max`` of the block's largest finite bits.

No host sync: the launch reads only shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fpaudit.numerics import layout

BLOCK = 4096
WINDOW = 512  # bins histogrammed per block; bin WINDOW - 1 takes what is not counted there
_B = layout.CLASS_LOWER_BOUNDS
_INF_BITS = 0x7F800000
# Dtypes loaded as they are; any other is converted to fp32 by torch first.
NATIVE = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _histogram_kernel(
    x_ptr,
    row_ptr,  # int64 row of the table: counts, then the amax bits column
    n,
    B1: tl.constexpr,
    B2: tl.constexpr,
    B3: tl.constexpr,
    B4: tl.constexpr,
    B5: tl.constexpr,
    B6: tl.constexpr,
    B7: tl.constexpr,
    ZERO_BIN: tl.constexpr,
    FIRST_FINITE_BIN: tl.constexpr,
    INF_BIN: tl.constexpr,
    NAN_BIN: tl.constexpr,
    AMAX_COLUMN: tl.constexpr,
    BLOCK: tl.constexpr,
    WINDOW: tl.constexpr,
    BF16: tl.constexpr,
):
    pid = tl.program_id(0)
    offsets = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    values = tl.load(x_ptr + offsets, mask=inside, other=0.0)
    if BF16:  # bf16 is the top half of fp32: widen the bits, not the value
        bits = (values.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) << 16
    else:  # fp32 as it is; fp16 widens exactly (subnormals included)
        bits = values.to(tl.float32).to(tl.int32, bitcast=True)
    bits = bits & 0x7FFFFFFF

    zero = inside & (bits == 0)
    inf = inside & (bits == 0x7F800000)
    nan = inside & (bits > 0x7F800000)
    finite = inside & (bits < 0x7F800000) & (bits != 0)

    exponent = bits >> 23
    fraction = bits & 0x7FFFFF
    # A subnormal is fraction * 2**-149; converting the integer fraction to fp32 is
    # exact and normalises it: float(fraction) = (1 + g / 2**23) * 2**j.
    normalised = fraction.to(tl.float32).to(tl.int32, bitcast=True)
    subnormal = exponent == 0
    fraction = tl.where(subnormal, normalised & 0x7FFFFF, fraction)
    offset = tl.where(subnormal, (normalised >> 23) - 127, exponent + 22)  # binade + 149
    cls = (
        (fraction >= B1).to(tl.int32)
        + (fraction >= B2).to(tl.int32)
        + (fraction >= B3).to(tl.int32)
        + (fraction >= B4).to(tl.int32)
        + (fraction >= B5).to(tl.int32)
        + (fraction >= B6).to(tl.int32)
        + (fraction >= B7).to(tl.int32)
    )
    index = FIRST_FINITE_BIN + offset * 8 + cls

    base = tl.min(tl.where(finite, index, NAN_BIN), axis=0)
    local = index - base
    windowed = finite & (local < WINDOW - 1)
    counts = tl.histogram(tl.where(windowed, local, WINDOW - 1), WINDOW)
    bins = tl.arange(0, WINDOW)
    tl.atomic_add(
        row_ptr + base + bins, counts.to(tl.int64), mask=(bins < WINDOW - 1) & (counts > 0)
    )
    beyond = finite & (local >= WINDOW - 1)
    tl.atomic_add(row_ptr + index, tl.full([BLOCK], 1, tl.int64), mask=beyond)

    n_zero = tl.sum(zero.to(tl.int64), axis=0)
    n_inf = tl.sum(inf.to(tl.int64), axis=0)
    n_nan = tl.sum(nan.to(tl.int64), axis=0)
    tl.atomic_add(row_ptr + ZERO_BIN, n_zero, mask=n_zero > 0)
    tl.atomic_add(row_ptr + INF_BIN, n_inf, mask=n_inf > 0)
    tl.atomic_add(row_ptr + NAN_BIN, n_nan, mask=n_nan > 0)
    largest = tl.max(tl.where(finite, bits, 0), axis=0).to(tl.int64)
    tl.atomic_max(row_ptr + AMAX_COLUMN, largest, mask=largest > 0)


def histogram_add(x: torch.Tensor, table: torch.Tensor, row: int) -> None:
    """Add the values of ``x`` (contiguous, 1-D, fp32/fp16/bf16, on ``table``'s device)
    to row ``row`` of ``table`` (int64, contiguous, at least ``layout.WIDTH`` columns)."""
    if x.dtype not in NATIVE:
        raise TypeError(f"histogram_add takes {NATIVE}, got {x.dtype}")
    if not (x.is_contiguous() and table.is_contiguous() and table.dtype == torch.int64):
        raise ValueError("histogram_add needs a contiguous x and a contiguous int64 table")
    n = x.numel()
    if n == 0:
        return
    _histogram_kernel[(triton.cdiv(n, BLOCK),)](
        x,
        table[row],
        n,
        B1=_B[1],
        B2=_B[2],
        B3=_B[3],
        B4=_B[4],
        B5=_B[5],
        B6=_B[6],
        B7=_B[7],
        ZERO_BIN=layout.ZERO_BIN,
        FIRST_FINITE_BIN=layout.FIRST_FINITE_BIN,
        INF_BIN=layout.INF_BIN,
        NAN_BIN=layout.NAN_BIN,
        AMAX_COLUMN=layout.AMAX_COLUMN,
        BLOCK=BLOCK,
        WINDOW=WINDOW,
        BF16=x.dtype == torch.bfloat16,
    )
