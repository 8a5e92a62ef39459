"""The static loss scale to use: the smallest power of two that loses as little as the
headroom allows.

One rule for every format. The ceiling ``2**K`` is the largest power of two with
``amax * 2**K <= max_finite / 2**h`` where ``amax`` is the largest finite unscaled
backward value in scope (every backward op inside the model, every step, that scales
with the loss; values computed from forward values alone do not move with S and cannot
limit it) and ``h`` is the headroom in binades. ``h = 4`` keeps the largest value 16x
below the format's maximum, as PopART's top histogram bin edge at 1/16 of max does. The
scale is kept within fp32's normal range (2**-126 .. 2**127),
where loss scalers hold it.

The recommendation is the smallest ``S = 2**k`` (``k`` from ``min(0, K)`` to ``K``)
that underflows and flushes (underflow or subnormal) no more values than the ceiling,
the least the headroom allows: a larger scale only moves values toward the top of the
range. Neither count grows with S (a value that survives at ``2**k`` survives at
``2**(k+1)``), so when they still fall with each binade, as fp16's usually do, the
recommendation is the ceiling; when nothing underflows or flushes at S = 1 (bf16 with
values in fp32's normal range), it is S = 1: no loss scale needed. Scales below 1 are
recommended only where the headroom demands them.

Values that do not scale with the loss and underflow or overflow the format do so
at every scale (:mod:`fpaudit.rules.analysis` counts them apart): no loss scale fixes
them, so they neither limit S nor count in the underflow it reports; the
recommendation lists them apart (:attr:`Recommendation.unscalable`), by autograd
node and op, so that a reader keeps those ops out of the format instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from typing import Any

from fpaudit.numerics.formats import Format, as_format
from fpaudit.numerics.limits import DEFAULT_HEADROOM_BITS, LOG2_SCALE_MAX, LOG2_SCALE_MIN
from fpaudit.report.data import ReportData
from fpaudit.report.tables import Key, Records
from fpaudit.rules import analysis


def largest_log2_scale(amax: float, limit: float) -> int:
    """Largest integer k with ``amax * 2**k <= limit`` (both positive, finite)."""
    k = math.floor(math.log2(limit) - math.log2(amax))
    while math.ldexp(amax, k + 1) <= limit:
        k += 1
    while math.ldexp(amax, k) > limit:
        k -= 1
    return k


def log2_scale_for(
    amax: float,
    fmt: Format,
    headroom_bits: int,
    losses: Callable[[int], tuple[int, int]] | None = None,
) -> tuple[int | None, LimitedBy]:
    """The rule: the recommended ``k`` for the largest unscaled value ``amax`` and the
    values lost at each ``2**k`` (``losses(k)``: the judged underflow and flushed counts;
    None: the ceiling alone), and what set it: "amax" (the headroom's ceiling), "scale
    range", "least underflow" (a smaller scale already underflows and flushes no more
    than the ceiling), or "no nonzero values" with ``k`` None. ``recommend`` applies it to
    a report, ``drift`` to each window, the dashboards to each step."""
    if not amax > 0:
        return None, LimitedBy.NO_NONZERO_VALUES
    ceiling = largest_log2_scale(amax, math.ldexp(fmt.max_finite, -headroom_bits))
    limited_by = LimitedBy.AMAX
    if not LOG2_SCALE_MIN <= ceiling <= LOG2_SCALE_MAX:
        ceiling = min(max(ceiling, LOG2_SCALE_MIN), LOG2_SCALE_MAX)
        limited_by = LimitedBy.SCALE_RANGE
    if losses is None:
        return ceiling, limited_by
    least_underflow, least_flushed = losses(ceiling)
    # Neither count grows with k: bisect for the smallest k in [min(0, K), K] at the least.
    lo, hi = min(0, ceiling), ceiling
    while lo < hi:
        mid = (lo + hi) // 2
        underflow, flushed = losses(mid)
        if underflow <= least_underflow and flushed <= least_flushed:
            hi = mid
        else:
            lo = mid + 1
    return (hi, limited_by) if hi == ceiling else (hi, LEAST_UNDERFLOW)


class LimitedBy(StrEnum):
    """What set a recommended scale (:func:`log2_scale_for`); JSON and the terminal
    carry these strings."""

    AMAX = "amax"  # the headroom's ceiling over the largest unscaled value
    SCALE_RANGE = "scale range"  # the ceiling lay outside fp32's scales: clamped
    LEAST_UNDERFLOW = "least underflow"  # a scale below the ceiling loses as little
    NO_NONZERO_VALUES = "no nonzero values"  # nothing to scale: no recommendation


LEAST_UNDERFLOW = LimitedBy.LEAST_UNDERFLOW  # the name its readers import


@dataclass(frozen=True)
class ModuleUnderflow:
    """One module's judged underflow fraction at S = 1 and at the recommended scale, and
    its finite unscaled amax."""

    module: str
    underflow_fraction_at_1: float
    underflow_fraction: float
    amax: float
    # live --shadow: nonzero values of the fp32 re-run the device held as zero
    lost: int = 0
    shadow_nonzero: int = 0
    lost_fraction: float = 0.0


@dataclass(frozen=True)
class UnscalableOp:
    """Values of one autograd node and op that underflow or overflow at every scale (they
    do not scale with the loss), and the modules they are in, in network order."""

    node: str
    op: str
    underflow: int
    overflow: int
    modules: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "modules": list(self.modules)}


@dataclass(frozen=True)
class Recommendation:
    format: str
    headroom_bits: int
    log2_scale: int | None
    scale: float | None
    amax: float
    limiting_module: str | None
    limiting_op: str | None
    limited_by: LimitedBy
    underflow_fraction: float  # at the recommended scale
    underflow_fraction_at_1: float
    underflow_recovered_by_one_fewer_headroom_bit: float
    include_loss: bool
    modules: list[ModuleUnderflow] = field(default_factory=list)
    live_dtype: str | None = None  # live report: only values held in this dtype count
    # values that do not scale with the loss and underflow/overflow at every scale
    unscalable_underflow: int = 0
    unscalable_overflow: int = 0
    unscalable: list[UnscalableOp] = field(default_factory=list)  # by node and op
    ceiling_log2_scale: int | None = None  # the largest scale the headroom allows
    # live --shadow: what the device lost at the run's loss scale (the fp32 re-run's nonzero
    # values it held as zero), over every module
    lost: int = 0
    shadow_nonzero: int = 0
    lost_fraction: float = 0.0
    # live: nonzero backward values held in another dtype (fp32 under autocast), left out
    left_out_nonzero: int = 0
    left_out_dtypes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ScaleChoice:
    """The power of two :func:`recommend` picks, and why (:func:`log2_scale_for`): the
    largest unscaled amax of the values that scale with the loss (its record's module and
    op) sizes the ceiling to the format with the headroom; ``log2_scale`` None when no
    such value is nonzero. ``ceiling`` is that largest scale the headroom allows."""

    log2_scale: int | None
    limited_by: LimitedBy
    amax: float = 0.0
    limiting_module: str | None = None
    limiting_op: str | None = None
    ceiling: int | None = None


def loss_counter(condensed: analysis.Condensed, fmt: Format) -> Callable[[int], tuple[int, int]]:
    """``k -> (judged underflow, flushed)`` of everything in ``condensed`` at ``2**k``, for
    the rule (:func:`log2_scale_for`)."""
    total = condensed.total()

    def losses(k: int) -> tuple[int, int]:
        underflow, flushed = total.scaled_losses_at(fmt, k)
        return int(underflow[0]), int(flushed[0])

    return losses


def choose_scale(
    report: ReportData, fmt: Format, headroom_bits: int, scope: analysis.Scope
) -> ScaleChoice:
    """The scale alone (no tables at it): what a per-step dashboard needs of a
    recommendation, and the start of :func:`recommend`."""
    records = scope.select(report.records)
    records = records[records[Records.scales_with_loss]]
    unscaled = records[Records.amax] / records[Records.loss_scale]
    if records.empty or not (unscaled > 0).any():
        return ScaleChoice(None, LimitedBy.NO_NONZERO_VALUES)
    limiter = records.loc[unscaled.idxmax()]
    amax = float(unscaled.max())
    counter = loss_counter(analysis.condense(report, scope), fmt)
    k, limited_by = log2_scale_for(amax, fmt, headroom_bits, counter)
    ceiling, _ = log2_scale_for(amax, fmt, headroom_bits)
    assert k is not None  # amax > 0
    return ScaleChoice(
        k, limited_by, amax, str(limiter[Records.module]), str(limiter[Records.op]), ceiling
    )


def recommend(
    report: ReportData,
    fmt: Format | str,
    headroom_bits: int = DEFAULT_HEADROOM_BITS,
    *,
    include_loss: bool = False,
) -> Recommendation:
    """Recommend a power-of-two static loss scale for ``fmt`` (a Format or its name)."""
    fmt = as_format(fmt)
    if headroom_bits < 0:
        raise ValueError("headroom_bits must be >= 0")
    scope = analysis.default_scope(report, include_loss)
    choice = choose_scale(report, fmt, headroom_bits, scope)
    at_1 = analysis.module_table(report, fmt, 0, scope=scope)
    overall_at_1 = analysis.totals(report, fmt, 0, scope=scope)

    apart = unscalable(report, fmt, scope)
    outside = analysis.left_out(report, scope)
    unscalable_counts: dict[str, Any] = {  # the same fields for both answers
        "unscalable_underflow": overall_at_1.unscalable_underflow,
        "unscalable_overflow": overall_at_1.unscalable_overflow,
        "unscalable": apart,
        "lost": overall_at_1.lost,
        "shadow_nonzero": overall_at_1.shadow_nonzero,
        "lost_fraction": overall_at_1.lost_fraction,
        "left_out_nonzero": outside.nonzero,
        "left_out_dtypes": outside.dtypes,
    }
    if choice.log2_scale is None:
        return Recommendation(
            format=fmt.name,
            headroom_bits=headroom_bits,
            log2_scale=None,
            scale=None,
            amax=0.0,
            limiting_module=None,
            limiting_op=None,
            limited_by=LimitedBy.NO_NONZERO_VALUES,
            underflow_fraction=overall_at_1.judged_underflow_fraction,
            underflow_fraction_at_1=overall_at_1.judged_underflow_fraction,
            underflow_recovered_by_one_fewer_headroom_bit=0.0,
            include_loss=include_loss,
            modules=_modules(at_1, at_1),
            live_dtype=scope.dtypes[0] if scope.dtypes else None,
            **unscalable_counts,
        )

    k, limited_by, amax = choice.log2_scale, choice.limited_by, choice.amax
    overall = analysis.totals(report, fmt, k, scope=scope)
    ceiling = choice.ceiling if choice.ceiling is not None else k
    one_fewer = min(ceiling + 1, LOG2_SCALE_MAX) if limited_by != LimitedBy.SCALE_RANGE else ceiling
    overall_one_fewer = analysis.totals(report, fmt, one_fewer, scope=scope)
    return Recommendation(
        format=fmt.name,
        headroom_bits=headroom_bits,
        log2_scale=k,
        scale=math.ldexp(1.0, k),
        amax=amax,
        limiting_module=choice.limiting_module,
        limiting_op=choice.limiting_op,
        limited_by=limited_by,
        underflow_fraction=overall.judged_underflow_fraction,
        underflow_fraction_at_1=overall_at_1.judged_underflow_fraction,
        underflow_recovered_by_one_fewer_headroom_bit=(
            overall.judged_underflow_fraction - overall_one_fewer.judged_underflow_fraction
        ),
        include_loss=include_loss,
        modules=_modules(at_1, analysis.module_table(report, fmt, k, scope=scope)),
        live_dtype=scope.dtypes[0] if scope.dtypes else None,
        **unscalable_counts,
        ceiling_log2_scale=ceiling,
    )


def unscalable(
    report: ReportData, fmt: Format | str, scope: analysis.Scope | None = None
) -> list[UnscalableOp]:
    """The values that underflow or overflow ``fmt`` at every scale (they do not scale
    with the loss), per autograd node and op, largest count first."""
    scope = scope or analysis.default_scope(report)
    table = analysis.range_loss(report, fmt, 0, scope=scope, by=(Key.module, Key.node, Key.op))
    table = table[(table["unscalable_underflow"] > 0) | (table["unscalable_overflow"] > 0)]
    groups: dict[tuple[str, str], UnscalableOp] = {}
    for row in table.itertuples():
        key = (str(row.node), str(row.op))
        group = groups.get(key, UnscalableOp(*key, underflow=0, overflow=0, modules=()))
        module = str(row.module)
        groups[key] = replace(
            group,
            underflow=group.underflow + int(row.unscalable_underflow),
            overflow=group.overflow + int(row.unscalable_overflow),
            modules=group.modules + (module,) * (module not in group.modules),
        )
    return sorted(groups.values(), key=lambda g: -(g.underflow + g.overflow))


def _modules(at_1: Any, at_scale: Any) -> list[ModuleUnderflow]:
    at_1 = at_1.assign(underflow_fraction=at_1["judged_underflow_fraction"])
    at_scale = at_scale.assign(underflow_fraction=at_scale["judged_underflow_fraction"])
    shadow = ["lost", "shadow_nonzero", "lost_fraction"]
    merged = at_1[[Key.module, "underflow_fraction", "amax", *shadow]].merge(
        at_scale[[Key.module, "underflow_fraction"]], on=Key.module, suffixes=("_at_1", "")
    )
    return [
        ModuleUnderflow(
            module=row.module,
            underflow_fraction_at_1=float(row.underflow_fraction_at_1),
            underflow_fraction=float(row.underflow_fraction),
            amax=float(row.amax),
            lost=int(row.lost),
            shadow_nonzero=int(row.shadow_nonzero),
            lost_fraction=float(row.lost_fraction),
        )
        for row in merged.itertuples()
    ]
