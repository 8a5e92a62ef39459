"""Exact magnitude histograms of tensors, keyed by fp32 bit patterns.

Every value is put in one bin: zero, inf, NaN, or a finite nonzero bin given
by its *binade* (``floor(log2(|x|))``, -149..127 for fp32, subnormals
included) and its *mantissa class*, an interval of the 23-bit normalised
fraction ``g`` in ``|x| = (1 + g / 2**23) * 2**binade``.

Why classes and not just binades: scaling by ``S = 2**k`` moves a value from
binade ``b`` to binade ``b + k`` and keeps ``g``, so whether ``(x * S)``
rounds to zero or overflows in a format depends only on ``(b + k, g)``, and
within one binade only on where ``g`` sits relative to a few breakpoints.
The class lower bounds below are the union of those breakpoints over every
supported format (``tests/test_histogram.py`` re-derives them with
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

This module knows tensors and bits, nothing about modules or formats.

Known limitations: float64 values are rounded to fp32 before binning, so
their histogram is that of ``x.float()`` (magnitudes beyond fp32's range
become inf or zero). Complex, sparse and integer tensors are not binned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

BINADE_MIN = -149  # fp32's smallest subnormal is 2**-149
BINADE_MAX = 127
N_BINADES = BINADE_MAX - BINADE_MIN + 1
CLASS_LOWER_BOUNDS = (0, 0x1, 0x81, 0x680001, 0x700000, 0x7F8000, 0x7FF000, 0x7FFFFF)
N_CLASSES = len(CLASS_LOWER_BOUNDS)
FRACTION_BITS = 23

ZERO_BIN = 0
FIRST_FINITE_BIN = 1
INF_BIN = FIRST_FINITE_BIN + N_BINADES * N_CLASSES
NAN_BIN = INF_BIN + 1
N_BINS = NAN_BIN + 1

_ABS_MASK = 0x7FFFFFFF
_INF_BITS = 0x7F800000
_FRACTION_MASK = (1 << FRACTION_BITS) - 1


def finite_bin(binade: int, cls: int) -> int:
    """Index of the bin holding binade ``binade`` and mantissa class ``cls``."""
    return FIRST_FINITE_BIN + (binade - BINADE_MIN) * N_CLASSES + cls


def bin_binade_and_class(bins: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Binade and mantissa class of finite nonzero bin indices (vectorised)."""
    offset = np.asarray(bins, dtype=np.int64) - FIRST_FINITE_BIN
    return offset // N_CLASSES + BINADE_MIN, offset % N_CLASSES


def class_bounds(cls: int) -> tuple[int, int]:
    """Inclusive range of 23-bit fractions in mantissa class ``cls``."""
    upper = CLASS_LOWER_BOUNDS[cls + 1] - 1 if cls + 1 < N_CLASSES else _FRACTION_MASK
    return CLASS_LOWER_BOUNDS[cls], upper


def bin_value_bounds(binade: int, cls: int) -> tuple[float, float]:
    """Smallest and largest magnitude (both inclusive) that a finite bin can hold."""
    low, high = class_bounds(cls)
    scale = math.ldexp(1.0, binade - FRACTION_BITS)
    return ((1 << FRACTION_BITS) + low) * scale, ((1 << FRACTION_BITS) + high) * scale


def _abs_bits(x: torch.Tensor) -> torch.Tensor:
    """The fp32 bit pattern of |x| as int32 (fp16/bf16/fp8 widen exactly)."""
    x = x.detach()
    if x.dtype != torch.float32:
        x = x.to(torch.float32)
    return x.reshape(-1).view(torch.int32) & _ABS_MASK


_class_bounds_cache: dict[torch.device, torch.Tensor] = {}


def _class_bounds_on(device: torch.device) -> torch.Tensor:
    bounds = _class_bounds_cache.get(device)
    if bounds is None:
        bounds = torch.tensor(CLASS_LOWER_BOUNDS, dtype=torch.int32, device=device)
        _class_bounds_cache[device] = bounds
    return bounds


