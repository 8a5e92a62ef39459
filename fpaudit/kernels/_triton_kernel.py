"""fpaudit's GPU histogram kernel (Triton): one read of every value, exact bins, finite amax.

Imported only when a GPU tensor is binned and Triton is installed (CUDA builds of
torch bring it). The bins are those of ``fpaudit.numerics.layout`` and identical to
``histogram.bin_indices`` (the pure-torch reference); the tests check that on edge
values and random bit patterns by running this kernel in Triton's interpreter
(``TRITON_INTERPRET=1``) on the CPU, and ``benchmarks/gpu_check.py`` checks it on
a GPU against the torch path.

The one-tensor kernel launches at most ``PROGRAMS_PER_SM`` programs per multiprocessor;
each reads blocks of ``BLOCK`` values (pid, pid + programs, ...) in their own dtype (fp16
widens to fp32 in registers, exactly; bf16's bits are shifted into fp32's, so no
conversion can flush its subnormals), counts them privately and adds its counts to the
row once (issue 55: per-program private counts, one flush per program):

* zeros, infs and NaNs by reductions, the amax by a running maximum;
* the finite nonzero values histogrammed into a window of ``WINDOW - 1`` bins
  (``tl.histogram``, whose cost grows with the number of bins, which is why the window
  is not all 2219 bins) fixed by the program's first block (8 binades below its smallest
  value), accumulated over its blocks, and flushed with one atomic per nonzero bin;
* any value outside the window with an atomic of its own.

The multi-tensor kernel (a step close) gives each program a segment of one tensor (up to
``SEGMENT_BLOCKS`` blocks, in order) and counts it with the same code (``_count``): one
flush per program there too, where each block flushed its own atomics before.

No host sync: the launch reads only shapes.

Launches are **bound** (:class:`BoundKernel`): the JIT's own launch does per call what
depends only on the class of the arguments (binding them to the signature, computing
their specialization, looking the compiled kernel up, checking the globals), several
microseconds of host time for a kernel that may run for less on a small tensor. The
first launch of a class goes through the JIT, which compiles and returns the kernel;
the next ones of that class call that kernel's own launcher.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl
from triton.compiler import CompiledKernel

from fpaudit.numerics import layout

BLOCK = 4096
SEGMENT_BLOCKS = 16  # blocks of one tensor a program of the multi-tensor kernel counts
SEGMENT = SEGMENT_BLOCKS * BLOCK  # values a program of the multi-tensor kernel counts, at most
WINDOW = 512  # bins histogrammed per block; bin WINDOW - 1 takes what is not counted there
_B = layout.CLASS_LOWER_BOUNDS
# The layout as the kernels' compile-time constants (globals a kernel may read).
_B1, _B2, _B3, _B4, _B5, _B6, _B7 = (tl.constexpr(bound) for bound in _B[1:])
_ZERO_BIN = tl.constexpr(layout.ZERO_BIN)
_FIRST_FINITE_BIN = tl.constexpr(layout.FIRST_FINITE_BIN)
_INF_BIN = tl.constexpr(layout.INF_BIN)
_NAN_BIN = tl.constexpr(layout.NAN_BIN)
_AMAX_COLUMN = tl.constexpr(layout.AMAX_COLUMN)
_WINDOW = tl.constexpr(WINDOW)
# The one-tensor kernel's window starts this many bins (8 binades) below its first
# block's smallest value, or, where that block holds no finite nonzero value, at binade
# -48 (the window then reaches 2**16): a choice of speed only, any base counts exactly.
_MARGIN = tl.constexpr(8 * layout.N_CLASSES)
_DEFAULT_BASE = tl.constexpr(layout.finite_bin(-48, 0))
# Dtypes loaded as they are; any other is converted to fp32 by torch first.
NATIVE = (torch.float32, torch.float16, torch.bfloat16)
_BF16 = torch.bfloat16


@triton.jit
def _bins(values, inside, BF16: tl.constexpr):
    """Each value's |x| bits and bin, and which lanes hold a zero, inf, NaN or finite
    nonzero value: what both kernels compute per value."""
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
        (fraction >= _B1).to(tl.int32)
        + (fraction >= _B2).to(tl.int32)
        + (fraction >= _B3).to(tl.int32)
        + (fraction >= _B4).to(tl.int32)
        + (fraction >= _B5).to(tl.int32)
        + (fraction >= _B6).to(tl.int32)
        + (fraction >= _B7).to(tl.int32)
    )
    index = _FIRST_FINITE_BIN + offset * 8 + cls
    return bits, index, finite, zero, inf, nan


@triton.jit
def _window(index, finite, base, row_ptr, BLOCK: tl.constexpr):
    """The histogram of the finite values in the window of ``WINDOW - 1`` bins from
    ``base`` (int32 counts, the caller's to add); those outside it are added to the row
    here, one atomic each."""
    local = index - base
    windowed = finite & (local >= 0) & (local < _WINDOW - 1)
    counts = tl.histogram(tl.where(windowed, local, _WINDOW - 1), _WINDOW)
    beyond = finite & ~windowed
    tl.atomic_add(row_ptr + index, tl.full([BLOCK], 1, tl.int64), mask=beyond)
    return counts


@triton.jit
def _flush(counts, base, n_zero, n_inf, n_nan, largest, row_ptr):
    """Add a window's counts, the zeros, infs and NaNs and raise the amax: one atomic
    per nonzero bin."""
    bins = tl.arange(0, _WINDOW)
    tl.atomic_add(
        row_ptr + base + bins, counts.to(tl.int64), mask=(bins < _WINDOW - 1) & (counts > 0)
    )
    tl.atomic_add(row_ptr + _ZERO_BIN, n_zero, mask=n_zero > 0)
    tl.atomic_add(row_ptr + _INF_BIN, n_inf, mask=n_inf > 0)
    tl.atomic_add(row_ptr + _NAN_BIN, n_nan, mask=n_nan > 0)
    largest = largest.to(tl.int64)
    tl.atomic_max(row_ptr + _AMAX_COLUMN, largest, mask=largest > 0)


@triton.jit
def _count(x_ptr, row_ptr, n, start, stride, blocks, BLOCK: tl.constexpr, BF16: tl.constexpr):
    """Count ``blocks`` (at least one) blocks of ``BLOCK`` values, at offsets ``start``,
    ``start + stride``, ... of the ``n`` values at ``x_ptr``, privately (a window of bins,
    the zeros, infs and NaNs, the amax), then add them to the row once: one flush per
    program, not per block. The window starts ``_MARGIN`` bins below the first block's
    smallest bin (or at ``_DEFAULT_BASE`` where that block has no finite nonzero value);
    values outside it have atomics of their own."""
    lanes = tl.arange(0, BLOCK)
    offsets = start + lanes
    inside = offsets < n
    values = tl.load(x_ptr + offsets, mask=inside, other=0.0)
    bits, index, finite, zero, inf, nan = _bins(values, inside, BF16)
    smallest = tl.min(tl.where(finite, index, _NAN_BIN), axis=0)
    base = tl.where(
        smallest < _NAN_BIN, tl.maximum(smallest - _MARGIN, _FIRST_FINITE_BIN), _DEFAULT_BASE
    )
    counts = _window(index, finite, base, row_ptr, BLOCK).to(tl.int64)  # a program may
    n_zero = tl.sum(zero.to(tl.int64), axis=0)  # count more than 2**31 values
    n_inf = tl.sum(inf.to(tl.int64), axis=0)
    n_nan = tl.sum(nan.to(tl.int64), axis=0)
    largest = tl.max(tl.where(finite, bits, 0), axis=0)
    for i in range(1, blocks):  # this program's next blocks
        offsets = start + i * stride + lanes
        inside = offsets < n
        values = tl.load(x_ptr + offsets, mask=inside, other=0.0)
        bits, index, finite, zero, inf, nan = _bins(values, inside, BF16)
        counts += _window(index, finite, base, row_ptr, BLOCK).to(tl.int64)
        n_zero += tl.sum(zero.to(tl.int64), axis=0)
        n_inf += tl.sum(inf.to(tl.int64), axis=0)
        n_nan += tl.sum(nan.to(tl.int64), axis=0)
        largest = tl.maximum(largest, tl.max(tl.where(finite, bits, 0), axis=0))
    _flush(counts, base, n_zero, n_inf, n_nan, largest, row_ptr)


@triton.jit
def _histogram_kernel(
    x_ptr,
    row_ptr,  # int64 row of the table: counts, then the amax bits column
    n,
    BLOCK: tl.constexpr,
    BF16: tl.constexpr,
):
    """Each program counts blocks pid, pid + programs, ... of ``BLOCK`` values (``_count``)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    start = pid.to(tl.int64) * BLOCK
    stride = programs.to(tl.int64) * BLOCK
    blocks = tl.cdiv(tl.cdiv(n, BLOCK) - pid, programs)
    _count(x_ptr, row_ptr, n, start, stride, blocks, BLOCK, BF16)


@triton.jit
def _histogram_many_kernel(
    segments_ptr,  # int64 (programs, 3): a segment's address, its values (1..SEGMENT),
    table_ptr,  # its row's offset in the table (int64, contiguous)
    BLOCK: tl.constexpr,
    DTYPE: tl.constexpr,  # 0: fp32, 1: fp16, 2: bf16 (the index in NATIVE)
):
    """Each program counts one segment (up to ``SEGMENT_BLOCKS`` blocks of one tensor, in
    order) with ``_count``: one flush per program."""
    entry = segments_ptr + tl.program_id(0).to(tl.int64) * 3
    address = tl.load(entry)
    n = tl.load(entry + 1)
    row_ptr = table_ptr + tl.load(entry + 2)
    if DTYPE == 1:
        x_ptr = address.to(tl.pointer_type(tl.float16))
    elif DTYPE == 2:
        x_ptr = address.to(tl.pointer_type(tl.bfloat16))
    else:
        x_ptr = address.to(tl.pointer_type(tl.float32))
    start = n * 0  # an int64 zero: the segment's first block
    _count(x_ptr, row_ptr, n, start, BLOCK, tl.cdiv(n, BLOCK), BLOCK, DTYPE == 2)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("+")[0].split(".")[:2] if part.isdigit())


