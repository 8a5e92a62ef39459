"""Histogram layout, exactness of both binning paths, and the one-transfer gather."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fpaudit.kernels import build as kernels
from fpaudit.kernels import histogram as H
from fpaudit.numerics.formats import FORMATS, fate

from ..conftest import compiled_cpu_kernel, kernel_required
from ..oracle import edge_values


def _bin(value: float) -> int:
    return int(H.bin_indices(torch.tensor([value], dtype=torch.float32))[0])


def test_layout_sizes() -> None:
    # binades -149..127 are 277 of them, 8 classes each, plus zero, inf and NaN.
    assert H.N_BINADES == 277
    assert H.N_BINS == 277 * 8 + 3


@pytest.mark.parametrize(
    ("value", "binade", "cls"),
    [
        (1.0, 0, 0),  # 1 = (1 + 0) * 2**0: fraction 0, class 0
        (1.5, 0, 2),  # fraction 0x400000 lies in [0x81, 0x680000]: class 2
        (-3.0, 1, 2),  # |-3| = 1.5 * 2**1
        (464.0, 8, 2),  # 464 = 1.8125 * 2**8: fraction 0x680000, still class 2
        (464.03125, 8, 3),  # fraction 0x680001: class 3
        (65520.0, 15, 6),  # (2 - 2**-11) * 2**15: fraction 0x7FF000, class 6
        (2.0**-149, -149, 0),  # smallest fp32 subnormal, normalised
        (3 * 2.0**-149, -148, 2),  # 1.5 * 2**-148
        (2.0**-127, -127, 0),  # a subnormal power of two
    ],
)
def test_known_values_land_in_known_bins(value: float, binade: int, cls: int) -> None:
    assert _bin(value) == H.finite_bin(binade, cls)
    found_binade, found_cls = H.bin_binade_and_class(np.array([_bin(value)]))
    assert (int(found_binade[0]), int(found_cls[0])) == (binade, cls)
    lower, upper = H.bin_value_bounds(binade, cls)
    assert lower <= abs(value) <= upper


def test_special_values() -> None:
    assert _bin(0.0) == _bin(-0.0) == H.ZERO_BIN
    assert _bin(float("inf")) == _bin(float("-inf")) == H.INF_BIN
    assert _bin(float("nan")) == _bin(-float("nan")) == H.NAN_BIN


def _breakpoints() -> set[int]:
    """Every fraction where some format's fate changes within a binade, found by bisection."""
    found: set[int] = set()
    for fmt in FORMATS.values():
        for t in range(-160, 131):
            start = 0
            while fate(fmt, t, start) != fate(fmt, t, (1 << 23) - 1):
                current, low, high = fate(fmt, t, start), start, (1 << 23) - 1
                while high - low > 1:  # fate is monotone in the fraction
                    middle = (low + high) // 2
                    low, high = (middle, high) if fate(fmt, t, middle) == current else (low, middle)
                found.add(high)
                start = high
    return found


def test_class_bounds_are_exactly_the_breakpoints_of_the_formats() -> None:
    # Re-derive the class bounds: any other breakpoint would break exactness,
    # any extra bound would waste bins.
    assert {0, *_breakpoints()} == set(H.CLASS_LOWER_BOUNDS)


def test_fate_is_constant_within_every_class() -> None:
    for fmt in FORMATS.values():
        for t in range(-160, 131):
            for cls in range(H.N_CLASSES):
                low, high = H.class_bounds(cls)
                assert fate(fmt, t, low) == fate(fmt, t, high), (fmt.name, t, cls)


def _all_paths(x: torch.Tensor) -> list[np.ndarray]:
    """Dense counts from the reference, the compiled kernel, the pure-torch CPU path and
    the no-sync device path (the one CUDA takes, run on the CPU). Without the compiled
    kernel the second is the pure-torch path again: that fails where it is required."""
    if kernel_required():
        compiled_cpu_kernel()
    reference = torch.bincount(H.bin_indices(x), minlength=H.N_BINS).numpy()
    table = H.HistogramTable(torch.device("cpu"), capacity=1)  # also exercises growing
    kernel, fallback, device = (table.new_row() for _ in range(3))
    table.add(kernel, x)
    table._add_cpu_torch(fallback, x)
    table._add_device(device, x)
    rows, _ = table.collect()
    hosts = [H.HostHistogram.from_row(rows[r], 1) for r in (kernel, fallback, device)]
    assert len({h.amax for h in hosts}) == 1
    return [reference, *(h.counts for h in hosts)]