def bin_indices(x: torch.Tensor) -> torch.Tensor:
    """Bin index (int32) of every element of ``x``; pure torch, any device.

    This is the reference implementation every faster path is tested against.
    """
    bits = _abs_bits(x)
    exponent = bits >> FRACTION_BITS
    fraction = bits & _FRACTION_MASK
    # A subnormal is fraction * 2**-149. Converting the integer fraction to
    # fp32 is exact and normalises it: float(fraction) = (1 + g/2**23) * 2**j.
    normalised = fraction.to(torch.float32).view(torch.int32)
    subnormal = exponent == 0
    fraction = torch.where(subnormal, normalised & _FRACTION_MASK, fraction)
    # binade - BINADE_MIN: exponent - 127 + 149 for normals, j for subnormals.
    binade_offset = torch.where(subnormal, (normalised >> FRACTION_BITS) - 127, exponent + 22)
    cls = torch.bucketize(fraction, _class_bounds_on(bits.device), out_int32=True, right=True) - 1
    index = FIRST_FINITE_BIN + binade_offset * N_CLASSES + cls
    index = torch.where(bits == 0, ZERO_BIN, index)
    index = torch.where(bits == _INF_BITS, INF_BIN, index)
    return torch.where(bits > _INF_BITS, NAN_BIN, index)


def finite_amax_bits(bits: torch.Tensor) -> torch.Tensor:
    """Bit pattern (int32, 0-dim, on device) of the largest finite |x|; 0 if none."""
    return torch.where(bits < _INF_BITS, bits, 0).amax()


# The CPU path bins by the raw exponent field first: raw bin (e + 22) * 8 + cls
# for exponent field e, which for normal numbers (e in 1..254) is exactly the
# finite bin offset, puts zero at (22, 0), inf at (277, 0), NaN at (277, 1..7)
# and unnormalised subnormals at (22, 1..7). Subnormals are rare, so they are
# re-binned exactly only when the raw counts show there are any.
_RAW_BINS = (255 + 23) * N_CLASSES
_RAW_ZERO = 22 * N_CLASSES
_RAW_INF = 277 * N_CLASSES
_FIRST_NORMAL_OFFSET = 23  # offset of binade -126, fp32's smallest normal


