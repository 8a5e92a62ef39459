"""Range loss at a power-of-two scale: pure arithmetic on histogram counts.

Scaling by ``S = 2**k`` moves a value from binade ``b`` to ``b + k`` and keeps
its mantissa class, so "what happens at scale S" is a table lookup per bin:
``fate_table(fmt)[b + k, cls]``. Values recorded under a loss scale ``S0``
(a power of two) are first brought back to unscaled units: their shift is
``k - log2(S0)``. Records that do not scale with the loss (backward
intermediates computed from forward values alone, ``scales_with_loss`` false)
keep their values at every scale: their shift is 0. No torch autograd and no
I/O here.

Definitions (fractions are of nonzero finite elements):

* ``underflow``: nonzero x whose scaled value rounds to zero;
* ``flushed``: nonzero x whose scaled value is below the smallest normal
  (what flush-to-zero hardware zeroes), ``underflow`` included;
* ``subnormal`` = ``flushed - underflow``;
* ``overflow``: finite x whose scaled value rounds past the largest finite
  value. All four counts are exact, not bounds.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from fpaudit import histogram
from fpaudit.formats import Fate, Format, fate
from fpaudit.report import KIND_BACKWARD, LOSS_MODULE, Report

# Below _T_MIN every value underflows, above _T_MAX every value overflows, for
# every format (bf16's round-to-zero edge is 2**-134; fp32 overflows at 2**128).
_T_MIN = -160
_T_MAX = 130

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
)


@functools.cache
def fate_table(fmt: Format) -> np.ndarray:
    """``table[t - _T_MIN, cls]``: the fate of a value in binade t (after scaling), class cls."""
    table = np.empty((_T_MAX - _T_MIN + 1, histogram.N_CLASSES), dtype=np.int8)
    for t in range(_T_MIN, _T_MAX + 1):
        for cls in range(histogram.N_CLASSES):
            table[t - _T_MIN, cls] = fate(fmt, t, histogram.CLASS_LOWER_BOUNDS[cls])
    assert (table[0] == Fate.UNDERFLOW).all() and (table[-1] == Fate.OVERFLOW).all()
    return table


def bin_fates(
    fmt: Format, binade: np.ndarray, cls: np.ndarray, shift: np.ndarray | int
) -> np.ndarray:
    """Fate of every bin after shifting its binade by ``shift`` (vectorised)."""
    t = np.clip(np.asarray(binade, dtype=np.int64) + shift, _T_MIN, _T_MAX) - _T_MIN
    return fate_table(fmt)[t, np.asarray(cls, dtype=np.int64)]


def histogram_counts(counts: np.ndarray, fmt: Format, log2_scale: int) -> dict[str, int]:
    """Range loss of one dense histogram (``histogram`` layout) at ``2**log2_scale``."""
    finite_bins = np.arange(histogram.FIRST_FINITE_BIN, histogram.INF_BIN)
    binade, cls = histogram.bin_binade_and_class(finite_bins)
    fates = bin_fates(fmt, binade, cls, log2_scale)
    finite = np.asarray(counts, dtype=np.int64)[finite_bins]
    underflow = int(finite[fates == Fate.UNDERFLOW].sum())
    subnormal = int(finite[fates == Fate.SUBNORMAL].sum())
    nonfinite = int(counts[histogram.INF_BIN] + counts[histogram.NAN_BIN])
    return {
        "elements": int(np.sum(counts)),
        "zeros": int(counts[histogram.ZERO_BIN]),
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

    def select(self, records: pd.DataFrame) -> pd.DataFrame:
        mask = records["kind"].isin(self.kinds)
        if not self.include_loss:
            mask &= records["module"] != LOSS_MODULE
        return records[mask]


def range_loss(
    report: Report,
    fmt: Format,
    log2_scale: int,
    *,
    scope: Scope = Scope(),
    by: Sequence[str] = ("module",),
) -> pd.DataFrame:
    """Counts and fractions at scale ``2**log2_scale``, one row per group of ``by``.

    ``by=()`` gives one row for everything in scope. Rows follow the model's
    module order when grouped by module. ``amax`` is the finite amax in unscaled
    units (at loss scale 1).
    """
    by = list(by)
    records = scope.select(report.records)
    if not by:
        records = records.assign(_all="all")
        group_columns = ["_all"]
    else:
        group_columns = by
    grouped = records.groupby(group_columns, sort=False, dropna=False)
    group_of_record = grouped.ngroup().to_numpy()
    n_groups = grouped.ngroups

    scales = records["scales_with_loss"].to_numpy(dtype=bool)
    loss_scale = records["loss_scale"].to_numpy(dtype=np.float64)
    record_log2 = np.frexp(loss_scale)[1].astype(np.int64) - 1
    record_shift = np.where(scales, log2_scale - record_log2, 0)
    unscaled_amax = records["amax"].to_numpy(dtype=np.float64) / np.where(scales, loss_scale, 1.0)

    bins = report.bins
    position = pd.Index(records["record_id"].to_numpy()).get_indexer(bins["record_id"].to_numpy())
    keep = position >= 0
    position = position[keep]
    counts = bins["count"].to_numpy()[keep]
    fates = bin_fates(
        fmt,
        bins["binade"].to_numpy()[keep],
        bins["cls"].to_numpy()[keep],
        record_shift[position],
    )
    bin_group = group_of_record[position]

    def per_group(mask: np.ndarray) -> np.ndarray:
        # Weights are exact in float64 for counts below 2**53.
        summed = np.bincount(bin_group[mask], weights=counts[mask], minlength=n_groups)
        return summed.astype(np.int64)

    underflow = per_group(fates == Fate.UNDERFLOW)
    subnormal = per_group(fates == Fate.SUBNORMAL)
    overflow = per_group(fates == Fate.OVERFLOW)

    def record_sum(column: str) -> np.ndarray:
        values = records[column].to_numpy(dtype=np.int64)
        return np.bincount(group_of_record, weights=values, minlength=n_groups).astype(np.int64)

    elements = record_sum("elements")
    zeros = record_sum("zeros")
    infs = record_sum("infs")
    nans = record_sum("nans")
    nonfinite = infs + nans
    nonzero = elements - zeros - nonfinite
    amax = np.zeros(n_groups)
    np.maximum.at(amax, group_of_record, unscaled_amax)

    table = (
        grouped.size().reset_index()[group_columns]
        if n_groups
        else pd.DataFrame({c: [] for c in group_columns})
    )
    if not by:
        table = pd.DataFrame(index=range(n_groups))
    table = table.assign(
        elements=elements,
        zeros=zeros,
        infs=infs,
        nans=nans,
        nonfinite=nonfinite,
        nonzero=nonzero,
        underflow=underflow,
        flushed=underflow + subnormal,
        subnormal=subnormal,
        overflow=overflow,
        amax=amax,
    )
    denominator = np.maximum(nonzero, 1)
    table["underflow_fraction"] = np.where(nonzero > 0, underflow / denominator, 0.0)
    table["flushed_fraction"] = np.where(nonzero > 0, (underflow + subnormal) / denominator, 0.0)
    table["overflow_fraction"] = np.where(nonzero > 0, overflow / denominator, 0.0)
    if "module" in by:
        order = {name: i for i, name in enumerate(report.meta.get("modules", []))}
        table = table.sort_values(
            "module", key=lambda s: s.map(lambda m: order.get(m, len(order))), kind="stable"
        ).reset_index(drop=True)
    return table


def totals(
    report: Report, fmt: Format, log2_scale: int, *, scope: Scope = Scope()
) -> dict[str, float]:
    """One row of :func:`range_loss` for everything in scope, as a dict."""
    table = range_loss(report, fmt, log2_scale, scope=scope, by=())
    if table.empty:
        empty: dict[str, float] = {c: 0 for c in COUNT_COLUMNS}
        empty.update(amax=0.0, underflow_fraction=0.0, flushed_fraction=0.0, overflow_fraction=0.0)
        return empty
    row = table.iloc[0].to_dict()
    return {k: (int(v) if k in COUNT_COLUMNS else float(v)) for k, v in row.items()}


def module_table(
    report: Report, fmt: Format, log2_scale: int, *, scope: Scope = Scope()
) -> pd.DataFrame:
    """Per-module range loss at ``2**log2_scale``, in network order."""
    return range_loss(report, fmt, log2_scale, scope=scope, by=("module",))