def test_the_compiled_kernel_builds_here() -> None:
    # This machine kind has a C++ compiler: a broken build must fail the suite, not
    # silently fall back to the 17x slower path (compiled_cpu_kernel fails in CI, skips
    # with the reason elsewhere).
    assert compiled_cpu_kernel() is kernels.cpu_kernel()


def _exact_amax(x: torch.Tensor) -> float:
    finite = x[torch.isfinite(x)]
    return float(finite.abs().max()) if finite.numel() else 0.0


def test_paths_agree_on_edge_values() -> None:
    x = edge_values()
    reference, *others = _all_paths(x)
    assert all(np.array_equal(reference, other) for other in others)
    assert reference.sum() == x.numel()


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=5000))
def test_paths_agree_on_arbitrary_bit_patterns(patterns: list[int]) -> None:
    x = torch.tensor(patterns, dtype=torch.int64).to(torch.int32).view(torch.float32)
    reference, *others = _all_paths(x)
    assert all(np.array_equal(reference, other) for other in others)


def test_amax_is_exact_and_ignores_non_finite() -> None:
    x = torch.tensor([-3.5, 2.0**-149, float("inf"), float("nan"), -0.0], dtype=torch.float32)
    hist = H.Histogram(torch.device("cpu"))
    hist.add(x)
    host = hist.host()
    assert host.amax == 3.5
    subnormal_only = torch.tensor([2.0**-149, -(2.0**-140)], dtype=torch.float32)
    hist = H.Histogram(torch.device("cpu"))
    hist.add(subnormal_only)
    host = hist.host()
    assert host.amax == 2.0**-140


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float8_e5m2, torch.float64])
def test_other_dtypes_are_binned_as_their_fp32_values(dtype: torch.dtype) -> None:
    x = (torch.randn(1000) * 10).to(dtype)
    hist = H.Histogram(torch.device("cpu"))
    hist.add(x)
    host = hist.host()
    expected = torch.bincount(H.bin_indices(x.float()), minlength=H.N_BINS).numpy()
    assert np.array_equal(host.counts, expected)
    assert host.amax == _exact_amax(x.float())


def test_accumulates_and_counts_calls() -> None:
    hist = H.Histogram(torch.device("cpu"))
    x = torch.randn(100)
    hist.add(x)
    hist.add(x)
    hist.add(torch.empty(0))
    host = hist.host()
    assert host.elements == 200  # the empty tensor adds a call, no values
    assert host.calls == 3


def test_table_collects_rows_and_scalars_in_one_transfer_and_resets() -> None:
    table = H.HistogramTable(torch.device("cpu"), capacity=1)
    a, b = table.new_row(), table.new_row()
    table.add(a, torch.tensor([1.0, 2.0]))
    table.add(b, torch.tensor([-8.0]))
    rows, scalars = table.collect((torch.tensor(float("nan")), torch.tensor(-2.5)))
    assert [H.HostHistogram.from_row(rows[r], 1).amax for r in (a, b)] == [2.0, 8.0]
    assert np.isnan(scalars[0]) and scalars[1] == -2.5
    assert table.calls == [1, 1]
    table.reset()
    rows, _ = table.collect()
    assert not rows.any() and table.calls == [0, 0]


@pytest.mark.parametrize("size", [1, 3, 4, 5, 2047, 2048, 2049, 70_000, 300_001])
def test_paths_agree_across_block_and_thread_boundaries(size: int) -> None:
    # The kernel works in blocks of 2048 values, 4 counter copies and chunks per thread.
    generator = torch.Generator().manual_seed(size)
    patterns = torch.randint(-(2**31), 2**31 - 1, (size,), generator=generator, dtype=torch.int64)
    x = patterns.to(torch.int32).view(torch.float32)
    x[::7] = torch.randn(len(x[::7]), generator=generator) * 1e-40  # plenty of subnormals
    reference, *others = _all_paths(x)
    assert all(np.array_equal(reference, other) for other in others)


