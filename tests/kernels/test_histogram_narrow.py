"""The CPU kernel's paths per dtype and size (issue 55): fp16/bf16/fp8 counted by bit
pattern or widened a block at a time, large fp32 tensors by their top 16 bits (the values
those cannot bin by raw bin), mid-sized ones by raw bin folded once, small ones directly. Each is compared, exactly, with an oracle that shares no fpaudit code
(numpy's frexp of the values cast to float64 by torch) and with the pure-torch path."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from fpaudit.kernels import histogram as H
from fpaudit.numerics.layout import CLASS_LOWER_BOUNDS

from ..conftest import compiled_cpu_kernel
from ..oracle import edge_values

SMALL = 2048  # the kernel's one-block path: at most this many values
PATTERN_MIN_16 = 1 << 15  # a 16-bit tensor of this many values and more: pattern counts
FP32_PATTERN_MIN = 1 << 15  # an fp32 tensor of this many values and more: top-16-bit counts


@pytest.fixture(autouse=True)
def _kernel() -> None:
    compiled_cpu_kernel()  # fails where the kernel is required, skips elsewhere


@contextmanager
def first_pass(vectorised: bool) -> Iterator[None]:
    """Large fp32 tensors' first pass with AVX-512 (where the CPU has it) or portable."""
    kernel = compiled_cpu_kernel()
    before = kernel.set_vector_split(vectorised)
    try:
        yield
    finally:
        kernel.set_vector_split(before)


def oracle(x: torch.Tensor) -> tuple[np.ndarray, float]:
    """Dense counts and finite amax of ``x`` from its float64 values (torch's cast, exact
    for every dtype here): |v| = m * 2**e with m in [0.5, 1) (frexp, exact, subnormals
    normalised), so binade e - 1 and 23-bit fraction (2m - 1) * 2**23, whose class is the
    number of class lower bounds at or below it, minus one."""
    v = np.abs(x.detach().to(torch.float64).reshape(-1).numpy())
    counts = np.zeros(H.N_BINS, dtype=np.int64)
    finite = np.isfinite(v) & (v != 0)
    m, e = np.frexp(v[finite])
    fraction = ((2 * m - 1) * 2.0**23).astype(np.int64)
    cls = np.searchsorted(np.array(CLASS_LOWER_BOUNDS), fraction, side="right") - 1
    bins = H.FIRST_FINITE_BIN + ((e - 1) + 149) * H.N_CLASSES + cls
    np.add.at(counts, bins, 1)
    counts[H.ZERO_BIN] = int((v == 0).sum())
    counts[H.INF_BIN] = int(np.isinf(v).sum())
    counts[H.NAN_BIN] = int(np.isnan(v).sum())
    amax = float(v[np.isfinite(v)].max()) if np.isfinite(v).any() else 0.0
    return counts, amax


def kernel_and_torch(x: torch.Tensor) -> tuple[H.HostHistogram, H.HostHistogram, H.HistogramTable]:
    """``x`` through ``HistogramTable.add`` (the kernel) and the pure-torch CPU path."""
    table = H.HistogramTable(torch.device("cpu"), capacity=2)
    kernel, fallback = table.new_row(), table.new_row()
    table.add(kernel, x)
    table._add_cpu_torch(fallback, x)
    rows, _ = table.collect()
    return (
        H.HostHistogram.from_row(rows[kernel].copy(), 1),
        H.HostHistogram.from_row(rows[fallback].copy(), 1),
        table,
    )


def assert_exact(x: torch.Tensor) -> None:
    kernel, fallback, table = kernel_and_torch(x)
    counts, amax = oracle(x)
    assert np.array_equal(kernel.counts, counts)
    assert np.array_equal(fallback.counts, counts)
    assert kernel.amax == fallback.amax == amax
    # The row's span (what closing a step reads) holds every nonzero finite bin.
    nonzero = table.nonzero_bins()
    assert nonzero is not None
    first = nonzero.row == 0
    finite = np.flatnonzero(counts[H.FIRST_FINITE_BIN : H.INF_BIN])
    assert np.array_equal(nonzero.offset[first], finite)
    assert np.array_equal(nonzero.count[first], counts[H.FIRST_FINITE_BIN + finite])


def every_pattern(dtype: torch.dtype) -> torch.Tensor:
    bits = 8 * torch.empty((), dtype=dtype).element_size()
    storage = torch.int16 if bits == 16 else torch.uint8
    return torch.arange(-(1 << (bits - 1)), 1 << (bits - 1)).to(storage).view(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_every_16_bit_pattern_on_every_path(dtype: torch.dtype) -> None:
    x = every_pattern(dtype)  # 65,536 values: both signs of every magnitude, inf, NaN
    assert_exact(x)  # counted by pattern
    assert_exact(x.repeat(3))  # each pattern three times
    for start in range(0, x.numel(), 20_000):  # widened a block at a time (2,049 .. 32,767)
        assert_exact(x[start : start + 20_000])
    for start in range(0, x.numel(), SMALL):  # the one-block path
        assert_exact(x[start : start + SMALL])


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3fn", "e5m2"])
def test_every_fp8_pattern_on_every_path(dtype: torch.dtype) -> None:
    x = every_pattern(dtype)
    assert_exact(x)
    assert_exact(x.repeat(300))  # 76,800 values: counted by pattern


@pytest.mark.parametrize("size", [SMALL - 1, SMALL + 1, PATTERN_MIN_16 - 1, PATTERN_MIN_16, 65_543])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_odd_sizes_and_alignments(size: int, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(size)
    base = (torch.randn(size + 3, generator=generator) * 1e-3).to(dtype)
    base[::97] = 0.0
    base[5::101] = -0.0
    for offset in (0, 1, 3):  # data addresses 2 or 4 bytes off the allocation's alignment
        assert_exact(base[offset : offset + size])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float8_e5m2])
