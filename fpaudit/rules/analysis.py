"""Range loss at a power-of-two scale: pure arithmetic on histogram counts.

Scaling by ``S = 2**k`` moves a value from binade ``b`` to ``b + k`` and keeps
its mantissa class, so "what happens at scale S" is a table lookup per bin:
``fate_table(fmt)[b + k, cls]``. Values recorded under a loss scale ``S0``
(a power of two) are first brought back to unscaled units: binade
``b - log2(S0)``. Records that do not scale with the loss (backward
intermediates computed from forward values alone, ``scales_with_loss``
false) keep their values at every scale. No torch, no autograd, no I/O.

A report's bins are first *condensed* (:func:`condense`): summed per group
(module, or module/node/op, or everything) into a small array indexed by
unscaled binade and class. Any number of scales is then cheap to evaluate,
however many rows the report has.

Definitions (fractions are of nonzero finite elements):

* ``underflow``: nonzero x whose scaled value rounds to zero;
* ``flushed``: nonzero x whose scaled value is below the smallest normal
  (what flush-to-zero hardware zeroes), ``underflow`` included;
* ``subnormal`` = ``flushed - underflow``;
* ``overflow``: finite x whose scaled value rounds past the largest finite
  value. All four counts are exact, not bounds.

What a verdict judges (one rule, here, for ``recommend``, ``gate``, ``show`` and
``fp16-plan``): a value that does not scale with the loss keeps its fate at every
scale, so one that underflows or overflows does so at *every* S, and no loss scale
fixes it (an RMSNorm's ``rsqrt(var + eps) ** 3``). Those are counted apart
(``unscalable_underflow``, ``unscalable_overflow``); the loss scale answers for the
rest (``judged_underflow = underflow - unscalable_underflow``, ``judged_overflow =
overflow - unscalable_overflow``, ``judged_underflow_fraction = judged_underflow /
nonzero``). ``underflow`` and ``overflow`` stay what happens to every value at S.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from fpaudit.numerics import layout
from fpaudit.numerics.formats import Fate, Format, as_format, fate
from fpaudit.report.data import ReportData
from fpaudit.report.records import KIND_BACKWARD, LOSS_MODULE
from fpaudit.report.tables import Bins, Key, Records, Steps

# Below _T_MIN every value underflows, above _T_MAX every value overflows, for
# every format (bf16's round-to-zero edge is 2**-134; fp32 overflows at 2**128).
_T_MIN = -160
_T_MAX = 130

# Loss scales are fp32 numbers (2**-149 .. 2**127), so unscaled binades span this
# (public: the plot draws on the same axis):
UNSCALED_MIN = layout.BINADE_MIN - 127
UNSCALED_MAX = layout.BINADE_MAX + 149
N_UNSCALED = UNSCALED_MAX - UNSCALED_MIN + 1

SHADOW_COLUMNS = (
    Records.shadow_calls,
    Records.shadow_nonzero,
    Records.lost,
    Records.overflowed,
)
# The records' counts a condensed group sums
_RECORD_COUNTS = (Records.elements, Records.zeros, Records.infs, Records.nans)
COUNT_COLUMNS = (
    "elements",
    "zeros",
    "infs",
    "nans",
    "nonfinite",
    "nonzero",
    "underflow",
    "flushed",
    "subnormal",
    "overflow",
    "unscalable_underflow",
    "unscalable_overflow",
    "judged_underflow",
    "judged_overflow",
)


@functools.cache
def fate_table(fmt: Format) -> np.ndarray:
    """``table[t - _T_MIN, cls]``: the fate of a value in binade t (after scaling), class cls."""
    table = np.empty((_T_MAX - _T_MIN + 1, layout.N_CLASSES), dtype=np.int8)
    for t in range(_T_MIN, _T_MAX + 1):
        for cls in range(layout.N_CLASSES):
            table[t - _T_MIN, cls] = fate(fmt, t, layout.CLASS_LOWER_BOUNDS[cls])
    assert (table[0] == Fate.UNDERFLOW).all() and (table[-1] == Fate.OVERFLOW).all()
    return table


def bin_fates(
    fmt: Format, binade: np.ndarray, cls: np.ndarray, shift: np.ndarray | int
) -> np.ndarray:
    """Fate of every bin after shifting its binade by ``shift`` (vectorised)."""
    t = np.clip(np.asarray(binade, dtype=np.int64) + shift, _T_MIN, _T_MAX) - _T_MIN
    fates: np.ndarray = fate_table(fmt)[t, np.asarray(cls, dtype=np.int64)]
    return fates


def _fate_masks(fmt: Format, binades: np.ndarray, shift: int) -> dict[Fate, np.ndarray]:
    """Per (binade, class) cell of a condensed array, whether it lands in each fate."""
    fates = bin_fates(fmt, binades[:, None], np.arange(layout.N_CLASSES)[None, :], shift)
    return {f: fates == f for f in (Fate.UNDERFLOW, Fate.SUBNORMAL, Fate.OVERFLOW)}


def histogram_counts(counts: np.ndarray, fmt: Format, log2_scale: int) -> dict[str, int]:
    """Range loss of one dense histogram (``layout`` order) at ``2**log2_scale``."""
    finite_bins = np.arange(layout.FIRST_FINITE_BIN, layout.INF_BIN)
    binade, cls = layout.bin_binade_and_class(finite_bins)
    fates = bin_fates(fmt, binade, cls, log2_scale)
    finite = np.asarray(counts, dtype=np.int64)[finite_bins]
    underflow = int(finite[fates == Fate.UNDERFLOW].sum())
    subnormal = int(finite[fates == Fate.SUBNORMAL].sum())
    nonfinite = int(counts[layout.INF_BIN] + counts[layout.NAN_BIN])
    return {
        "elements": int(np.sum(counts)),
        "zeros": int(counts[layout.ZERO_BIN]),
        "nonfinite": nonfinite,
        "nonzero": int(finite.sum()),
        "underflow": underflow,
        "flushed": underflow + subnormal,
        "subnormal": subnormal,
        "overflow": int(finite[fates == Fate.OVERFLOW].sum()),
    }


def log2_exact(value: float) -> int:
    """log2 of a positive power of two; raises ValueError for anything else."""
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{value!r} is not a positive finite number")
    mantissa, exponent = math.frexp(value)
    if mantissa != 0.5:
        raise ValueError(f"{value!r} is not a power of two")
    return exponent - 1


@dataclass(frozen=True)
class Scope:
    """Which records an analysis covers.

    By default: backward-op outputs of every module, but not the ``<loss>``
    pseudo-module (the loss seed and top-level ops run in fp32 under autocast).
    """

    kinds: tuple[str, ...] = (KIND_BACKWARD,)
    include_loss: bool = False
    dtypes: tuple[str, ...] = ()  # only records of these dtypes (live mode); empty: all

    def mask(self, records: pd.DataFrame) -> np.ndarray:
        mask = records[Records.kind].isin(self.kinds).to_numpy(copy=True)
        if not self.include_loss:
            mask &= (records[Records.module] != LOSS_MODULE).to_numpy()
        if self.dtypes:
            mask &= records[Records.dtype].isin(self.dtypes).to_numpy()
        selected: np.ndarray = mask
        return selected

    def select(self, records: pd.DataFrame) -> pd.DataFrame:
        return records[self.mask(records)]


LOW_PRECISION_DTYPES = ("float16", "bfloat16")


def held_dtype(report: ReportData) -> str | None:
    """The low-precision dtype most backward values were held in (autocast or a
    ``.half()`` model), or None when backward ran in fp32."""
    records = report.records
    low = records[
        (records[Records.kind] == KIND_BACKWARD) & records[Records.dtype].isin(LOW_PRECISION_DTYPES)
    ]
    if low.empty:
        return None
    return str(low.groupby(Records.dtype)[Records.elements].sum().idxmax())


def live_dtypes(report: ReportData) -> tuple[str, ...]:
    """In a live (--amp) report, the low-precision dtype the recommendation is about."""
    dtype = report.info.amp_dtype
    return (dtype,) if dtype is not None else ()


@dataclass(frozen=True)
class LeftOut:
    """The backward values a live report's scope leaves out of its format: those the device
    held in another dtype (fp32 ops under autocast), counted, with their dtypes."""

    nonzero: int
    dtypes: tuple[str, ...]
    format_dtype: str | None  # the dtype judged (None: nothing is left out)


def left_out(report: ReportData, scope: Scope) -> LeftOut:
    """What ``scope``'s dtype filter leaves out of ``scope``'s kinds and modules."""
    if not scope.dtypes:
        return LeftOut(0, (), None)
    records = dataclasses.replace(scope, dtypes=()).select(report.records)
    out = records[~records[Records.dtype].isin(scope.dtypes)]
    nonzero = out[Records.elements] - out[Records.zeros] - out[Records.infs] - out[Records.nans]
    return LeftOut(int(nonzero.sum()), tuple(sorted(set(out[Records.dtype]))), scope.dtypes[0])


def nonfinite_steps(report: ReportData) -> list[int]:
    """The steps whose loss or parameter gradients held inf or NaN and whose optimizer step
    no loss scaler skipped, in order. A scaler skipping such a step is doing its job, so
    only a report with a loss scaler (``fpaudit run`` with a GradScaler) excuses its
    skipped steps; any other such step trained on (or stopped at) a broken value."""
    steps = report.steps
    if steps.empty:
        return []
    excused = steps[Steps.skipped].to_numpy(dtype=bool) & (report.info.scaler is not None)
    broken = ~steps[Steps.loss_finite].to_numpy(dtype=bool)
    broken |= steps[Steps.nonfinite_grads].to_numpy(dtype=np.int64) > 0
    return sorted({int(step) for step in steps.loc[broken & ~excused, Steps.step]})


def trained_log2_scales(report: ReportData, scope: Scope = Scope()) -> tuple[int, int] | None:
    """For a ``fpaudit run`` report, the smallest and largest log2 loss scale its captured
    steps trained at (values in ``scope`` that scale with the loss); None for any other
    report, or one with no such value."""
    if report.info.command != "run":
        return None
    records = scope.select(report.records)
    scales = records.loc[records[Records.scales_with_loss], Records.loss_scale].to_numpy(
        dtype=np.float64
    )
    if not len(scales):
        return None
    log2 = np.frexp(scales)[1] - 1
    return int(log2.min()), int(log2.max())


def as_trained(report: ReportData) -> ReportData:
    """``report`` with each record's values taken as unscaled at loss scale 1, so that
    at scale ``2**0`` every value keeps the fate it had at the loss scale its step
    trained at (a report of a run judged as it ran, step by step)."""
    records = report.records.assign(loss_scale=1.0)
    return ReportData(report.info, records, report.bins, report.steps, report.path, report.origins)


def default_scope(report: ReportData, include_loss: bool = False) -> Scope:
    """What recommendations and gates judge: backward values inside the model, and in a
    live report only the values the device really held in the low-precision dtype."""
    return Scope(include_loss=include_loss, dtypes=live_dtypes(report))


@dataclass(frozen=True)
class Condensed:
    """A report's histograms summed per group, in unscaled units: all any scale needs.

    ``groups`` has one row per group (its key columns, then ``elements``,
    ``zeros``, ``infs``, ``nans`` and the unscaled finite ``amax``);
    ``scaled[g, b - UNSCALED_MIN, cls]`` counts values of group g that scale
    with the loss by unscaled binade; ``fixed[g, b - BINADE_MIN, cls]`` the
    values that do not, by recorded binade.
    """

    groups: pd.DataFrame
    scaled: np.ndarray
    fixed: np.ndarray

    def at(self, fmt: Format, log2_scale: int) -> pd.DataFrame:
        """Counts and fractions per group at ``2**log2_scale``."""
        unscaled = np.arange(UNSCALED_MIN, UNSCALED_MAX + 1)
        recorded = np.arange(layout.BINADE_MIN, layout.BINADE_MAX + 1)
        scaled_masks = _fate_masks(fmt, unscaled, log2_scale)
        fixed_masks = _fate_masks(fmt, recorded, 0)

        def count(fate_: Fate) -> np.ndarray:
            in_scaled = _cells(self.scaled, scaled_masks[fate_])
            return np.asarray(in_scaled + _cells(self.fixed, fixed_masks[fate_]), dtype=np.int64)

        table = self.groups.copy()
        underflow, subnormal = count(Fate.UNDERFLOW), count(Fate.SUBNORMAL)
        nonzero = self.scaled.sum(axis=(1, 2)) + self.fixed.sum(axis=(1, 2))
        table["nonfinite"] = table["infs"] + table["nans"]
        table["nonzero"] = nonzero
        table["underflow"] = underflow
        table["flushed"] = underflow + subnormal
        table["subnormal"] = subnormal
        table["overflow"] = count(Fate.OVERFLOW)
        # Values that do not scale keep their recorded fate at every scale.
        table["unscalable_underflow"] = _cells(self.fixed, fixed_masks[Fate.UNDERFLOW])
        table["unscalable_overflow"] = _cells(self.fixed, fixed_masks[Fate.OVERFLOW])
        table["judged_underflow"] = table["underflow"] - table["unscalable_underflow"]
        table["judged_overflow"] = table["overflow"] - table["unscalable_overflow"]
        denominator = np.maximum(nonzero, 1)
        for name in ("underflow", "flushed", "overflow", "judged_underflow"):
            table[f"{name}_fraction"] = np.where(nonzero > 0, table[name] / denominator, 0.0)
        shadow_nonzero = table["shadow_nonzero"].to_numpy()
        table["lost_fraction"] = np.where(
            shadow_nonzero > 0, table["lost"] / np.maximum(shadow_nonzero, 1), 0.0
        )
        fractions = [
            "underflow_fraction",
            "flushed_fraction",
            "overflow_fraction",
            "judged_underflow_fraction",
        ]
        shadow = [*SHADOW_COLUMNS, "lost_fraction"]
        keys = [
            c for c in self.groups.columns if c not in (*COUNT_COLUMNS, *shadow, "amax", "dtype")
        ]
        return table[[*keys, "dtype", *COUNT_COLUMNS, "amax", *fractions, *shadow]]

    def scaled_losses_at(self, fmt: Format, log2_scale: int) -> tuple[np.ndarray, np.ndarray]:
        """Per group, the values that scale with the loss and underflow, and those flushed
        (underflow or subnormal), at ``2**log2_scale`` alone, cheaply. The underflow is
        ``at``'s ``judged_underflow`` column (a value that does not scale with the loss
        and underflows is counted apart)."""
        unscaled = np.arange(UNSCALED_MIN, UNSCALED_MAX + 1)
        masks = _fate_masks(fmt, unscaled, log2_scale)
        underflow = _cells(self.scaled, masks[Fate.UNDERFLOW])
        return underflow, underflow + _cells(self.scaled, masks[Fate.SUBNORMAL])

    def total(self) -> Condensed:
        """Everything in one group."""
        sums = self.groups[[*_RECORD_COUNTS, *SHADOW_COLUMNS]].sum()
        dtypes = sorted(
            {d for joined in self.groups[Records.dtype] for d in joined.split(",") if d}
        )
        groups = pd.DataFrame(
            {
                **{name: [int(sums[name])] for name in sums.index},
                "amax": [float(self.groups[Records.amax].max()) if len(self.groups) else 0.0],
                "dtype": [",".join(dtypes)],
            }
        )
        return Condensed(
            groups, self.scaled.sum(axis=0, keepdims=True), self.fixed.sum(axis=0, keepdims=True)
        )


def _cells(counts: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Per group, the counts of ``counts[g, b, c]`` in the cells ``mask[b, c]`` selects."""
    return np.asarray(np.einsum("gbc,bc->g", counts, mask.astype(np.int64)), dtype=np.int64)