def fold_raw(raw: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Final-layout counts: ``counts`` (already final) plus the raw counts folded in."""
    folded = counts.astype(np.int64, copy=True)
    normal = slice(_FIRST_NORMAL_OFFSET * N_CLASSES, _RAW_INF)
    folded[FIRST_FINITE_BIN + normal.start : FIRST_FINITE_BIN + normal.stop] += raw[normal]
    folded[ZERO_BIN] += raw[_RAW_ZERO]
    folded[INF_BIN] += raw[_RAW_INF]
    folded[NAN_BIN] += raw[_RAW_INF + 1 :].sum()
    return folded


class Histogram:
    """Counts per bin and the exact finite amax of every tensor added, on their device.

    Nothing here synchronises with the host off the CPU: counts and
    ``amax_bits`` stay device tensors until the owner gathers them once per
    step. On the CPU, where reading a count costs nothing, a faster path skips
    work the data does not need (subnormal re-binning, inf/NaN masking).
    """

    __slots__ = ("amax_bits", "calls", "counts", "device", "raw")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.calls = 0  # tensors added, empty ones included
        self.counts = torch.zeros(N_BINS, dtype=torch.int64, device=device)  # final layout
        self.raw = torch.zeros(_RAW_BINS, dtype=torch.int64, device=device)  # CPU path only
        self.amax_bits = torch.zeros((), dtype=torch.int32, device=device)

    def add(self, x: torch.Tensor) -> None:
        self.calls += 1
        if x.numel() == 0:
            return
        if x.device.type == "cpu":
            self._add_cpu(x)
        else:
            self._add_device(x)

    def _add_device(self, x: torch.Tensor) -> None:
        # torch.bincount syncs with the host on CUDA (it sizes its output from
        # the max); index_add_ accumulates in place without a sync.
        bits = _abs_bits(x)
        index = bin_indices(x)
        ones = torch.ones((), dtype=torch.int64, device=index.device).expand(index.numel())
        self.counts.index_add_(0, index, ones)
        torch.maximum(self.amax_bits, finite_amax_bits(bits), out=self.amax_bits)

    def _add_cpu(self, x: torch.Tensor) -> None:
        bits = _abs_bits(x)
        raw_index = (bits >> FRACTION_BITS) << 3
        raw_index += torch.bucketize(
            bits & _FRACTION_MASK, _class_bounds_on(bits.device), out_int32=True, right=True
        )
        raw_index += _RAW_ZERO - 1  # bucketize(right=True) returns class + 1
        raw = torch.bincount(raw_index, minlength=_RAW_BINS)
        self.raw += raw
        if int(raw[_RAW_ZERO + 1 : _RAW_ZERO + N_CLASSES].sum()):
            subnormal = bits[(bits < (1 << FRACTION_BITS)) & (bits != 0)]
            index = bin_indices(subnormal.view(torch.float32))
            self.counts += torch.bincount(index, minlength=N_BINS)
        amax = finite_amax_bits(bits) if int(raw[_RAW_INF:].sum()) else bits.amax()
        torch.maximum(self.amax_bits, amax, out=self.amax_bits)


@dataclass(frozen=True)
class HostHistogram:
    """A histogram brought to the host: dense counts and the finite amax."""

    counts: np.ndarray  # int64, N_BINS
    amax: float
    calls: int = 1

    @property
    def elements(self) -> int:
        return int(self.counts.sum())

    @property
    def zeros(self) -> int:
        return int(self.counts[ZERO_BIN])

    @property
    def infs(self) -> int:
        return int(self.counts[INF_BIN])

    @property
    def nans(self) -> int:
        return int(self.counts[NAN_BIN])


def amax_from_bits(bits: np.ndarray) -> np.ndarray:
    """Turn int32 bit patterns of |x| into float64 magnitudes, exactly."""
    return np.asarray(bits, dtype=np.int32).view(np.float32).astype(np.float64)


def gather(
    histograms: list[Histogram], scalars: tuple[torch.Tensor, ...] = ()
) -> tuple[list[HostHistogram], list[float]]:
    """Bring device histograms (and a few 0-dim float tensors) to the host.

    Everything on one device travels in one packed int64 tensor: one host
    sync per device, however many records a step has.
    """
    hosts: list[HostHistogram | None] = [None] * len(histograms)
    values: list[float] = [math.nan] * len(scalars)
    groups: dict[torch.device, tuple[list[int], list[int]]] = {}
    for position, hist in enumerate(histograms):
        groups.setdefault(hist.device, ([], []))[0].append(position)
    for position, scalar in enumerate(scalars):
        groups.setdefault(scalar.device, ([], []))[1].append(position)
    for hist_positions, scalar_positions in groups.values():
        parts = [histograms[p].counts for p in hist_positions]
        parts += [histograms[p].raw for p in hist_positions]
        parts += [histograms[p].amax_bits.to(torch.int64).reshape(1) for p in hist_positions]
        parts += [
            scalars[p].detach().reshape(1).to(torch.float64).view(torch.int64)
            for p in scalar_positions
        ]
        if not parts:
            continue
        packed = torch.cat(parts).cpu().numpy()  # the one sync for this device
        n = len(hist_positions)
        raw_start = n * N_BINS
        amax_start = raw_start + n * _RAW_BINS
        counts = packed[:raw_start].reshape(n, N_BINS)
        raws = packed[raw_start:amax_start].reshape(n, _RAW_BINS)
        amaxes = amax_from_bits(packed[amax_start : amax_start + n].astype(np.int32))
        floats = packed[amax_start + n :].view(np.float64)
        for row, position in enumerate(hist_positions):
            hosts[position] = HostHistogram(
                fold_raw(raws[row], counts[row]), float(amaxes[row]), histograms[position].calls
            )
        for row, position in enumerate(scalar_positions):
            values[position] = float(floats[row])
    return [h for h in hosts if h is not None], values