def test_non_contiguous_and_other_dtypes_through_the_kernel() -> None:
    x = torch.randn(64, 64)
    for tensor in (x.t(), x[:, ::3], x.half(), x.bfloat16(), x.double()):
        hist = H.Histogram(torch.device("cpu"))
        hist.add(tensor)
        host = hist.host()
        expected = torch.bincount(H.bin_indices(tensor.float()), minlength=H.N_BINS).numpy()
        assert np.array_equal(host.counts, expected)


@pytest.mark.parametrize(
    ("make", "copied"),
    [
        (lambda x: x, False),
        (lambda x: x.permute(2, 0, 1), False),  # dense in another order: read in place
        (lambda x: x.transpose(1, 2)[1:], False),  # ... at an offset into the storage
        (lambda x: x.transpose(0, 2).unsqueeze(1), False),  # size-1 dims have any stride
        (lambda x: x.reshape(2, 2, 5, 6).to(memory_format=torch.channels_last), False),
        (lambda x: x[:, ::2], True),  # gaps: copied
        (lambda x: x[:, :1].expand(4, 5, 6), True),  # broadcast: copied
        (lambda x: x[:0], False),
    ],
)
def test_dense_flat_holds_every_element_once_and_copies_only_when_it_must(
    make: Callable[[torch.Tensor], torch.Tensor], copied: bool
) -> None:
    x = make(torch.arange(4 * 5 * 6, dtype=torch.float32).reshape(4, 5, 6))
    flat = H.dense_flat(x)
    assert flat.dim() == 1 and flat.is_contiguous()
    assert torch.equal(flat.sort().values, x.reshape(-1).sort().values)
    assert (flat.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()) == copied


def test_a_permuted_tensor_is_binned_exactly_in_memory_order() -> None:
    x = torch.randn(8, 16, 32).transpose(1, 2)
    counted = torch.bincount(H.bin_indices(x.contiguous()), minlength=H.N_BINS)
    hist = H.Histogram(torch.device("cpu"))
    hist.add(x)
    assert np.array_equal(hist.host().counts, counted.numpy())


@settings(max_examples=60, deadline=None)
@given(
    patterns=st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=400),
    cuts=st.lists(st.integers(0, 400), max_size=4),
    order=st.randoms(use_true_random=False),
)
def test_merging_histograms_is_associative_and_commutative(
    patterns: list[int], cuts: list[int], order: object
) -> None:
    # Steps and ranks merge by adding counts and taking the max amax: any split of the
    # values, added in any order and grouping, gives the histogram of all of them.
    x = torch.tensor(patterns, dtype=torch.int64).to(torch.int32).view(torch.float32)
    edges = sorted({0, len(x), *(min(c, len(x)) for c in cuts)})
    parts = [x[a:b] for a, b in itertools.pairwise(edges) if b > a]
    order.shuffle(parts)  # type: ignore[attr-defined]
    whole = H.Histogram(torch.device("cpu"))
    whole.add(x)
    one_table = H.Histogram(torch.device("cpu"))  # all parts into one row, shuffled order
    for part in parts:
        one_table.add(part)
    separate = [H.Histogram(torch.device("cpu")) for _ in parts]  # grouped per part, then summed
    for hist, part in zip(separate, parts, strict=True):
        hist.add(part)
    summed = sum(h.host().counts for h in separate)
    assert np.array_equal(one_table.host().counts, whole.host().counts)
    assert np.array_equal(summed, whole.host().counts)
    assert max(h.host().amax for h in separate) == whole.host().amax == one_table.host().amax


def test_a_missing_kernel_fails_where_required_and_skips_with_its_reason_elsewhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FPAUDIT_KERNEL", "torch")
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setenv("FPAUDIT_REQUIRE_KERNEL", "1")
    with pytest.raises(pytest.fail.Exception, match="FPAUDIT_KERNEL=torch turns it off"):
        compiled_cpu_kernel()
    monkeypatch.delenv("FPAUDIT_REQUIRE_KERNEL")
    with pytest.raises(pytest.skip.Exception, match="untested: FPAUDIT_KERNEL=torch"):
        compiled_cpu_kernel()
    monkeypatch.setenv("CI", "true")  # CI systems set it
    with pytest.raises(pytest.fail.Exception):
        compiled_cpu_kernel()