def condense(
    report: ReportData, scope: Scope = Scope(), by: Sequence[str] = (Key.module,)
) -> Condensed:
    """Sum the in-scope bins of ``report`` per group of ``by`` (one pass over the bins).

    Results are cached on the report, so several scales and formats cost one pass.
    """
    return report.cached(("condense", scope, tuple(by)), lambda: _condense(report, scope, by))


def _condense(report: ReportData, scope: Scope, by: Sequence[str]) -> Condensed:
    by = list(by)
    groups, group_of_record = _groups(report.records, scope, by)
    scaled, fixed = _binned_cells(report, group_of_record, len(groups))
    result = Condensed(groups, scaled, fixed)
    return _in_network_order(result, report) if Key.module in by else result


def _groups(records: pd.DataFrame, scope: Scope, by: list[str]) -> tuple[pd.DataFrame, np.ndarray]:
    """The groups of the records in ``scope`` (by the columns ``by``; one group without)
    with their per-group counts, dtypes and unscaled amax, and each record's group
    (-1: out of scope)."""
    in_scope = scope.mask(records)
    selected = records[in_scope]
    if by:
        grouped = selected.groupby(by, sort=False, dropna=False)
        group_of_selected = grouped.ngroup().to_numpy()
        groups = grouped.size().reset_index()[by]
        n_groups = len(groups)
    else:
        group_of_selected = np.zeros(len(selected), dtype=np.int64)
        groups = pd.DataFrame(index=range(1))
        n_groups = 1
    group_of_record = np.full(len(records), -1, dtype=np.int64)
    group_of_record[np.flatnonzero(in_scope)] = group_of_selected

    def per_group(column: str) -> np.ndarray:
        values = selected[column].to_numpy(dtype=np.int64)
        return np.bincount(group_of_selected, weights=values, minlength=n_groups).astype(np.int64)

    for column in (*_RECORD_COUNTS, *SHADOW_COLUMNS):
        groups[column] = per_group(column)
    dtype_sets: list[set[str]] = [set() for _ in range(n_groups)]
    for group, dtype in zip(group_of_selected, selected[Records.dtype].to_numpy(), strict=True):
        dtype_sets[group].add(str(dtype))
    groups[Records.dtype] = [",".join(sorted(d)) for d in dtype_sets]
    amax = np.zeros(n_groups)
    unscaled_amax = selected[Records.amax].to_numpy(dtype=np.float64) / np.where(
        selected[Records.scales_with_loss].to_numpy(dtype=bool),
        selected[Records.loss_scale].to_numpy(),
        1.0,
    )
    np.maximum.at(amax, group_of_selected, unscaled_amax)
    groups[Records.amax] = amax
    return groups, group_of_record