def test_strided_and_permuted_views(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(300, 400, generator=generator).to(dtype)
    assert_exact(x[:, ::3])  # gaps: copied in its own dtype
    assert_exact(x.t())  # dense in another order: read in place
    assert_exact(x[1:, 1:])


def fp32_from_bits(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(bits.astype(np.uint32).view(np.int32)).view(torch.float32)


@pytest.mark.parametrize("vectorised", [True, False], ids=["avx512", "portable"])
def test_large_fp32_every_top_half_with_low_halves_at_the_class_bounds(vectorised: bool) -> None:
    # Every fp32 top 16 bits (sign, exponent, 7 fraction bits: 65,536, zeros, subnormals,
    # inf and NaN among them) with low 16 bits on both sides of each class bound that
    # falls inside a 7-bit prefix (0x1, 0x81, 0x680001, 0x7F8000, 0x7FF000, 0x7FFFFF) and
    # at the ends: 655,360 values, the patterns counted once with each other's neighbours.
    top = np.arange(1 << 16, dtype=np.uint64) << 16
    low = np.array([0, 1, 0x80, 0x81, 0x7FFF, 0x8000, 0xEFFF, 0xF000, 0xFFFE, 0xFFFF], np.uint64)
    x = fp32_from_bits((top[:, None] | low[None, :]).reshape(-1))
    with first_pass(vectorised):
        assert_exact(x)
        assert_exact(x[3:-5])  # unaligned, a partial block of 16 at the end
        assert_exact(x.reshape(10, -1).t().contiguous()[:, 4])  # low 0x8000 alone


@pytest.mark.parametrize("vectorised", [True, False], ids=["avx512", "portable"])
@pytest.mark.parametrize("size", [FP32_PATTERN_MIN - 1, FP32_PATTERN_MIN, FP32_PATTERN_MIN + 15])
def test_fp32_at_the_top_half_path_threshold(size: int, vectorised: bool) -> None:
    generator = torch.Generator().manual_seed(size)
    x = torch.randint(-(2**31), 2**31 - 1, (size,), generator=generator, dtype=torch.int64)
    with first_pass(vectorised):
        assert_exact(x.to(torch.int32).view(torch.float32))  # every kind of value
        assert_exact(torch.randn(size, generator=generator) * 1e-3)


@pytest.mark.parametrize("vectorised", [True, False], ids=["avx512", "portable"])
def test_large_fp32_edge_values_subnormals_signed_zeros_inf_nan(vectorised: bool) -> None:
    with first_pass(vectorised):
        large_fp32_edge_values()


def large_fp32_edge_values() -> None:
    edges = edge_values()
    generator = torch.Generator().manual_seed(3)
    subnormals = torch.randint(1, 1 << 23, (5000,), generator=generator, dtype=torch.int32)
    mixed = torch.cat([edges, subnormals.view(torch.float32), -subnormals.view(torch.float32)])
    assert_exact(mixed.repeat(200))  # about 1.1 M values: subnormals counted again
    normal = torch.randn(200_000, generator=generator)
    assert_exact(normal)  # no subnormal, no inf or NaN: no second read
    with_inf = normal.clone()
    with_inf[123_456] = float("-inf")
    with_inf[7] = float("nan")
    assert_exact(with_inf)  # the amax read again, past inf and NaN
    assert_exact(torch.zeros(100_000))
    assert_exact(torch.full((100_000,), float("nan")))
    assert_exact(torch.full((100_000,), -(2.0**-149)))
    assert_exact(torch.full((100_000,), 1.0))  # every value of an ambiguous prefix (0x00)
    assert_exact(torch.full((100_000,), -float("inf")))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_counts_do_not_depend_on_threads(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(11)
    x = (torch.randn(1 << 20, generator=generator) * 1e-3).to(dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel_and_torch(x)[0]
        torch.set_num_threads(max(2, threads))
        many = kernel_and_torch(x)[0]
    finally:
        torch.set_num_threads(threads)
    assert np.array_equal(one.counts, many.counts) and one.amax == many.amax
    assert np.array_equal(one.counts, oracle(x)[0])


def test_a_step_close_of_narrow_gradients_counts_as_adds_do() -> None:
    generator = torch.Generator().manual_seed(5)
    tensors = [
        (torch.randn(size, generator=generator) * 1e-3).to(dtype)
        for size, dtype in [
            (100, torch.bfloat16), (SMALL, torch.float16), (40_000, torch.bfloat16),
            (3000, torch.float8_e4m3fn), (70_000, torch.float16), (5000, torch.float32),
        ]
    ]  # fmt: skip
    table = H.HistogramTable(torch.device("cpu"))
    rows = [table.new_row() for _ in tensors]
    table.add_many(rows, tensors)
    planned = H.HistogramTable(torch.device("cpu"))
    plan_rows = [planned.new_row() for _ in tensors]
    left = planned.add_planned(tensors, plan_rows, [t.dtype for t in tensors])
    assert left == []
    many, _ = table.collect()
    plan, _ = planned.collect()
    for row, plan_row, x in zip(rows, plan_rows, tensors, strict=True):
        counts, amax = oracle(x)
        assert np.array_equal(many[row, : H.N_BINS], counts)
        assert np.array_equal(plan[plan_row, : H.N_BINS], counts)
        assert H.HostHistogram.from_row(many[row], 1).amax == amax
