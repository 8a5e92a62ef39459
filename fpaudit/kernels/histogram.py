"""Exact magnitude histograms of tensors, on the tensors' own device.

The layout (which bin a value goes to, and why the mantissa classes make every
count exact at every power-of-two scale) is in ``fpaudit.numerics.layout``; this module
turns tensors into counts. It knows tensors and bits, nothing about modules or
formats.

Known limitations: float64 values are rounded to fp32 before binning, so
their histogram is that of ``x.float()`` (magnitudes beyond fp32's range
become inf or zero). Such values are not lost silently: each table counts
them (:attr:`HistogramTable.out_of_range`) and reports carry the total.
Complex, sparse and integer tensors are not binned.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import torch

from fpaudit.kernels import build as kernels
from fpaudit.numerics.layout import (
    AMAX_COLUMN,
    BINADE_MAX,
    BINADE_MIN,
    CLASS_LOWER_BOUNDS,
    FIRST_FINITE_BIN,
    FIRST_NONFINITE_COLUMN,
    FRACTION_BITS,
    FRACTION_MASK,
    INF_BIN,
    N_BINADES,
    N_BINS,
    N_CLASSES,
    NAN_BIN,
    NEVER,
    OVERFLOWED_COLUMN,
    SHADOW_CALLS_COLUMN,
    SHADOW_COLUMNS,
    SHADOW_NONZERO_COLUMN,
    WIDTH,
    ZERO_BIN,
    amax_from_bits,
    bin_binade_and_class,
    bin_value_bounds,
    class_bounds,
    finite_bin,
)
from fpaudit.report.records import NonzeroBins

__all__ = [
    "AMAX_COLUMN",
    "BINADE_MAX",
    "BINADE_MIN",
    "CLASS_LOWER_BOUNDS",
    "FIRST_FINITE_BIN",
    "FIRST_NONFINITE_COLUMN",
    "FRACTION_BITS",
    "INF_BIN",
    "NAN_BIN",
    "N_BINADES",
    "N_BINS",
    "N_CLASSES",
    "SHADOW_COLUMNS",
    "SKIP",
    "UNPLANNED",
    "WIDTH",
    "ZERO_BIN",
    "Histogram",
    "HistogramTable",
    "HostHistogram",
    "amax_from_bits",
    "bin_binade_and_class",
    "bin_indices",
    "bin_value_bounds",
    "class_bounds",
    "dense_flat",
    "finite_amax_bits",
    "finite_bin",
]

_ABS_MASK = 0x7FFFFFFF
_INF_BITS = 0x7F800000
_FRACTION_MASK = FRACTION_MASK


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


def dense_flat(x: torch.Tensor) -> torch.Tensor:
    """The elements of ``x`` as a contiguous 1-D tensor, without a copy where possible.

    A histogram does not depend on the order of the elements, so a tensor whose
    elements fill a block of memory exactly once (contiguous in some order of its
    dimensions: transposed, permuted, channels-last; many backward ops return such
    outputs) is read in memory order, as the block itself. Other layouts (gaps,
    broadcast strides) are copied.
    """
    if x.is_contiguous():
        return x.reshape(-1)
    expected = 1
    dims = sorted((stride, size) for size, stride in zip(x.shape, x.stride(), strict=True))
    for stride, size in dims:
        if size == 1:
            continue  # a size-1 dimension may have any stride
        if stride != expected:
            return x.contiguous().reshape(-1)
        expected *= size
    return x.as_strided((x.numel(),), (1,), x.storage_offset())


def finite_amax_bits(bits: torch.Tensor) -> torch.Tensor:
    """Bit pattern (int32, 0-dim, on device) of the largest finite |x|; 0 if none."""
    return torch.where(bits < _INF_BITS, bits, 0).amax()


# The pure-torch CPU path bins by the raw exponent field first: raw bin
# (e + 22) * 8 + cls for exponent field e, which for normal numbers (e in
# 1..254) is exactly the finite bin offset, puts zero at (22, 0), inf at
# (277, 0), NaN at (277, 1..7) and unnormalised subnormals at (22, 1..7).
# Subnormals are rare, so they are re-binned exactly only when there are any.
_RAW_BINS = (255 + 23) * N_CLASSES
_RAW_ZERO = 22 * N_CLASSES
_RAW_INF = 277 * N_CLASSES
_FIRST_NORMAL_OFFSET = 23  # offset of binade -126, fp32's smallest normal
_NORMAL = slice(_FIRST_NORMAL_OFFSET * N_CLASSES, _RAW_INF)
_CLASS_BOUNDS = list(CLASS_LOWER_BOUNDS)
_UNRESOLVED = object()


def _empty_spans(rows: int) -> torch.Tensor:
    """Spans (see ``HistogramTable.spans``) of ``rows`` rows no add has touched."""
    spans = torch.empty((rows, 2), dtype=torch.int64)
    spans[:, 0] = N_BINS
    spans[:, 1] = -1
    return spans


_FLOAT64 = torch.float64
_STRIDED = torch.strided
_MAPPED_ROWS = 4096  # the CPU kernel's table, as first grown: 73 MB of address space
UNPLANNED = -1  # HistogramTable.add_planned's rows: no row decided for this gradient yet
SKIP = -2  # its gradient (of the planned dtype) is not recorded


class HistogramTable:
    """The histograms of many records on one device, one row each.

    Columns are the ``N_BINS`` counts and the bit pattern of the finite amax
    (as int64). Rows are handed out once and reused step after step: one
    ``zero_()`` resets them all and one transfer (``collect``) brings them all
    to the host, the only host sync a step needs. Adding never syncs off the
    CPU. On the CPU the compiled kernel (``kernels``) bins in one pass; its
    pure-torch fallback gives identical counts.
    """

    def __init__(self, device: torch.device, capacity: int = 64) -> None:
        self.device = device
        self._cpu = device.type == "cpu"
        self._kernel: Any = _UNRESOLVED  # see _resolve_kernel
        self.table = torch.zeros((capacity, WIDTH), dtype=torch.int64, device=device)
        # the CPU kernel's spans: per row, the bins its adds touched (histogram_clear)
        self.spans = _empty_spans(capacity) if self._cpu else None
        self.calls: list[int] = []  # tensors added to each row since the last reset
        # the total of calls when nonzero_bins last cleared the rows it read (see
        # reset_touched); None: not since the last reset, or a row was written since
        self._cleared: int | None = None
        # fp64 values that fp32 (the binned range) cannot hold: nonzero finite values
        # that round to zero or to inf. Cumulative: reset() keeps it.
        self.out_of_range = torch.zeros((), dtype=torch.int64, device=device)

    @property
    def rows(self) -> int:
        return len(self.calls)

    def new_row(self) -> int:
        if self.rows == self.table.shape[0]:
            kernel = self._kernel  # resolved once rows were added to: growing tables are
            if kernel is not _UNRESOLVED and kernel is not None:  # big ones (see the kernel)
                # Its memory is mapped, and a page is only backed once a row on it is
                # written: the first growth reserves room for a large model's rows, where
                # doubling from 64 copied the table four times in a first step (7 ms of
                # the MLP's 1,004 rows).
                size = max(2 * self.rows, _MAPPED_ROWS)
                grown = kernel.histogram_table(size, WIDTH)
            else:
                size = 2 * self.rows
                grown = torch.zeros((size, WIDTH), dtype=torch.int64, device=self.device)
            grown[: self.rows] = self.table
            self.table = grown
            if self.spans is not None:
                spans = _empty_spans(size)
                spans[: self.rows] = self.spans
                self.spans = spans
        self.calls.append(0)
        return self.rows - 1

    def add(self, row: int, x: torch.Tensor) -> None:
        self.calls[row] += 1
        kernel = self._kernel
        if kernel is _UNRESOLVED:
            kernel = self._resolve_kernel()
        if (
            kernel is not None
            and type(x) is torch.Tensor
            and x.dtype is not _FLOAT64
            and x.layout is _STRIDED
        ):
            kernel.histogram_add_fast(x, self.table, row, self.spans)  # widens, flattens
            return
        if x.numel() == 0:
            return
        wide = x.dtype == torch.float64
        if wide:
            self._count_out_of_range(x)
        if kernel is not None:
            values = x.detach()
            if values.dtype != torch.float32:
                values = values.to(torch.float32)  # exact for fp16, bf16, fp8
            kernel.histogram_add(dense_flat(values), self.table, row, _CLASS_BOUNDS, self.spans)
        elif self._cpu:  # a table holds the rows of its device's tensors
            self._add_cpu_torch(row, x)
        else:
            self._add_device(row, x)

    def _resolve_kernel(self) -> ModuleType | None:
        """The CPU kernel this table bins with (None: the pure-torch or device path),
        chosen at its first ``add`` (``FPAUDIT_KERNEL`` as it is then): asking the
        environment on every call cost as much as binning a small tensor."""
        kernel = self._kernel = _cpu_kernel() if self._cpu else None
        return kernel

    def add_many(self, rows: list[int], tensors: list[torch.Tensor]) -> None:
        """``add(rows[i], tensors[i])`` for every i, in as few kernel calls as the device
        allows: on the CPU with the compiled kernel, one call for all of them (float64
        ones aside, which ``add`` takes with their out-of-range count); elsewhere one
        ``add`` each; on CUDA with the Triton kernel, one launch per dtype
        (``_add_many_compiled``). The counts are those of the ``add`` calls, in any
        order."""
        kernel = self._kernel if self._kernel is not _UNRESOLVED else self._resolve_kernel()
        if kernel is None:
            device_kernel = kernels.device_kernel() if self.device.type == "cuda" else None
            if device_kernel is not None:
                _add_many_compiled(self, device_kernel, rows, tensors)
                return
            for row, x in zip(rows, tensors, strict=True):
                self.add(row, x)
            return
        batch_rows: list[int] = []
        batch: list[torch.Tensor] = []
        calls = self.calls
        for row, x in zip(rows, tensors, strict=True):
            if x.dtype is _FLOAT64 or not x.is_cpu:
                self.add(row, x)
                continue
            calls[row] += 1
            batch_rows.append(row)
            batch.append(x)
        if batch:
            kernel.histogram_add_many(batch, self.table, batch_rows, _CLASS_BOUNDS, self.spans)

    def add_planned(
        self,
        grads: Sequence[torch.Tensor | None],
        rows: list[int],
        dtypes: list[torch.dtype],
        *,
        of_params: bool = False,
    ) -> list[int] | None:
        """``add(rows[i], grads[i])`` for each gradient the plan expects (one CPU kernel
        call for all of them): a strided CPU tensor of dtype ``dtypes[i]`` (not float64, not
        a subclass with a dispatch of its own) where ``rows[i]`` is a row; ``rows[i]`` ==
        ``SKIP``: such a gradient is not recorded; None gradients are skipped. Returns the
        indices of the gradients left to the caller (unplanned, or not as planned), or None
        where this table has no CPU kernel (the caller adds each). ``of_params``: ``grads``
        are parameters, whose ``.grad`` the kernel reads (a parameter with a dispatch of
        its own is left to the caller)."""
        kernel = self._kernel if self._kernel is not _UNRESOLVED else self._resolve_kernel()
        if kernel is None:
            return None
        added, left = kernel.histogram_add_planned(
            grads, self.table, rows, dtypes, self.spans, of_params=of_params
        )
        calls = self.calls
        for row in added:
            calls[row] += 1
        return list(left)

    def _count_out_of_range(self, x: torch.Tensor) -> None:
        """Count the nonzero finite fp64 values that fp32 turns into zero or inf (no sync)."""
        values = x.detach()
        narrowed = values.to(torch.float32)
        lost = ((values != 0) & (narrowed == 0)) | (torch.isfinite(values) & torch.isinf(narrowed))
        self.out_of_range += lost.sum()

    def _raise_amax(self, row: int, amax_bits: torch.Tensor) -> None:
        column = self.table[row, AMAX_COLUMN : AMAX_COLUMN + 1]
        torch.maximum(column, amax_bits.to(torch.int64), out=column)

    def add_shadow(self, row: int, real: torch.Tensor, shadow: torch.Tensor) -> None:
        """Compare an op's real output with its fp32 re-run: lost and overflowed values.

        Device ops only, no sync: counted into the row's shadow columns.
        """
        real = real.detach().to(torch.float32)
        shadow = shadow.detach().to(torch.float32)
        nonzero = shadow != 0
        counts = torch.stack(
            [
                nonzero.sum(),
                (nonzero & (real == 0)).sum(),
                (torch.isfinite(shadow) & ~torch.isfinite(real)).sum(),
            ]
        )
        self._cleared = None  # a write that counts no call (see reset_touched)
        self.table[row, SHADOW_CALLS_COLUMN] += 1
        self.table[row, SHADOW_NONZERO_COLUMN : OVERFLOWED_COLUMN + 1] += counts

    def mark_nonfinite(
        self, row: int, x: torch.Tensor, sequence: int, clean: torch.Tensor | None = None
    ) -> None:
        """Remember the earliest op number (this step) at which ``x`` held inf or NaN made
        from ``clean`` inputs (a 0-dim bool on ``x``'s device; None: no floating input)."""
        bad = ~torch.isfinite(x.detach()).all()
        if clean is not None:
            bad = bad & clean
        score = torch.where(bad, NEVER - sequence, 0).to(torch.int64).reshape(1)
        self._cleared = None  # a write that counts no call (see reset_touched)
        column = self.table[row, FIRST_NONFINITE_COLUMN : FIRST_NONFINITE_COLUMN + 1]
        torch.maximum(column, score, out=column)

    def _add_device(self, row: int, x: torch.Tensor) -> None:
        kernel = kernels.device_kernel() if x.device.type == "cuda" else None
        if kernel is None or not self._add_compiled(kernel, row, x):
            self._add_device_torch(row, x)

    def _add_compiled(self, kernel: ModuleType, row: int, x: torch.Tensor) -> bool:
        """Bin ``x`` with the Triton kernel; False (and a warning, once) if it fails."""
        try:
            kernel.add_flat(_native_flat(kernel, x), self.table, row)
        except Exception as error:  # Triton too old for the kernel, no compiler, ...
            _device_kernel_failed(error)
            return False
        return True

    def _add_device_torch(self, row: int, x: torch.Tensor) -> None:
        """The pure-torch device path (several passes, no host sync)."""
        # torch.bincount syncs with the host on CUDA (it sizes its output from
        # the max); index_add_ accumulates in place without a sync.
        index = bin_indices(x)
        ones = torch.ones((), dtype=torch.int64, device=index.device).expand(index.numel())
        self.table[row, :N_BINS].index_add_(0, index, ones)
        self._raise_amax(row, finite_amax_bits(_abs_bits(x)))

    def _add_cpu_torch(self, row: int, x: torch.Tensor) -> None:
        """The pure-torch CPU path: the fallback when the compiled kernel is unavailable."""
        bits = _abs_bits(x)
        raw_index = (bits >> FRACTION_BITS) << 3
        raw_index += torch.bucketize(
            bits & _FRACTION_MASK, _class_bounds_on(bits.device), out_int32=True, right=True
        )
        raw_index += _RAW_ZERO - 1  # bucketize(right=True) returns class + 1
        raw = torch.bincount(raw_index, minlength=_RAW_BINS)
        counts = self.table[row, :N_BINS]
        counts[FIRST_FINITE_BIN + _NORMAL.start : FIRST_FINITE_BIN + _NORMAL.stop] += raw[_NORMAL]
        counts[ZERO_BIN] += raw[_RAW_ZERO]
        counts[INF_BIN] += raw[_RAW_INF]
        counts[NAN_BIN] += raw[_RAW_INF + 1 :].sum()
        if int(raw[_RAW_ZERO + 1 : _RAW_ZERO + N_CLASSES].sum()):
            subnormal = bits[(bits < (1 << FRACTION_BITS)) & (bits != 0)]
            counts += torch.bincount(bin_indices(subnormal.view(torch.float32)), minlength=N_BINS)
        self._raise_amax(row, finite_amax_bits(bits) if int(raw[_RAW_INF:].sum()) else bits.amax())

    def collect(self, scalars: tuple[torch.Tensor, ...] = ()) -> tuple[np.ndarray, list[float]]:
        """All rows (and a few 0-dim float tensors on this device) in one host transfer.

        On the CPU the rows are the table itself, not a copy (a step's table is tens of
        MB, and copying it was most of closing a step): valid until the next ``add`` or
        ``reset``."""
        if self.device.type == "cpu":
            values = [float(s.item()) for s in scalars]  # exact: a Python float is fp64
            return self.table[: self.rows].numpy(), values
        parts = [self.table[: self.rows].reshape(-1)]
        parts += [s.detach().reshape(1).to(torch.float64).view(torch.int64) for s in scalars]
        packed = torch.cat(parts).cpu().numpy()  # the one sync
        rows = packed[: self.rows * WIDTH].reshape(self.rows, WIDTH)
        return rows, [float(v) for v in packed[self.rows * WIDTH :].view(np.float64)]

    def nonzero_bins(self, *, clear: bool = False) -> NonzeroBins | None:
        """The rows' nonzero finite bins in row-major order, with each row's finite sum
        and edge columns (``report.records.NonzeroBins``), read by the CPU kernel from the
        bins this table's adds touched (``spans``) alone; None where there is no such
        kernel (another device, the pure-torch path): the reader then finds them in the rows.
        Rows written other than through this table (the kernel called on ``table``
        directly) are not looked at beyond their spans. ``clear``: each row is also
        cleared (as ``reset_touched`` clears it) as soon as it is read, while in cache:
        the rows then read as zeros, and ``reset_touched`` is still called for the
        calls: it clears the rows again only where one was written since."""
        kernel = self._kernel if self._kernel is not _UNRESOLVED else self._resolve_kernel()
        if kernel is None:
            return None
        read = kernel.histogram_nonzero(self.table, self.rows, self.spans, clear=clear)
        if clear:  # what reset_touched finds clean while no add came since
            self._cleared = sum(self.calls)
        return NonzeroBins(*(part.numpy() for part in read))

    def reset(self) -> None:
        """Zero every row (however it was written)."""
        self.table[: self.rows].zero_()
        self._cleared = None
        if self.spans is not None:
            self.spans[: self.rows] = _empty_spans(self.rows)
        self.calls = [0] * self.rows

    def reset_touched(self) -> None:
        """``reset`` for rows written through this table alone (a recorder's): with the
        CPU kernel, only the bins its adds touched (``spans``) and the columns after the
        bins are written, where zeroing the whole table (17 KB a row) was most of closing
        a step of a model with many small ops."""
        kernel = self._kernel if self._kernel is not _UNRESOLVED else self._resolve_kernel()
        if kernel is None:
            self.reset()
            return
        # Rows that nonzero_bins(clear=True) read are clean while nothing wrote them since:
        # every add counts a call (calls only grow until here), the writes that count none
        # forget the read, and a new row is a clean one.
        cleared, self._cleared = self._cleared, None
        if cleared is None or cleared != sum(self.calls):
            kernel.histogram_clear(self.table, self.rows, self.spans)
        self.calls = [0] * self.rows


def _add_many_compiled(
    table: HistogramTable, kernel: ModuleType, rows: list[int], tensors: list[torch.Tensor]
) -> None:
    """``table.add_many`` with the Triton kernel: the plain strided floating tensors (not
    float64, not a subclass) of each dtype in one ``histogram_add_many`` launch (fp8
    widened to fp32 first, as ``_add_compiled`` does; layouts flattened by ``dense_flat``),
    the others through ``add``. A dtype whose launch fails, and those after it, take the
    pure-torch path (with ``_add_compiled``'s warning, once)."""
    groups: dict[torch.dtype, tuple[list[int], list[torch.Tensor], list[torch.Tensor]]] = {}
    calls = table.calls
    for row, x in zip(rows, tensors, strict=True):
        if (
            type(x) is not torch.Tensor
            or x.dtype is _FLOAT64
            or x.layout is not _STRIDED
            or not x.is_floating_point()
            or x.device != table.table.device
        ):
            table.add(row, x)
            continue
        calls[row] += 1
        values = _native_flat(kernel, x)
        group = groups.setdefault(values.dtype, ([], [], []))
        group[0].append(row)
        group[1].append(values)
        group[2].append(x)
    failed = False
    for group_rows, values_list, originals in groups.values():
        if not failed:
            try:
                kernel.histogram_add_many(values_list, table.table, group_rows)
                continue
            except Exception as error:  # as in _add_compiled
                _device_kernel_failed(error)
                failed = True
        for row, x in zip(group_rows, originals, strict=True):
            table._add_device_torch(row, x)


def _native_flat(kernel: ModuleType, x: torch.Tensor) -> torch.Tensor:
    """``x``'s values as the Triton kernels read them: 1-D, contiguous, in a dtype they
    load (any other converted to fp32: exact for fp8; fp64 rounds, see above)."""
    values = x.detach()
    if values.dtype not in kernel.NATIVE:
        values = values.to(torch.float32)
    return dense_flat(values)


def _device_kernel_failed(error: Exception) -> None:
    """Turn the Triton histogram kernel off for this process, with a warning."""
    kernels.device_kernel_failed(error)
    warnings.warn(
        f"fpaudit: the Triton histogram kernel failed ({kernels.device_failure()}); "
        "using the pure-torch path",
        stacklevel=4,
    )


_bounds_given: set[int] = set()  # ids of the kernel modules given the class bounds


def _cpu_kernel() -> ModuleType | None:
    """``kernels.cpu_kernel()``, given the class bounds once (``histogram_add_tensor``)."""
    kernel = kernels.cpu_kernel(on_build=_warn_build)
    if kernel is not None and id(kernel) not in _bounds_given:
        kernel.set_class_bounds(_CLASS_BOUNDS)
        _bounds_given.add(id(kernel))
    return kernel


def _warn_build() -> None:
    # the library's own use (no CLI to print a note): the same words the CLI prints
    warnings.warn(f"fpaudit: {kernels.build_reason()}", stacklevel=2)


@dataclass(frozen=True)
class HostHistogram:
    """A histogram brought to the host: dense counts, the finite amax, tensors added."""

    counts: np.ndarray  # int64, N_BINS
    amax: float
    calls: int = 1

    @classmethod
    def from_row(cls, row: np.ndarray, calls: int) -> HostHistogram:
        amax = float(amax_from_bits(np.array([row[AMAX_COLUMN]]))[0])
        return cls(row[:N_BINS].copy(), amax, calls)

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


class Histogram:
    """One histogram with a table of its own: for one-off use (the tests, small tools)."""

    def __init__(self, device: torch.device) -> None:
        self.table = HistogramTable(device, capacity=1)
        self.row = self.table.new_row()

    def add(self, x: torch.Tensor) -> None:
        self.table.add(self.row, x)

    def host(self) -> HostHistogram:
        rows, _ = self.table.collect()
        return HostHistogram.from_row(rows[self.row], self.table.calls[self.row])