def _binned_cells(
    report: ReportData, group_of_record: np.ndarray, n_groups: int
) -> tuple[np.ndarray, np.ndarray]:
    """Each group's bin counts: (groups, unscaled binades, classes) of the values that
    scale with the loss, in unscaled units, and (groups, binades, classes) of the others."""
    records = report.records
    scales = records[Records.scales_with_loss].to_numpy(dtype=bool)
    loss_scale = records[Records.loss_scale].to_numpy(dtype=np.float64)
    log2_loss_scale = np.frexp(loss_scale)[1].astype(np.int64) - 1
    # One pass over the bins, in chunks so that temporaries stay small and reused
    # (fresh 80 MB arrays cost more in page faults than the arithmetic).
    # Record ids number the records (checked on read).
    bins = report.bins
    all_records = bins[Bins.record_id].to_numpy()
    all_binades = bins[Bins.binade].to_numpy()
    all_classes = bins[Bins.cls].to_numpy()
    all_counts = bins[Bins.count].to_numpy()
    scaled_cells = n_groups * N_UNSCALED * layout.N_CLASSES
    fixed_cells = n_groups * layout.N_BINADES * layout.N_CLASSES
    # One index space: the scaled cube, then the fixed one. Per record, the offset
    # of its cell block, with its shift to unscaled units folded in; -1 out of scope.
    scaled_base = (group_of_record * N_UNSCALED - log2_loss_scale - UNSCALED_MIN) * layout.N_CLASSES
    fixed_base = (
        scaled_cells + (group_of_record * layout.N_BINADES - layout.BINADE_MIN) * layout.N_CLASSES
    )
    base = np.where(group_of_record >= 0, np.where(scales, scaled_base, fixed_base), -1)
    cells = np.zeros(scaled_cells + fixed_cells)
    chunk = 1 << 20
    for start in range(0, len(all_records), chunk):
        offset = base[all_records[start : start + chunk]]
        index = offset + all_binades[start : start + chunk] * layout.N_CLASSES  # int64
        index += all_classes[start : start + chunk]
        weight = all_counts[start : start + chunk].astype(np.float64)  # exact below 2**53
        if (offset < 0).any():  # out-of-scope records (the <loss> pseudo-module, grads)
            keep = offset >= 0
            index, weight = index[keep], weight[keep]
        cells += np.bincount(index, weights=weight, minlength=len(cells))
    scaled, fixed = cells[:scaled_cells], cells[scaled_cells:]
    return (
        scaled.astype(np.int64).reshape(n_groups, N_UNSCALED, layout.N_CLASSES),
        fixed.astype(np.int64).reshape(n_groups, layout.N_BINADES, layout.N_CLASSES),
    )


