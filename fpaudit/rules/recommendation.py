"""The static loss scale to use: the largest power of two that leaves headroom.

``S = 2**k`` is the largest power of two with ``amax * S <= max_finite / 2**h``
where ``amax`` is the largest finite unscaled backward value in scope (every
backward op inside the model, every step, that scales with the loss; values
computed from forward values alone do not move with S and cannot limit it)
and ``h`` is the headroom in binades. ``h = 4`` keeps the largest value 16x
below the format's maximum, as PopART's top histogram bin edge at 1/16 of max
does. Scales below 1 are
legitimate. The scale is kept within fp32's normal range (2**-126 .. 2**127),
where loss scalers hold it.

Values that do not scale with the loss and underflow or overflow the format do so
at every scale (:mod:`fpaudit.rules.analysis` counts them apart): no loss scale fixes
them, so they neither limit S nor count in the underflow it reports; the
recommendation lists them apart (:attr:`Recommendation.unscalable`), by autograd
node and op, so that a reader keeps those ops out of the format instead.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from fpaudit.numerics.formats import Format, as_format
from fpaudit.numerics.limits import DEFAULT_HEADROOM_BITS, LOG2_SCALE_MAX, LOG2_SCALE_MIN
from fpaudit.report.store import Report
from fpaudit.rules import analysis


def largest_log2_scale(amax: float, limit: float) -> int:
    """Largest integer k with ``amax * 2**k <= limit`` (both positive, finite)."""
    k = math.floor(math.log2(limit) - math.log2(amax))
    while math.ldexp(amax, k + 1) <= limit:
        k += 1
    while math.ldexp(amax, k) > limit:
        k -= 1
    return k


def log2_scale_for(amax: float, fmt: Format, headroom_bits: int) -> tuple[int | None, str]:
    """The rule, on one number: the recommended ``k`` for the largest unscaled value
    ``amax``, and what limited it ("amax", "scale range" or "no nonzero values", with
    ``k`` None). ``recommend`` applies it to a report, ``drift`` to each window."""
    if not amax > 0:
        return None, "no nonzero values"
    k = largest_log2_scale(amax, math.ldexp(fmt.max_finite, -headroom_bits))
    if not LOG2_SCALE_MIN <= k <= LOG2_SCALE_MAX:
        return min(max(k, LOG2_SCALE_MIN), LOG2_SCALE_MAX), "scale range"
    return k, "amax"


@dataclass(frozen=True)
class ModuleUnderflow:
    """One module's judged underflow fraction at S = 1 and at the recommended scale, and
    its finite unscaled amax."""

    module: str
    underflow_fraction_at_1: float
    underflow_fraction: float
    amax: float


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
    limited_by: str  # "amax", "scale range" or "no nonzero values"
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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ScaleChoice:
    """The power of two :func:`recommend` picks, and why: the largest unscaled amax of the
    values that scale with the loss (its record's module and op) sized to the format with
    the headroom; ``log2_scale`` None when no such value is nonzero."""

    log2_scale: int | None
    limited_by: str
    amax: float = 0.0
    limiting_module: str | None = None
    limiting_op: str | None = None


def choose_scale(
    report: Report, fmt: Format, headroom_bits: int, scope: analysis.Scope
) -> ScaleChoice:
    """The scale alone (no tables at it): what a per-step dashboard needs of a
    recommendation, and the start of :func:`recommend`."""
    records = scope.select(report.records)
    records = records[records["scales_with_loss"]]
    unscaled = records["amax"] / records["loss_scale"]
    if records.empty or not (unscaled > 0).any():
        return ScaleChoice(None, "no nonzero values")
    limiter = records.loc[unscaled.idxmax()]
    amax = float(unscaled.max())
    k, limited_by = log2_scale_for(amax, fmt, headroom_bits)
    assert k is not None  # amax > 0
    return ScaleChoice(k, limited_by, amax, str(limiter["module"]), str(limiter["op"]))


def recommend(
    report: Report,
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
    unscalable_counts: dict[str, Any] = {  # the same three fields for both answers
        "unscalable_underflow": overall_at_1.unscalable_underflow,
        "unscalable_overflow": overall_at_1.unscalable_overflow,
        "unscalable": apart,
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
            limited_by="no nonzero values",
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
    one_fewer = min(k + 1, LOG2_SCALE_MAX) if limited_by == "amax" else k
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
    )


def unscalable(
    report: Report, fmt: Format | str, scope: analysis.Scope | None = None
) -> list[UnscalableOp]:
    """The values that underflow or overflow ``fmt`` at every scale (they do not scale
    with the loss), per autograd node and op, largest count first."""
    scope = scope or analysis.default_scope(report)
    table = analysis.range_loss(report, fmt, 0, scope=scope, by=("module", "node", "op"))
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
    merged = at_1[["module", "underflow_fraction", "amax"]].merge(
        at_scale[["module", "underflow_fraction"]], on="module", suffixes=("_at_1", "")
    )
    return [
        ModuleUnderflow(
            module=row.module,
            underflow_fraction_at_1=float(row.underflow_fraction_at_1),
            underflow_fraction=float(row.underflow_fraction),
            amax=float(row.amax),
        )
        for row in merged.itertuples()
    ]