# Bound launches where the launch path is the one read (Triton 3.6 to 3.9: the JIT
# passes every argument, constexprs too, to the compiled kernel's launcher, and
# ``CompiledKernel[grid]`` does the same with the same hooks) and the backend is CUDA's
# (ROCm specialises pointers on more than their alignment); elsewhere the JIT's launch.
BINDS = _version(triton.__version__) >= (3, 6) and torch.version.hip is None


class BoundKernel:
    """A ``@triton.jit`` kernel launched through the compiled kernel the JIT returned for
    the first launch of each class of arguments (:meth:`launch`'s ``key``), without the
    JIT's per-call work. ``launches`` and ``bound`` count the launches made and those of
    them that went straight to a bound kernel. A bound launch that raises (a launcher
    that takes its arguments otherwise) turns binding off for this kernel and is made
    again by the JIT, whose error, if any, is the caller's. Triton's interpreter returns
    no compiled kernel: every launch there is the JIT's (interpreted) one."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.binds = BINDS
        self.compiled: dict[Hashable, Any] = {}
        self.launches = 0
        self.bound = 0

    def launch(self, key: Hashable | None, grid: tuple[int, int, int], *args: Any) -> None:
        """Launch on ``grid`` with ``args``, every parameter of the kernel in order
        (constexprs too, positionally). ``key``: the arguments' class, equal only for
        arguments the JIT specialises alike (the dtype and 16-byte alignment of each
        pointer; each int's type and whether it is 1 or a multiple of 16: finer is
        safe, coarser is not); None: not bound (the JIT's launch)."""
        self.launches += 1
        compiled = self.compiled.get(key) if key is not None and self.binds else None
        if compiled is not None:
            try:
                compiled[grid](*args)
                self.bound += 1
                return
            except Exception:  # the launcher refused them: not bound from now on
                self.binds = False
                self.compiled.clear()
        kernel = self.fn[grid](*args)
        if key is not None and self.binds and isinstance(kernel, CompiledKernel):
            self.compiled[key] = kernel


ONE = BoundKernel(_histogram_kernel)
MANY = BoundKernel(_histogram_many_kernel)
_I32 = 1 << 31


def _int_class(value: int) -> tuple[bool, bool] | None:
    """How the JIT specialises an int argument (is it 1, a multiple of 16), None where it
    is no int32 (a launch left unbound)."""
    if not 0 <= value < _I32:
        return None
    return value == 1, value % 16 == 0


def histogram_add(x: torch.Tensor, table: torch.Tensor, row: int) -> None:
    """Add the values of ``x`` (contiguous, 1-D, fp32/fp16/bf16, on ``table``'s device)
    to row ``row`` of ``table`` (int64, contiguous, at least ``layout.WIDTH`` columns)."""
    if x.dtype not in NATIVE:
        raise TypeError(f"histogram_add takes {NATIVE}, got {x.dtype}")
    if not (x.is_contiguous() and table.is_contiguous() and table.dtype == torch.int64):
        raise ValueError("histogram_add needs a contiguous x and a contiguous int64 table")
    add_flat(x, table, row)


def add_flat(x: torch.Tensor, table: torch.Tensor, row: int) -> None:
    """``histogram_add`` for arguments known to be what it takes (fpaudit's own table,
    ``x`` flattened and in a native dtype by the caller): one bound launch."""
    n = x.numel()
    if n == 0:
        return
    row_ptr = table[row]
    key = one_key(x, row_ptr, n)
    # -(-n // BLOCK), not triton.cdiv: a ConstexprFunction, about 1.7 µs a call from Python
    programs = min(-(-n // BLOCK), _programs(x))
    ONE.launch(key, (programs, 1, 1), x, row_ptr, n, BLOCK, x.dtype is _BF16)


_resident: dict[int, int] = {}
PROGRAMS_PER_SM = 4  # programs of the one-tensor kernel per multiprocessor, at most
INTERPRETED_PROGRAMS = 4  # off CUDA (Triton's interpreter): few, so that each loops


def _programs(x: torch.Tensor) -> int:
    """How many programs the one-tensor kernel launches at most on ``x``'s device: enough
    to fill a GPU, few enough that each counts many blocks before its one flush."""
    if x.device.type != "cuda":
        return INTERPRETED_PROGRAMS
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    programs = _resident.get(index)
    if programs is None:
        sms = torch.cuda.get_device_properties(index).multi_processor_count
        programs = _resident[index] = PROGRAMS_PER_SM * sms
    return programs


def one_key(x: torch.Tensor, row_ptr: torch.Tensor, n: int) -> Hashable | None:
    """The class of the one-tensor kernel's arguments (``BoundKernel.launch``'s key)."""
    n_class = _int_class(n)
    if n_class is None:
        return None
    aligned = (x.data_ptr() & 15 == 0, row_ptr.data_ptr() & 15 == 0)
    return x.dtype, aligned, n_class, x.get_device()


# Programs (segments) per launch of the multi-tensor kernel: a batch of more segments
# (2**32 values and up) is split into launches of at most this many.
MAX_PROGRAMS = 1 << 16


def histogram_add_many(
    tensors: Sequence[torch.Tensor], table: torch.Tensor, rows: Sequence[int]
) -> int:
    """``histogram_add(tensors[i], table, rows[i])`` for every i, in one launch (or one
    per ``MAX_PROGRAMS`` segments): the tensors (contiguous, 1-D, of one dtype in
    ``NATIVE``, on ``table``'s device) are read through a table of segments (per program,
    the address of up to ``SEGMENT`` values of one tensor, how many, its row's offset in
    ``table``) made on the host from their addresses and sizes, copied to the device
    without a sync (from pinned memory). Returns the launches made (0 when every tensor
    is empty)."""
    if len(tensors) != len(rows):
        raise ValueError(f"histogram_add_many: {len(tensors)} tensors but {len(rows)} rows")
    if not (table.is_contiguous() and table.dtype == torch.int64 and table.dim() == 2):
        raise ValueError("histogram_add_many needs a contiguous 2-D int64 table")
    if not tensors:
        return 0
    dtype = tensors[0].dtype
    if dtype not in NATIVE:
        raise TypeError(f"histogram_add_many takes {NATIVE}, got {dtype}")
    for x in tensors:
        if x.dtype != dtype or not x.is_contiguous() or x.device != table.device:
            raise ValueError(
                "histogram_add_many needs contiguous tensors of one dtype on the table's "
                f"device, got {x.dtype} ({'' if x.is_contiguous() else 'not '}contiguous) "
                f"on {x.device} with {dtype} on {table.device}"
            )
    if min(rows) < 0 or max(rows) >= table.shape[0]:
        raise ValueError(f"histogram_add_many: a row out of range of the table's {table.shape[0]}")
    segments = _segments(tensors, rows, table.stride(0))
    if segments is None:
        return 0
    if table.device.type != "cpu":  # pinned, so that the copy does not wait on the host
        segments = segments.pin_memory().to(table.device, non_blocking=True)
    kind = NATIVE.index(dtype)
    launches = 0
    for start in range(0, segments.shape[0], MAX_PROGRAMS):
        chunk = segments[start : start + MAX_PROGRAMS]
        # the segment table and the table: int64 pointers, aligned (allocated by torch)
        key = (kind, chunk.data_ptr() & 15 == 0, table.data_ptr() & 15 == 0, table.get_device())
        MANY.launch(key, (chunk.shape[0], 1, 1), chunk, table, BLOCK, kind)
        launches += 1
    return launches


def _segments(
    tensors: Sequence[torch.Tensor], rows: Sequence[int], row_stride: int
) -> torch.Tensor | None:
    """The multi-tensor kernel's table of segments (int64 (segments, 3), on the CPU) for
    these tensors: each one's runs of ``SEGMENT`` values (its last one partial), in order;
    None when they hold no value."""
    sizes = np.fromiter((x.numel() for x in tensors), np.int64, len(tensors))
    addresses = np.fromiter((x.data_ptr() for x in tensors), np.int64, len(tensors))
    offsets = np.asarray(rows, dtype=np.int64) * row_stride
    per_tensor = -(-sizes // SEGMENT)
    total = int(per_tensor.sum())
    if total == 0:
        return None
    owner = np.repeat(np.arange(len(tensors)), per_tensor)
    first = np.cumsum(per_tensor) - per_tensor  # each tensor's first segment
    start = (np.arange(total, dtype=np.int64) - first[owner]) * SEGMENT  # its first value
    segments = np.empty((total, 3), dtype=np.int64)
    segments[:, 0] = addresses[owner] + start * tensors[0].element_size()
    segments[:, 1] = np.minimum(sizes[owner] - start, SEGMENT)
    segments[:, 2] = offsets[owner]
    return torch.from_numpy(segments)