def _in_network_order(condensed: Condensed, report: ReportData) -> Condensed:
    """``condensed``'s groups sorted by module in network order (stable within a module)."""
    order = {name: i for i, name in enumerate(report.info.modules)}
    rank = condensed.groups[Records.module].map(lambda m: order.get(m, len(order))).to_numpy()
    permutation = np.argsort(rank, kind="stable")
    return Condensed(
        condensed.groups.iloc[permutation].reset_index(drop=True),
        condensed.scaled[permutation],
        condensed.fixed[permutation],
    )


def range_loss(
    report: ReportData,
    fmt: Format | str,
    log2_scale: int,
    *,
    scope: Scope = Scope(),
    by: Sequence[str] = (Key.module,),
) -> pd.DataFrame:
    """Counts and fractions at scale ``2**log2_scale``, one row per group of ``by``.

    ``by=()`` gives one row for everything in scope. Rows follow the model's
    module order when grouped by module. ``amax`` is the finite amax in unscaled
    units (at loss scale 1).
    """
    return condense(report, scope, by).at(as_format(fmt), log2_scale)


@dataclass(frozen=True)
class Totals:
    """One row of :func:`range_loss` for everything in scope (:func:`totals`): the counts
    and fractions at one scale (see the module's definitions), the finite unscaled
    ``amax``, the dtypes the values were held in (joined by commas) and what a live
    ``--shadow`` run lost."""

    dtype: str
    elements: int
    zeros: int
    infs: int
    nans: int
    nonfinite: int
    nonzero: int
    underflow: int
    flushed: int
    subnormal: int
    overflow: int
    unscalable_underflow: int
    unscalable_overflow: int
    judged_underflow: int
    judged_overflow: int
    amax: float
    underflow_fraction: float
    flushed_fraction: float
    overflow_fraction: float
    judged_underflow_fraction: float
    shadow_calls: int
    shadow_nonzero: int
    lost: int
    overflowed: int
    lost_fraction: float

    @classmethod
    def from_row(cls, row: Mapping[str, object] | pd.Series) -> Totals:
        """The totals in ``row`` (a row of :meth:`Condensed.at`'s table, whose other
        columns, the group's keys, are left out), each as its field's type."""
        kinds = {"int": int, "float": float, "str": str}
        return cls(**{f.name: kinds[str(f.type)](row[f.name]) for f in dataclasses.fields(cls)})

    def to_dict(self) -> dict[str, int | float | str]:
        return dataclasses.asdict(self)


def totals(
    report: ReportData, fmt: Format | str, log2_scale: int, *, scope: Scope = Scope()
) -> Totals:
    """:func:`range_loss` for everything in scope, as one record."""
    condensed = condense(report, scope, (Key.module,)).total()
    return Totals.from_row(condensed.at(as_format(fmt), log2_scale).iloc[0])


def module_table(
    report: ReportData, fmt: Format | str, log2_scale: int, *, scope: Scope = Scope()
) -> pd.DataFrame:
    """Per-module range loss at ``2**log2_scale``, in network order."""
    return range_loss(report, fmt, log2_scale, scope=scope, by=(Key.module,))
