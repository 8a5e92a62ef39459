"""What a capture accumulates, step by step, before it becomes a report.

Plain numpy: a training process that captures never imports pandas or pyarrow
(about 70 MB of memory) until it builds the report.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Generic, NamedTuple, Protocol, Self, TypeVar

import numpy as np

from fpaudit.numerics import layout
from fpaudit.report.tables import Bins, Blocks, Key, Origins, Records, Skips, Steps

K = TypeVar("K")
C = TypeVar("C", bound="Mergeable")

# The columns of every table, read from their classes in tables.py (each column named
# once there; schema.py turns them into the versioned Arrow schemas; the order is the
# order in the files). What names a record (Key): the op output a value is (kind, module,
# autograd node, op, output index) and the dtype it was stored in. RecordKey adds whether
# the value scales with the loss; the records and block tables lay these columns out in
# this order.
KEY_COLUMNS = Key.columns()
OP_KEY_COLUMNS = tuple(name for name in KEY_COLUMNS if name != Key.dtype)  # an op, any dtype

RECORD_COLUMNS = Records.columns()
STEP_COLUMNS = Steps.columns()
STEP_DEFAULTS: dict[str, Any] = {
    "rank": 0,
    "scale_after": None,  # None: the step's loss_scale
    "skipped": False,
    "optimizer_step": False,
    "grad_norm": math.nan,
    "clip_max_norm": math.nan,
    "clipped": False,
    "clip_value": math.nan,
    "clipped_fraction": math.nan,
    "grad_amax": math.nan,
    "backward_calls": 1,
    "captured": True,
    "records": 0,
    "nonfinite_grads": 0,
    "first_nonfinite": "",
}
"""Values of the step columns that a report of schema version 1 lacks, and that a
step without records (``fpaudit run`` between captures) starts from."""
# Block-scaled statistics (--recipe): one row per (step, record key, recipe); the
# counts are fpaudit.kernels.blockstats.COUNT_COLUMNS, the histograms lists of counts.
BLOCK_KEY_COLUMNS = Blocks.columns()


@dataclass(frozen=True)
class BlockCounts:
    """One recipe's counts of a block-statistics vector
    (``fpaudit.kernels.blockstats.summary``), in the report's column order: how many
    elements landed in each class after the block scale (zero, flushed to zero,
    subnormal, normal, saturated, not finite, poisoned by a non-finite block maximum),
    how many blocks there were, how many had every nonzero element flushed, and how many
    block scales fell outside the scale format's range. Ints, or floats for the expected
    counts of stochastic rounding."""

    zero: float
    flushed: float
    subnormal: float
    normal: float
    saturated: float
    nonfinite: float
    poisoned: float
    blocks: float
    blocks_flushed: float
    scales_out_of_range: float

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in BLOCK_COUNT_COLUMNS}


BLOCK_COUNT_COLUMNS = tuple(item.name for item in fields(BlockCounts))
# The origins table (`scan --origins`): one row per op call that may make inf/NaN.
ORIGIN_COLUMNS: dict[str, str] = Origins.columns()
ORIGINS_TABLE = "origins"
# The skips table (`fpaudit run` with a loss scaler, from version 6): `report.tables.Skips`.
SKIP_COLUMNS: dict[str, str] = Skips.columns()
SKIPS_TABLE = "skips"

BLOCK_HISTOGRAM_COLUMNS = ("scale_codes", "dynamic_range")
# Their lengths: one bin per E8M0 scale code; one per binade of a block's max/min ratio,
# floor(log2(fp32 max / smallest fp32 subnormal)) = 127 + 149 = 276, so 277 bins.
BLOCK_HISTOGRAM_WIDTHS = {"scale_codes": 256, "dynamic_range": 277}
# In memory, bins keep what analysis needs; lower and upper are derived from
# (binade, cls) when a report is written, for users of the plain Parquet files.
BIN_COLUMNS = (Bins.record_id, Bins.binade, Bins.cls, Bins.count)

KIND_BACKWARD = "backward"  # an output of an op that ran in backward
KIND_GRAD = "grad"  # a parameter's final .grad, as a GradScaler sees it
KIND_FORWARD = "forward"  # an output of an op in forward (--forward)
KIND_OPERAND = "operand"
"""Block statistics only (--recipe): an operand of a backward matrix multiply of a module
that owns a weight (a Linear's output gradient, its saved input and weight), as the GEMM
reads it: blocks along the contraction dimension. What Transformer Engine and torchao
quantize; ``output`` is 0 for the left operand, 1 for the right one."""
LOSS_MODULE = "<loss>"
"""Pseudo-module for backward ops of nodes created outside every module of the model."""


class RecordKey(NamedTuple):
    """KEY_COLUMNS (tests/report/test_report.py checks the two agree) and scales_with_loss."""

    kind: str
    module: str
    node: str
    op: str
    output: int
    dtype: str
    scales_with_loss: bool


# A table row's columns outside its finite bins, as ``NonzeroBins.edges`` holds them: the
# zero bin, then every column from the inf bin on (NaN, amax and the shadow's, ...).
EDGE_COLUMNS = (layout.ZERO_BIN, *range(layout.INF_BIN, layout.WIDTH))
_EDGE = {column: i for i, column in enumerate(EDGE_COLUMNS)}


@dataclass(frozen=True)
class NonzeroBins:
    """What the CPU kernel read from a step's table rows in one pass (closing a step):
    the nonzero finite bins, row-major, as ``row``, ``offset`` (from
    ``layout.FIRST_FINITE_BIN``) and ``count``; each row's sum of its finite counts
    (``finite``); and its ``edges`` (int64 [rows, len(EDGE_COLUMNS)]), read while the row
    was in cache where reading each column from the table later was a cold line per row."""

    row: np.ndarray
    offset: np.ndarray
    count: np.ndarray
    finite: np.ndarray
    edges: np.ndarray

    def edge(self, column: int) -> np.ndarray:
        """Table column ``column`` (one of ``EDGE_COLUMNS``) of every row."""
        return self.edges[:, _EDGE[column]]

    def edge_block(self, columns: slice) -> np.ndarray:
        """Table columns ``columns`` (a run from the inf bin on) of every row."""
        return self.edges[:, _EDGE[columns.start] : _EDGE[columns.stop - 1] + 1]


@dataclass
class StepRecords:
    """The records of one closed step: keys and, row for row, their histograms."""

    keys: list[RecordKey]
    # int64 [records, layout.N_BINS]; None where the recorder cleared the rows as its
    # kernel read them (``Recorder.collect(keep_rows=False)``): ``nonzero`` has them
    counts: np.ndarray | None
    amax: np.ndarray  # float64 [records], finite amax as recorded
    calls: np.ndarray  # int64 [records], tensors added
    shadow: np.ndarray | None = None  # int64 [records, 4]: layout.SHADOW_COLUMNS
    # Where the recorder has them (closing a step with the CPU kernel): what the kernel
    # read from the rows (their nonzero finite bins, sums and edge columns), and the keys
    # as columns (RecordKey's fields), which the builder would otherwise compute from
    # ``counts`` and ``keys``; None: it does.
    nonzero: NonzeroBins | None = None
    key_columns: dict[str, np.ndarray] | None = None
    # each kind's rows, found once (closing a step asks for the gradients' three times)
    _masks: dict[str, np.ndarray] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.shadow is None:
            self.shadow = np.zeros((len(self.keys), 4), dtype=np.int64)

    @classmethod
    def from_histograms(cls, records: Mapping[RecordKey, HostCounts]) -> StepRecords:
        hosts = list(records.values())
        return cls(
            keys=list(records),
            counts=np.array([h.counts for h in hosts], dtype=np.int64).reshape(-1, layout.N_BINS),
            amax=np.array([h.amax for h in hosts], dtype=np.float64),
            calls=np.array([h.calls for h in hosts], dtype=np.int64),
        )

    def grad_amax(self, loss_scale: float) -> float:
        """The largest finite parameter gradient magnitude, unscaled (NaN: none recorded)."""
        mask = self._kind_mask(KIND_GRAD)
        if not mask.any():
            return math.nan
        return float(self.amax[mask].max()) / loss_scale

    def _kind_mask(self, kind: str) -> np.ndarray:
        mask = self._masks.get(kind)
        if mask is None:
            if self.key_columns is not None:
                mask = np.asarray(self.key_columns["kind"] == kind, dtype=bool).reshape(-1)
            else:
                mask = np.array([key.kind == kind for key in self.keys], dtype=bool)
            self._masks[kind] = mask
        return mask

    def nonfinite(self, kind: str) -> int:
        """inf and NaN elements in the records of ``kind``."""
        mask = self._kind_mask(kind)
        if self.nonzero is not None:
            special = self.nonzero.edge(layout.INF_BIN) + self.nonzero.edge(layout.NAN_BIN)
        else:
            assert self.counts is not None
            special = self.counts[:, layout.INF_BIN] + self.counts[:, layout.NAN_BIN]
        return int(special[mask].sum()) if len(mask) else 0


class HostCounts(Protocol):
    """One record's histogram on the host, as a kernel brings it there
    (``fpaudit.kernels.histogram.HostHistogram``): dense counts, the finite amax, and
    how many tensors were added. Declared here, the data model's room, so that the
    kernels depend on the report's types and not the other way round."""

    @property
    def counts(self) -> np.ndarray: ...  # int64, layout.N_BINS

    @property
    def amax(self) -> float: ...

    @property
    def calls(self) -> int: ...


class Mergeable(Protocol):
    """What a :class:`Window` merges: a cell that takes another of its kind in."""

    def merge(self, other: Self) -> None: ...


class Window(Generic[K, C]):
    """``--window``'s one rule, for the histogram records and the block statistics alike:
    W consecutive closed steps merge into one row per key (the cells ``merge``: counts
    add exactly), numbered by the window's first step. A step counts whether or not it
    brought cells (a step whose records were dropped still fills its place)."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("window must be at least 1")
        self.size = size
        self.cells: dict[K, C] = {}  # the window filling, by key, in the order keys came
        self.first = -1  # the step that opened it
        self.steps = 0  # closed steps in it so far

    def add_step(self, step: int, cells: Iterable[tuple[K, C]]) -> dict[K, C] | None:
        """Merge one closed step's ``cells`` (each the caller's to keep: the first of a
        key is kept, later ones merged into it); the full window, emptied, once its W-th
        step closed, else None."""
        if self.steps == 0:
            self.first = step
        self.steps += 1
        for key, cell in cells:
            merged = self.cells.get(key)
            if merged is None:
                self.cells[key] = cell
            else:
                merged.merge(cell)
        if self.steps < self.size:
            return None
        full, self.cells, self.steps = self.cells, {}, 0
        return full


@dataclass
class RecordCell:
    """One record's values merged over a window: its bin ``counts``, ``amax`` (the max),
    its ``calls`` and captured ``steps``, and the ``--shadow`` counts (4 per record)."""

    counts: np.ndarray
    amax: float
    calls: int
    steps: int
    shadow: np.ndarray

    def merge(self, other: RecordCell) -> None:
        self.counts += other.counts
        self.amax = max(self.amax, other.amax)
        self.calls += other.calls
        self.steps += other.steps
        self.shadow += other.shadow


class WindowKey(NamedTuple):
    """What a record merges by in a window: its key, and the loss scale it was captured
    under (values recorded under two scales are two records: their bins are the scaled
    values')."""

    record: RecordKey
    loss_scale: float


# The records table's columns read from a row's special bins.
_SPECIAL_BINS = {"zeros": layout.ZERO_BIN, "infs": layout.INF_BIN, "nans": layout.NAN_BIN}


def _column(counts: np.ndarray | None, column: int, nonzero: NonzeroBins | None) -> np.ndarray:
    """Table column ``column`` of every row, from what ``nonzero`` read of the rows' edges
    or else from ``counts``: a copy, not a view, which would keep the step's whole matrix
    (or every edge column) alive."""
    if nonzero is not None:
        return nonzero.edge(column).copy()
    assert counts is not None
    return counts[:, column].copy()


class ReportBuilder:
    """Collects closed steps, for ``Report.from_builder`` to turn into a report.

    With ``window=W`` the records of W consecutive captured steps are merged
    (counts add, amax is the max; only records captured under the same loss
    scale merge): exact, and W times fewer rows for long runs. The steps table
    keeps one row per step either way.
    """

    def __init__(self, modules: list[str], window: int = 1, rank: int = 0) -> None:
        self.modules = modules
        self.window = window
        self.rank = rank
        self._records: dict[str, list[np.ndarray]] = {name: [] for name in RECORD_COLUMNS}
        self._bins: dict[str, list[np.ndarray]] = {"record_id": [], "offset": [], "count": []}
        self._steps: dict[str, list[Any]] = {name: [] for name in STEP_COLUMNS}
        self._next_record = 0
        self._window: Window[WindowKey, RecordCell] = Window(window)
        self._step_chunks = 0  # where the last closed step's emitted rows start
        self.steps = 0  # steps closed
        self.last_index = -1  # training-step number of the last closed step

    def add_step(
        self,
        records: StepRecords,
        *,
        loss: float | None,
        loss_scale: float,
        seconds: float,
        index: int | None = None,
        first_nonfinite: str = "",
    ) -> None:
        """Add one closed step (vectorised over its records). A non-finite loss drops
        the step's records: it is a forward problem, never backward overflow.
        ``index`` numbers the step (default: one after the last); it must increase.
        ``first_nonfinite`` names the forward op that first made inf or NaN (--forward)."""
        step = self.last_index + 1 if index is None else index
        if step <= self.last_index:
            raise ValueError(f"step index {step} does not follow {self.last_index}")
        self.last_index = step
        self.steps += 1
        self._step_chunks = len(self._records["record_id"])  # where this step's rows start
        loss_finite = loss is None or math.isfinite(loss)
        kept = len(records.keys) if loss_finite else 0
        if self.window == 1:
            if kept:
                n = kept
                self._emit(
                    records.keys,
                    records.counts,
                    records.amax,
                    records.calls,
                    records.shadow,
                    np.full(n, loss_scale),
                    np.full(n, step, dtype=np.int32),
                    np.ones(n, dtype=np.int32),
                    nonzero=records.nonzero,
                    key_columns=records.key_columns,
                )
        else:
            assert records.shadow is not None and records.counts is not None  # rows kept
            shadow = records.shadow
            cells = (
                (WindowKey(key, loss_scale), RecordCell(records.counts[row].copy(),
                 records.amax[row], records.calls[row], 1, shadow[row].copy()))
                for row, key in enumerate(records.keys[:kept])
            )  # fmt: skip
            full = self._window.add_step(step, cells)
            if full is not None:
                self._emit(*self._window_block(full, self._window.first))
        step_row = {
            **STEP_DEFAULTS,
            "step": step,
            "rank": self.rank,
            "loss": math.nan if loss is None else loss,
            "loss_finite": loss_finite,
            "loss_scale": loss_scale,
            "scale_after": loss_scale,
            "grad_amax": records.grad_amax(loss_scale),
            "records": kept,
            "nonfinite_grads": records.nonfinite(KIND_GRAD),
            "first_nonfinite": first_nonfinite,
            "seconds": seconds,
        }
        for name in STEP_COLUMNS:
            self._steps[name].append(step_row[name])

    @staticmethod
    def _window_block(cells: dict[WindowKey, RecordCell], first: int) -> tuple[Any, ...]:
        """A window's merged records as ``_emit``'s arguments, numbered by step ``first``."""
        n = len(cells)
        merged = list(cells.values())
        return (
            [key.record for key in cells],
            np.array([c.counts for c in merged], dtype=np.int64).reshape(n, layout.N_BINS),
            np.array([c.amax for c in merged], dtype=np.float64),
            np.array([c.calls for c in merged], dtype=np.int64),
            np.array([c.shadow for c in merged], dtype=np.int64).reshape(n, 4),
            np.array([key.loss_scale for key in cells], dtype=np.float64),
            np.full(n, first, dtype=np.int32),
            np.array([c.steps for c in merged], dtype=np.int32),
        )

    def _filling_block(self) -> tuple[Any, ...]:
        """The window still filling, as ``_emit``'s arguments."""
        return self._window_block(self._window.cells, self._window.first)

    def _emit(
        self,
        keys: list[RecordKey],
        counts: np.ndarray | None,  # None: ``nonzero`` has what is read of them
        amax: np.ndarray,
        calls: np.ndarray,
        shadow: np.ndarray | None,
        loss_scale: np.ndarray,
        step: np.ndarray,
        steps: np.ndarray,
        *,
        nonzero: NonzeroBins | None = None,
        key_columns: dict[str, np.ndarray] | None = None,
    ) -> None:
        n = len(keys)
        if not n:
            return
        ids = np.arange(self._next_record, self._next_record + n, dtype=np.int32)
        self._next_record += n
        columns: dict[str, Any] = {
            "record_id": ids,
            "rank": np.full(n, self.rank, dtype=np.int16),
            "step": step,
            "steps": steps,
            "calls": calls,
            "elements": None,  # below, from the nonzero bins: no second pass over counts
            **{name: _column(counts, column, nonzero) for name, column in _SPECIAL_BINS.items()},
            "amax": amax,
            "loss_scale": loss_scale,
        }
        shadow = np.zeros((n, 4), dtype=np.int64) if shadow is None else shadow
        for column, name in enumerate(("shadow_calls", "shadow_nonzero", "lost", "overflowed")):
            columns[name] = shadow[:, column].copy()
        for field_name in RecordKey._fields:
            # the recorder's key columns are its cached read-only arrays, the same step
            # after step: kept as they are (a copy each step cost more than its records)
            columns[field_name] = (
                np.array([getattr(k, field_name) for k in keys])
                if key_columns is None
                else key_columns[field_name]
            )
        if nonzero is None:
            assert counts is not None
            finite = counts[:, layout.FIRST_FINITE_BIN : layout.INF_BIN]
            # np.nonzero's row-major order, from one pass over a bool mask (several times
            # faster than np.nonzero of the int64 counts: this is most of a step's emit)
            rows, offsets = np.divmod(np.flatnonzero(finite != 0), finite.shape[1])
            values = finite[rows, offsets]
            # each row's sum of finite counts, exactly (int64), from its run of nonzero bins
            running = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(values)])
            finite_sums = np.diff(running[np.searchsorted(rows, np.arange(n + 1))])
        else:  # the same, found by the recorder's kernel
            rows, offsets, values = nonzero.row, nonzero.offset, nonzero.count
            finite_sums = nonzero.finite
        columns["elements"] = columns["zeros"] + columns["infs"] + columns["nans"] + finite_sums
        for name in RECORD_COLUMNS:
            self._records[name].append(np.asarray(columns[name]))
        self._bins["record_id"].append(ids[rows])
        self._bins["offset"].append(offsets)
        self._bins["count"].append(values)

    def mark_optimizer_step(self, stepped: bool, skipped: bool = False) -> None:
        """Whether the last closed step was followed by an optimizer step, or skipped one."""
        if self._steps["optimizer_step"]:
            self._steps["optimizer_step"][-1] = stepped
            self._steps["skipped"][-1] = skipped

    def last_step(self) -> ReportBuilder | None:
        """A builder holding the last closed step alone (its records as emitted, renumbered
        from 0, and its steps row), None before a step closed. With ``window`` > 1 it is
        the window that step is in, as far as it has filled."""
        if not self.steps:
            return None
        alone = ReportBuilder(self.modules, rank=self.rank)
        if self.window > 1 and self._window.cells:
            chunk = _Chunk.of(self, 0, pending=True)
        else:
            chunk = _Chunk.of(self, self._step_chunks, pending=False)
        chunk.into(alone)
        for name in STEP_COLUMNS:
            alone._steps[name].append(self._steps[name][-1])
        alone.steps, alone.last_index = 1, self.last_index
        return alone

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped (inf/NaN gradients) among the steps closed so far."""
        return sum(bool(s) for s in self._steps["skipped"])

    def step_rows(self) -> dict[str, list[Any]]:
        """The steps table so far, column by column (copies)."""
        return {name: list(values) for name, values in self._steps.items()}

    def columns(self) -> tuple[dict[str, Any], dict[str, Any], dict[str, list[Any]]]:
        """The records, bins and steps tables so far, column by column (numpy arrays;
        bins as ``record_id``, ``offset`` into the finite bins and ``count``); a window
        still filling is included as it stands. ``Report.from_builder`` makes the
        report of them: this module stays free of pandas and pyarrow."""
        if not self._window.cells:
            return self._columns()
        pending_next = self._next_record
        records_before = {k: len(v) for k, v in self._records.items()}
        bins_before = {k: len(v) for k, v in self._bins.items()}
        self._emit(*self._filling_block())
        try:
            return self._columns()
        finally:  # leave the window open: later steps still merge into it
            self._next_record = pending_next
            for name, length in records_before.items():
                del self._records[name][length:]
            for name, length in bins_before.items():
                del self._bins[name][length:]

    def _columns(self) -> tuple[dict[str, Any], dict[str, Any], dict[str, list[Any]]]:
        def joined(parts: list[np.ndarray], dtype: Any) -> np.ndarray:
            return np.concatenate(parts) if parts else np.zeros(0, dtype)

        bins = {
            "record_id": joined(self._bins["record_id"], np.int32),
            "offset": joined(self._bins["offset"], np.int64),
            "count": joined(self._bins["count"], np.int64),
        }
        records = {
            name: joined(self._records[name], object if dtype == "string" else dtype)
            for name, dtype in RECORD_COLUMNS.items()
        }
        return records, bins, self.step_rows()


@dataclass(frozen=True)
class _Chunk:
    """Some emitted rows of a builder (records and their bins), to copy into another."""

    records: dict[str, list[np.ndarray]]
    bins: dict[str, list[np.ndarray]]

    @staticmethod
    def of(builder: ReportBuilder, start: int, *, pending: bool) -> _Chunk:
        if pending:  # a window still filling: emit it into a scratch builder
            scratch = ReportBuilder(builder.modules, rank=builder.rank)
            scratch._emit(*builder._filling_block())
            builder = scratch
        return _Chunk(
            {name: parts[start:] for name, parts in builder._records.items()},
            {name: parts[start:] for name, parts in builder._bins.items()},
        )

    def into(self, builder: ReportBuilder) -> None:
        ids = self.records["record_id"]
        first = int(ids[0][0]) if ids and len(ids[0]) else 0
        for name, parts in self.records.items():
            builder._records[name] = [p - first if name == "record_id" else p for p in parts]
        for name, parts in self.bins.items():
            builder._bins[name] = [p - first if name == "record_id" else p for p in parts]
        builder._next_record = sum(len(p) for p in builder._records["record_id"])
